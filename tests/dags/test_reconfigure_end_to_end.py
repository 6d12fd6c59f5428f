"""The reconfiguration DAG end to end: real broker, real routed job, real ``airflow dags test``.

The routed job (its own process, all-hash v1) counts a correlated pairs
workload (paper 000 §4.2) while more events keep arriving. One run of
``keyplane_reconfigure`` then collects statistics with Spark, validates them,
plans a new version (METIS tables, FISH hot keys) stored as waves of at most
``max_moves_per_wave`` moved keys, validates it with Great Expectations,
backtests it, decides to publish, rolls the waves out one after the other and
the last over the DAG's own tasks (PREPARE → ACK → PROPAGATE A and B in one
publish → MIGRATED A, MIGRATED B from the same batch → DONE, with deferred
waits), and verifies the job's first batches on the last. Every count stays
exact. Then a deliberately bad configuration (one instance given three times
the average load) is rejected by Great Expectations and never reaches the
job; the run's ``roll_out_waves``, ``publish`` and ``propagate``, run again
with ``airflow tasks test``, change nothing.

A second, forced run then meets a flash hot key (001 §1) that arrives right
after its statistics were taken: every event carries one key, so the version
it rolls out measures four times the mean load on one instance. ``verify``
detects the regression, the ``rollback`` group republishes the previous
routing as a new version, the run ends failed with the reason, and the job
ends on the previous routing with every count exact.

It runs on the embedded broker and on Apache Kafka with keyplane's source
reading the events, and in the slow suite on Apache Kafka with Spark's Kafka
connector reading them (``kafka-connector``: the job runs with source ``jvm``
and routes the events in the JVM; every assertion above holds there too, and
the checkpoint's offset log shows that the connector read every event).
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from keyplane.algorithms import statistics as stats
from keyplane.control.controller import ControllerFile
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import WorkloadTrickle, produce_workload
from keyplane.orchestration import (
    configuration_steps,
    dagrun,
    rollout_steps,
    run_records,
    verification_steps,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.migration import plan_migration
from keyplane.routing.routedkeys import spark_partition
from keyplane.settings import KafkaSource
from keyplane.spark.counts_job import read_output
from keyplane.testing import (
    events_read_by_connector,
    routed_job_settings,
    start_job_process,
    wait_while_job_runs,
)

pytestmark = pytest.mark.integration

P = 4
BUSY_S = 900
"""The longest wait for the job's batches: generous, since a CI machine may be busy."""
REPO = Path(__file__).resolve().parents[2]
MAX_MOVES_PER_WAVE = 40


def _message_ids(broker: str, topic: str) -> list[str]:
    with ControlChannel(broker, topic) as channel:
        return [str(message.message_id) for _, message in channel.read(0).messages]


