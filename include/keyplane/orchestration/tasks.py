"""The steps of the reconfiguration DAG, one plain function each (paper 000 §3.4).

Every step takes the :class:`~keyplane.orchestration.deployment.Deployment`
and the DAG run's id, reads what earlier steps left in the run's snapshot
folder, and returns a small JSON-able dict (the task's XCom). Idempotence,
since Airflow retries tasks and a run may be cleared and rerun:

* files are written once (``_write_once``): a retried step finds its record
  and returns it, so the configuration version, the validation verdict and
  the decision of a run never change once taken;
* a step that stores versions reserves them first (``_reserve``: the first
  new version and its parent, in a record of the run's written before
  anything is stored), so a try that dies between storing a version and
  recording it leaves the retry that version to store again, not a newer
  one: no orphan version, unvalidated, is left in the store;
* configurations are saved with :func:`keyplane.routing.config.save`, a no-op for an
  identical version, so the retry's save of its reserved version is one;
* a run's records are its DAG's: Airflow's run ids are unique per DAG only,
  and both DAGs can have a run of the same id (:func:`run_folder`);
* protocol steps go through :class:`keyplane.control.controller.Controller`, whose
  retried steps re-send the same message (same id), which the job ignores.

Gates. :func:`publish` refuses a version without a passed validation record
and a decision to publish, so a configuration Great Expectations rejected
cannot reach the job even if a task were skipped or marked success by hand.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from keyplane.algorithms import statistics as stats
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.orchestration import planning
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig

if TYPE_CHECKING:
    from keyplane.control.controller_protocol import ControllerState, Reconfiguration

log = logging.getLogger(__name__)

PROPOSAL = "proposal.json"
ALLOCATION = "allocation.json"
ROLLBACK_ALLOCATION = "rollback_allocation.json"
BACKTEST = "backtest.json"
DECISION = "decision.json"
ROLLOUT = "rollout.json"
VERIFICATION = "verification.json"
ROLLBACK = "rollback.json"
SCALE_DECISION = "scale_decision.json"
SCALE_PROPOSAL = "scale_proposal.json"
"""The records of a ``keyplane_scale`` run (:mod:`keyplane.orchestration.scale_steps`),
named here with the other runs' records so that this module need not import that one."""
APPROVAL = "approval.json"

WaitKind = Literal["ack", "migrated", "metrics"]

RECONFIGURE_DAG_ID = "keyplane_reconfigure"
SCALE_DAG_ID = "keyplane_scale"


class StepError(RuntimeError):
    """A step cannot run: an earlier step's record is missing or says no."""


class Refused(StepError):
    """A step refuses for a reason no retry can change: a Param the job cannot take, a
    failed validation, a decision not to publish, a stale plan. The DAGs fail the task
    at once, without retries (:func:`keyplane.orchestration.dagparts.fail_fast`)."""


def check_plan_params(
    deployment: Deployment, operators: Sequence[str], parallelism: int | None
) -> dict[str, Any]:
    """Refuse Params the running job cannot take, before any statistics are collected.

    The operators must be stages of the pipeline (``KEYPLANE_PIPELINE``) and
    routed by the active version, and a parallelism must fit the job's state
    partitions: Spark fixes them when the job starts, so a plan over more
    instances could never roll out.
    """
    from keyplane.control.operators import check_operators

    try:
        check_operators(operators, deployment.operators)
    except ValueError as exc:
        raise Refused(str(exc)) from None
    version = active_version(deployment, None)
    config = config_store.load(deployment.routing_store, version)
    unknown = [name for name in operators if name not in config.operators]
    if unknown:
        raise Refused(
            f"operators {', '.join(unknown)} are not in the job's pipeline "
            f"(v{version} routes {', '.join(config.operators)})"
        )
    if parallelism is not None:
        partitions = min(config.operators[name].parallelism for name in operators)
        if parallelism > partitions:
            raise Refused(
                f"parallelism {parallelism} is more than the job's {partitions} state "
                f"partitions (fixed when the job started); give at most {partitions}"
            )
    return {"active_version": version, "operators": list(operators), "parallelism": parallelism}


