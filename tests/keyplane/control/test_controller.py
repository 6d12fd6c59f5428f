"""The controller (keyplane.control.controller) over the real broker, against a stand-in job.

The job side is :class:`keyplane.testing.ProtocolOnlyJob`: the real job
protocol of paper 000 §3.4 on the real control topic, without Spark. Steps
are run the way Airflow runs them, each by a new Controller object on the
same state file, and retried the same way.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyplane.control.controller import (
    Controller,
    ControllerError,
    RolloutProgress,
    RolloutRefused,
    RolloutTimeout,
)
from keyplane.control.messages import ProtocolError
from keyplane.kafka.control import ControlChannel, ControlRead
from keyplane.routing import config as config_store
from keyplane.testing import ProtocolOnlyJob

Controllers = Callable[..., Controller]
StartJob = Callable[[], ProtocolOnlyJob]


class CountingChannel(ControlChannel):
    """A real channel that counts its reads, to check that waits do not spin."""

    reads = 0

    def read(self, start: int, end: int | None = None) -> ControlRead:
        self.reads += 1
        return super().read(start, end)


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "controller.json"


@pytest.fixture
def controllers(
    broker: str, topic_name: str, routing_store: Path, state_file: Path, control_key: str
) -> Iterator[Controllers]:
    """A new Controller on the same state file at each call, as each Airflow task builds one."""
    channels: list[ControlChannel] = []

    def build(channel: ControlChannel | None = None, poll_interval_s: float = 0.1) -> Controller:
        channel = channel or ControlChannel(broker, topic_name, key=control_key)
        channels.append(channel)
        return Controller(channel, state_file, routing_store, poll_interval_s=poll_interval_s)

    yield build
    for channel in channels:
        channel.close()


def on_topic(broker: str, topic: str, key: str) -> ControlRead:
    with ControlChannel(broker, topic, key=key) as channel:
        return channel.read(0)


def protocol_state(state_file: Path) -> object:
    """The protocol part of the state file (the read offset is only a cursor)."""
    return json.loads(state_file.read_text())["protocol"]


@pytest.mark.integration
def test_a_rollout_moves_the_job_to_the_new_version_and_times_each_step(
    controllers: Controllers,
    protocol_only_job: StartJob,
    routing_store: Path,
    broker: str,
    topic_name: str,
    control_key: str,
) -> None:
    job = protocol_only_job()
    progress: list[RolloutProgress] = []

    result = controllers().rollout(2, timeout_s=30, on_step=progress.append)

    assert job.wait_until(lambda state: state.active_version == 2 and state.pending is None)
    assert (result.version, result.previous_version) == (2, 1)
    assert result.checksum == config_store.checksum(routing_store, 2)
    assert list(result.seconds) == ["PREPARE", "PROPAGATE", "MIGRATED A", "MIGRATED B", "DONE"]
    assert all(seconds > 0 for seconds in result.seconds.values())
    assert result.total_s == pytest.approx(sum(result.seconds.values()))
    assert [(p.label, p.index, p.total) for p in progress if p.finished] == [
        ("PREPARE v2 → ACK", 0, 5),
        ("PROPAGATE A, B", 1, 5),
        ("await MIGRATED A", 2, 5),
        ("await MIGRATED B", 3, 5),
        ("DONE v2", 4, 5),
    ]
    state = controllers().state
    assert state is not None and (state.active_version, state.current) == (2, None)
    sent = on_topic(broker, topic_name, control_key).messages
    assert [m.describe() for _, m in sent if m.sender == "controller"] == [
        "PREPARE v2",
        "PROPAGATE A v2",
        "PROPAGATE B v2",
        "DONE v2",
    ]
    assert [m.describe() for _, m in sent if m.sender == "job"] == [
        "ACK v2",
        "MIGRATED A v2",
        "MIGRATED B v2",
    ]


@pytest.mark.integration
def test_retrying_every_step_resends_the_same_message_and_changes_nothing(
    controllers: Controllers,
    protocol_only_job: StartJob,
    state_file: Path,
    broker: str,
    topic_name: str,
    control_key: str,
) -> None:
    job = protocol_only_job()

    first = controllers().prepare(2)
    before = state_file.read_bytes()
    assert controllers().prepare(2) == first
    assert state_file.read_bytes() == before
    controllers().wait_ack(20)
    propagated = []
    for operator in ("A", "B"):
        first = controllers().propagate(operator)
        propagated.append(first)
        controllers().wait_migrated(operator, 20)
        before_retry = protocol_state(state_file)
        assert controllers().propagate(operator) == first
        ticks: list[float] = []
        controllers().wait_migrated(operator, 20, on_tick=ticks.append)
        assert ticks == [], "a retried wait must find its MIGRATED on the first look"
        assert protocol_state(state_file) == before_retry
    assert controllers().propagate_all(("A", "B")) == propagated
    assert protocol_state(state_file) == before_retry
    first = controllers().done()
    before_retry = protocol_state(state_file)
    assert controllers().done() == first
    again = controllers().rollout(2, timeout_s=5)
    assert protocol_state(state_file) == before_retry

    assert job.wait_until(lambda state: state.active_version == 2)
    assert again.version == 2 and again.previous_version == 1
    ids: dict[str, set[str]] = defaultdict(set)
    copies: dict[str, int] = defaultdict(int)
    for _, message in on_topic(broker, topic_name, control_key).messages:
        ids[message.describe()].add(str(message.message_id))
        copies[message.describe()] += 1
    assert set(ids) == {
        "PREPARE v2",
        "ACK v2",
        "PROPAGATE A v2",
        "MIGRATED A v2",
        "PROPAGATE B v2",
        "MIGRATED B v2",
        "DONE v2",
    }
    assert all(len(distinct) == 1 for distinct in ids.values()), ids
    assert all(copies[name] >= 2 for name in ("PREPARE v2", "PROPAGATE A v2", "DONE v2"))


@pytest.mark.integration
def test_a_silent_job_times_out_the_rollout_which_aborts_and_says_what_is_missing(
    controllers: Controllers, broker: str, topic_name: str, control_key: str
) -> None:
    channel = CountingChannel(broker, topic_name, key=control_key)
    controller = controllers(channel, poll_interval_s=0.25)

    with pytest.raises(RolloutTimeout) as caught:
        controller.rollout(2, timeout_s=1.0)

    error = caught.value
    assert (error.version, error.reply, error.operator, error.aborted) == (2, "ACK", None, True)
    assert re.fullmatch(
        rf"rollout of v2 aborted: no ACK from the job for v2 \d+\.\d s after PREPARE v2 "
        rf"\(control topic '{topic_name}'\); is the job running\? `keyplane job status`",
        str(error),
    ), str(error)
    assert error.waited_s >= 1.0
    assert 1 <= channel.reads <= 8, "a wait of 1 s polls a few times, not in a busy loop"
    sent = on_topic(broker, topic_name, control_key).messages
    assert [m.describe() for _, m in sent] == ["PREPARE v2", "ABORT v2"]
    assert controllers().in_flight is None
    with pytest.raises(ProtocolError, match="v2 was aborted"):
        controllers().prepare(2)


@pytest.mark.integration
def test_a_missing_migrated_names_the_operator(
    controllers: Controllers, protocol_only_job: StartJob
) -> None:
    job = protocol_only_job()
    controllers().prepare(2)
    controllers().wait_ack(20)
    job.__exit__(None, None, None)
    controllers().propagate("A")

    with pytest.raises(RolloutTimeout) as caught:
        controllers().wait_migrated("A", 0.5)
    assert re.search(
        r"no MIGRATED from operator A for v2 \d+\.\d s after PROPAGATE A v2", str(caught.value)
    )
    assert caught.value.aborted is False
    assert controllers().in_flight == 2


@pytest.mark.integration
def test_abort_after_a_migrated_operator_returns_the_job_and_a_new_version_rolls_out(
    controllers: Controllers, protocol_only_job: StartJob
) -> None:
    job = protocol_only_job()
    controller = controllers()
    controller.prepare(2)
    controller.wait_ack(20)
    controller.propagate("A")
    controller.wait_migrated("A", 20)

    abort = controller.abort()

    assert controllers().abort() == abort
    assert job.wait_until(
        lambda state: (
            state.pending is None
            and all(operator.phase == "steady" for operator in state.phases.values())
        )
    )
    assert (job.state.active_version, job.state.latest_version) == (1, 2)
    with pytest.raises(ControllerError, match="v2 was aborted"):
        controllers().wait_ack(1)
    result = controllers().rollout(3, timeout_s=30)
    assert result.previous_version == 1
    assert job.wait_until(lambda state: state.active_version == 3)


@pytest.mark.integration
def test_an_abort_by_another_process_ends_the_wait_of_a_running_one(
    controllers: Controllers,
) -> None:
    waiting = controllers()
    waiting.prepare(2)

    controllers().abort()

    with pytest.raises(ControllerError, match="v2 was aborted"):
        waiting.wait_ack(5)
    state = waiting.state
    assert state is not None and state.last is not None and state.last.finish is not None
    assert state.last.finish.type == "ABORT"


@pytest.mark.integration
def test_steps_out_of_order_are_refused_with_the_fix(
    controllers: Controllers, broker: str, routing_store: Path, state_file: Path
) -> None:
    with pytest.raises(ControllerError, match="no rollout in flight"):
        controllers().propagate("A")
    with pytest.raises(ControllerError, match="v1 is an initial configuration"):
        controllers().prepare(1)
    with pytest.raises(config_store.UnknownVersionError, match="no configuration version 9"):
        controllers().prepare(9)
    assert not state_file.exists()

    controllers().prepare(2)

    with pytest.raises(ControllerError, match=r"v2 is still rolling out.*keyplane config abort"):
        controllers().prepare(3)
    with pytest.raises(ProtocolError, match="has not acknowledged PREPARE v2"):
        controllers().propagate("A")
    with pytest.raises(ControllerError, match="records the control topic"):
        Controller(ControlChannel(broker, "another-topic", key="k"), state_file, routing_store)


def test_an_unreadable_state_file_is_a_clear_error(
    state_file: Path, routing_store: Path, control_key: str
) -> None:
    state_file.write_text('{"format": 1, "control_topic": "c"}')
    with pytest.raises(ControllerError) as caught:
        Controller(ControlChannel("127.0.0.1:1", "c", key=control_key), state_file, routing_store)
    assert str(caught.value).startswith(f"{state_file} is not a controller state file (")
    assert "move it aside" in str(caught.value)


@pytest.mark.integration
def test_a_version_the_job_cannot_take_is_refused_at_once_with_the_jobs_reason(
    broker: str,
    topic_name: str,
    control_key: str,
    routing_store: Path,
    protocol_only_job: StartJob,
    tmp_path: Path,
    state_file: Path,
) -> None:
    """The controller's store holds another v2 than the job's: the job answers PREPARE
    with REFUSED and its reason, and the rollout fails at once, aborted, instead of
    waiting out its timeout for an ACK that cannot come."""
    job = protocol_only_job()
    other = tmp_path / "other-configs"
    config_store.save(config_store.load(routing_store, 1), other)
    theirs = config_store.load(routing_store, 2)
    config_store.save(theirs.model_copy(update={"created_by": "manual"}), other)
    assert config_store.checksum(other, 2) != config_store.checksum(routing_store, 2)

    with ControlChannel(broker, topic_name, key=control_key) as channel:
        controller = Controller(channel, state_file, other, poll_interval_s=0.1)
        started = time.monotonic()
        with pytest.raises(RolloutRefused) as refused:
            controller.rollout(2, timeout_s=60)
        waited = time.monotonic() - started

    assert waited < 20, waited
    message = str(refused.value)
    assert message.startswith("the job refused v2: unknown_checksum: PREPARE v2 has checksum ")
    assert f"the job's store holds checksum {config_store.checksum(routing_store, 2)}" in message
    assert message.endswith("; rollout of v2 aborted")
    state = controller.state
    assert state is not None and state.current is None and state.active_version == 1
    assert state.last is not None and state.last.finish is not None
    assert state.last.finish.type == "ABORT"
    assert state.last.refused is not None and state.last.refused.reason is not None
    assert message.startswith(f"the job refused v2: {state.last.refused.reason}; ")
    assert job.state.active_version == 1 and job.state.pending is None
