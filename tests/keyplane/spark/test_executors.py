"""Executor commands: their signed wire form, which executor a scale-in releases, local mode."""

from __future__ import annotations

import threading
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
    decode,
    encode,
    executor_ids,
    executors_topic,
    request,
    to_release,
)

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
    with pytest.raises(ValueError, match="not JSON"):
        decode(b"\xff{", KEY)
    with pytest.raises(ValueError, match="not a JSON object"):
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
    answered: list[ExecutorReply] = []
    stop = threading.Event()

    def driver() -> None:
        while not stop.is_set() and not answered:
            answered.extend(control.poll())
            stop.wait(0.2)

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        command = ExecutorCommand(action="add", wait_s=5.0)
        reply = request(controller_side, command, timeout_s=60.0)
    finally:
        stop.set()
        thread.join(timeout=30)
        driver_side.close()
        controller_side.close()
    assert reply.request_id == command.request_id
    assert reply.outcome == "refused"
    assert reply.reason == LOCAL_MODE_REFUSAL
    assert reply.before == reply.after == ()
    assert answered == [reply]


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
    """Unit-test fake of the JVM SparkContext: executors that never change."""

    def __init__(self, executors: str) -> None:
        self.executors = executors
        self.requested = 0

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
        return True


class _FakeContext:
    master = "spark://127.0.0.1:7077"

    def __init__(self, executors: str) -> None:
        self._jsc = _FakeJavaContext(executors)

    def getConf(self) -> dict[str, str]:
        return {"spark.cores.max": "2"}


class _FakeChannel:
    def ensure(self) -> None:
        pass

    def end(self) -> int:
        return 0


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