def _write_once(path: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``record`` as JSON unless ``path`` exists; return what the file holds."""
    if path.is_file():
        return dict(json.loads(path.read_text()))
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    staging.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    try:
        os.link(staging, path)
    except FileExistsError:
        pass
    finally:
        staging.unlink(missing_ok=True)
    return dict(json.loads(path.read_text()))


def _read(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise StepError(f"{what} is missing ({path}); run the step that writes it first")
    return dict(json.loads(path.read_text()))


def _snapshot(deployment: Deployment, run_id: str) -> stats.Snapshot:
    return stats.read_snapshot(deployment.snapshots, run_id)


def scale_folder(deployment: Deployment, run_id: str) -> Path:
    """The records of a ``keyplane_scale`` run, which takes no statistics snapshot."""
    return deployment.home / "scale" / stats.safe_run_id(run_id)


def _folder(deployment: Deployment, run_id: str) -> Path:
    folder = stats.snapshot_folder(deployment.snapshots, run_id)
    if not (folder / stats.MANIFEST_NAME).is_file():
        raise StepError(f"no statistics snapshot for run {run_id!r} in {folder}")
    return folder


def run_folder(deployment: Deployment, dag_id: str, run_id: str) -> Path:
    """The folder of the records of ``dag_id``'s run ``run_id``.

    A reconfiguration run keeps them in its statistics snapshot, a scale
    run in :func:`scale_folder`. The DAG must be named: Airflow makes a run
    id unique within its DAG only, and a run id chosen by hand (the REST
    API, ``airflow dags trigger -r``) or an ``airflow dags test`` of the
    same logical date gives both DAGs a run of the same id, whose records
    are not each other's.
    """
    if dag_id == RECONFIGURE_DAG_ID:
        return stats.snapshot_folder(deployment.snapshots, run_id)
    if dag_id == SCALE_DAG_ID:
        return scale_folder(deployment, run_id)
    raise StepError(
        f"DAG {dag_id!r} keeps no keyplane run records "
        f"(only {RECONFIGURE_DAG_ID} and {SCALE_DAG_ID} do)"
    )


def _reserve(
    path: Path,
    deployment: Deployment,
    parent: int,
    *,
    version: int | None = None,
    **inputs: Any,
) -> dict[str, Any]:
    """The run's first new version and its parent, reserved once in ``path``.

    Written before the step stores anything, so that every try of the step
    stores the same versions: a try that died after storing a version and
    before recording it in the step's own record (``proposal.json``,
    ``rollback.json``) left that version, and the retry, planning with the
    reserved numbers and ``inputs`` (what the plan needs that could change
    between tries), stores it again, a no-op. ``version`` defaults to the
    store's newest + 1. The reservation is the run's alone: another
    process may still store that version meanwhile, and then
    :func:`_store` refuses rather than overwrite it. The step's own record,
    which :func:`run_versions` reads to ABORT the run's versions, is
    written only once they are stored, so it never names another's.
    """
    if version is None:
        version = (config_store.latest_version(deployment.routing_store) or parent) + 1
    return _write_once(path, {"parent_version": parent, "version": version, **inputs})


def _store(deployment: Deployment, config: RoutingConfig) -> config_store.SavedConfig:
    """Save a version the run reserved (:func:`_reserve`); a no-op for the retry's save.

    Another configuration stored under the version meanwhile (another run,
    ``keyplane config publish``) is left as it is: the step fails naming
    it rather than overwrite a version that may be in flight already.
    """
    try:
        return config_store.save(config, deployment.routing_store)
    except config_store.VersionConflictError:
        raise Refused(
            f"v{config.version}, which this run reserved, was stored meanwhile with another "
            "routing (by another run or `keyplane config publish`); it is left as it is and "
            "this run stores and publishes nothing: the next run plans from the store as it is"
        ) from None


# --- 1. statistics ---------------------------------------------------------------------


def statistics_job_args(
    deployment: Deployment,
    run_id: str,
    *,
    decay: float,
    holdout_fraction: float,
) -> list[str]:
    """The arguments of ``spark_jobs/key_statistics.py`` for this run (``SparkSubmitOperator``)."""
    return [
        "--bootstrap-servers",
        deployment.bootstrap_servers,
        "--pipeline",
        deployment.pipeline,
        "--metrics-topic",
        deployment.metrics_topic,
        "--snapshots",
        str(deployment.snapshots),
        "--run-id",
        run_id,
        "--routing-store",
        str(deployment.routing_store),
        "--decay",
        str(decay),
        "--holdout-fraction",
        str(holdout_fraction),
    ]


def validate_statistics(
    deployment: Deployment, run_id: str, *, min_total_count: int = 10_000
) -> dict[str, Any]:
    """Run the ``keyplane_statistics`` suite on the run's snapshot; raise if it fails.

    Plans are only as good as their statistics (000 §3.2): too few tuples and
    per-instance loads are noise, a window that does not cover what it
    claims would plan on the wrong data.
    """
    from keyplane.orchestration.quality import QualitySettings, locked_context
    from keyplane.orchestration.quality import validate_statistics as run_suite

    snapshot = _snapshot(deployment, run_id)
    widened = stats.lookback(deployment.snapshots, snapshot, min_total_count)
    if len(widened.runs) > 1:
        log.info(
            "window widened to %d runs (%d tuples): %s",
            len(widened.runs),
            widened.total,
            widened.runs,
        )
    with locked_context(deployment.gx_root) as context:
        result = run_suite(
            widened.frame,
            widened.window,
            context=context,
            settings=QualitySettings(min_total_count=min_total_count),
            run_name=f"statistics-{stats.safe_run_id(run_id)}",
            stages=deployment.operators,
        )
    log.info("statistics validation:\n%s", result.summary)
    if not result.success:
        # The run's snapshot never changes: a retry would fail the same checks.
        raise Refused(f"the statistics of run {run_id} failed validation:\n{result.summary}")
    log.info(
        "statistics of %d tuples passed validation (window %s)",
        snapshot.manifest.n_events,
        snapshot.manifest.window,
    )
    return {
        "n_events": snapshot.manifest.n_events,
        "window": list(snapshot.manifest.window),
        "summary": result.summary,
    }


# --- 2. configuration ------------------------------------------------------------------


def active_version(deployment: Deployment, manifest: stats.SnapshotManifest | None) -> int:
    """The version the job runs now.

    The controller's state is authoritative once a rollout happened (its
    ``active_version`` moves at DONE). Before that, the job's own metrics say
    which version it routed its last batch with; failing both, the newest
    stored version, which is what a routed job starts on.
    """
    from keyplane.control.controller import ControllerFile

    if deployment.controller_state.is_file():
        saved = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        return saved.protocol.active_version
    if manifest is not None and manifest.job_version is not None:
        return manifest.job_version
    latest = config_store.latest_version(deployment.routing_store)
    if latest is None:
        raise StepError(
            f"no configuration in {deployment.routing_store}: start the routed job first "
            "(it stores an all-hash v1)"
        )
    return latest


class Proposal(BaseModel):
    """What :func:`compute_configuration` decided for a run; the later steps read it.

    ``version`` routes as the plan. ``waves`` are the versions rolled out
    before it, in order, when the run splits its moves into waves
    (:mod:`keyplane.routing.waves`); each is the parent of the next, the first a
    child of ``parent_version`` and the last the parent of ``version``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    parent_version: int
    checksum: str
    alpha: float
    window: planning.HistoryWindow
    table_budget: int | None
    predicted_locality: float
    current_locality: float
    predicted_imbalance: dict[str, float]
    hot_keys: dict[str, int]
    table_sizes: dict[str, int]
    waves: tuple[int, ...] = ()


