"""The DAGs' deferred waits and their ABORT, run in-process on an in-memory control topic.

What Airflow does around an operator is taken from its source, not run: a
trigger that times out or fails resumes the task with ``__fail__``; a
trigger's kwargs are serialised; a run that fails calls the DAG's
``on_failure_callback`` with its ``dag`` and ``run_id``. The controller, the
protocol, the state file, the configuration store, the trigger and the
operators are the real ones; the control topic is a list
(``fake_control.FakeControlTopic``) and the job's replies are written onto it
by hand; the tests on it say "fake".
The same waits on a real broker and job: ``tests/dags/``, ``-m integration``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk import DAG
from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR, TriggerFailureReason
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from fake_control import (
    FakeControlTopic,
    FakeTaskInstance,
    in_flight,
    prepare,
    reply,
    write_record,
)

from keyplane.algorithms import statistics as stats
from keyplane.control.controller import ControllerError
from keyplane.control.controller_protocol import ControllerProtocol
from keyplane.control.messages import ProtocolError
from keyplane.orchestration import (
    dagparts,
    planning,
    rollout_steps,
    run_records,
    verification_steps,
)
from keyplane.orchestration import deployment as deployment_module
from keyplane.orchestration.deployment import Deployment
from keyplane.orchestration.scale_steps import PROPOSAL as SCALE_PROPOSAL
from keyplane.orchestration.triggers import (
    AwaitRolloutOperator,
    RolloutWaitTrigger,
    RollOutWavesOperator,
    whole_number,
)
from keyplane.routing import config as config_store
from keyplane.testing import (
    deployment_under,
    moved_off_hash_config,
    paired_tuple_counts,
    write_statistics_snapshot,
)

RUN = "scheduled__2026-11-03T12:00:00+00:00"
OTHER_RUN = "manual__2026-11-03T12:00:05+00:00"


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Deployment:
    """A deployment with v1 (what the job runs) to v4 stored, which the tasks find."""
    target = deployment_under(tmp_path, bootstrap_servers="fake:9092")
    for version in (1, 2, 3, 4):
        keys = {"A": [f"a{version}"], "B": [f"b{version}"]}
        config_store.save(moved_off_hash_config(version, keys, 4), target.routing_store)
    monkeypatch.setattr(deployment_module, "deployment", lambda: target)
    monkeypatch.setattr(dagparts, "deployment", lambda: target)
    return target


def context(published: int | None = 2, run_id: str = RUN) -> dict[str, Any]:
    """A task's context in ``run_id`` whose ``publish`` task returned ``published``."""
    xcoms = {} if published is None else {"publish": {"version": published, "message_id": "x"}}
    return {"run_id": run_id, "ti": FakeTaskInstance(xcoms)}


@pytest.fixture
def dag() -> Iterator[DAG]:
    """The reconfiguration DAG's id, whose runs keep their records in their snapshots."""
    with DAG(run_records.RECONFIGURE_DAG_ID, schedule=None) as defined:
        yield defined


def callback_context(dag_id: str, run_id: str) -> dict[str, Any]:
    """What Airflow passes a DAG's failure callback at the least: the DAG and the run id."""
    return {"dag": DAG(dag_id, schedule=None), "run_id": run_id}


def await_migrated_a(dag: DAG) -> AwaitRolloutOperator:
    return AwaitRolloutOperator(
        task_id="await_migrated_A",
        kind="migrated",
        operator="A",
        published_by="publish",
        timeout_s="300",
        dag=dag,
    )


