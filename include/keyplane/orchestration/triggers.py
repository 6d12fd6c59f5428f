"""Deferrable waits of the reconfiguration DAG: the job's replies and its first batches.

Paper 000 §3.4's manager waits for every ACK and MIGRATED before the next
step. A task that slept in a loop would hold a worker slot for the whole
migration, so the waits are a :class:`RolloutWaitTrigger` run by Airflow's
triggerer: it polls the control topic through the
:class:`~keyplane.control.controller.Controller` (which records each reply in its
state file) or the metrics topic, every ``poll_interval_s``, in a thread so
the triggerer's event loop never blocks, and fires once the reply is in or
the deadline has passed. :class:`AwaitRolloutOperator` checks once, defers
on the trigger if it must wait, and on a missing reply aborts the rollout
(the job returns to its active version) before it fails.
:class:`RollOutWavesOperator` rolls out a run's waves the same way: it sends
what the waves need next and defers on the same trigger for each reply.

Every reply is awaited for one version, the one the run published: the
controller is shared with ``keyplane config abort`` and ``keyplane config
publish``, so the version in flight when a wait ends need not be the run's.
A missing reply aborts only the run's own version, and fails the task with
``AirflowFailException``, which Airflow does not retry: after an ABORT a
retry could only fail again, less clearly.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Collection, Mapping
from datetime import timedelta
from typing import Any, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    TaskDeferralError,
    TaskDeferralTimeout,
)
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from keyplane.orchestration.deployment import Deployment

TRIGGER_PATH = "keyplane.orchestration.triggers.RolloutWaitTrigger"


def _satisfied(
    deployment: Deployment,
    kind: str,
    operator: str | None,
    dag_id: str,
    run_id: str,
    record: str,
    batches: int,
    version: int | None = None,
) -> bool:
    from keyplane.orchestration import rollout_steps, verification_steps

    if kind == "metrics":
        return verification_steps.new_version_batches(deployment, dag_id, run_id, record) >= batches
    if kind not in ("ack", "migrated"):
        raise ValueError(f"unknown wait {kind!r}")
    return rollout_steps.reply_arrived(
        deployment, "ack" if kind == "ack" else "migrated", operator, version=version
    )


def whole_number(value: Any, name: str) -> int:
    """``value``, a templated field, as an int; fail the task clearly if it is not whole.

    Airflow renders a template such as ``{{ params.verify_batches }}`` to a
    string, and a Param of type integer accepts ``5.0`` from a run's JSON
    conf (JSON Schema counts it as an integer), which renders ``"5.0"``:
    ``int("5.0")`` would raise a bare ValueError. A value that is not whole
    never becomes whole on a retry, hence ``AirflowFailException``.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not number.is_integer():
        raise AirflowFailException(f"{name} must be a whole number, not {value!r}")
    return int(number)


def published_version(context: Any, published_by: str) -> int:
    """The version the run's task ``published_by`` PREPAREd, from its XCom.

    Every step after a PREPARE (a wait, a PROPAGATE, the DONE) acts on that
    version only: one that took whatever is in flight would, after an
    operator aborted the run's version and published another by hand, drive
    theirs.
    """
    published = context["ti"].xcom_pull(task_ids=published_by)
    if not isinstance(published, Mapping) or "version" not in published:
        raise AirflowFailException(
            f"{published_by} left no version in this run's XCom ({published!r}); "
            "run it before this step"
        )
    return int(published["version"])


def _deferral_failure(error: AirflowException) -> str:
    """What Airflow's ``__fail__`` resumption says happened to the trigger."""
    if isinstance(error, TaskDeferralTimeout):
        return "the deferral timed out before the trigger fired; is the triggerer running?"
    reason = error.args[0] if error.args else "unknown"
    return f"the trigger failed ({getattr(reason, 'value', reason)}); see the triggerer's log"