def changed_operators(config: RoutingConfig, parent: RoutingConfig) -> RoutingConfig:
    """``config`` with only the operators whose routing differs from ``parent``'s.

    A run that re-plans some operators (the ``operators`` Param) keeps the
    others as they run; validating those would fail the run for a balance it
    did not set and cannot change. A version that changes nothing is judged
    whole.
    """
    changed = {
        name: routing
        for name, routing in config.operators.items()
        if routing != parent.operators.get(name)
    }
    return config.model_copy(update={"operators": changed}) if changed else config


def _forecast(
    deployment: Deployment,
    snapshot: stats.Snapshot,
    current: RoutingConfig,
    params: planning.PlanParams,
) -> planning.LoadForecast | None:
    """The next window's key loads forecast from the recent windows' snapshots, when
    the history policy is ``decay`` and there are enough of them to backtest on."""
    if params.window != "decay":
        return None
    windows = stats.recent_windows(deployment.snapshots, snapshot, planning.FORECAST_WINDOWS)
    if len(windows) < planning.MIN_FORECAST_WINDOWS:
        log.info(
            "planning on the decayed statistics: %d consecutive window(s), a forecast needs %d",
            len(windows),
            planning.MIN_FORECAST_WINDOWS,
        )
        return None
    chain = planning.chain_of(current, deployment.operators)
    n = params.parallelism or current.operators[chain[0]].parallelism
    forecast = planning.forecast_loads(windows, chain, n)
    log.info(
        "planning on next-window loads forecast from %d windows; memories by backtest: %s",
        len(windows),
        forecast.memories,
    )
    return forecast


def compute_configuration(
    deployment: Deployment,
    run_id: str,
    params: planning.PlanParams,
    *,
    max_waves: int | None = None,
    created_by: config_store.CreatedBy = "schedule",
) -> dict[str, Any]:
    """Plan a new version from the snapshot and store it, child of the active version.

    ``created_by`` records what started the run (its schedule, an operator,
    a metrics event), so the store says why each version exists.

    METIS routing tables (000 §3.3, :func:`keyplane.algorithms.locality.build_plan`) and
    FISH hot keys (001 §4.1.2). With ``params.max_moves_per_wave``, the
    change is stored as waves that each move at most that many keys, the
    last routing as the plan (:func:`keyplane.routing.waves.split_into_waves`), so
    the rollout spreads its moved states over more micro-batches; a change
    that needs more than ``max_waves`` waves (a DAG run's limit, None: none)
    fails before anything is stored. Retried,
    it returns the versions it stored the first time instead of storing more,
    also after a try that died while storing them: the versions and the
    parent are reserved first (:func:`_reserve`), and the plan, a function
    of the snapshot, the Params and the parent (METIS runs seeded), comes
    out the same.
    """
    folder = _folder(deployment, run_id)
    existing = folder / PROPOSAL
    if existing.is_file():
        proposal = Proposal.model_validate_json(existing.read_text())
        config_store.load(deployment.routing_store, proposal.version, proposal.checksum)
        return proposal.model_dump(mode="json")
    snapshot = _snapshot(deployment, run_id)
    reserved = _reserve(
        folder / ALLOCATION, deployment, active_version(deployment, snapshot.manifest)
    )
    parent = int(reserved["parent_version"])
    current = config_store.load(deployment.routing_store, parent)
    plan = planning.plan_configuration(
        snapshot.pairs,
        snapshot.frequencies,
        current,
        params,
        version=int(reserved["version"]),
        cost=snapshot.manifest.cost_model,
        created_by=created_by,
        stages=deployment.operators,
        forecast=_forecast(deployment, snapshot, current, params),
    )
    log.info(
        "chose the %s configuration (throughputs %s); it promises next-window imbalance ≤ %.3f "
        "(target α %.3f)",
        plan.candidate,
        plan.throughputs,
        plan.promised_imbalance,
        params.alpha,
    )
    stored = [
        _store(deployment, config)
        for config in _waves(current, plan.config, params.max_moves_per_wave, max_waves)
    ]
    saved = stored[-1]
    proposal = Proposal(
        version=saved.version,
        parent_version=parent,
        checksum=saved.checksum,
        alpha=params.alpha,
        window=params.window,
        table_budget=params.max_table_entries,
        predicted_locality=plan.predicted_locality,
        current_locality=plan.current_locality,
        predicted_imbalance=plan.predicted_imbalance,
        hot_keys=plan.hot_keys,
        table_sizes={name: len(r.table) for name, r in plan.config.operators.items()},
        waves=tuple(wave.version for wave in stored[:-1]),
    )
    record = _write_once(existing, proposal.model_dump(mode="json"))
    log.info(
        "planned v%d from v%d%s: predicted locality %.1f%% → %.1f%%, imbalance %s, %d hot keys",
        proposal.version,
        parent,
        f" in {len(proposal.waves) + 1} waves" if proposal.waves else "",
        100 * proposal.current_locality,
        100 * proposal.predicted_locality,
        ", ".join(f"{k} {v:.3f}" for k, v in proposal.predicted_imbalance.items()),
        sum(proposal.hot_keys.values()),
    )
    return record


def _waves(
    current: RoutingConfig,
    planned: RoutingConfig,
    max_moves_per_wave: int | None,
    max_waves: int | None,
) -> tuple[RoutingConfig, ...]:
    """``planned`` alone, or as at most ``max_waves`` waves of at most ``max_moves_per_wave``
    moved keys each."""
    if max_moves_per_wave is None:
        return (planned,)
    from keyplane.routing.routedkeys import spark_partition
    from keyplane.routing.waves import split_into_waves

    try:
        return split_into_waves(
            current, planned, spark_partition, max_moves_per_wave, max_waves=max_waves
        )
    except ValueError as exc:
        raise Refused(f"v{planned.version} cannot roll out in waves: {exc}") from None