async def first_event(trigger: RolloutWaitTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger fired nothing")


def wait_trigger(deployment: Deployment, kind: str, version: int) -> RolloutWaitTrigger:
    return RolloutWaitTrigger(
        deployment=deployment.model_dump(mode="json"),
        kind=kind,
        operator="A" if kind == "migrated" else None,
        deadline=time.time() + 0.3,
        poll_interval_s=0.05,
        version=version,
    )


# --- a trigger that timed out or failed (Airflow's __fail__) ------------------------------


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (TriggerFailureReason.TRIGGER_TIMEOUT, "timed out"),
        (TriggerFailureReason.TRIGGER_FAILURE, "trigger failed (Trigger failure)"),
    ],
)
def test_a_wait_resumed_with_fail_aborts_its_version_in_a_fake_topic(
    deployment: Deployment,
    topic: FakeControlTopic,
    dag: DAG,
    reason: TriggerFailureReason,
    said: str,
) -> None:
    prepare(deployment, 2)
    wait = await_migrated_a(dag)

    with pytest.raises(AirflowFailException, match="MIGRATED A of v2") as failed:
        wait.resume_execution(TRIGGER_FAIL_REPR, {"error": reason}, context())

    assert said in str(failed.value) and "v2 was aborted" in str(failed.value)
    assert topic.sent() == ["controller:PREPARE v2", "controller:ABORT v2"]
    assert in_flight(deployment) is None


def test_a_wave_resumed_with_fail_aborts_the_runs_wave_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, dag: DAG
) -> None:
    folder = stats.snapshot_folder(deployment.snapshots, RUN)
    write_record(folder, run_records.PROPOSAL, {"version": 3, "waves": [2]})
    prepare(deployment, 2)
    waves = RollOutWavesOperator(task_id="roll_out_waves", timeout_s="300", dag=dag)

    failure = {"error": TriggerFailureReason.TRIGGER_TIMEOUT}
    with pytest.raises(AirflowFailException, match="v2 was aborted"):
        waves.resume_execution(TRIGGER_FAIL_REPR, failure, context(None))

    assert topic.sent() == ["controller:PREPARE v2", "controller:ABORT v2"]


# --- the version a wait belongs to --------------------------------------------------------


def test_a_wait_for_an_aborted_version_ignores_the_next_versions_ack_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, dag: DAG
) -> None:
    """The run PREPAREd v2; while its await_ack is deferred an operator runs
    ``keyplane config abort`` and ``keyplane config publish v3``, and the job ACKs v3."""
    prepare(deployment, 2)
    rollout_steps.abort(deployment, {2})
    prepare(deployment, 3)
    reply(topic, deployment, "ACK", 3)

    event = asyncio.run(first_event(wait_trigger(deployment, "ack", 2)))

    assert event["status"] == "error"
    assert event["message"] == "v2 was aborted; v3 is in flight now"
    sent = len(topic.messages)
    with pytest.raises(AirflowFailException, match="nothing was aborted"):
        await_migrated_a(dag).execute_complete(context(), event)
    assert topic.messages[sent:] == [] and in_flight(deployment) == 3


def test_a_wait_for_a_superseded_version_names_the_one_in_flight_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic
) -> None:
    for version in (2, 3):
        prepare(deployment, version)
        rollout_steps.abort(deployment, {version})
    prepare(deployment, 4)
    reply(topic, deployment, "ACK", 4)

    with pytest.raises(ControllerError, match="v2 is not in flight: superseded by v4"):
        rollout_steps.reply_arrived(deployment, "ack", version=2)
    assert rollout_steps.reply_arrived(deployment, "ack", version=4)


def test_a_wait_refused_by_the_protocol_fails_as_a_controller_error() -> None:
    with pytest.raises(ControllerError, match=r"^v2 is not in flight: no rollout is in flight$"):
        rollout_steps.awaited_rollout(None, 2)
    protocol = ControllerProtocol(("A", "B"), 1, "checksum of v1")
    protocol.prepare(2, "checksum of v2")
    protocol.abort()
    with pytest.raises(ControllerError, match=r"^v2 was aborted; no rollout is in flight$"):
        rollout_steps.awaited_rollout(protocol.state, 2)
    protocol.prepare(3, "checksum of v3")
    assert rollout_steps.awaited_rollout(protocol.state, 3) is protocol.state.current


def test_a_timed_out_wait_leaves_a_version_it_does_not_await_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, dag: DAG
) -> None:
    prepare(deployment, 3)

    with pytest.raises(AirflowFailException, match="nothing was aborted"):
        await_migrated_a(dag).execute_complete(context(published=2), {"status": "timeout"})

    assert topic.sent() == ["controller:PREPARE v3"] and in_flight(deployment) == 3


