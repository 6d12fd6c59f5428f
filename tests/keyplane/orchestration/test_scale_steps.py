"""The scale DAG's executor step: a retried try never sends a second command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyplane.orchestration import run_records, scale_steps
from keyplane.orchestration.deployment import Deployment
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
