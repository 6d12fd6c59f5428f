"""The optional human gate between ``decide`` and the rollout (``require_approval``).

:class:`RolloutApprovalOperator` is Airflow's human-in-the-loop
``ApprovalOperator`` (standard provider): with ``require_approval`` on, the
task waits for someone to approve or reject in the UI's Required actions,
showing the backtest summary of the version the run decided to publish.
Approve, and the rollout goes ahead; reject, and Airflow skips the rollout
tasks, the version is marked not published with who rejected it, and
``publish`` refuses it should it be run by hand. With the Param off (the
default) the task passes at once, so scheduled runs roll out unattended.
This module imports Airflow only; the records are read when the task runs.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator

log = logging.getLogger(__name__)


class RolloutApprovalOperator(ApprovalOperator):
    """Approve or reject the rollout of the version the run decided to publish."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(subject="Roll out the planned routing?", **kwargs)

    def execute(self, context: Any) -> Any:
        from keyplane.orchestration import decision_steps
        from keyplane.orchestration.deployment import deployment

        if not context["params"].get("require_approval"):
            log.info("approval not required (require_approval is off): the rollout goes ahead")
            return None
        summary = decision_steps.approval_summary(deployment(), str(context["run_id"]))
        self.subject = summary["subject"]
        self.body = summary["body"]
        return super().execute(context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        """Record the answer, then let ``ApprovalOperator`` go on or skip the rollout.

        Recorded first: on a rejection the parent skips the downstream tasks by
        raising, so nothing after it would run.
        """
        from keyplane.orchestration import decision_steps
        from keyplane.orchestration.deployment import deployment

        chosen = list(event.get("chosen_options") or [])
        if "error" not in event and chosen:
            approved = chosen[0] == self.APPROVE
            user = event.get("responded_by_user") or {}
            by = str(user.get("name") or user.get("id") or "someone")
            record = decision_steps.record_approval(
                deployment(), str(context["run_id"]), approved, by
            )
            verdict = "approved" if approved else "rejected"
            outcome = "rolling out" if approved else "nothing is published"
            log.info("v%d %s by %s: %s", record["version"], verdict, by, outcome)
        return super().execute_complete(context, event)
