"""Task wiring shared by the DAGs that roll a version out (reconfigure, scale).

Both DAGs end with the same rollout of paper 000 §3.4: await the job's ACK,
PROPAGATE every operator, upstream first, in one step, then await each MIGRATED.
:func:`rollout_chain` builds that chain inside the DAG being defined. It
imports only Airflow (the DAG files are parsed often and under a timeout);
the steps import the rest when they run.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from airflow.sdk import Asset, Context, Param, get_current_context, task

from keyplane.orchestration import triggers
from keyplane.orchestration.deployment import deployment
from keyplane.orchestration.triggers import AwaitRolloutOperator

#: The published configuration: both DAGs update it when a rollout is DONE.
CONFIGURATION_ASSET = Asset(name="keyplane_routing_configuration")

log = logging.getLogger(__name__)

QUIET_LOGGERS = ("kafka", "great_expectations", "py4j", "urllib3", "matplotlib")
"""Client libraries whose INFO lines (connections opened, fetches, data sources saved) bury
a task's own lines; their warnings and errors still reach the task log."""


def quiet_client_logs() -> None:
    """Raise the client libraries' loggers to WARNING in this process.

    Called when a DAG file imports this module, which every task process
    does before it runs its task, so each task's log holds its own lines.
    """
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


quiet_client_logs()

REPLY_TIMEOUT_MAX_S = 3600
"""The largest ``reply_timeout_s`` Param of either DAG: the longest wait for one reply."""


def reply_timeout_param() -> Param:
    """Both rollout DAGs' ``reply_timeout_s``: one wait per reply, bounded so that
    :func:`rollout_dag_args` can size the run's timeout."""
    return Param(
        300,
        type="integer",
        minimum=5,
        maximum=REPLY_TIMEOUT_MAX_S,
        description="Seconds to wait for each reply of the job (ACK, each MIGRATED, the "
        "batches to verify) before the rollout is aborted and the job returns to the "
        f"version it ran (5 to {REPLY_TIMEOUT_MAX_S}).",
    )


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def unclamped(params: dict[str, Param]) -> dict[str, Param]:
    """``params`` with each numeric bound moved under ``allOf``, where it is still enforced.

    Airflow's trigger form hands a number Param's top-level ``minimum`` and
    ``maximum`` to its number input, which clamps an out-of-range entry when
    the field loses focus, without a word: α 7 became 2 and the run planned
    with 2. Under ``allOf`` the form leaves the typed value alone, and the
    same JSON-schema validation refuses it when the run is triggered (from
    the form, the REST API or the CLI), with a message that names the Param
    and its bound ("7 is greater than the maximum of 2.0").
    """
    moved = {}
    for name, param in params.items():
        schema = dict(param.schema)
        bounds = {key: schema.pop(key) for key in BOUNDS if key in schema}
        if bounds:
            schema["allOf"] = [*schema.get("allOf", []), bounds]
        moved[name] = Param(param.value, description=param.description, **schema)
    return moved


def bound(param: Param, key: Literal["minimum", "maximum"]) -> Any:
    """A Param's ``minimum`` or ``maximum``, at the top level or where :func:`unclamped` put it."""
    if key in param.schema:
        return param.schema[key]
    return next((part[key] for part in param.schema.get("allOf", []) if key in part), None)


MAX_WAVES_PER_RUN = 16
"""The most waves a reconfigure run splits its change into (``max_moves_per_wave``).

Each wave before the last is a whole rollout inside ``roll_out_waves``,
with a wait for its ACK and one for each operator's MIGRATED, and
``dagrun_timeout`` must leave all of them their longest wait; the number of
waves is known only once the run has planned, so it is bounded here. A
change that needs more fails in ``compute_configuration``, before anything
is stored, naming the smallest ``max_moves_per_wave`` that fits. Each wave
costs a rollout's fixed part again, so more than a few gain nothing.
"""


def roll_out_waves_waits(operators: int) -> int:
    """The most replies ``roll_out_waves`` awaits in one run of a job with ``operators``
    stages: the ACK and each MIGRATED of every wave but the last (the last goes through
    the DAG's own rollout tasks)."""
    return (MAX_WAVES_PER_RUN - 1) * (1 + operators)


OTHER_STEPS_TIME = timedelta(hours=1)
"""What a run's steps other than its waits may take together (Spark, GX, the protocol's sends)."""