class RolloutWaitTrigger(BaseTrigger):
    """Fires when the awaited reply (or the metrics of ``batches`` batches) is in.

    ``kind`` is ``"ack"``, ``"migrated"`` (of ``operator``) or ``"metrics"``,
    the batches counted from the rollout record ``record`` of ``dag_id``'s run
    ``run_id`` (:func:`keyplane.orchestration.run_records.run_folder`).
    ``version`` is the version whose reply is awaited
    (:func:`keyplane.orchestration.rollout_steps.awaited_rollout`: once it was
    aborted or superseded, the trigger fires an error rather than take
    another version's reply). ``deadline`` is a wall-clock time (seconds
    since the epoch), so a trigger moved to another triggerer keeps its
    original deadline.
    """

    def __init__(
        self,
        *,
        deployment: dict[str, Any],
        kind: str,
        deadline: float,
        operator: str | None = None,
        dag_id: str = "",
        run_id: str = "",
        record: str = "rollout.json",
        batches: int = 0,
        poll_interval_s: float = 0.5,
        version: int | None = None,
    ) -> None:
        super().__init__()
        self.deployment = deployment
        self.kind = kind
        self.deadline = deadline
        self.operator = operator
        self.dag_id = dag_id
        self.run_id = run_id
        self.record = record
        self.batches = batches
        self.poll_interval_s = poll_interval_s
        self.version = version

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            TRIGGER_PATH,
            {
                "deployment": self.deployment,
                "kind": self.kind,
                "deadline": self.deadline,
                "operator": self.operator,
                "dag_id": self.dag_id,
                "run_id": self.run_id,
                "record": self.record,
                "batches": self.batches,
                "poll_interval_s": self.poll_interval_s,
                "version": self.version,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        deployment = Deployment.model_validate(self.deployment)
        polls = 0
        while True:
            polls += 1
            try:
                arrived = await asyncio.to_thread(
                    _satisfied,
                    deployment,
                    self.kind,
                    self.operator,
                    self.dag_id,
                    self.run_id,
                    self.record,
                    self.batches,
                    self.version,
                )
            except Exception as exc:
                yield TriggerEvent({"status": "error", "polls": polls, "message": str(exc)})
                return
            if arrived:
                yield TriggerEvent({"status": "ok", "polls": polls})
                return
            if time.time() >= self.deadline:
                yield TriggerEvent({"status": "timeout", "polls": polls})
                return
            await asyncio.sleep(self.poll_interval_s)


class AwaitRolloutOperator(BaseOperator):
    """Wait, deferred, for the job's ACK, an operator's MIGRATED, or the new version's batches.

    ``kind`` and ``operator`` as for :class:`RolloutWaitTrigger`;
    ``timeout_s`` bounds the wait. An ACK or MIGRATED is awaited for the
    version in the return value (XCom) of ``published_by``, the run's task
    that PREPAREd it. On a missing ACK or MIGRATED the run's version, if
    still in flight, is aborted before the task fails, as ``keyplane config
    publish`` does: a half-propagated version must not stay pending. The
    new version's batches are counted from the rollout record ``record`` of
    the run of this task's DAG, not of the other DAG's run of the same id.
    """

    template_fields = ("timeout_s", "batches")

    def __init__(
        self,
        *,
        kind: str,
        operator: str | None = None,
        published_by: str | None = None,
        timeout_s: Any = 300,
        batches: Any = 0,
        record: str = "rollout.json",
        poll_interval_s: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if kind in ("ack", "migrated") and published_by is None:
            raise ValueError(f"a wait for {kind} needs published_by: the task that PREPAREd")
        self.kind = kind
        self.operator = operator
        self.published_by = published_by
        self.timeout_s = timeout_s
        self.batches = batches
        self.record = record
        self.poll_interval_s = poll_interval_s

    def _what(self, version: int | None) -> str:
        if self.kind == "metrics":
            return f"{self.batches} batches on the new version"
        reply = "ACK" if self.kind == "ack" else f"MIGRATED {self.operator}"
        return reply if version is None else f"{reply} of v{version}"

    def _version(self, context: Any) -> int | None:
        """The version the run's ``published_by`` task PREPAREd; None for a metrics wait.

        Read from XCom each time, not kept on the operator: Airflow resumes a
        deferred task on a new operator object.
        """
        if self.published_by is None:
            return None
        return published_version(context, self.published_by)

    def execute(self, context: Any) -> dict[str, Any]:
        from keyplane.control.controller import ControllerError
        from keyplane.orchestration.deployment import deployment

        batches = whole_number(self.batches, "batches")
        timeout = whole_number(self.timeout_s, "timeout_s")
        version = self._version(context)
        target = deployment()
        run_id = str(context["run_id"])
        try:
            arrived = _satisfied(
                target, self.kind, self.operator, self.dag_id, run_id, self.record, batches, version
            )
        except ControllerError as refused:
            if version is None:
                raise
            _abort_and_fail(self._what(version), str(refused), {version})
        if arrived:
            return {"status": "ok", "polls": 0}
        self.defer(
            trigger=RolloutWaitTrigger(
                deployment=target.model_dump(mode="json"),
                kind=self.kind,
                deadline=time.time() + timeout,
                operator=self.operator,
                dag_id=self.dag_id,
                run_id=run_id,
                record=self.record,
                batches=batches,
                poll_interval_s=self.poll_interval_s,
                version=version,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout + 60),
        )
        raise AssertionError("defer() raises TaskDeferred")

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        version = self._version(context)
        if event.get("status") == "ok":
            self.log.info("%s arrived after %s polls", self._what(version), event.get("polls"))
            return event
        detail = event.get("message") or f"not within {self.timeout_s} s"
        if version is not None:
            _abort_and_fail(self._what(version), detail, {version})
        raise AirflowException(f"no {self._what(version)} ({detail})")

    def resume_execution(
        self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any
    ) -> Any:
        """Abort the run's version when the trigger timed out or failed, then fail.

        Airflow resumes a task whose trigger passed the deferral's timeout
        (the scheduler's ``check_trigger_timeouts``) or crashed
        (``Trigger.submit_failure``) with ``next_method="__fail__"``, and
        ``BaseOperator.resume_execution`` raises ``TaskDeferralTimeout`` or
        ``TaskDeferralError`` without calling :meth:`execute_complete`: the
        reply is as missing as after the trigger's own deadline, so it is
        handled the same way.
        """
        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except (TaskDeferralTimeout, TaskDeferralError) as failed:
            version = self._version(context)
            if version is None:
                raise
            _abort_and_fail(self._what(version), _deferral_failure(failed), {version})


def _abort_and_fail(what: str, detail: str, versions: Collection[int]) -> NoReturn:
    """ABORT the run's version if it is in flight after a missing reply; fail, no retry."""
    from keyplane.orchestration import rollout_steps
    from keyplane.orchestration.deployment import deployment

    aborted = rollout_steps.abort(deployment(), versions) if versions else None
    if aborted is None:
        outcome = "no version of this run is in flight, so nothing was aborted"
    else:
        outcome = (
            f"v{aborted} was aborted and the job is back on its active version. "
            "Is the job running? `keyplane job status`"
        )
    raise AirflowFailException(f"no {what} from the job ({detail}); {outcome}")


class RollOutWavesOperator(BaseOperator):
    """Roll out a run's waves before its last version, each wait deferred.

    The number of waves is the plan's, known only when the run has planned,
    and Airflow cannot chain a varying number of task groups one after
    another; so one task walks them. Each time it runs (first, and after
    every reply) it calls :func:`keyplane.orchestration.rollout_steps.advance_waves`,
    which sends what the waves need next, and defers on
    :class:`RolloutWaitTrigger` for the reply that step awaits, for that
    wave's version: the worker slot is free while the job migrates, as with
    the DAG's other waits. A missing reply aborts the wave in flight if it
    is one of this run's, so the job stays on the last finished wave, a
    complete version, and the task fails.
    """

    template_fields = ("timeout_s",)

    def __init__(self, *, timeout_s: Any = 300, poll_interval_s: float = 0.5, **kwargs: Any):
        super().__init__(**kwargs)
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s

    def execute(self, context: Any) -> dict[str, Any]:
        return self._advance(context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "ok":
            self._fail_wave(context, event.get("message") or "timeout")
        return self._advance(context)

    def resume_execution(
        self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any
    ) -> Any:
        """As :meth:`AwaitRolloutOperator.resume_execution`: a trigger that timed out or
        failed leaves the wave's reply missing, so the wave is aborted and the task fails."""
        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except (TaskDeferralTimeout, TaskDeferralError) as failed:
            self._fail_wave(context, _deferral_failure(failed))

    def _fail_wave(self, context: Any, detail: str) -> NoReturn:
        """Abort whichever of the run's versions is in flight, and fail.

        The run's versions, not the wave's alone: a new operator object
        resumes the task, and ``__fail__`` replaces the kwargs a deferral
        passed on, so the wave is known only from the run's records, those
        of this task's DAG (the other DAG may have a run of the same id).
        """
        from keyplane.orchestration import rollout_steps
        from keyplane.orchestration.deployment import deployment

        versions = rollout_steps.run_versions(deployment(), self.dag_id, str(context["run_id"]))
        _abort_and_fail("reply to the wave in flight", detail, versions)

    def _advance(self, context: Any) -> dict[str, Any]:
        from keyplane.orchestration import rollout_steps
        from keyplane.orchestration.deployment import deployment

        timeout = whole_number(self.timeout_s, "timeout_s")
        target = deployment()
        run_id = str(context["run_id"])
        step = rollout_steps.advance_waves(target, run_id)
        if step["wait"] is None:
            self.log.info("every wave before the last is active: %s", step["waves"])
            return step
        self.defer(
            trigger=RolloutWaitTrigger(
                deployment=target.model_dump(mode="json"),
                kind=step["wait"],
                deadline=time.time() + timeout,
                operator=step["operator"],
                dag_id=self.dag_id,
                run_id=run_id,
                poll_interval_s=self.poll_interval_s,
                version=step["version"],
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout + 60),
        )
        raise AssertionError("defer() raises TaskDeferred")


METRICS_SIGNAL_TRIGGER_PATH = "keyplane.orchestration.triggers.MetricsSignalTrigger"


def _new_metrics(
    deployment: Deployment, offsets: dict[int, int] | None
) -> tuple[list[Any], dict[int, int]]:
    """The metrics records after ``offsets`` (None: none yet, start at the end), and the
    offsets to read from next."""
    from keyplane.kafka.admin import ensure_topic, high_watermarks
    from keyplane.kafka.metrics_topic import read_metrics

    servers, topic = deployment.bootstrap_servers, deployment.metrics_topic
    if offsets is None:
        ensure_topic(servers, topic, 1)
        return [], dict(high_watermarks(servers, topic))
    end = high_watermarks(servers, topic)
    if all(end.get(p, 0) <= o for p, o in offsets.items()) and set(end) <= set(offsets):
        return [], offsets
    read = read_metrics(servers, topic, offsets, end)
    return [r.metrics for r in read], dict(end)


def _signal(
    deployment: Deployment, records: list[Any], thresholds: dict[str, Any]
) -> dict[str, Any] | None:
    from keyplane.dashboard.metrics import active_instances
    from keyplane.orchestration.signals import SignalThresholds, reconfiguration_signal

    versions = {v for r in records for v in r.versions.values()}
    active = active_instances(deployment.routing_store, versions)
    return reconfiguration_signal(records, SignalThresholds.model_validate(thresholds), active)


class MetricsSignalTrigger(BaseEventTrigger):
    """Fires an asset event each time the job's newest batches call for a re-plan.

    The event-driven start of ``keyplane_reconfigure``: an ``AssetWatcher``
    on the asset ``keyplane_metrics_signal`` runs this trigger in the
    triggerer for as long as the DAG is deployed. It reads the metrics topic
    from its end when it starts (only batches from then on count), every
    ``poll_interval_s``, in a thread so the event loop never blocks, and
    judges the newest batches with
    :func:`keyplane.orchestration.signals.reconfiguration_signal`. The
    event's payload (why, on which version, over which batches, the measured
    figures) becomes the asset event's extra, which the run started by it
    shows and its first task logs. After firing it waits ``cooldown_s`` and
    judges only batches that arrived since, so a re-plan in progress (or one
    that could not help) does not start run after run. The deployment comes
    from the triggerer's ``KEYPLANE_*`` variables.
    """

    def __init__(
        self,
        *,
        thresholds: dict[str, Any],
        poll_interval_s: float = 5.0,
        cooldown_s: float = 600.0,
        lookback: int = 200,
    ) -> None:
        super().__init__()
        self.thresholds = thresholds
        self.poll_interval_s = poll_interval_s
        self.cooldown_s = cooldown_s
        self.lookback = lookback

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            METRICS_SIGNAL_TRIGGER_PATH,
            {
                "thresholds": self.thresholds,
                "poll_interval_s": self.poll_interval_s,
                "cooldown_s": self.cooldown_s,
                "lookback": self.lookback,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        deployment = await asyncio.to_thread(Deployment.from_environment)
        offsets: dict[int, int] | None = None
        records: list[Any] = []
        quiet_until = 0.0
        while True:
            try:
                new, offsets = await asyncio.to_thread(_new_metrics, deployment, offsets)
            except Exception as exc:
                self.log.warning("metrics topic not readable yet: %s", exc)
                new = []
            records = (records + new)[-self.lookback :]
            if new and time.time() >= quiet_until:
                signal = await asyncio.to_thread(_signal, deployment, records, self.thresholds)
                if signal is not None:
                    self.log.info("re-plan called for: %s", signal["reason"])
                    yield TriggerEvent(signal)
                    records = []
                    quiet_until = time.time() + self.cooldown_s
            await asyncio.sleep(self.poll_interval_s)
