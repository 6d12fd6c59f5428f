"""A driver crash in the middle of a live migration (paper 000 §3.4), recovered exactly.

The routed job runs as its own process. The controller prepares v2 and
propagates it to stage A; as soon as the switch batch has handed A's moved
state to the migration topic, and before the job could report MIGRATED, the
driver (Python and JVM) is killed with SIGKILL. Restarted on the same
checkpoint, the job replays from its offset log: the same routing, the same
evictions, idempotent installs. The rollout then completes, and every count
is exact.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from keyplane.config import OperatorRouting, RoutingConfig, save
from keyplane.controller import Controller
from keyplane.handoff import routed_key_table
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.partials import latest_partials
from keyplane.routedkeys import spark_partition
from keyplane.spark.counts_job import CountsJobSettings, read_output, read_partials
from keyplane.testing import routed_job_topics, start_job_process, wait_while_job_runs
from keyplane.verification import compare_counts, expected_counts
from keyplane.workloads import ZipfEvolvingWorkload

pytestmark = pytest.mark.integration

P = 4


def test_driver_killed_after_propagate_before_migrated_completes_after_restart(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    spec = ZipfEvolvingWorkload(n_keys=300, exponent=1.2, n_categories=12, n_events=30_000, seed=11)
    assert produce_workload(spec, broker, topic_name, partitions=2) == spec.n_events
    truth = expected_counts(spec)
    by_count = truth.sort_values("count", ascending=False, kind="mergesort")
    a_keys = by_count.loc[by_count["stage"] == "A", "key"].tolist()
    b_keys = by_count.loc[by_count["stage"] == "B", "key"].tolist()
    store = tmp_path / "routing"
    save(
        RoutingConfig(
            version=1,
            created_by="initial",
            operators={name: OperatorRouting(parallelism=P) for name in ("A", "B")},
        ),
        store,
    )
    v2 = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="manual",
        operators={
            "A": OperatorRouting(
                parallelism=P,
                table={k: (spark_partition(k, P) + 1) % P for k in a_keys[1:8]},
                hot_keys={a_keys[0]: (0, 2)},
            ),
            "B": OperatorRouting(
                parallelism=P, table={k: (spark_partition(k, P) + 2) % P for k in b_keys[:4]}
            ),
        },
    )
    save(v2, store)
    settings = CountsJobSettings(
        bootstrap_servers=broker,
        events_topic=topic_name,
        checkpoint=tmp_path / "checkpoint",
        output=tmp_path / "output",
        shuffle_partitions=P,
        max_offsets_per_trigger=1_500,
        # A batch at most every 2 s: the kill lands between the switch batch
        # writing A's moved state and the next boundary, which replies MIGRATED.
        trigger_interval="2 seconds",
        routing_store=store,
        routing_version=1,
        **routed_job_topics(topic_name),
    )
    log = tmp_path / "job.log"
    output = settings.output

    first = start_job_process(settings, log)

    def batches_written() -> bool:
        return len(list(output.glob("batch-*.parquet"))) >= 2

    wait_while_job_runs(batches_written, "two batches", first, log, poll_s=0.05)
    with ControlChannel(broker, settings.control_topic) as channel:
        controller = Controller(channel, tmp_path / "controller.json", store)
        controller.prepare(2)
        controller.wait_ack(timeout_s=120)
        controller.propagate("A")

        def moved_state_written() -> bool:
            return sum(high_watermarks(broker, settings.migration_topic).values()) > 0

        wait_while_job_runs(moved_state_written, "stage A's moved state", first, log, poll_s=0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        controller.poll()
        rollout = controller.state.current if controller.state else None
        assert rollout is not None and "A" not in rollout.migrated, "the kill must land first"

        second = start_job_process(settings, log)
        try:
            controller.wait_migrated("A", timeout_s=180)
            controller.propagate("B")
            controller.wait_migrated("B", timeout_s=180)
            controller.done()
            done = sum(high_watermarks(broker, topic_name).values())

            def all_counted() -> bool:
                frame = read_output(output)
                return int(frame.loc[frame["stage"] == "A", "count"].sum()) == done

            wait_while_job_runs(all_counted, "every event", second, log, poll_s=0.05)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=120) == 0, log.read_text()[-3000:]

    report = compare_counts(truth, read_output(output))
    assert report.expected_events == spec.n_events
    assert report.exact, report
    latest = latest_partials(read_partials(output))
    live = latest[latest["count"] > 0]
    for stage in ("A", "B"):
        table = routed_key_table(v2.operators[stage])
        for key, routed, instance in live.loc[
            live["stage"] == stage, ["key", "routed_key", "instance"]
        ].itertuples(index=False):
            assert routed in table.route(key) and instance == table.instance_of(routed), (
                stage,
                key,
                routed,
            )