def test_a_deferred_wait_carries_the_published_version_through_serialisation_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, dag: DAG
) -> None:
    prepare(deployment, 2)

    with pytest.raises(TaskDeferred) as deferred:
        await_migrated_a(dag).execute(context(published=2))

    trigger = deferred.value.trigger
    assert isinstance(trigger, RolloutWaitTrigger)
    path, kwargs = trigger.serialize()
    assert path == "keyplane.orchestration.triggers.RolloutWaitTrigger"
    rebuilt = RolloutWaitTrigger(**{**json.loads(json.dumps(kwargs)), "deadline": time.time() + 5})
    assert rebuilt.version == 2
    reply(topic, deployment, "ACK", 2)
    rollout_steps.propagate(deployment, ["A"])
    reply(topic, deployment, "MIGRATED", 2)
    assert asyncio.run(first_event(rebuilt))["status"] == "ok"


# --- templated numbers ----------------------------------------------------------------------


@pytest.mark.parametrize(("value", "number"), [("5.0", 5), ("300.0", 300), ("1e3", 1000)])
def test_a_templated_whole_number_written_as_a_float_converts(value: str, number: int) -> None:
    """A Param of type integer accepts 5.0, which renders "5.0": not an int literal."""
    assert whole_number(value, "batches") == number


@pytest.mark.parametrize("value", ["5.5", "five", "", None, "nan", "inf"])
def test_a_templated_number_that_is_not_whole_fails_without_retry(value: object) -> None:
    with pytest.raises(AirflowFailException, match="batches must be a whole number"):
        whole_number(value, "batches")


def test_a_metrics_wait_rendered_from_a_float_param_defers_with_fake_batch_counts(
    deployment: Deployment, dag: DAG, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``{"verify_batches": 5.0}`` passes the Param's integer schema and renders "5.0"."""
    monkeypatch.setattr(verification_steps, "new_version_batches", lambda *_: 4)
    wait = AwaitRolloutOperator(
        task_id="await_new_version_batches",
        kind="metrics",
        batches="5.0",
        timeout_s="300.0",
        dag=dag,
    )

    with pytest.raises(TaskDeferred) as deferred:
        wait.execute(context(None))

    trigger = deferred.value.trigger
    assert isinstance(trigger, RolloutWaitTrigger) and trigger.batches == 5
    assert deferred.value.timeout is not None and deferred.value.timeout.total_seconds() == 360


# --- a missing reply ------------------------------------------------------------------------


def test_a_missing_reply_aborts_and_fails_without_retry_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, dag: DAG
) -> None:
    prepare(deployment, 2)

    with pytest.raises(AirflowFailException, match="v2 was aborted"):
        await_migrated_a(dag).execute_complete(context(), {"status": "timeout", "polls": 3})

    assert topic.sent() == ["controller:PREPARE v2", "controller:ABORT v2"]


# --- the steps between the waits: PROPAGATE and DONE of the run's own version -------------


def test_a_retried_propagate_of_an_aborted_version_does_not_propagate_the_next_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic
) -> None:
    """The run PREPAREd v2 and the job ACKed it; an operator aborted v2 and published
    v3 by hand, which the job ACKed too. The run's ``propagate``, retried, names v2."""
    prepare(deployment, 2)
    reply(topic, deployment, "ACK", 2)
    rollout_steps.abort(deployment, {2})
    prepare(deployment, 3)
    reply(topic, deployment, "ACK", 3)
    sent = len(topic.messages)

    with pytest.raises(ProtocolError, match="v2 was aborted; v3 is in flight"):
        rollout_steps.propagate(deployment, ["A", "B"], 2)
    with (
        rollout_steps.controller(deployment) as controller,
        pytest.raises(ProtocolError, match="v2"),
    ):
        controller.done(version=2)

    assert topic.messages[sent:] == [] and in_flight(deployment) == 3
    assert rollout_steps.propagate(deployment, ["A", "B"], 3) == {
        "version": 3,
        "operators": ["A", "B"],
    }
    assert topic.sent(sent) == ["controller:PROPAGATE v3"] * 2


