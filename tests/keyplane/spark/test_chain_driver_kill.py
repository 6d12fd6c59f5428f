"""A user's pipeline with its driver killed between PROPAGATE and MIGRATED stays exact.

Each example runs as its own job process (``--pipeline``) on v1 (all hash):
the three-stage clickstream and the one-stage hot merchant. The controller
takes it to v2 (keys moved and a hot key split in every stage) step by step,
stage by stage, upstream first. Once one stage's moved state is on the
migration topic and before the job installs it, the whole process group
(Python driver and JVM) is SIGKILLed and the job restarted on its
checkpoint. The restarted job installs the state and reports MIGRATED; the
stages after it follow, then v3 (the first stage's split undone) goes live
in one rollout. The sink's latest row per (stage, key) equals ground truth
computed with pandas over the records read back from the topic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
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
from examples.hot_merchant.produce import payment_events
from keyplane.control.controller import Controller
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.routing.config import save
from keyplane.spark.pipeline_sink import read_parquet_results
from keyplane.testing import routed_job_settings


@dataclass(frozen=True)
class Example:
    """One example pipeline: how to run it, its events, its keys and its ground truth."""

    spec: str
    topic_variable: str
    output_variable: str
    stages: tuple[str, ...]
    killed: str
    """The stage whose hand-off the kill interrupts."""
    events: Callable[[], list[dict[str, Any]]]
    keys: Callable[[pd.DataFrame], dict[str, list[str]]]
    truth: Callable[[pd.DataFrame], dict[tuple[str, str], object]]


def merchants_truth(events: pd.DataFrame) -> dict[tuple[str, str], object]:
    grouped = events.groupby("merchant")["cents"]
    return {
        ("merchants", str(m)): {"cents": int(total), "payments": int(n)}
        for (m, total), n in zip(grouped.sum().items(), grouped.size(), strict=True)
    }


CLICKS = Example(
    "examples.clickstream.pipeline:clicks", "CLICKS_TOPIC", "CLICKS_OUTPUT",
    ("sessions", "users", "categories"), "users",
    lambda: list(page_views(3_000, users=60, seed=4)),
    lambda e: {
        "sessions": ranked_keys(e, lambda f: f["session_id"]),
        "users": ranked_keys(e, lambda f: f["user_id"]),
        "categories": ranked_keys(e, lambda f: f["page"].map(lambda p: p["category"])),
    },
    clicks_truth,
)  # fmt: skip
PAYMENTS = Example(
    "examples.hot_merchant.pipeline:payments", "PAYMENTS_TOPIC", "PAYMENTS_OUTPUT",
    ("merchants",), "merchants",
    lambda: list(payment_events(3_000, seed=6)),
    lambda e: {"merchants": ranked_keys(e, lambda f: f["merchant"])},
    merchants_truth,
)  # fmt: skip


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("example", [CLICKS, PAYMENTS], ids=["three-stages", "one-stage"])
def test_a_pipeline_killed_mid_hand_off_keeps_its_results_exact(
    example: Example,
    broker: str,
    topic_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    sink = tmp_path / "results"
    for name, value in (
        (example.topic_variable, topic_name),
        (example.output_variable, str(sink)),
        ("KEYPLANE_PIPELINE", example.spec),
    ):
        monkeypatch.setenv(name, value)
    events = example.events()
    slices = [events[:1_000], events[1_000:2_000], events[2_000:]]
    assert produce(broker, topic_name, iter(slices[0])) == 1_000
    store = tmp_path / "routing"
    v1, v2, v3 = versions(example.stages, example.keys(records(broker, topic_name)))
    for config in (v1, v2, v3):
        save(config, store)
    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=P, batch=500, trigger="2 seconds",
        version=1, pipeline=example.spec,
    )  # fmt: skip
    job = KilledJob(settings, tmp_path / "job.log")
    request.addfinalizer(job.ensure_gone)
    channel = ControlChannel(broker, settings.control_topic)
    request.addfinalizer(channel.close)
    controller = Controller(channel, tmp_path / "controller.json", store)

    # A hand-off waits 6 s for its install: the kill lands in between.
    job.start("6 seconds")
    controller.prepare(2)
    job.wait(acked(controller), "ACK")
    ack = rollout_of(controller).ack
    assert ack is not None and ack.batch_id is not None
    after = ack.batch_id
    for stage in example.stages:
        controller.propagate(stage)
        if stage != example.killed:
            job.wait(migrated(controller, stage), f"MIGRATED {stage}")
            after = rollout_of(controller).migrated[stage].batch_id or after
            continue
        moved_before = sum(high_watermarks(broker, settings.migration_topic).values())
        moved = MovedState(settings, stage, after=after, moved_before=moved_before)
        job.wait(moved, f"the {stage} stage's moved state", poll_s=RACE_POLL_S)
        job.kill()
        assert stage not in rollout_of(controller).migrated, "the kill must land before the install"
        job.start()
        assert produce(broker, topic_name, iter(slices[1])) == 1_000
        job.wait(migrated(controller, stage), f"MIGRATED {stage}")
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
    read_back = records(broker, topic_name)
    assert len(read_back) == 3_000
    assert latest_results(rows) == example.truth(read_back)