@pytest.mark.parametrize(
    "engine_broker",
    [
        "embedded",
        pytest.param("kafka", marks=pytest.mark.apache_kafka),
        pytest.param("kafka-connector", marks=[pytest.mark.apache_kafka, pytest.mark.slow]),
    ],
    indirect=True,
)
def test_scheduled_run_publishes_reruns_change_nothing_and_a_regression_rolls_back(
    engine_broker: str, kafka_source: KafkaSource, topic_name: str, tmp_path: Path
) -> None:
    before = PairsWorkload(n_keys=48, locality=0.9, n_events=8_000, seed=5)
    assert produce_workload(before, engine_broker, topic_name, partitions=2) == before.n_events
    store = tmp_path / "routing"
    config_store.save(
        RoutingConfig.all_hash(P, OPERATORS),
        store,
    )
    settings = routed_job_settings(
        engine_broker,
        topic_name,
        tmp_path,
        parallelism=P,
        batch=2_000,
        trigger="1 second",
        version=1,
        source=kafka_source,
    )
    job_log = tmp_path / "job.log"
    job = start_job_process(settings, job_log)
    setup = dagrun.AirflowSetup.for_job(
        settings,
        airflow_home=tmp_path / "airflow",
        keyplane_home=tmp_path / "keyplane-home",
        dags_folder=REPO / "dags",
    )
    # Events keep arriving while the DAG runs, so the new version has batches to
    # verify; once ``hot`` is set, every event carries the one key 1 (a flash hot key).
    hot = threading.Event()
    producer = WorkloadTrickle(
        lambda i: PairsWorkload(
            n_keys=1 if hot.is_set() else 48, locality=0.9, n_events=400, seed=100 + i
        ),
        engine_broker,
        topic_name,
    )
    try:
        dagrun.migrate_database(setup)

        def counted(n: int) -> bool:
            frame = read_output(settings.output)
            return int(frame.loc[frame["stage"] == "A", "count"].sum()) >= n

        wait_while_job_runs(
            lambda: counted(4_000), "the job's first batches", job, job_log, timeout_s=BUSY_S
        )
        producer.start()
        conf = {
            "min_total_count": 5_000,
            "alpha": 1.1,
            "verify_batches": 3,
            "reply_timeout_s": 600,
        }
        run = dagrun.dag_test(
            setup,
            {**conf, "max_moves_per_wave": MAX_MOVES_PER_WAVE},
            log=tmp_path / "airflow.log",
            timeout_s=BUSY_S * 2,
        )
        assert run.returncode == 0 and run.state == "success", run.output[-6000:]

        deployment = Deployment.from_environment(engine_broker)
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
        proposal = json.loads((folder / run_records.PROPOSAL).read_text())
        new, waves = int(proposal["version"]), list(proposal["waves"])
        assert proposal["parent_version"] == 1 and waves and waves == list(range(2, new))
        chain = [config_store.load(store, v) for v in (1, *waves, new)]
        for old, wave in itertools.pairwise(chain):
            assert 1 <= plan_migration(old, wave, spark_partition).cost.keys <= MAX_MOVES_PER_WAVE
        assert run.task("roll_out_waves").state == "success"
        assert json.loads((folder / run_records.DECISION).read_text())["publish"]
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        assert state.protocol.active_version == new
        assert state.protocol.last is not None and state.protocol.last.finish is not None
        assert state.protocol.last.finish.type == "DONE"
        assert set(state.protocol.last.migrated) == {"A", "B"}
        # One publish PROPAGATEs both stages: they switch in one batch and install in the next.
        installed = {op: r.batch_id for op, r in state.protocol.last.migrated.items()}
        assert installed["A"] == installed["B"], installed
        verification = json.loads((folder / run_records.VERIFICATION).read_text())
        assert verification["regressed"] is False, verification
        assert verification["after"]["batches"] == 3

        # A deliberately bad configuration: one instance carries 3x the average load.
        frequencies = stats.read_snapshot(deployment.snapshots, manifest.run_id).frequencies
        a_keys = frequencies.loc[frequencies["stage"] == "A", "key"].tolist()
        cut = len(a_keys) * 3 // 4
        table = {k: 0 for k in a_keys[:cut]} | {k: 1 + i % 3 for i, k in enumerate(a_keys[cut:])}
        bad = RoutingConfig(
            version=new + 1,
            parent_version=new,
            created_by="manual",
            operators={
                "A": OperatorRouting(parallelism=P, table=table),
                "B": config_store.load(store, new).operators["B"],
            },
        )
        config_store.save(bad, store)
        with pytest.raises(run_records.StepError, match="failed validation") as rejected:
            configuration_steps.validate_configuration(
                deployment, manifest.run_id, version=bad.version
            )
        assert "max/mean within α" in str(rejected.value)
        with pytest.raises(run_records.StepError, match="never published"):
            rollout_steps.require_validated(deployment, bad.version)

        # publish and propagate of the finished run, run again: the same messages with the
        # same ids, which the job ignores; it stays on the new version and replies nothing
        # new. roll_out_waves sends nothing: the job runs past every wave.
        sent = _message_ids(engine_broker, settings.control_topic)
        mark = rollout_steps.metrics_end(deployment)
        for task_id in ("roll_out_waves", "publish", "propagate"):
            again = subprocess.run(
                [dagrun.airflow_command(), "tasks", "test", dagrun.DAG_ID, task_id, run.run_id],
                env=setup.environment(),
                capture_output=True,
                text=True,
                timeout=BUSY_S,
            )
            assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        resent = _message_ids(engine_broker, settings.control_topic)
        assert len(resent) == len(sent) + 3 and set(resent) == set(sent)

        def batches_since(start: dict[int, int]) -> list[dict[str, int]]:
            return [
                r.versions for r in verification_steps.read_metrics(deployment, start) if r.rows
            ]

        wait_while_job_runs(
            lambda: len(batches_since(mark)) >= 3, "batches", job, job_log, timeout_s=BUSY_S
        )
        assert all(v == {"A": new, "B": new} for v in batches_since(mark))
        assert _message_ids(engine_broker, settings.control_topic) == resent
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        assert state.protocol.active_version == new and state.protocol.current is None

        # A forced run; a flash hot key arrives once its statistics are taken.
        def on_task(record: dagrun.TaskRecord) -> None:
            if record.task_id == "collect_statistics":
                hot.set()

        forced = dagrun.dag_test(
            setup,
            {**conf, "force": True, "min_total_count": 2_000},
            log=tmp_path / "airflow-forced.log",
            on_task=on_task,
            timeout_s=BUSY_S * 2,
        )
        assert forced.state == "failed", forced.output[-6000:]
        assert forced.task("verify").state == "success"
        assert forced.task("rollback.rollback_done").state == "success"
        assert forced.task("rollback.report_rollback").state == "failed"
        assert "and was rolled back" in forced.output
        forced_folder = stats.snapshot_folder(deployment.snapshots, forced.run_id)
        regressed = json.loads((forced_folder / run_records.VERIFICATION).read_text())
        assert regressed["regressed"] and regressed["version"] == new + 2, regressed
        assert "imbalance rose" in regressed["reason"]
        assert regressed["after"]["imbalance"] >= 2.0 > 1.5 * regressed["before"]["imbalance"]
        rollback = json.loads((forced_folder / run_records.ROLLBACK).read_text())
        restored = new + 3
        assert (rollback["version"], rollback["restores"], rollback["replaces"]) == (
            restored,
            new,
            new + 2,
        )
        assert config_store.load(store, restored).operators == chain[-1].operators
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        assert state.protocol.active_version == restored and state.protocol.current is None
        rolled_back = json.loads((forced_folder / "rollback_rollout.json").read_text())
        back = {int(p): int(o) for p, o in rolled_back["metrics_start"].items()}
        wait_while_job_runs(
            lambda: len(batches_since(back)) >= 2, "batches", job, job_log, timeout_s=BUSY_S
        )
        assert all(v == {"A": restored, "B": restored} for v in batches_since(back))

        producer.finish()
        total = sum(high_watermarks(engine_broker, topic_name).values())
        assert total == before.n_events + sum(spec.n_events for spec in producer.specs)
        wait_while_job_runs(lambda: counted(total), "every event", job, job_log, timeout_s=BUSY_S)
    finally:
        producer.stop.set()
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, job_log.read_text()[-3000:]

    truth = expected_counts_of((before, *producer.specs))
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == total
    assert report.exact, report
    if kafka_source == "jvm":
        assert events_read_by_connector(settings.checkpoint, topic_name) == total
    with ControlChannel(engine_broker, settings.control_topic) as channel:
        messages = channel.read(0).messages
    assert all(message.config_version != bad.version for _, message in messages)
    for version in (*waves, new):
        assert {m.type for _, m in messages if m.config_version == version} >= {
            "PREPARE",
            "ACK",
            "PROPAGATE",
            "MIGRATED",
            "DONE",
        }
    done = [m.config_version for _, m in messages if m.type == "DONE"]
    assert list(dict.fromkeys(done))[: len(waves) + 1] == [*waves, new]
    routed = verification_steps.read_metrics(deployment, {0: 0})
    assert all(bad.version not in record.versions.values() for record in routed)
    # Every wave ran micro-batches of its own, in order: the job never skipped one.
    seen = list(dict.fromkeys(record.versions["A"] for record in routed if record.versions))
    assert seen[: len(waves) + 2] == [1, *waves, new]
