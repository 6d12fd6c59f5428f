"""The reconfiguration DAG end to end: real broker, real routed job, real ``airflow dags test``.

The routed job (its own process, all-hash v1) counts a correlated pairs
workload (paper 000 §4.2) while more events keep arriving. One run of
``keyplane_reconfigure`` then collects statistics with Spark, validates them,
plans v2 (METIS tables, FISH hot keys), validates it with Great
Expectations, backtests it, decides to publish, rolls it out over the control
topic (PREPARE → ACK → PROPAGATE A → MIGRATED A → PROPAGATE B → MIGRATED B →
DONE) with deferred waits, and verifies the job's first batches on v2. Every
count stays exact. Then a deliberately bad configuration (one instance given
three times the average load) is rejected by Great Expectations and never
reaches the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from keyplane import config as config_store
from keyplane import statistics as stats
from keyplane.config import OperatorRouting, RoutingConfig
from keyplane.controller import ControllerFile
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.orchestration import tasks
from keyplane.orchestration.deployment import Deployment
from keyplane.spark.counts_job import CountsJobSettings, read_output
from keyplane.testing import routed_job_topics, start_job_process, wait_while_job_runs
from keyplane.verification import compare_counts, expected_counts
from keyplane.workloads import PairsWorkload

pytestmark = pytest.mark.integration

P = 4
REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _airflow_env(tmp_path: Path, broker: str, settings: CountsJobSettings) -> dict[str, str]:
    home = tmp_path / "keyplane-home"
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "AIRFLOW_CONN_KEYPLANE_KAFKA": json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": broker}}
        ),
        "KEYPLANE_HOME": str(home),
        "KEYPLANE_EVENTS_TOPIC": settings.events_topic,
        "KEYPLANE_METRICS_TOPIC": settings.metrics_topic,
        "KEYPLANE_CONTROL_TOPIC": settings.control_topic,
        "KEYPLANE_ROUTING_STORE": str(settings.routing_store),
        "KEYPLANE_SPARK_MASTER": "local[1]",
    }


class Trickle(threading.Thread):
    """Small workloads, one after the other, until stopped: events keep arriving while the
    DAG runs, so the new version has batches to verify. ``specs`` is what was sent."""

    def __init__(self, broker: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.broker, self.topic = broker, topic
        self.specs: list[PairsWorkload] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                spec = PairsWorkload(
                    n_keys=48, locality=0.9, n_events=400, seed=100 + len(self.specs)
                )
                produce_workload(spec, self.broker, self.topic, partitions=2)
                self.specs.append(spec)
                self.stop.wait(2.0)
        except BaseException as exc:
            self.error = exc


def test_scheduled_run_publishes_a_validated_configuration_and_counts_stay_exact(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    before = PairsWorkload(n_keys=48, locality=0.9, n_events=8_000, seed=5)
    assert produce_workload(before, broker, topic_name, partitions=2) == before.n_events
    store = tmp_path / "routing"
    config_store.save(
        RoutingConfig(
            version=1,
            created_by="initial",
            operators={name: OperatorRouting(parallelism=P) for name in ("A", "B")},
        ),
        store,
    )
    settings = CountsJobSettings(
        bootstrap_servers=broker,
        events_topic=topic_name,
        checkpoint=tmp_path / "checkpoint",
        output=tmp_path / "output",
        shuffle_partitions=P,
        max_offsets_per_trigger=2_000,
        trigger_interval="1 second",
        routing_store=store,
        routing_version=1,
        **routed_job_topics(topic_name),
    )
    job_log = tmp_path / "job.log"
    job = start_job_process(settings, job_log)
    env = _airflow_env(tmp_path, broker, settings)
    airflow = str(VENV_BIN / "airflow")
    producer = Trickle(broker, topic_name)
    try:
        subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)

        def counted(n: int) -> bool:
            frame = read_output(settings.output)
            return int(frame.loc[frame["stage"] == "A", "count"].sum()) >= n

        wait_while_job_runs(lambda: counted(4_000), "the job's first batches", job, job_log)
        producer.start()
        conf = {
            "min_total_count": 5_000,
            "alpha": 1.1,
            "verify_batches": 3,
            "reply_timeout_s": 120,
        }
        try:
            run = subprocess.run(
                [airflow, "dags", "test", "keyplane_reconfigure", "-c", json.dumps(conf)],
                env=env,
                capture_output=True,
                text=True,
                timeout=480,
            )
        except subprocess.TimeoutExpired as timeout:
            output = (timeout.stdout or b"") + (timeout.stderr or b"")
            text = output.decode(errors="replace") if isinstance(output, bytes) else output
            (tmp_path / "airflow.log").write_text(text)
            raise
        (tmp_path / "airflow.log").write_text(run.stdout + run.stderr)
        assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]

        deployment = Deployment.from_environment(broker)
        deployment = deployment.model_copy(
            update={
                "home": tmp_path / "keyplane-home",
                "snapshots": tmp_path / "keyplane-home" / "statistics",
                "controller_state": tmp_path / "keyplane-home" / "controller.json",
                "gx_root": tmp_path / "keyplane-home" / "gx",
                "routing_store": store,
                "events_topic": topic_name,
                "metrics_topic": settings.metrics_topic,
                "control_topic": settings.control_topic,
            }
        )
        (manifest,) = stats.list_snapshots(deployment.snapshots)
        assert manifest.n_events >= 4_000 and manifest.job_version == 1
        folder = stats.snapshot_folder(deployment.snapshots, manifest.run_id)
        proposal = json.loads((folder / tasks.PROPOSAL).read_text())
        assert (proposal["version"], proposal["parent_version"]) == (2, 1)
        assert json.loads((folder / tasks.DECISION).read_text())["publish"]
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        assert state.protocol.active_version == 2
        assert state.protocol.last is not None and state.protocol.last.finish is not None
        assert state.protocol.last.finish.type == "DONE"
        assert set(state.protocol.last.migrated) == {"A", "B"}
        verification = json.loads((folder / tasks.VERIFICATION).read_text())
        assert verification["regressed"] is False, verification
        assert verification["after"]["batches"] == 3

        # A deliberately bad configuration: one instance carries 3x the average load.
        frequencies = stats.read_snapshot(deployment.snapshots, manifest.run_id).frequencies
        a_keys = frequencies.loc[frequencies["stage"] == "A", "key"].tolist()
        cut = len(a_keys) * 3 // 4
        table = {k: 0 for k in a_keys[:cut]} | {k: 1 + i % 3 for i, k in enumerate(a_keys[cut:])}
        bad = RoutingConfig(
            version=3,
            parent_version=2,
            created_by="manual",
            operators={
                "A": OperatorRouting(parallelism=P, table=table),
                "B": config_store.load(store, 2).operators["B"],
            },
        )
        config_store.save(bad, store)
        with pytest.raises(tasks.StepError, match="failed validation") as rejected:
            tasks.validate_configuration(deployment, manifest.run_id, version=3)
        assert "max/mean within α" in str(rejected.value)
        with pytest.raises(tasks.StepError, match="never published"):
            tasks._require_validated(deployment, 3)

        producer.stop.set()
        producer.join(timeout=60)
        assert not producer.is_alive() and producer.error is None, producer.error
        total = sum(high_watermarks(broker, topic_name).values())
        assert total == before.n_events + sum(spec.n_events for spec in producer.specs)
        wait_while_job_runs(lambda: counted(total), "every event", job, job_log)
    finally:
        producer.stop.set()
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, job_log.read_text()[-3000:]

    truth = (
        pd.concat([expected_counts(spec) for spec in (before, *producer.specs)])
        .groupby(["stage", "key"], as_index=False)["count"]
        .sum()
    )
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == total
    assert report.exact, report
    with ControlChannel(broker, settings.control_topic) as channel:
        messages = channel.read(0).messages
    assert all(message.config_version != 3 for _, message in messages)
    assert {m.type for _, m in messages if m.config_version == 2} >= {
        "PREPARE",
        "ACK",
        "PROPAGATE",
        "MIGRATED",
        "DONE",
    }
    routed = tasks.read_metrics(deployment, {0: 0})
    assert all(3 not in record.versions.values() for record in routed)
