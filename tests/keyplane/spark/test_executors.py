"""Executor commands: their signed wire form, which executor a scale-in releases, local mode,
and that a command delivered again is answered, never carried out, twice."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest

from keyplane.spark.executors import (
    LOCAL_MODE_REFUSAL,
    ExecutorChannel,
    ExecutorCommand,
    ExecutorControl,
    ExecutorError,
    ExecutorReply,
    command_id,
    decode,
    encode,
    executor_ids,
    executors_topic,
    request,
    surplus,
    to_release,
)
from keyplane.testing import answering

KEY = b"keyplane-tests-only"


def test_pure_command_and_reply_round_trip_signed() -> None:
    command = ExecutorCommand(action="release", executor="3", wait_s=30.0)
    assert decode(encode(command, KEY), KEY) == command
    reply = ExecutorReply(
        request_id=command.request_id,
        outcome="applied",
        before=("0", "3"),
        after=("0",),
        changed="3",
        seconds=1.5,
    )
    assert decode(encode(reply, KEY), KEY) == reply


def test_pure_forged_or_malformed_records_are_refused_in_one_line() -> None:
    raw = encode(ExecutorCommand(action="add"), KEY)
    with pytest.raises(ValueError, match="signature"):
        decode(raw, b"another key")
    with pytest.raises(ValueError, match="signature"):
        decode(raw.replace(b'"add"', b'"release"'), KEY)
    with pytest.raises(ValueError, match=r"\(not_json\)"):
        decode(b"\xff{", KEY)
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        decode(b"[1]", KEY)


def test_pure_command_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="action"):
        ExecutorCommand.model_validate({"action": "double"})
    with pytest.raises(ValueError, match="wait_s"):
        ExecutorCommand(action="add", wait_s=0.0)


def test_pure_release_takes_the_newest_by_number_never_the_last() -> None:
    assert to_release(["0", "2", "10"], None) == "10"
    assert to_release(["0", "2", "10"], "2") == "2"
    with pytest.raises(ExecutorError, match="not one of the job's executors 0, 2"):
        to_release(["0", "2"], "7")
    with pytest.raises(ExecutorError, match="leave none"):
        to_release(["0"], None)


def test_pure_surplus_is_the_executors_granted_last() -> None:
    assert surplus(["10", "2", "1"], 2) == ["10"]
    assert surplus(["0", "1"], 2) == []
    assert surplus(["3", "1", "2", "0"], 1) == ["1", "2", "3"]


def test_pure_command_ids_are_the_runs_and_the_actions() -> None:
    run = "manual__2026-12-06T17:00:00+00:00"
    first = command_id("jobs.control.executors", run, "add")
    assert command_id("jobs.control.executors", run, "add") == first
    assert first.version == 5
    others = {
        command_id("jobs.control.executors", run, "release"),
        command_id("jobs.control.executors", "manual__2026-12-06T18:00:00+00:00", "add"),
        command_id("other.control.executors", run, "add"),
    }
    assert first not in others and len(others) == 3


def test_pure_executor_ids_of_metrics_labels() -> None:
    assert executor_ids(["10.0.0.2:3", "host:0"]) == {"3", "0"}
    assert executors_topic("jobs.control") == "jobs.control.executors"


@pytest.mark.integration
def test_local_mode_refuses_over_the_broker_with_one_line(
    broker: str, topic_name: str, spark: Any
) -> None:
    topic = executors_topic(topic_name)
    driver_side = ExecutorChannel(broker, topic)
    controller_side = ExecutorChannel(broker, topic)
    control = ExecutorControl(spark.sparkContext, driver_side, poll_s=0.1)
    command = ExecutorCommand(action="add", wait_s=5.0)
    try:
        with answering(control) as answered:
            reply = request(controller_side, command, timeout_s=60.0)
    finally:
        driver_side.close()
        controller_side.close()
    assert reply.request_id == command.request_id
    assert reply.outcome == "refused"
    assert reply.reason == LOCAL_MODE_REFUSAL
    assert reply.before == reply.after == ()
    assert answered == [reply]


@pytest.mark.integration
def test_a_request_answered_on_the_topic_already_sends_nothing(
    broker: str, topic_name: str
) -> None:
    channel = ExecutorChannel(broker, executors_topic(topic_name))
    channel.ensure()
    command = ExecutorCommand(action="add", request_id=command_id(topic_name, "run-1", "add"))
    answer = ExecutorReply(
        request_id=command.request_id,
        outcome="applied",
        before=("0",),
        after=("0", "1"),
        changed="1",
        seconds=2.0,
    )
    other = answer.model_copy(update={"request_id": uuid4(), "changed": "2"})
    try:
        channel.send(command)
        channel.send(answer)
        channel.send(other)
        end = channel.end()
        reply = request(channel, command, timeout_s=30.0)
        assert channel.end() == end
    finally:
        channel.close()
    assert reply == answer


@pytest.mark.integration
def test_a_restarted_driver_answers_a_command_answered_before_it_started_the_same(
    broker: str, topic_name: str, spark: Any
) -> None:
    """The local-mode driver would refuse: an "applied" answer is the one on the topic."""
    topic = executors_topic(topic_name)
    step_side = ExecutorChannel(broker, topic)
    step_side.ensure()
    answered = ExecutorCommand(action="add", request_id=command_id(topic, "run-1", "add"))
    before_restart = ExecutorReply(
        request_id=answered.request_id,
        outcome="applied",
        before=("0",),
        after=("0", "1"),
        changed="1",
        seconds=2.0,
    )
    step_side.send(answered)
    step_side.send(before_restart)
    driver_side = ExecutorChannel(broker, topic)
    try:
        control = ExecutorControl(spark.sparkContext, driver_side, poll_s=0.1)
        fresh = ExecutorCommand(action="add", request_id=command_id(topic, "run-2", "add"))
        step_side.send(answered)
        step_side.send(fresh)
        deadline = time.monotonic() + 60.0
        replies: list[ExecutorReply] = []
        while len(replies) < 2 and time.monotonic() < deadline:
            replies.extend(control.poll())
            time.sleep(0.2)
        on_topic, _ = step_side.read(step_side.earliest())
    finally:
        driver_side.close()
        step_side.close()
    assert replies[0] == before_restart
    assert replies[1].request_id == fresh.request_id
    assert replies[1].reason == LOCAL_MODE_REFUSAL
    assert [m for m in on_topic if isinstance(m, ExecutorReply)] == [
        before_restart,
        before_restart,
        replies[1],
    ]


@pytest.mark.integration
def test_a_controller_with_no_driver_gets_a_clear_timeout(broker: str, topic_name: str) -> None:
    channel = ExecutorChannel(broker, executors_topic(topic_name))
    channel.ensure()
    try:
        with pytest.raises(ExecutorError, match="did not answer the add executor command"):
            request(channel, ExecutorCommand(action="add", request_id=uuid4()), timeout_s=2.0)
    finally:
        channel.close()


class _FakeJavaContext:
    """Unit-test fake of the JVM SparkContext: executors that never change, unless
    ``registers``: then each executor requested registers at once."""

    def __init__(self, executors: str, registers: bool = False) -> None:
        self.executors = executors
        self.registers = registers
        self.requested = 0
        self.total: int | None = None

    def sc(self) -> _FakeJavaContext:
        return self

    def getExecutorIds(self) -> Any:
        executors = self.executors

        class _Seq:
            def mkString(self, separator: str) -> str:
                return executors

        return _Seq()

    def requestExecutors(self, n: int) -> bool:
        self.requested += n
        if self.registers:
            ids = [i for i in self.executors.split(",") if i]
            self.executors = ",".join(ids + [str(len(ids) + k) for k in range(n)])
        return True

    def requestTotalExecutors(self, total: int, locality_aware: int, hosts: object) -> bool:
        self.total = total
        return True


class _FakeContext:
    master = "spark://127.0.0.1:7077"

    def __init__(self, executors: str, registers: bool = False) -> None:
        self._jsc = _FakeJavaContext(executors, registers)
        empty_map = SimpleNamespace(**{"MODULE$": SimpleNamespace(empty=dict)})
        self._jvm = SimpleNamespace(
            scala=SimpleNamespace(
                collection=SimpleNamespace(immutable=SimpleNamespace(**{"Map$": empty_map}))
            )
        )

    def getConf(self) -> dict[str, str]:
        return {"spark.cores.max": "2"}


class _FakeChannel:
    """Unit-test fake of the executors topic: a list of messages, offset = index."""

    def __init__(self, log: list[ExecutorCommand | ExecutorReply] | None = None) -> None:
        self.log = [] if log is None else log

    def ensure(self) -> None:
        pass

    def end(self) -> int:
        return len(self.log)

    def earliest(self) -> int:
        return 0

    def read(
        self, start: int, stop: int | None = None
    ) -> tuple[list[ExecutorCommand | ExecutorReply], int]:
        stop = self.end() if stop is None else stop
        return self.log[start:stop], max(start, stop)

    def send(self, message: ExecutorCommand | ExecutorReply) -> None:
        self.log.append(message)


def test_pure_fake_context_add_that_never_registers_is_refused_naming_the_setting() -> None:
    ticks = iter(float(t) for t in range(1000))
    context = _FakeContext("0")
    control = ExecutorControl(
        context,
        _FakeChannel(),
        poll_s=0.0,
        clock=lambda: next(ticks),
    )
    reply = control.carry_out(ExecutorCommand(action="add", wait_s=5.0))
    assert context._jsc.requested == 1
    assert context._jsc.total == 1, "the request is withdrawn: one executor in all"
    assert reply.outcome == "refused" and reply.changed is None
    assert reply.before == reply.after == ("0",)
    assert reply.reason is not None
    assert reply.reason.startswith("no new executor registered within 5 s")
    assert "spark.cores.max (2)" in reply.reason


def test_pure_fake_context_release_of_the_last_executor_is_refused() -> None:
    control = ExecutorControl(
        _FakeContext("0"),
        _FakeChannel(),
    )
    reply = control.carry_out(ExecutorCommand(action="release"))
    assert reply.outcome == "refused"
    assert (
        reply.reason
        == "the job has 1 executor(s); releasing one would leave none to run its batches"
    )


def test_pure_fake_context_command_delivered_twice_is_applied_once_with_the_same_reply() -> None:
    context = _FakeContext("0", registers=True)
    channel = _FakeChannel()
    control = ExecutorControl(context, channel, poll_s=0.0)
    command = ExecutorCommand(action="add", request_id=command_id("t", "run-1", "add"))
    channel.send(command)
    first = control.poll()
    channel.send(command)
    second = control.poll()
    assert context._jsc.requested == 1
    assert first[0].outcome == "applied" and first[0].after == ("0", "1")
    assert second == first
    assert [m for m in channel.log if isinstance(m, ExecutorReply)] == first + second


def test_pure_fake_context_restarted_driver_reads_its_answers_back_from_the_topic() -> None:
    context = _FakeContext("0", registers=True)
    channel = _FakeChannel()
    command = ExecutorCommand(action="add", request_id=command_id("t", "run-1", "add"))
    before_restart = ExecutorControl(context, channel)
    channel.send(command)
    (first,) = before_restart.poll()
    restarted = ExecutorControl(context, _FakeChannel(channel.log))
    channel.send(command)
    assert restarted.poll() == [first]
    assert context._jsc.requested == 1
