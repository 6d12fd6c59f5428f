"""The scale DAG's steps: the executor step never sends a second command on a retry, and a
run counts its topics' keys once, the later steps reading what the first counted."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fake_control import decide_scale_in_of_b
from pydantic import ValidationError

from keyplane.algorithms.statistics import TopicWindow
from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.orchestration import run_records, scale_steps
from keyplane.orchestration.deployment import Deployment
from keyplane.reference.events import key_name
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.spark.executors import (
    LOCAL_MODE_REFUSAL,
    ExecutorChannel,
    ExecutorCommand,
    ExecutorControl,
    ExecutorReply,
    command_id,
    executors_topic,
)
from keyplane.testing import answering, deployment_under

RUN = "manual__2026-12-06T17:00:00+00:00"


def scaling_out(tmp_path: Path, broker: str, prefix: str) -> Deployment:
    """A deployment on ``broker`` whose run ``RUN`` decided to scale out."""
    deployment = deployment_under(tmp_path, bootstrap_servers=broker, topic_prefix=f"{prefix}-")
    folder = run_records.scale_folder(deployment, RUN)
    folder.mkdir(parents=True)
    run_records.write_once(folder / scale_steps.DECISION, {"action": "out", "publish": True})
    return deployment


@pytest.mark.integration
def test_a_try_that_died_before_its_record_records_the_reply_on_the_topic_and_sends_nothing(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    deployment = scaling_out(tmp_path, broker, topic_name)
    topic = executors_topic(deployment.control_topic)
    channel = ExecutorChannel(broker, topic)
    channel.ensure()
    # The first try's command and the driver's answer; the try died before writing its record.
    sent = ExecutorCommand(action="add", wait_s=5.0, request_id=command_id(topic, RUN, "add"))
    answer = ExecutorReply(
        request_id=sent.request_id,
        outcome="applied",
        before=("0",),
        after=("0", "1"),
        changed="1",
        seconds=3.0,
    )
    try:
        channel.send(sent)
        channel.send(answer)
        end = channel.end()
        record = scale_steps.change_executors(deployment, RUN, when="out", enabled=True, wait_s=5.0)
        assert channel.end() == end
    finally:
        channel.close()
    assert record["executor"] == "1"
    assert record["executors_after"] == ["0", "1"]
    assert (run_records.scale_folder(deployment, RUN) / scale_steps.EXECUTORS).is_file()


@pytest.mark.integration
def test_a_retried_try_gets_the_first_answer_without_a_second_command(
    broker: str, topic_name: str, tmp_path: Path, spark: Any
) -> None:
    """The local-mode driver refuses; the retry finds that refusal with no driver running."""
    deployment = scaling_out(tmp_path, broker, topic_name)
    topic = executors_topic(deployment.control_topic)
    driver_side = ExecutorChannel(broker, topic)
    control = ExecutorControl(spark.sparkContext, driver_side, poll_s=0.1)
    try:
        with (
            answering(control) as answered,
            pytest.raises(run_records.Refused, match=LOCAL_MODE_REFUSAL),
        ):
            scale_steps.change_executors(deployment, RUN, when="out", enabled=True, wait_s=5.0)
    finally:
        driver_side.close()
    assert len(answered) == 1
    end = driver_side.end()

    with pytest.raises(run_records.Refused, match=LOCAL_MODE_REFUSAL):
        scale_steps.change_executors(deployment, RUN, when="out", enabled=True, wait_s=5.0)

    assert driver_side.end() == end
    on_topic, _ = driver_side.read(driver_side.earliest())
    driver_side.close()
    commands = [m for m in on_topic if isinstance(m, ExecutorCommand)]
    assert [c.request_id for c in commands] == [command_id(topic, RUN, "add")]


# --- the run's event counts -------------------------------------------------------------

COUNTS = scale_steps.EventCounts(
    windows=(TopicWindow(topic="events", start={0: 0, 1: 5}, end={0: 4, 1: 7}),),
    loads={"A": {"a1": 3, "a2": 3}, "B": {"b1": 4, "b2": 2}},
    pairs={"A": {"a1": {"b1": 3}, "a2": {"b1": 1, "b2": 2}}},
)


def test_the_stored_counts_read_back_equal_through_their_json_pure() -> None:
    text = json.dumps(COUNTS.model_dump(mode="json"))

    again = scale_steps.EventCounts.model_validate_json(text)

    assert again == COUNTS
    assert again.windows[0].end == {0: 4, 1: 7}
    assert again.events == 6
    assert again.key_loads()["B"] == {"b1": 4.0, "b2": 2.0}
    assert again.pair_counts() == {
        ("A", "a1", "b1"): 3.0,
        ("A", "a2", "b1"): 1.0,
        ("A", "a2", "b2"): 2.0,
    }


@pytest.mark.parametrize(
    ("corrupt", "refusal"),
    [
        (lambda text: text[: len(text) // 2], "Invalid JSON"),
        (lambda text: text.replace('"a1": 3', '"a1": 5'), "'a1': 5 events but 3 in pairs"),
        (lambda text: text.replace('"b2": 2}}', '"b2": -2}}'), "greater than or equal to 0"),
        (lambda text: text.replace('"pairs"', '"pears"'), "pairs"),
    ],
    ids=["cut", "edited", "negative", "renamed"],
)
def test_a_corrupt_counts_file_is_refused_pure(corrupt: Any, refusal: str) -> None:
    text = json.dumps(COUNTS.model_dump(mode="json"), sort_keys=True)

    with pytest.raises(ValidationError, match=refusal):
        scale_steps.EventCounts.model_validate_json(corrupt(text))


def _truth(*workloads: PairsWorkload) -> tuple[dict[str, dict[str, int]], Counter[str]]:
    """Events per key of each stage of ``workloads``, and per (A key, B key) pair."""
    loads: dict[str, Counter[str]] = {FIRST_STAGE: Counter(), SECOND_STAGE: Counter()}
    pairs: Counter[str] = Counter()
    for workload in workloads:
        for batch in workload.batches(10_000):
            for a, b in zip(batch.a.tolist(), batch.b.tolist(), strict=True):
                loads[FIRST_STAGE][key_name(a)] += 1
                loads[SECOND_STAGE][key_name(b)] += 1
                pairs[f"{key_name(a)} {key_name(b)}"] += 1
    return {stage: dict(counts) for stage, counts in loads.items()}, pairs


def _pairs_of(counts: scale_steps.EventCounts) -> Counter[str]:
    return Counter(
        {f"{a} {b}": int(n) for (_, a, b), n in counts.pair_counts().items() if int(n) > 0}
    )


@pytest.fixture
def scaling_in(
    tmp_path: Path, broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> Deployment:
    """A deployment on ``broker`` whose job runs all-hash v1 and whose run ``RUN`` decided to
    scale B in; the reference pipeline reads the deployment's events topic."""
    deployment = deployment_under(tmp_path, bootstrap_servers=broker, topic_prefix=f"{topic_name}-")
    monkeypatch.setenv("KEYPLANE_EVENTS_TOPIC", deployment.events_topic)
    config_store.save(RoutingConfig.all_hash(4, OPERATORS), deployment.routing_store)
    decide_scale_in_of_b(deployment, RUN)
    return deployment