def abort_run_in_flight(context: Context) -> None:
    """The DAGs' ``on_failure_callback``: ABORT the run's version if it is still in flight.

    A run can fail with its PREPAREd version in flight and no task left to
    abort it: at ``dagrun_timeout`` the scheduler marks every unfinished
    task, a deferred wait included, SKIPPED and calls nothing on its
    operator (``SchedulerJobRunner._schedule_dag_run``); a task marked
    failed by hand ends the same way. The version would stay in flight and
    the next run's ``publish`` fail "still rolling out". Airflow calls a
    DAG's failure callbacks with at least ``dag`` and ``run_id`` in the
    context (the dag processor's ``_execute_dag_callbacks``; ``dag.test``
    runs them inline, ``DagRun.execute_dag_callbacks``), so the versions are
    read from the records of that DAG's run
    (:func:`keyplane.orchestration.rollout_steps.run_versions`): a version another
    run, the other DAG's run of the same id included, or ``keyplane config
    publish`` put in flight is left alone.
    """
    from keyplane.orchestration import rollout_steps

    target = deployment()
    dag_id = str(context["dag"].dag_id)
    run = str(context["run_id"])
    versions = rollout_steps.run_versions(target, dag_id, run)
    aborted = rollout_steps.abort(target, versions) if versions else None
    if aborted is not None:
        log.warning("run %s of %s failed with v%d in flight; it was aborted", run, dag_id, aborted)


SCHEDULE = timedelta(minutes=10)
"""How often each DAG runs on its schedule."""


def metrics_signal_asset() -> Asset:
    """The asset whose watcher starts ``keyplane_reconfigure`` when the job's metrics call
    for a re-plan (:class:`~keyplane.orchestration.triggers.MetricsSignalTrigger`).

    The thresholds are the ``KEYPLANE_RECONFIGURE_*`` settings, read where the
    DAG file is parsed; the trigger reads the metrics topic in the triggerer.
    """
    from airflow.sdk import AssetWatcher

    from keyplane.settings import Settings

    settings = Settings()
    thresholds = {
        "imbalance_above": settings.reconfigure_imbalance_above,
        "locality_below": settings.reconfigure_locality_below,
        "lag_growth_above": settings.reconfigure_lag_growth_above,
        "batches": settings.reconfigure_signal_batches,
    }
    trigger = triggers.MetricsSignalTrigger(
        thresholds=thresholds, cooldown_s=settings.reconfigure_signal_cooldown_s
    )
    return Asset(
        name="keyplane_metrics_signal",
        watchers=[AssetWatcher(name="keyplane_metrics_watcher", trigger=trigger)],
    )


def rollout_dag_args(waits: int, schedule: Any = SCHEDULE) -> dict[str, Any]:
    """The DAG arguments both DAGs share, for a DAG with ``waits`` wait tasks in a row.

    One run at a time: the controller drives one rollout at a time, and a
    second run would only find the first's in flight. Every step is
    idempotent (a retried task sends nothing new), so retries are safe; no
    catch-up, since a run plans from the newest statistics.
    ``dagrun_timeout`` leaves every wait its longest ``reply_timeout_s``
    (``waits`` × :data:`REPLY_TIMEOUT_MAX_S`) plus :data:`OTHER_STEPS_TIME`:
    a run that times out ends its deferred waits without their abort (see
    :func:`abort_run_in_flight`, which makes up for it), so a run within its
    Params must not reach it. A DAG with ``roll_out_waves`` counts its
    waits as :func:`roll_out_waves_waits`, the most that
    :data:`MAX_WAVES_PER_RUN` allows.
    """
    return {
        "schedule": schedule,
        "start_date": datetime(2026, 1, 1, tzinfo=UTC),
        "catchup": False,
        "max_active_runs": 1,
        "default_args": {
            "retries": 2,
            "retry_delay": timedelta(seconds=20),
            # Each step ends its log with one line of what it decided or measured; the
            # returned record is the task's XCom, not a second summary.
            "show_return_value_in_logs": False,
        },
        "dagrun_timeout": waits * timedelta(seconds=REPLY_TIMEOUT_MAX_S) + OTHER_STEPS_TIME,
        "on_failure_callback": abort_run_in_flight,
    }


_Result = TypeVar("_Result")