def _proposal(deployment: Deployment, run_id: str) -> tuple[Proposal, RoutingConfig]:
    record = _read(_folder(deployment, run_id) / PROPOSAL, "the proposal")
    proposal = Proposal.model_validate(record)
    config = config_store.load(deployment.routing_store, proposal.version, proposal.checksum)
    return proposal, config


def _validation_path(deployment: Deployment, version: int) -> Path:
    return deployment.routing_store / f"validation-v{version:06d}.json"


def validate_configuration(
    deployment: Deployment,
    run_id: str,
    *,
    version: int | None = None,
    locality_tolerance: float = 0.02,
) -> dict[str, Any]:
    """Run the configuration suites on a stored version; raise with the summary if it fails.

    The verdict is recorded next to the store (``validation-v<version>.json``),
    which :func:`publish` requires. The snapshot's training weights are the
    key loads the suites route through the configuration
    (:func:`keyplane.orchestration.quality.predicted_instance_loads`), so a configuration
    that overloads an instance fails whatever its plan claimed. Only the
    operators the version changes are judged (:func:`changed_operators`),
    each over its active instances. ``version`` defaults to the run's
    proposal. When the proposal passes and rolls out
    in waves, each wave before it is recorded as validated with that reason:
    a wave routes every key either as the active version or as the proposal
    does, and it is a step on the way to a configuration that passed, not a
    plan of its own (as a rollback is recorded, :func:`prepare_rollback`).
    """
    from keyplane.orchestration.quality import OperatorPrediction, QualitySettings, locked_context
    from keyplane.orchestration.quality import validate_configuration as run_suites

    proposal, proposed = _proposal(deployment, run_id)
    if version is not None and version != proposal.version:
        config = config_store.load(deployment.routing_store, version)
    else:
        config = proposed
    snapshot = _snapshot(deployment, run_id)
    window = proposal.window
    pair_w = planning.pair_weights(snapshot.pairs, window)
    column: planning.Column = "train" if window == "decay" else "count"
    current = config_store.load(deployment.routing_store, proposal.parent_version)
    locality_new = planning.locality(config, snapshot.pairs, pair_w, deployment.operators)
    locality_current = planning.locality(current, snapshot.pairs, pair_w, deployment.operators)
    judged = changed_operators(config, current)
    predictions = {}
    for name, routing in judged.operators.items():
        key_loads = planning.stage_loads(snapshot.frequencies, name, column)
        planned = proposal.predicted_imbalance.get(name)
        if config.version != proposal.version or planned is None:
            planned = planning.imbalance(planning.instance_loads(routing, key_loads))
        predictions[name] = OperatorPrediction(
            predicted_imbalance=planned,
            predicted_locality=locality_new,
            current_locality=locality_current,
            alpha=proposal.alpha,
            table_budget=proposal.table_budget,
            key_loads=key_loads,
        )
    with locked_context(deployment.gx_root) as context:
        result = run_suites(
            judged,
            predictions,
            context=context,
            settings=QualitySettings(locality_tolerance=locality_tolerance),
            run_name=f"configuration-v{config.version}",
        )
    log.info("configuration validation of v%d:\n%s", config.version, result.summary)
    record = record_validation(
        deployment, config.version, result.success, result.summary, result.data_docs_path
    )
    if not record["success"]:
        not_published(
            deployment,
            [*proposal.waves, proposal.version],
            "failed validation",
            run_id,
        )
        raise Refused(
            f"v{config.version} failed validation and will not be published:\n{record['summary']}"
        )
    log.info("v%d passed validation: %s", config.version, _first_line(record["summary"]))
    if config.version == proposal.version:
        for number, wave in enumerate(proposal.waves, start=1):
            record_validation(
                deployment,
                wave,
                True,
                f"wave {number} of {len(proposal.waves) + 1} towards v{proposal.version}, "
                "which passed validation",
            )
    return record


def record_validation(
    deployment: Deployment,
    version: int,
    success: bool,
    summary: str,
    data_docs: Path | None = None,
) -> dict[str, Any]:
    """Record a version's verdict next to the store, once; :func:`publish` requires it."""
    return _write_once(
        _validation_path(deployment, version),
        {
            "version": version,
            "checksum": config_store.checksum(deployment.routing_store, version),
            "success": success,
            "summary": summary,
            "data_docs": str(data_docs),
        },
    )


# --- 3. backtest and decision ------------------------------------------------------------