def test_propagate_sends_every_operator_upstream_first_in_one_publish_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic
) -> None:
    """The DAG's one ``propagate`` step: both PROPAGATEs in one send, A before B, so that
    the job reads them at one batch boundary; retried, it sends the same two again."""
    prepare(deployment, 2)
    reply(topic, deployment, "ACK", 2)
    sent, sends = len(topic.messages), len(topic.sends)

    first = rollout_steps.propagate(deployment, ["A", "B"], 2)
    assert first == {"version": 2, "operators": ["A", "B"]}
    assert topic.sends[sends:] == [2]
    assert [m.operator for m in topic.messages[sent:]] == ["A", "B"]
    assert rollout_steps.propagate(deployment, ["A", "B"], 2) == first
    assert topic.messages[sent + 2 :] == topic.messages[sent : sent + 2]
    with pytest.raises(ValueError, match="at least one operator"):
        rollout_steps.propagate(deployment, [], 2)
    assert len(topic.messages) == sent + 4 and len(topic.sends) == sends + 2


def test_a_step_retried_after_its_rollout_was_done_resends_its_message_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic
) -> None:
    """v2 rolled out to DONE and v3 is in flight: a retried PROPAGATE or DONE of v2
    sends again what it sent (the job ignores the duplicate), and v3 is left alone."""
    prepare(deployment, 2)
    reply(topic, deployment, "ACK", 2)
    with rollout_steps.controller(deployment) as controller:
        propagated = controller.propagate_all(["A", "B"], version=2)
        reply(topic, deployment, "MIGRATED", 2, "A")
        reply(topic, deployment, "MIGRATED", 2, "B")
        finished = controller.done(version=2)
        controller.prepare(3)
        sent = len(topic.messages)

        assert controller.propagate("B", version=2) == propagated[1]
        assert controller.done(version=2) == finished

    assert topic.messages[sent:] == [propagated[1], finished]
    assert in_flight(deployment) == 3


# --- a run that failed with its version in flight (dagrun_timeout) --------------------------


def test_the_failure_callback_aborts_the_runs_version_only_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic
) -> None:
    reconfigure, scale = run_records.RECONFIGURE_DAG_ID, run_records.SCALE_DAG_ID
    write_record(
        stats.snapshot_folder(deployment.snapshots, RUN), run_records.PROPOSAL, {"version": 2}
    )
    write_record(run_records.scale_folder(deployment, OTHER_RUN), SCALE_PROPOSAL, {"version": 3})
    prepare(deployment, 2)

    dagparts.abort_run_in_flight(callback_context(scale, OTHER_RUN))
    assert topic.sent() == ["controller:PREPARE v2"]
    dagparts.abort_run_in_flight(callback_context(reconfigure, RUN))
    assert topic.sent()[1:] == ["controller:ABORT v2"]

    prepare(deployment, 3)
    dagparts.abort_run_in_flight(callback_context(reconfigure, RUN))
    assert topic.sent()[2:] == ["controller:PREPARE v3"]
    dagparts.abort_run_in_flight(callback_context(scale, OTHER_RUN))
    assert topic.sent()[3:] == ["controller:ABORT v3"]


# --- two DAGs' runs of the same run id ------------------------------------------------------


def test_a_failed_run_leaves_the_other_dags_run_of_the_same_id_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic
) -> None:
    """A run id chosen by hand (``airflow dags trigger -r``), or an ``airflow dags
    test`` of the same logical date, names a run of each DAG: the scale run rolls
    out v3 while the reconfiguration run of that id, which stored nothing, fails."""
    write_record(run_records.scale_folder(deployment, RUN), SCALE_PROPOSAL, {"version": 3})
    prepare(deployment, 3)

    dagparts.abort_run_in_flight(callback_context(run_records.RECONFIGURE_DAG_ID, RUN))
    assert topic.sent() == ["controller:PREPARE v3"] and in_flight(deployment) == 3

    dagparts.abort_run_in_flight(callback_context(run_records.SCALE_DAG_ID, RUN))
    assert topic.sent()[1:] == ["controller:ABORT v3"]


