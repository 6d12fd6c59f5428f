"""Task wiring shared by the DAGs that roll a version out (reconfigure, scale).

Both DAGs end with the same rollout of paper 000 §3.4: await the job's ACK,
PROPAGATE each operator, upstream first, then await each MIGRATED.
:func:`rollout_chain` builds that chain inside the DAG being defined. It
imports only Airflow (the DAG files are parsed often and under a timeout);
the steps import the rest when they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import Asset, get_current_context, task

from keyplane.operators import OPERATORS
from keyplane.orchestration.deployment import deployment
from keyplane.orchestration.triggers import AwaitRolloutOperator

#: The published configuration: both DAGs update it when a rollout is DONE.
CONFIGURATION_ASSET = Asset(name="keyplane_routing_configuration")

#: The DAG arguments both DAGs share. One run at a time: the controller drives
#: one rollout at a time, and a second run would only find the first's in
#: flight. Every step is idempotent (a retried task sends nothing new), so
#: retries are safe; no catch-up, since a run plans from the newest statistics.
ROLLOUT_DAG_ARGS: dict[str, Any] = {
    "schedule": timedelta(minutes=10),
    "start_date": datetime(2026, 1, 1, tzinfo=UTC),
    "catchup": False,
    "max_active_runs": 1,
    "default_args": {"retries": 2, "retry_delay": timedelta(seconds=20)},
    "dagrun_timeout": timedelta(minutes=60),
}


def params() -> dict[str, Any]:
    """The running DAG run's Params."""
    return dict(get_current_context()["params"])


def run_id() -> str:
    """The running DAG run's id."""
    return str(get_current_context()["run_id"])


@task
def migrate(operator: str) -> dict[str, Any]:
    """PROPAGATE the version in flight to ``operator`` (000 §3.4)."""
    from keyplane.orchestration import tasks

    return tasks.propagate(deployment(), operator)


def rollout_chain(
    prefix: str = "",
    operators: Sequence[str] = OPERATORS,
    timeout: str = "{{ params.reply_timeout_s }}",
) -> tuple[Any, Any]:
    """await ACK → PROPAGATE each operator → await each MIGRATED, upstream first.

    Every PROPAGATE goes out before the first wait, so that all operators
    switch in the same micro-batch and install in the next (see
    :mod:`keyplane.protocol` for why a micro-batch job may). Returns the
    first and the last task, to wire before and after. Every wait is
    deferred to the triggerer (:class:`AwaitRolloutOperator`), which aborts
    the rollout when the job does not answer within ``timeout`` seconds.
    """
    first = AwaitRolloutOperator(task_id=f"{prefix}await_ack", kind="ack", timeout_s=timeout)
    last: Any = first
    for operator in operators:
        step = migrate.override(task_id=f"{prefix}migrate_{operator}")(operator)
        last >> step
        last = step
    for operator in operators:
        wait = AwaitRolloutOperator(
            task_id=f"{prefix}await_migrated_{operator}",
            kind="migrated",
            operator=operator,
            timeout_s=timeout,
        )
        last >> wait
        last = wait
    return first, last