def backtest(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Score the proposal and the active version on the snapshot's hold-out."""
    folder = _folder(deployment, run_id)
    proposal, config = _proposal(deployment, run_id)
    current = config_store.load(deployment.routing_store, proposal.parent_version)
    snapshot = _snapshot(deployment, run_id)
    result = planning.backtest(
        config, current, snapshot.pairs, snapshot.frequencies, deployment.operators
    )
    record = _write_once(folder / BACKTEST, {"version": proposal.version, **asdict(result)})
    log.info("backtest of v%d on the hold-out: %s", proposal.version, backtest_summary(record))
    return record


def backtest_summary(record: Mapping[str, Any]) -> str:
    """One line of a backtest record: locality, worst imbalance and state moved."""
    result = _backtest_of(record)
    return (
        f"locality {result.current.locality:.1%} → {result.new.locality:.1%}, worst imbalance "
        f"{result.current.worst_imbalance:.3f} → {result.new.worst_imbalance:.3f}, "
        f"{result.moved_share:.1%} of the state moves"
    )


def _first_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _backtest_of(record: Mapping[str, Any]) -> planning.Backtest:
    return planning.Backtest(
        new=planning.Forecast(**record["new"]),
        current=planning.Forecast(**record["current"]),
        moved_share=float(record["moved_share"]),
        holdout_tuples=float(record["holdout_tuples"]),
    )


def decide(
    deployment: Deployment, run_id: str, rule: planning.DecisionRule, *, dry_run: bool
) -> dict[str, Any]:
    """Whether to publish the proposal (:class:`~keyplane.orchestration.planning.DecisionRule`).

    A dry run never publishes. The first decision of a run stands.
    """
    folder = _folder(deployment, run_id)
    result = _backtest_of(_read(folder / BACKTEST, "the backtest"))
    decision = planning.decide(result, rule)
    publish_it = decision.publish and not dry_run
    reason = f"dry run: {decision.reason}" if dry_run else decision.reason
    record = _write_once(
        folder / DECISION,
        {
            "version": _read(folder / PROPOSAL, "the proposal")["version"],
            "publish": publish_it,
            "gain": decision.gain,
            "cost": decision.cost,
            "reason": reason,
        },
    )
    log.info("decision: %s", record["reason"])
    if not record["publish"]:
        proposal = Proposal.model_validate(_read(folder / PROPOSAL, "the proposal"))
        not_published(
            deployment, [*proposal.waves, proposal.version], str(record["reason"]), run_id
        )
    return record


def not_published(
    deployment: Deployment, versions: Sequence[int], reason: str, run_id: str
) -> None:
    """Mark the run's ``versions`` as planned but not published, then prune the oldest such
    (:func:`keyplane.routing.config.prune_not_published`), never the job's active version or one
    in flight."""
    for version in versions:
        config_store.mark_not_published(deployment.routing_store, version, reason, run_id)
    protected: list[int] = []
    if deployment.controller_state.is_file():
        from keyplane.control.controller import ControllerFile

        saved = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        state = saved.protocol
        protected = [state.active_version] + [
            r.version for r in (state.current, state.last) if r is not None
        ]
    pruned = config_store.prune_not_published(
        deployment.routing_store, deployment.unpublished_versions_kept, protected
    )
    if pruned:
        log.info(
            "pruned %d versions that were never published (v%s)",
            len(pruned),
            ", v".join(map(str, pruned)),
        )


def approval_summary(deployment: Deployment, run_id: str) -> dict[str, str]:
    """What the person asked to approve the rollout sees: the version, the backtest's
    predicted gain, the keys and state it moves, and the migration cost."""
    from keyplane.routing.migration import plan_migration
    from keyplane.routing.routedkeys import spark_partition

    folder = _folder(deployment, run_id)
    proposal, config = _proposal(deployment, run_id)
    decision = _read(folder / DECISION, "the decision")
    result = _backtest_of(_read(folder / BACKTEST, "the backtest"))
    parent = config_store.load(deployment.routing_store, proposal.parent_version)
    moved = sum(len(m.moves) for m in plan_migration(parent, config, spark_partition).operators)
    waves = f" in {len(proposal.waves) + 1} waves" if proposal.waves else ""
    body = "\n".join(
        [
            f"**v{proposal.version}** replaces the active **v{proposal.parent_version}**{waves}.",
            "",
            "Backtest on the newest traffic, held out of planning:",
            "",
            f"- locality: {result.current.locality:.1%} → {result.new.locality:.1%}",
            f"- worst imbalance: {result.current.worst_imbalance:.3f} → "
            f"{result.new.worst_imbalance:.3f}",
            f"- keys moved: {moved}, {result.moved_share:.1%} of the state",
            f"- predicted gain {decision['gain']:+.4f}, migration cost {decision['cost']:.4f}",
            "",
            f"Decision: {decision['reason']}",
        ]
    )
    return {
        "subject": f"Roll out v{proposal.version}? (gain {decision['gain']:+.4f}, "
        f"{moved} keys move)",
        "body": body,
    }


def record_approval(deployment: Deployment, run_id: str, approved: bool, by: str) -> dict[str, Any]:
    """Record the answer to the approval request, once; a rejected version is marked not
    published and :func:`publish` refuses it."""
    folder = _folder(deployment, run_id)
    proposal = Proposal.model_validate(_read(folder / PROPOSAL, "the proposal"))
    record = _write_once(
        folder / APPROVAL, {"version": proposal.version, "approved": approved, "by": by}
    )
    if not record["approved"]:
        not_published(
            deployment, [*proposal.waves, proposal.version], f"rejected by {record['by']}", run_id
        )
    return record


def _require_approved(folder: Path) -> None:
    """Refuse a version whose approval request was answered with a rejection."""
    path = folder / APPROVAL
    if path.is_file():
        record = _read(path, "the approval")
        if not record.get("approved"):
            raise Refused(f"v{record['version']} was rejected by {record.get('by')}")


# --- 4. the rollout ---------------------------------------------------------------------


@contextmanager
def controller(deployment: Deployment) -> Iterator[Any]:
    """A :class:`keyplane.control.controller.Controller` on the deployment's control topic,
    rolling out the pipeline's stages upstream first (000 §3.4)."""
    from keyplane.control.controller import Controller
    from keyplane.kafka.control import ControlChannel

    with ControlChannel(deployment.bootstrap_servers, deployment.control_topic) as channel:
        yield Controller(
            channel, deployment.controller_state, deployment.routing_store, deployment.operators
        )


def _require_validated(deployment: Deployment, version: int) -> None:
    path = _validation_path(deployment, version)
    record = _read(path, f"the validation record of v{version}")
    if not record.get("success"):
        raise Refused(f"v{version} failed validation; it is never published")
    if record["checksum"] != config_store.checksum(deployment.routing_store, version):
        raise Refused(f"v{version} changed since it was validated")


def _require_planned_on_active(state: ControllerState | None, version: int, parent: int) -> None:
    """Refuse a proposal planned on a version that is no longer active.

    A migration plan is a difference from the version it was computed on
    (000 §3.4), and a proposal is only as good as the statistics of that
    version. Two runs (a scheduled and a manual one) can plan at the same
    time; the controller lets only one roll out, and once it is done the
    other's proposal is stale: its ``publish``, retried, fails saying so
    rather than rolling out a plan for a job that no longer exists. A
    retried ``publish`` of a version the controller already took is let
    through: it re-sends the same PREPARE.
    """
    if state is None or parent == state.active_version:
        return
    if version in {r.version for r in (state.current, state.last) if r is not None}:
        return
    raise Refused(
        f"v{version} was planned from v{parent}, but v{state.active_version} is active now; "
        f"it is stale and will not be published (the next run plans from v{state.active_version})"
    )


def publish(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """PREPARE the run's proposal (000 §3.4) once it was validated and chosen.

    Only one rollout is ever in flight: the controller takes its file lock and
    refuses a second version until the first is done or aborted, so of two
    runs that publish at once one fails naming the other.
    """
    folder = _folder(deployment, run_id)
    decision = _read(folder / DECISION, "the decision")
    if not decision["publish"]:
        raise Refused(f"the decision was not to publish: {decision['reason']}")
    _require_approved(folder)
    version = int(decision["version"])
    _require_validated(deployment, version)
    proposal, _ = _proposal(deployment, run_id)
    parent = proposal.waves[-1] if proposal.waves else proposal.parent_version
    return publish_version(deployment, version, parent)


def advance_waves(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Send what the proposal's waves need next; say which reply to await, if any.

    The waves before the proposal's last version roll out one after the
    other, each a whole rollout (000 §3.4: PREPARE → ACK → PROPAGATE every
    operator → every MIGRATED → DONE); the last version then goes through
    the DAG's own ``publish`` and rollout tasks, and ``verify`` judges it
    against the version before the waves. Each call reads the job's replies,
    takes every step they allow (finishing a wave and preparing the next),
    and returns ``wait``: ``"ack"``, ``"migrated"`` (of ``operator``) or
    None once every wave is done, for
    :class:`~keyplane.orchestration.triggers.RollOutWavesOperator` to defer
    on. Its steps follow from the controller's state file alone, so a call
    after a crash, a retry or a lost trigger resumes where the waves stand
    and sends nothing for waves the job already runs.
    """
    folder = _folder(deployment, run_id)
    decision = _read(folder / DECISION, "the decision")
    if not decision["publish"]:
        raise Refused(f"the decision was not to publish: {decision['reason']}")
    proposal, _ = _proposal(deployment, run_id)
    waves = list(proposal.waves)

    def step(
        wait: str | None, version: int | None = None, operator: str | None = None
    ) -> dict[str, Any]:
        return {"waves": waves, "version": version, "wait": wait, "operator": operator}

    if not waves:
        return step(None)
    for wave in waves:
        _require_validated(deployment, wave)
    with controller(deployment) as control:
        control.poll()
        state = control.state
        if state is not None and state.active_version not in (
            proposal.parent_version,
            *waves,
            proposal.version,
        ):
            _require_planned_on_active(state, waves[0], proposal.parent_version)
        while True:
            state = control.state
            pending = [w for w in waves if state is None or w > state.active_version]
            if not pending:
                return step(None)
            wave = pending[0]
            number = f"wave {waves.index(wave) + 1} of {len(waves) + 1}"
            current = None if state is None else state.current
            if current is None or current.version != wave:
                control.prepare(wave)
                log.info("PREPARE v%d (%s)", wave, number)
                return step("ack", wave)
            if current.ack is None:
                return step("ack", wave)
            operators = control.operators_for(wave)
            unsent = [name for name in operators if name not in current.propagated]
            if unsent:
                control.propagate_all(unsent, version=wave)
                log.info("PROPAGATE v%d to %s (%s)", wave, ", ".join(unsent), number)
            missing = [name for name in operators if name not in current.migrated]
            if missing:
                return step("migrated", wave, missing[0])
            control.done(version=wave)
            log.info("DONE v%d (%s)", wave, number)


def publish_version(deployment: Deployment, version: int, parent: int) -> dict[str, Any]:
    """PREPARE ``version``, planned on ``parent``, once validated (the reconfigure and
    scale DAGs' publish)."""
    _require_validated(deployment, version)
    with controller(deployment) as control:
        _require_planned_on_active(control.state, version, parent)
        message = control.prepare(version)
    log.info("PREPARE v%d sent (planned on v%d); awaiting the job's ACK", version, parent)
    return {"version": version, "message_id": str(message.message_id)}


def propagate(
    deployment: Deployment, operators: Sequence[str], version: int | None = None
) -> dict[str, Any]:
    """PROPAGATE ``version`` to every one of ``operators``, upstream first, in one publish
    (after the ACK), so the job switches them all in the same micro-batch.

    ``version`` is the one the run PREPAREd; if another is in flight (the
    run's was aborted and an operator published one by hand), the step is
    refused rather than propagating theirs. None: whatever is in flight. A
    retry re-sends the same messages, which the job ignores as duplicates.
    """
    with controller(deployment) as control:
        messages = control.propagate_all(operators, version=version)
    log.info(
        "PROPAGATE v%d sent to %s in one publish",
        messages[0].config_version,
        ", ".join(m.operator or "?" for m in messages),
    )
    return {
        "version": messages[0].config_version,
        "operators": [m.operator for m in messages],
    }


def metrics_end(deployment: Deployment) -> dict[int, int]:
    """The metrics topic's end offsets: where records of later batches start."""
    from keyplane.kafka.admin import ensure_topic, high_watermarks

    ensure_topic(deployment.bootstrap_servers, deployment.metrics_topic, 1)
    return high_watermarks(deployment.bootstrap_servers, deployment.metrics_topic)


def done(
    deployment: Deployment,
    run_id: str,
    record_name: str = ROLLOUT,
    version: int | None = None,
) -> dict[str, Any]:
    """Send DONE: the new version becomes active. Records where its metrics begin."""
    return done_into(deployment, _folder(deployment, run_id) / record_name, version)


def done_into(deployment: Deployment, record: Path, version: int | None = None) -> dict[str, Any]:
    """Send DONE and write the rollout record (version, metrics start) to ``record``.

    ``version`` as for :func:`propagate`. :func:`verify` measures the batches
    from the record's metrics start on, so every try must record the same
    start. It is reserved once, before DONE is sent, when every operator
    has MIGRATED: read after DONE, a try that died between DONE and its
    record left its retry measuring from later, skipping the batches
    between. The batches from the reservation on already run the new
    version (an operator switches before its MIGRATED), and verify keeps
    only the new version's batches. Should the controller learn of the
    last MIGRATED only as it sends DONE, the start is reserved after DONE,
    as before.
    """
    reserved = record.with_name(f"{record.stem}.metrics-start.json")

    def reserve() -> dict[str, Any]:
        if reserved.is_file():
            return _read(reserved, "the reserved metrics start")
        ends = metrics_end(deployment)
        return _write_once(reserved, {"metrics_start": {str(p): o for p, o in ends.items()}})

    with controller(deployment) as control:
        state = control.state
        migrated = None if state is None else state.migrated_rollout
        if migrated is not None and version in (None, migrated.version):
            reserve()
        message = control.done(version=version)
    start = reserve()["metrics_start"]
    written = _write_once(record, {"version": message.config_version, "metrics_start": start})
    log.info("DONE v%d sent: it is the job's active version", written["version"])
    return written


def reply_arrived(
    deployment: Deployment,
    kind: Literal["ack", "migrated"],
    operator: str | None = None,
    *,
    version: int | None = None,
) -> bool:
    """Whether the job's ACK (or ``operator``'s MIGRATED) for the rollout is in.

    One poll of the control topic through the controller, which records the
    replies in its state file: the check a deferrable trigger repeats. A
    PREPARE the job answered with REFUSED raises
    :class:`~keyplane.control.controller.ControllerError` with the job's reason.
    ``version`` is the version the wait is for (:func:`awaited_rollout`);
    None takes the rollout in flight, else the last one.
    """
    with controller(deployment) as control:
        control.poll()
        rollout = awaited_rollout(control.state, version)
        if kind == "ack":
            if rollout.ack is None and rollout.refused is not None:
                from keyplane.control.controller import ControllerError

                raise ControllerError(
                    f"the job refused v{rollout.version}: {rollout.refused.reason}"
                )
            return rollout.ack is not None
        assert operator is not None
        return operator in rollout.migrated


def awaited_rollout(state: ControllerState | None, version: int | None) -> Reconfiguration:
    """The rollout of ``version`` in the controller's state; raise if it cannot be awaited.

    A wait that took whatever is in flight would, after an operator aborted
    the run's v2 and published v3, report v3's ACK as the run's; so a wait
    names its version and :func:`keyplane.control.controller_protocol.rollout_for` judges it as
    it judges the protocol's steps. Its refusal is raised as a
    :class:`~keyplane.control.controller.ControllerError`, as the controller's other
    refusals to wait are.
    """
    from keyplane.control.controller import ControllerError
    from keyplane.control.controller_protocol import rollout_for
    from keyplane.control.messages import ProtocolError

    try:
        return rollout_for(state, version)
    except ProtocolError as refused:
        raise ControllerError(str(refused)) from None


def abort(deployment: Deployment, versions: Collection[int]) -> int | None:
    """ABORT the rollout in flight if it is one of ``versions``; return the version aborted.

    The job returns to its active version. A version not in ``versions`` is
    left alone: it belongs to another run or to ``keyplane config publish``,
    which share the controller, and aborting it would undo a rollout the
    caller knows nothing of.
    """
    with controller(deployment) as control:
        message = control.abort_any_of(versions)
    return None if message is None else message.config_version


def run_versions(deployment: Deployment, dag_id: str, run_id: str) -> tuple[int, ...]:
    """Every version a DAG run stored to roll out: its waves, its proposal, its rollback.

    Read from the records of ``dag_id``'s run (:func:`run_folder`):
    ``proposal.json`` and ``rollback.json`` of a reconfiguration run,
    ``scale_proposal.json`` of a scale run. A caller that knows only the
    run (the DAGs' failure callback, a wave task whose deferral failed)
    passes them to :func:`abort` so that it aborts only this run's version,
    not that of the other DAG's run of the same id.
    """
    folder = run_folder(deployment, dag_id, run_id)
    versions: list[int] = []
    if dag_id == SCALE_DAG_ID:
        names: tuple[str, ...] = (SCALE_PROPOSAL,)
    else:
        proposal = folder / PROPOSAL
        if proposal.is_file():
            record = json.loads(proposal.read_text())
            versions += [int(v) for v in record.get("waves", ())] + [int(record["version"])]
        names = (ROLLBACK,)
    for name in names:
        path = folder / name
        if path.is_file():
            versions.append(int(json.loads(path.read_text())["version"]))
    return tuple(versions)


# --- 5. verification and rollback ---------------------------------------------------------


def read_metrics(
    deployment: Deployment, start: Mapping[int, int], end: Mapping[int, int] | None = None
) -> list[BatchMetrics]:
    """The metrics records in ``[start, end)`` (end: now), oldest first."""
    return [record for record, _ in read_timed_metrics(deployment, start, end)]


def read_timed_metrics(
    deployment: Deployment, start: Mapping[int, int], end: Mapping[int, int] | None = None
) -> list[tuple[BatchMetrics, float]]:
    """:func:`read_metrics` with each record's Kafka timestamp, in seconds.

    The gap between two records is the wall-clock time of the later batch
    (:class:`~keyplane.kafka.metrics_topic.PublishedMetrics`).
    """
    from keyplane.kafka.admin import high_watermarks
    from keyplane.kafka.metrics_topic import read_metrics as read_topic

    servers, topic = deployment.bootstrap_servers, deployment.metrics_topic
    stop = dict(end) if end is not None else high_watermarks(servers, topic, list(start))
    return [(r.metrics, r.published_s) for r in read_topic(servers, topic, start, stop)]


def _on_version(records: list[BatchMetrics], version: int) -> list[BatchMetrics]:
    """Batches that routed events (hops between stages) with every operator on ``version``."""
    return [
        r for r in records if r.hops > 0 and r.versions and set(r.versions.values()) == {version}
    ]


def new_version_batches(
    deployment: Deployment, dag_id: str, run_id: str, record_name: str = ROLLOUT
) -> int:
    """How many batches with rows ran on the new version since DONE.

    The version and where its batches start are read from ``record_name`` in
    ``dag_id``'s run (:func:`run_folder`).
    """
    rollout = _read(run_folder(deployment, dag_id, run_id) / record_name, "the rollout record")
    start = {int(p): int(o) for p, o in rollout["metrics_start"].items()}
    return len(_on_version(read_metrics(deployment, start), int(rollout["version"])))


def verify(
    deployment: Deployment,
    run_id: str,
    tolerances: planning.VerifyTolerances,
    *,
    batches: int,
) -> dict[str, Any]:
    """Measured locality, imbalance and lag growth on the new version vs the window before.

    Before: the snapshot window's batches on the parent version. After: the
    first ``batches`` batches with rows on the new version since DONE.
    """
    folder = _folder(deployment, run_id)
    existing = folder / VERIFICATION
    if existing.is_file():
        return _read(existing, "the verification")
    rollout = _read(folder / ROLLOUT, "the rollout record")
    proposal = _read(folder / PROPOSAL, "the proposal")
    manifest = _snapshot(deployment, run_id).manifest
    before_records = _on_version(
        read_metrics(deployment, manifest.metrics.start, manifest.metrics.end),
        int(proposal["parent_version"]),
    )
    start = {int(p): int(o) for p, o in rollout["metrics_start"].items()}
    after_records = _on_version(read_metrics(deployment, start), int(rollout["version"]))[:batches]
    if len(after_records) < batches:
        raise StepError(
            f"only {len(after_records)} of {batches} batches ran on v{rollout['version']} yet"
        )
    before = planning.measure(before_records)
    after = planning.measure(after_records)
    verdict = planning.verdict(before, after, tolerances)
    record = _write_once(
        existing,
        {
            "version": int(rollout["version"]),
            "before": asdict(before),
            "after": asdict(after),
            "regressed": verdict is not None,
            "reason": verdict or "no regression",
        },
    )
    log.info(
        "verified v%d over %d batches: %s; %s",
        record["version"],
        len(after_records),
        measured_summary(before, after),
        record["reason"],
    )
    return record


def measured_summary(before: planning.Measured, after: planning.Measured) -> str:
    """What verify measured, before → after, in one line."""

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    def lag(value: float | None) -> str:
        return "n/a" if value is None else f"{value:+.0f}/batch"

    return (
        f"locality {share(before.locality)} → {share(after.locality)}, imbalance "
        f"{ratio(before.imbalance)} → {ratio(after.imbalance)}, lag growth "
        f"{lag(before.lag_growth)} → {lag(after.lag_growth)}"
    )


def verification(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """The run's verification record (after :func:`verify`)."""
    return _read(_folder(deployment, run_id) / VERIFICATION, "the verification")


def prepare_rollback(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Store the parent's routing as a new version and PREPARE it.

    Versions only grow (:func:`keyplane.orchestration.planning.rollback_config`).
    The rollback configuration is the one that ran before, so it passed
    validation when it was published; it is recorded as validated with that
    reason rather than re-validated against statistics it was not planned on.

    Every call takes every step, each a no-op when done: the version is
    reserved first (:func:`_reserve`) and stored, its validation record
    written, then ``rollback.json``. A retry after a try that died anywhere
    in between stores no second version, and a rollback is never left
    without the validation record its PREPARE requires: the job would stay
    on the version that regressed, every retry failing the same way.
    """
    folder = _folder(deployment, run_id)
    verification = _read(folder / VERIFICATION, "the verification")
    proposal = _read(folder / PROPOSAL, "the proposal")
    path = folder / ROLLBACK
    replaces = int(verification["version"])
    restores = int(proposal["parent_version"])
    # A rollback.json without a reservation beside it is an older keyplane's: its version.
    recorded = _read(path, "the rollback")["version"] if path.is_file() else None
    reserved = _reserve(
        folder / ROLLBACK_ALLOCATION,
        deployment,
        replaces,
        version=None if recorded is None else int(recorded),
    )
    version = int(reserved["version"])
    previous = config_store.load(deployment.routing_store, restores)
    active = config_store.load(deployment.routing_store, replaces)
    saved = _store(deployment, planning.rollback_config(previous, active, version))
    _write_once(
        _validation_path(deployment, version),
        {
            "version": version,
            "checksum": saved.checksum,
            "success": True,
            "summary": f"rollback to the routing of v{previous.version}",
        },
    )
    record = _write_once(
        path,
        {
            "version": version,
            "restores": previous.version,
            "replaces": active.version,
            "reason": verification["reason"],
        },
    )
    _require_validated(deployment, version)
    with controller(deployment) as control:
        control.prepare(version)
    log.info(
        "rollback: PREPARE v%d sent, restoring the routing of v%d in place of v%d",
        version,
        previous.version,
        active.version,
    )
    return record
