"""The broker crashes twice under the routed job, on durable storage; counts stay exact.

The routed job runs as its own process on the embedded broker with ``s3``
storage (a real local S3 server), then on Apache Kafka with its log
directories on disk, and in the slow suite on Apache Kafka again with Spark's
Kafka connector reading the events (``kafka-connector``: the job runs with
source ``jvm`` and routes them in the JVM; the checkpoint's offset log shows
that the connector, not keyplane's source, read every event). The broker is
SIGKILLed and started again twice: once mid-stream, and once in the middle
of a live migration (paper 000 §3.4), after stage A's moved state reached
the migration topic and before the job reported MIGRATED. Each time the
broker stays down for a while, so the job's reads, its protocol replies and
its producers meet a dead broker. The moved state, the control topic and the
input survive in the object store or the log directories; the rollout
completes and every count is exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from keyplane.algorithms.partials import latest_partials
from keyplane.control.controller import Controller
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import HighWatermarks
from keyplane.kafka.apache_kafka import ApacheKafkaBroker
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.routing.handoff import routed_key_table
from keyplane.settings import KafkaSource
from keyplane.spark.counts_job import read_output, read_partials
from keyplane.spark.job_status import read_metrics_topic, read_rollout
from keyplane.testing import (
    crash_broker,
    events_read_by_connector,
    free_port,
    moved_off_hash_config,
    routed_job_settings,
    stage_keys_by_count,
    start_job_process,
    wait_while_job_runs,
)

pytestmark = pytest.mark.integration

P = 4
OUTAGE_S = 3.0


def _crash_and_restart(broker: EmbeddedBroker | ApacheKafkaBroker) -> None:
    """SIGKILL the broker process, leave it down for ``OUTAGE_S``, start it on the same port."""
    crash_broker(broker)
    time.sleep(OUTAGE_S)
    broker.start()


@pytest.mark.parametrize(
    "engine",
    [
        "embedded",
        pytest.param("kafka", marks=pytest.mark.apache_kafka),
        pytest.param("kafka-connector", marks=[pytest.mark.apache_kafka, pytest.mark.slow]),
    ],
)
def test_broker_crashes_mid_stream_and_mid_migration_counts_stay_exact(
    engine: str, kafka_source: KafkaSource, tmp_path: Path
) -> None:
    crashing: EmbeddedBroker | ApacheKafkaBroker = (
        EmbeddedBroker(tmp_path / "broker", free_port(), storage="s3")
        if engine == "embedded"
        else ApacheKafkaBroker(tmp_path / "broker", free_port())
    )
    bootstrap = crashing.start().bootstrap_servers
    job: subprocess.Popen[bytes] | None = None
    try:
        topic = "restarts"
        spec = ZipfEvolvingWorkload(
            n_keys=300, exponent=1.2, n_categories=12, n_events=12_000, seed=17
        )
        assert produce_workload(spec, bootstrap, topic, partitions=2) == spec.n_events
        truth = expected_counts(spec)
        a_keys, b_keys = stage_keys_by_count(truth)
        store = tmp_path / "routing"
        save(
            RoutingConfig.all_hash(P, OPERATORS),
            store,
        )
        v2 = moved_off_hash_config(
            2,
            {"A": a_keys[1:8], "B": b_keys[:4]},
            P,
            shifts={"B": 2},
            hot_keys={"A": {a_keys[0]: (0, 2)}},
        )
        save(v2, store)
        # A trigger well above a batch's duration, even on a loaded machine, leaves the
        # crash a window between the switch batch (moved state written) and the install
        # batch (MIGRATED); with 2 seconds a slow batch closed it.
        settings = routed_job_settings(
            bootstrap,
            topic,
            tmp_path,
            parallelism=P,
            batch=1_000,
            trigger="5 seconds",
            version=1,
            source=kafka_source,
        )
        log = tmp_path / "job.log"
        output = settings.output

        def batches_written(n: int) -> bool:
            return len(list(output.glob("batch-*.parquet"))) >= n

        job = start_job_process(settings, log)
        wait_while_job_runs(
            lambda: batches_written(1), "a first batch", job, log, timeout_s=600, poll_s=0.05
        )
        _crash_and_restart(crashing)
        before = len(list(output.glob("batch-*.parquet")))
        wait_while_job_runs(
            lambda: batches_written(before + 1),
            "a batch after the restart",
            job,
            log,
            timeout_s=600,
        )

        with ControlChannel(bootstrap, settings.control_topic) as channel:
            controller = Controller(channel, tmp_path / "controller.json", store)
            controller.prepare(2)
            controller.wait_ack(timeout_s=600)
            controller.propagate("A")

            # One consumer for every poll: a new one per poll connects and fetches
            # metadata first, time taken from the window between the moved state
            # and MIGRATED in which the crash must land.
            with HighWatermarks(bootstrap) as marks:

                def moved_state_written() -> bool:
                    return sum(marks.of(settings.migration_topic).values()) > 0

                wait_while_job_runs(
                    moved_state_written, "A's moved state", job, log, timeout_s=600, poll_s=0.05
                )
            # Checked before the crash: once the broker is back, the job may send
            # MIGRATED before this process reads the topic again, as it should.
            controller.poll()
            in_flight = controller.state.current if controller.state else None
            assert in_flight is not None and "A" not in in_flight.migrated, "crash before MIGRATED"
            _crash_and_restart(crashing)
            controller.wait_migrated("A", timeout_s=600)
            controller.propagate("B")
            controller.wait_migrated("B", timeout_s=600)
            controller.done()

            def all_counted() -> bool:
                frame = read_output(output)
                return int(frame.loc[frame["stage"] == "A", "count"].sum()) == spec.n_events

            wait_while_job_runs(all_counted, "every event", job, log, timeout_s=600, poll_s=0.1)
        metrics = read_metrics_topic(bootstrap, settings.metrics_topic)
        assert metrics is not None and metrics.latest.versions == {"A": 2, "B": 2}
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        crashing.stop()

    rollout = read_rollout(tmp_path / "controller.json")
    assert rollout is not None
    assert (rollout.active_version, rollout.in_flight, rollout.last_outcome) == (2, None, "DONE")
    report = compare_counts(truth, read_output(output))
    assert report.expected_events == spec.n_events
    assert report.exact, report
    if kafka_source == "jvm":
        assert events_read_by_connector(settings.checkpoint, topic) == spec.n_events
    latest = latest_partials(read_partials(output))
    live = latest[latest["count"] > 0]
    for stage in OPERATORS:
        table = routed_key_table(v2.operators[stage])
        for key, routed, instance in live.loc[
            live["stage"] == stage, ["key", "routed_key", "instance"]
        ].itertuples(index=False):
            assert routed in table.route(key) and instance == table.instance_of(routed), (
                stage,
                key,
                routed,
            )
