"""Deferrable waits of the reconfiguration DAG: the job's replies and its first batches.

Paper 000 §3.4's manager waits for every ACK and MIGRATED before the next
step. A task that slept in a loop would hold a worker slot for the whole
migration, so the waits are a :class:`RolloutWaitTrigger` run by Airflow's
triggerer: it polls the control topic through the
:class:`~keyplane.controller.Controller` (which records each reply in its
state file) or the metrics topic, every ``poll_interval_s``, in a thread so
the triggerer's event loop never blocks, and fires once the reply is in or
the deadline has passed. :class:`AwaitRolloutOperator` checks once, defers
on the trigger if it must wait, and on a missing reply aborts the rollout
(the job returns to its active version) before it fails.
:class:`RollOutWavesOperator` rolls out a run's waves the same way: it sends
what the waves need next and defers on the same trigger for each reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from keyplane.orchestration.deployment import Deployment

TRIGGER_PATH = "keyplane.orchestration.triggers.RolloutWaitTrigger"


def _satisfied(
    deployment: Deployment,
    kind: str,
    operator: str | None,
    run_id: str,
    record: str,
    batches: int,
) -> bool:
    from keyplane.orchestration import tasks

    if kind == "metrics":
        return tasks.new_version_batches(deployment, run_id, record) >= batches
    if kind not in ("ack", "migrated"):
        raise ValueError(f"unknown wait {kind!r}")
    return tasks.reply_arrived(deployment, "ack" if kind == "ack" else "migrated", operator)


class RolloutWaitTrigger(BaseTrigger):
    """Fires when the awaited reply (or the metrics of ``batches`` batches) is in.

    ``kind`` is ``"ack"``, ``"migrated"`` (of ``operator``) or ``"metrics"``.
    ``deadline`` is a wall-clock time (seconds since the epoch), so a trigger
    moved to another triggerer keeps its original deadline.
    """

    def __init__(
        self,
        *,
        deployment: dict[str, Any],
        kind: str,
        deadline: float,
        operator: str | None = None,
        run_id: str = "",
        record: str = "rollout.json",
        batches: int = 0,
        poll_interval_s: float = 0.5,
    ) -> None:
        super().__init__()
        self.deployment = deployment
        self.kind = kind
        self.deadline = deadline
        self.operator = operator
        self.run_id = run_id
        self.record = record
        self.batches = batches
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            TRIGGER_PATH,
            {
                "deployment": self.deployment,
                "kind": self.kind,
                "deadline": self.deadline,
                "operator": self.operator,
                "run_id": self.run_id,
                "record": self.record,
                "batches": self.batches,
                "poll_interval_s": self.poll_interval_s,
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
                    self.run_id,
                    self.record,
                    self.batches,
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
    ``timeout_s`` bounds the wait. On a missing ACK or MIGRATED the rollout
    in flight is aborted before the task fails, as ``keyplane config publish``
    does: a half-propagated version must not stay pending.
    """

    template_fields = ("timeout_s", "batches")

    def __init__(
        self,
        *,
        kind: str,
        operator: str | None = None,
        timeout_s: Any = 300,
        batches: Any = 0,
        record: str = "rollout.json",
        poll_interval_s: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.operator = operator
        self.timeout_s = timeout_s
        self.batches = batches
        self.record = record
        self.poll_interval_s = poll_interval_s

    def _what(self) -> str:
        if self.kind == "metrics":
            return f"{self.batches} batches on the new version"
        return "ACK" if self.kind == "ack" else f"MIGRATED {self.operator}"

    def execute(self, context: Any) -> dict[str, Any]:
        from keyplane.orchestration.deployment import deployment

        target = deployment()
        run_id = str(context["run_id"])
        if _satisfied(target, self.kind, self.operator, run_id, self.record, int(self.batches)):
            return {"status": "ok", "polls": 0}
        timeout = float(self.timeout_s)
        self.defer(
            trigger=RolloutWaitTrigger(
                deployment=target.model_dump(mode="json"),
                kind=self.kind,
                deadline=time.time() + timeout,
                operator=self.operator,
                run_id=run_id,
                record=self.record,
                batches=int(self.batches),
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout + 60),
        )
        raise AssertionError("defer() raises TaskDeferred")

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") == "ok":
            self.log.info("%s arrived after %s polls", self._what(), event.get("polls"))
            return event
        detail = event.get("message") or f"not within {self.timeout_s} s"
        if self.kind in ("ack", "migrated"):
            _abort_and_fail(self._what(), detail)
        raise AirflowException(f"no {self._what()} ({detail})")


def _abort_and_fail(what: str, detail: str) -> NoReturn:
    """ABORT the rollout in flight after a missing reply, then fail the task saying so."""
    from keyplane.orchestration import tasks
    from keyplane.orchestration.deployment import deployment

    tasks.abort(deployment())
    raise AirflowException(
        f"no {what} from the job ({detail}); the rollout was aborted and the "
        "job is back on its active version. Is the job running? `keyplane job status`"
    )


class RollOutWavesOperator(BaseOperator):
    """Roll out a run's waves before its last version, each wait deferred.

    The number of waves is the plan's, known only when the run has planned,
    and Airflow cannot chain a varying number of task groups one after
    another; so one task walks them. Each time it runs (first, and after
    every reply) it calls :func:`keyplane.orchestration.tasks.advance_waves`,
    which sends what the waves need next, and defers on
    :class:`RolloutWaitTrigger` for the reply that step awaits: the worker
    slot is free while the job migrates, as with the DAG's other waits. A
    missing reply aborts the wave in flight, so the job stays on the last
    finished wave, a complete version, and the task fails.
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
            _abort_and_fail("reply to the wave in flight", event.get("message") or "timeout")
        return self._advance(context)

    def _advance(self, context: Any) -> dict[str, Any]:
        from keyplane.orchestration import tasks
        from keyplane.orchestration.deployment import deployment

        target = deployment()
        run_id = str(context["run_id"])
        step = tasks.advance_waves(target, run_id)
        if step["wait"] is None:
            self.log.info("every wave before the last is active: %s", step["waves"])
            return step
        timeout = float(self.timeout_s)
        self.defer(
            trigger=RolloutWaitTrigger(
                deployment=target.model_dump(mode="json"),
                kind=step["wait"],
                deadline=time.time() + timeout,
                operator=step["operator"],
                run_id=run_id,
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout + 60),
        )
        raise AssertionError("defer() raises TaskDeferred")
