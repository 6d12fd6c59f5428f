"""A metrics event past the threshold starts ``keyplane_reconfigure``: no schedule, no trigger.

The real stack, as ``keyplane airflow`` runs it: API server, scheduler
(LocalExecutor), dag processor and triggerer on the project's DAGs, SQLite
metadata, the embedded broker. The DAG is unpaused; the test then writes
micro-batch metrics whose stage-A load is 2.8 times the mean to the metrics
topic, as the routed job would. The asset watcher's trigger, in the
triggerer, fires an asset event, and the scheduler creates an
``asset_triggered`` run of ``keyplane_reconfigure`` that consumed it; the
event carries why (the imbalance measured, the version, the batches).

The store is left empty, so the runs end in their first task (no active
version to plan from) instead of starting Spark: what is tested is how the
run started, not what it does.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from contextlib import closing
from pathlib import Path

import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.kafka.producer import make_producer, send_confirmed
from keyplane.orchestration.dagrun import AirflowSetup, airflow_command
from keyplane.orchestration.localairflow import LocalAirflow, start, wait_until_up
from keyplane.testing import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "keyplane_reconfigure"


def _skewed(batch_id: int) -> BatchMetrics:
    return BatchMetrics(
        batch_id=batch_id,
        versions={"A": 1, "B": 1},
        rows=100,
        hops=100,
        local_hops=90,
        load={"A": {0: 70, 1: 10, 2: 10, 3: 10}, "B": {0: 25, 1: 25, 2: 25, 3: 25}},
    )


def _asset_triggered(database: Path) -> list[tuple[str, str]]:
    """(run id, consumed event's extra) of every asset-triggered run of the DAG."""
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30)) as db:
        return [
            (str(run_id), str(extra))
            for run_id, extra in db.execute(
                "SELECT dag_run.run_id, asset_event.extra FROM dag_run "
                "JOIN dagrun_asset_event ON dagrun_asset_event.dag_run_id = dag_run.id "
                "JOIN asset_event ON asset_event.id = dagrun_asset_event.event_id "
                "WHERE dag_run.dag_id = ? AND dag_run.run_type = 'asset_triggered'",
                (DAG_ID,),
            ).fetchall()
        ]


def test_a_metrics_event_past_the_threshold_starts_a_run(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    metrics = f"{topic_name}-metrics"
    local = LocalAirflow(
        setup=AirflowSetup(
            airflow_home=tmp_path / "airflow",
            dags_folder=REPO / "dags",
            bootstrap_servers=broker,
            keyplane_home=tmp_path / "home",
            routing_store=tmp_path / "configs",
            events_topic=f"{topic_name}-events",
            metrics_topic=metrics,
            control_topic=f"{topic_name}-control",
            control_key="k" * 32,
        ),
        plugins_folder=REPO / "plugins",
        port=free_port(),
        parallelism=2,
    )
    env_before = dict(os.environ)
    os.environ.update(
        {"KEYPLANE_RECONFIGURE_SIGNAL_BATCHES": "3", "KEYPLANE_RECONFIGURE_SIGNAL_COOLDOWN_S": "0"}
    )
    try:
        running = start(local)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    producer = make_producer(broker)
    try:
        assert wait_until_up(local, running, timeout_s=300) is None
        env = local.environment()
        deadline = time.monotonic() + 240
        while True:
            unpaused = subprocess.run(
                [airflow_command(), "dags", "unpause", DAG_ID], env=env, capture_output=True
            )
            if unpaused.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(5)  # the dag processor has not parsed the DAG yet
        assert unpaused.returncode == 0, unpaused.stderr[-2000:]
        database = local.setup.airflow_home / "airflow.db"
        batch = 0
        found: list[tuple[str, str]] = []
        deadline = time.monotonic() + 420
        while not found and time.monotonic() < deadline:
            # Every few seconds, three more skewed batches: the watcher starts reading at
            # the topic's end whenever the triggerer picks it up.
            records = [_skewed(batch + i) for i in range(3)]
            send_confirmed(
                producer, metrics, [(b"", r.model_dump_json().encode()) for r in records]
            )
            batch += 3
            time.sleep(5)
            found = _asset_triggered(database)
        assert running.failed() == {}, running.failed()
    finally:
        producer.close()
        running.stop()

    assert found, f"no asset-triggered run; see {local.setup.airflow_home / 'logs'}"
    run_id, extra = found[0]
    assert run_id.startswith("asset_triggered__")
    payload = json.loads(extra)["payload"]
    assert payload["reason"] == "imbalance 2.800 > 1.5"
    assert payload["version"] == 1 and payload["last_batch"] - payload["first_batch"] == 2