FIRST = PairsWorkload(n_events=1_500, n_keys=24, locality=0.5, seed=3)
LATER = PairsWorkload(n_events=700, n_keys=40, locality=0.5, seed=4)


@pytest.mark.integration
def test_the_validation_reads_the_counts_the_configuration_step_counted_not_newer_events(
    scaling_in: Deployment, spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    deployment = scaling_in
    produce_workload(FIRST, deployment.bootstrap_servers, deployment.events_topic, partitions=2)
    loads, pairs = _truth(FIRST)

    proposal = scale_steps.compute_scaled_configuration(deployment, RUN)
    stored = (run_records.scale_folder(deployment, RUN) / scale_steps.COUNTS).read_text()
    produce_workload(LATER, deployment.bootstrap_servers, deployment.events_topic)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=scale_steps.__name__):
        record = scale_steps.validate_scaled_configuration(deployment, RUN, alpha=4.0)
        seen = scale_steps.run_counts(deployment, RUN, stored=True)

    assert proposal["keys"] == len(loads[SECOND_STAGE])
    assert record["success"] is True
    assert seen.loads == loads
    assert _pairs_of(seen) == pairs
    ((window),) = seen.windows
    assert window.topic == deployment.events_topic
    assert window.records == FIRST.n_events
    assert sorted(window.end) == [0, 1]
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith("counted")]
    assert len([m for m in messages if m.startswith("read the run's event counts")]) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (run_records.scale_folder(deployment, RUN) / scale_steps.COUNTS).read_text() == stored


@pytest.mark.integration
def test_a_task_that_cannot_read_the_counts_sets_them_aside_and_counts_again(
    scaling_in: Deployment, spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    deployment = scaling_in
    produce_workload(FIRST, deployment.bootstrap_servers, deployment.events_topic, partitions=2)
    scale_steps.run_counts(deployment, RUN)
    path = run_records.scale_folder(deployment, RUN) / scale_steps.COUNTS
    cut = path.read_text()[:100]
    path.write_text(cut)
    produce_workload(LATER, deployment.bootstrap_servers, deployment.events_topic)
    caplog.clear()

    with caplog.at_level(logging.INFO, logger=scale_steps.__name__):
        seen = scale_steps.run_counts(deployment, RUN, stored=True)

    loads, pairs = _truth(FIRST, LATER)
    assert seen.loads == loads
    assert _pairs_of(seen) == pairs
    assert seen.windows[0].records == FIRST.n_events + LATER.n_events
    (aside,) = path.parent.glob(f"{scale_steps.COUNTS}.unreadable-*")
    assert aside.read_text() == cut
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "cannot be read" in warning.getMessage() and "counting again" in warning.getMessage()
    assert scale_steps.EventCounts.model_validate_json(path.read_text()) == seen