def fail_fast(step: Callable[[], _Result]) -> Callable[[], _Result]:
    """Fail the task at once, without retries, when its step refuses for good.

    A :class:`~keyplane.orchestration.run_records.Refused` step (a Param the job
    cannot take, a failed validation, a stale plan) and a Param its typed
    settings reject (``ValueError``) would fail the same way on every retry;
    retrying only delays the operator's answer. Other errors (Kafka, Spark,
    a reply not in yet) are retried as the DAG's ``retries`` say.
    """

    @functools.wraps(step)
    def run() -> _Result:
        from airflow.sdk.exceptions import AirflowFailException

        from keyplane.orchestration.run_records import Refused

        try:
            return step()
        except (Refused, ValueError) as refused:
            raise AirflowFailException(str(refused)) from None

    return run


def params() -> dict[str, Any]:
    """The running DAG run's Params."""
    return dict(get_current_context()["params"])


def created_by_of(run_type: object) -> Literal["schedule", "manual", "event"]:
    """What a version planned by a DAG run of ``run_type`` records as its origin.

    Airflow's run types: ``scheduled`` (the DAG's timetable), ``asset_triggered``
    (an asset event, such as the metrics watcher's), and ``manual`` or
    ``backfill``, which someone asked for.
    """
    kind = str(getattr(run_type, "value", run_type))
    if kind == "scheduled":
        return "schedule"
    if kind == "asset_triggered":
        return "event"
    return "manual"


def created_by() -> Literal["schedule", "manual", "event"]:
    """The running DAG run's origin, as :func:`created_by_of` names it."""
    return created_by_of(get_current_context()["dag_run"].run_type)


def triggering_events() -> list[dict[str, Any]]:
    """The metrics signals that started the running DAG run (none for other runs).

    An asset-triggered run carries no conf of its own: the signal's payload
    is the extra of the asset event the run consumed.
    """
    context = get_current_context()
    events = context.get("triggering_asset_events") or {}
    found = []
    for asset, asset_events in events.items():
        if getattr(asset, "name", None) != "keyplane_metrics_signal":
            continue
        for event in asset_events:
            extra = dict(getattr(event, "extra", None) or {})
            found.append(dict(extra.get("payload") or extra))
    return found


def run_id() -> str:
    """The running DAG run's id."""
    return str(get_current_context()["run_id"])


def published_version(published_by: str) -> int:
    """The version the running DAG run's task ``published_by`` PREPAREd."""
    return triggers.published_version(get_current_context(), published_by)


@task
def propagate(operators: Sequence[str], published_by: str) -> dict[str, Any]:
    """PROPAGATE the version ``published_by`` PREPAREd to every one of ``operators``,
    upstream first, in one publish
    (000 §3.4; :func:`keyplane.orchestration.rollout_steps.propagate`)."""
    from keyplane.orchestration import rollout_steps

    return rollout_steps.propagate(deployment(), operators, published_version(published_by))


def rollout_chain(
    operators: Sequence[str],
    prefix: str = "",
    timeout: str = "{{ params.reply_timeout_s }}",
    published_by: str = "publish",
) -> tuple[Any, Any]:
    """await ACK → PROPAGATE every operator → await each MIGRATED, upstream first.

    One task sends every operator's PROPAGATE in one publish, before the
    first wait, so that the job reads them at one batch boundary: all
    operators switch in the same micro-batch and install in the next (see
    :mod:`keyplane.control.messages` for why a micro-batch job may). A task per
    operator would let a boundary fall between their publishes, and the
    downstream operators would switch, and the rollout end, one batch
    later. Each operator's install is still a step of its own: its wait for
    MIGRATED.

    Returns the first and the last task, to wire before and after: after
    ``published_by``, the task that PREPAREs, whose returned ``version`` the
    waits await. Every wait is deferred to the triggerer
    (:class:`AwaitRolloutOperator`), which aborts that version when the job
    does not answer within ``timeout`` seconds.
    """
    first = AwaitRolloutOperator(
        task_id=f"{prefix}await_ack", kind="ack", published_by=published_by, timeout_s=timeout
    )
    last: Any = propagate.override(task_id=f"{prefix}propagate")(list(operators), published_by)
    first >> last
    for operator in operators:
        wait = AwaitRolloutOperator(
            task_id=f"{prefix}await_migrated_{operator}",
            kind="migrated",
            operator=operator,
            published_by=published_by,
            timeout_s=timeout,
        )
        last >> wait
        last = wait
    return first, last
