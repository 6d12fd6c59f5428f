"""A three-stage pipeline's driver killed between PROPAGATE and MIGRATED stays exact.

The clickstream example runs as its own job process (``--pipeline``), on
v1 (all hash). The controller takes it to v2 step by step, stage by stage,
upstream first: once the middle stage's moved state is on the migration
topic and before the job installs it, the whole process group (Python
driver and JVM) is SIGKILLed and the job restarted on its checkpoint. The
restarted job installs the state and reports MIGRATED; the last stage
follows, then v3 (the first stage's split undone) goes live in one rollout.
The sink's latest row per (stage, key) equals ground truth computed with
pandas over the records read back from the topic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chain_runs import P, clicks_truth, latest_results, produce, ranked_keys, records, versions
from test_live_reconfiguration_fault import (
    RACE_POLL_S,
    KilledJob,
    MovedState,
    acked,
    committed_through,
    migrated,
    plan_of,
    rollout_of,
)

from examples.clickstream.produce import page_views
from keyplane.control.controller import Controller
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.routing.config import save
from keyplane.spark.pipeline_sink import read_parquet_results
from keyplane.testing import routed_job_settings

PIPELINE = "examples.clickstream.pipeline:clicks"
STAGES = ("sessions", "users", "categories")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_three_stage_pipeline_killed_mid_hand_off_keeps_its_results_exact(
    broker: str,
    topic_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    sink = tmp_path / "results"
    for name, value in (
        ("CLICKS_TOPIC", topic_name),
        ("CLICKS_OUTPUT", str(sink)),
        ("KEYPLANE_PIPELINE", PIPELINE),
    ):
        monkeypatch.setenv(name, value)
    views = list(page_views(3_000, users=60, seed=4))
    slices = [views[:1_000], views[1_000:2_000], views[2_000:]]
    assert produce(broker, topic_name, iter(slices[0])) == 1_000
    first = records(broker, topic_name)
    ranked = {
        "sessions": ranked_keys(first, lambda e: e["session_id"]),
        "users": ranked_keys(first, lambda e: e["user_id"]),
        "categories": ranked_keys(first, lambda e: e["page"].map(lambda p: p["category"])),
    }
    store = tmp_path / "routing"
    v1, v2, v3 = versions(STAGES, ranked)
    for config in (v1, v2, v3):
        save(config, store)
    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=P, batch=500, trigger="2 seconds",
        version=1, pipeline=PIPELINE,
    )  # fmt: skip
    job = KilledJob(settings, tmp_path / "job.log")
    request.addfinalizer(job.ensure_gone)
    channel = ControlChannel(broker, settings.control_topic)
    request.addfinalizer(channel.close)
    controller = Controller(channel, tmp_path / "controller.json", store)

    # The middle stage's hand-off waits 6 s for its install: the kill lands in between.
    job.start("6 seconds")
    controller.prepare(2)
    job.wait(acked(controller), "ACK")
    ack = rollout_of(controller).ack
    assert ack is not None and ack.batch_id is not None
    controller.propagate("sessions")
    job.wait(migrated(controller, "sessions"), "MIGRATED sessions")
    moved_before = sum(high_watermarks(broker, settings.migration_topic).values())
    after = rollout_of(controller).migrated["sessions"].batch_id
    assert after is not None
    controller.propagate("users")
    users_moved = MovedState(settings, "users", after=after, moved_before=moved_before)
    job.wait(users_moved, "the users stage's moved state", poll_s=RACE_POLL_S)
    job.kill()
    assert "users" not in rollout_of(controller).migrated, "the kill must land before the install"

    job.start()
    assert produce(broker, topic_name, iter(slices[1])) == 1_000
    job.wait(migrated(controller, "users"), "MIGRATED users")
    controller.propagate("categories")
    job.wait(migrated(controller, "categories"), "MIGRATED categories")
    controller.done()
    assert controller.rollout(3, timeout_s=600).version == 3
    assert produce(broker, topic_name, iter(slices[2])) == 1_000
    end = sum(high_watermarks(broker, topic_name).values())

    def caught_up() -> bool:
        batch = committed_through(settings.checkpoint)
        if batch is None:
            return False
        plan = plan_of(settings.checkpoint, batch)
        read = sum(int(o) for o in plan["events"][topic_name].values())
        return read == end and plan["protocol"]["active_version"] == 3

    job.wait(caught_up, "every event read on v3")
    job.stop()

    assert job.restarts == 1
    rows = read_parquet_results(sink)
    events = records(broker, topic_name)
    assert len(events) == 3_000
    assert latest_results(rows) == clicks_truth(events)
