"""The scale DAG end to end: real broker, real routed job, real ``airflow dags test``.

The routed job (its own process, all-hash v1 over 4 state partitions) counts
a correlated pairs workload (paper 000 §4.2) while more events keep arriving.
One on-demand run of ``keyplane_scale`` scales stage B in from 4 to 2 active
instances (003 §5.3): it decides from the metrics topic, stores v2 with B's
keys on its two remaining instances, validates it with Great Expectations,
rolls it out over the control topic with deferred waits (the state of every
key of a released instance is handed over live), and verifies that the first
batches on v2 used active instances only. Afterwards every B partial that
holds state sits on an active instance, and every count is exact.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import pandas as pd
import pytest

from keyplane import config as config_store
from keyplane.config import OperatorRouting, RoutingConfig
from keyplane.controller import ControllerFile
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.producer import produce_workload
from keyplane.orchestration import dagrun, scale_steps, tasks
from keyplane.orchestration.deployment import Deployment
from keyplane.partials import latest_partials
from keyplane.spark.counts_job import CountsJobSettings, read_output, read_partials
from keyplane.testing import routed_job_topics, start_job_process, wait_while_job_runs
from keyplane.verification import compare_counts, expected_counts
from keyplane.workloads import PairsWorkload

pytestmark = pytest.mark.integration

P = 4
REPO = Path(__file__).resolve().parents[2]


class Trickle(threading.Thread):
    """Small workloads, one after the other, until stopped, so the scaled version has
    batches to verify. ``specs`` is what was sent."""

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
                    n_keys=48, locality=0.9, n_events=150, seed=200 + len(self.specs)
                )
                produce_workload(spec, self.broker, self.topic, partitions=2)
                self.specs.append(spec)
                self.stop.wait(2.0)
        except BaseException as exc:
            self.error = exc


def _b_instances_holding_state(output: Path) -> set[int]:
    """The stage-B instances whose latest partial of some key is not zero."""
    latest = latest_partials(read_partials(output))
    holding = latest[(latest["stage"] == "B") & (latest["count"] > 0)]
    return {int(i) for i in holding["instance"].dropna()}


def test_on_demand_scale_in_moves_state_to_the_active_instances_and_counts_stay_exact(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    before = PairsWorkload(n_keys=48, locality=0.9, n_events=3_000, seed=7)
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
    setup = dagrun.AirflowSetup(
        airflow_home=tmp_path / "airflow",
        dags_folder=REPO / "dags",
        bootstrap_servers=broker,
        keyplane_home=tmp_path / "keyplane-home",
        routing_store=store,
        events_topic=settings.events_topic,
        metrics_topic=settings.metrics_topic,
        control_topic=settings.control_topic,
    )
    job_log = tmp_path / "job.log"
    job = start_job_process(settings, job_log)
    producer = Trickle(broker, topic_name)
    try:
        dagrun.migrate_database(setup)

        def counted(n: int) -> bool:
            frame = read_output(settings.output)
            return int(frame.loc[frame["stage"] == "A", "count"].sum()) >= n

        wait_while_job_runs(
            lambda: counted(before.n_events), "the first events", job, job_log, timeout_s=600
        )
        assert _b_instances_holding_state(settings.output) == {0, 1, 2, 3}
        producer.start()
        conf = {
            "action": "in",
            "operator": "B",
            "instances": 2,
            "alpha": 1.5,
            "verify_batches": 3,
            "reply_timeout_s": 120,
        }
        run = subprocess.run(
            [dagrun.airflow_command(), "dags", "test", "keyplane_scale", "-c", json.dumps(conf)],
            env=setup.environment(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        producer.stop.set()
        (tmp_path / "airflow.log").write_text(run.stdout + run.stderr)
        assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
        assert "DagRun Finished" in run.stdout + run.stderr

        deployment = Deployment.from_environment(broker).model_copy(
            update={
                "home": setup.keyplane_home,
                "controller_state": setup.keyplane_home / "controller.json",
                "routing_store": store,
                "events_topic": topic_name,
                "metrics_topic": settings.metrics_topic,
                "control_topic": settings.control_topic,
            }
        )
        (folder,) = (setup.keyplane_home / "scale").iterdir()
        decision = json.loads((folder / scale_steps.DECISION).read_text())
        assert decision["action"] == "in" and decision["operator"] == "B"
        assert decision["instances_before"] == {"A": 4, "B": 4}
        assert decision["instances_after"] == {"A": 4, "B": 2}
        proposal = json.loads((folder / scale_steps.PROPOSAL).read_text())
        assert (proposal["version"], proposal["parent_version"]) == (2, 1)
        active = tuple(proposal["active_after"])
        assert len(active) == 2
        scaled = config_store.load(store, 2)
        assert scaled.created_by == "scale"
        assert scaled.operators["B"].active_instances == active
        assert scaled.operators["A"] == config_store.load(store, 1).operators["A"]
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        assert state.protocol.active_version == 2
        assert state.protocol.last is not None and state.protocol.last.finish is not None
        assert state.protocol.last.finish.type == "DONE"
        verification = json.loads((folder / tasks.VERIFICATION).read_text())
        assert verification["ok"] and verification["batches"] == 3
        assert set(verification["busy_instances"]["B"]) <= set(active)

        producer.join(timeout=60)
        assert not producer.is_alive() and producer.error is None, producer.error
        total = sum(high_watermarks(broker, topic_name).values())
        assert total == before.n_events + sum(spec.n_events for spec in producer.specs)
        wait_while_job_runs(lambda: counted(total), "every event", job, job_log, timeout_s=600)
        assert _b_instances_holding_state(settings.output) == set(active)
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