def test_a_failed_wave_leaves_the_scale_runs_version_of_the_same_id_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, dag: DAG
) -> None:
    """The reconfiguration run's wave v2 was aborted by hand, and the scale run of
    the same id put its v3 in flight: the wave task's failure must not abort v3."""
    folder = stats.snapshot_folder(deployment.snapshots, RUN)
    write_record(folder, run_records.PROPOSAL, {"version": 4, "waves": [2]})
    write_record(run_records.scale_folder(deployment, RUN), SCALE_PROPOSAL, {"version": 3})
    prepare(deployment, 2)
    rollout_steps.abort(deployment, {2})
    prepare(deployment, 3)
    waves = RollOutWavesOperator(task_id="roll_out_waves", timeout_s="300", dag=dag)

    failure = {"error": TriggerFailureReason.TRIGGER_TIMEOUT}
    with pytest.raises(AirflowFailException, match="nothing was aborted"):
        waves.resume_execution(TRIGGER_FAIL_REPR, failure, context(None))

    assert topic.sent()[-1] == "controller:PREPARE v3" and in_flight(deployment) == 3


@pytest.mark.parametrize(
    ("dag_id", "version"), [(run_records.RECONFIGURE_DAG_ID, 2), (run_records.SCALE_DAG_ID, 3)]
)
def test_a_metrics_wait_counts_from_its_own_dags_rollout_record_with_fake_metrics(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch, dag_id: str, version: int
) -> None:
    """Both DAGs have a run of the same id on its way to verify, one on v2, one on v3."""
    starts = {2: {"0": 100}, 3: {"0": 5}}
    write_record(
        stats.snapshot_folder(deployment.snapshots, RUN),
        run_records.ROLLOUT,
        {"version": 2, "metrics_start": starts[2]},
    )
    write_record(
        run_records.scale_folder(deployment, RUN),
        run_records.ROLLOUT,
        {"version": 3, "metrics_start": starts[3]},
    )
    read_from: list[dict[int, int]] = []

    def no_batches_yet(_: Deployment, start: dict[int, int], end: object = None) -> list[object]:
        read_from.append(dict(start))
        return []

    monkeypatch.setattr(verification_steps, "read_metrics", no_batches_yet)
    with DAG(dag_id, schedule=None) as defined:
        wait = AwaitRolloutOperator(
            task_id="await_new_version_batches", kind="metrics", batches="1", dag=defined
        )

    with pytest.raises(TaskDeferred) as deferred:
        wait.execute(context(None))

    trigger = deferred.value.trigger
    assert isinstance(trigger, RolloutWaitTrigger)
    _, kwargs = trigger.serialize()
    rebuilt = RolloutWaitTrigger(**{**json.loads(json.dumps(kwargs)), "deadline": time.time()})
    assert rebuilt.dag_id == dag_id
    assert asyncio.run(first_event(rebuilt))["status"] == "timeout"
    assert read_from == [{0: starts[version]["0"]}] * 2


def test_a_reconfiguration_runs_verify_reads_its_own_rollout_record_with_fake_metrics(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scale run of the same id rolled out v3; this run's record names v2."""
    write_statistics_snapshot(deployment.snapshots, RUN, paired_tuple_counts(10, 3))
    folder = stats.snapshot_folder(deployment.snapshots, RUN)
    write_record(folder, run_records.PROPOSAL, {"version": 2, "parent_version": 1})
    write_record(folder, run_records.ROLLOUT, {"version": 2, "metrics_start": {"0": 100}})
    write_record(
        run_records.scale_folder(deployment, RUN),
        run_records.ROLLOUT,
        {"version": 3, "metrics_start": {"0": 5}},
    )
    monkeypatch.setattr(verification_steps, "read_metrics", lambda *_: [])

    with pytest.raises(run_records.StepError, match=r"only 0 of 1 batches ran on v2 yet"):
        verification_steps.verify(deployment, RUN, planning.VerifyTolerances(), batches=1)
