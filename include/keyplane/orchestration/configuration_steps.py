"""Step 2 of the reconfiguration DAG: plan a configuration from the run's statistics and
validate it (paper 000 §3.4).

The plan's Params are checked against the running job first
(:func:`check_plan_params`); the configuration and its waves are stored under
versions the run reserved (:func:`~keyplane.orchestration.run_records.reserve_versions`),
and the validation verdict of a version is recorded once, so that the publish
gate (:func:`~keyplane.orchestration.rollout_steps.publish`) can read it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keyplane.algorithms import statistics as stats
from keyplane.orchestration import decision_steps, planning, run_records
from keyplane.orchestration.deployment import Deployment
from keyplane.orchestration.run_records import ALLOCATION, PROPOSAL, Proposal, Refused, StepError
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig

log = logging.getLogger(__name__)


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

    METIS routing tables (000 §3.3, :func:`keyplane.algorithms.locality.build_plan`) and FISH hot
    keys (001 §4.1.2). With ``params.max_moves_per_wave``, the change is stored as waves that each
    move at most that many keys, the last routing as the plan
    (:func:`keyplane.routing.waves.split_into_waves`), so the rollout spreads its moved states over
    more micro-batches; a change that needs more than ``max_waves`` waves (a DAG run's limit, None:
    none) fails before anything is stored. Retried, it returns the versions it stored the first time
    instead of storing more, also after a try that died while storing them: the versions and the
    parent are reserved first (:func:`~keyplane.orchestration.run_records.reserve_versions`), and
    the plan, a function of the snapshot, the Params and the parent (METIS runs seeded), comes out
    the same.

    The candidate and its promise are :func:`keyplane.algorithms.plan_choice.choose`'s, the promise
    calibrated on how the promises of earlier rollouts held
    (:func:`~keyplane.orchestration.run_records.promise_ratios`, recorded by their verification).
    """
    from keyplane.algorithms.plan_choice import MAX_PROMISE_RATIOS

    folder = run_records.reconfigure_folder(deployment, run_id)
    existing = folder / PROPOSAL
    if existing.is_file():
        proposal = Proposal.model_validate_json(existing.read_text())
        config_store.load(deployment.routing_store, proposal.version, proposal.checksum)
        return proposal.model_dump(mode="json")
    snapshot = run_records.snapshot(deployment, run_id)
    reserved = run_records.reserve_versions(
        folder / ALLOCATION, deployment, active_version(deployment, snapshot.manifest)
    )
    parent = int(reserved["parent_version"])
    current = config_store.load(deployment.routing_store, parent)
    ratios = run_records.promise_ratios(deployment, MAX_PROMISE_RATIOS)
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
        promise_ratios=ratios,
    )
    promised = plan.promised_imbalance if math.isfinite(plan.promised_imbalance) else None
    log.info(
        "chose the %s configuration (throughputs %s); %s (target α %.3f)",
        plan.candidate,
        plan.throughputs,
        "it makes no next-window promise"
        if promised is None
        else f"it promises next-window imbalance ≤ {promised:.3f} under the prior drift: "
        "none could be measured (the snapshot has no hold-out)"
        if plan.model_promise <= 1.0
        else f"it promises next-window imbalance ≤ {promised:.3f} (drift model "
        f"{plan.model_promise:.3f}, calibrated on {len(plan.promise_ratios)} earlier rollout(s))",
        params.alpha,
    )
    stored = [
        run_records.store_version(deployment, config)
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
        candidate=plan.candidate,
        promised_imbalance=promised,
        model_promise=plan.model_promise,
    )
    record = run_records.write_once(existing, proposal.model_dump(mode="json"))
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


def validate_configuration(
    deployment: Deployment,
    run_id: str,
    *,
    version: int | None = None,
    locality_tolerance: float = 0.02,
) -> dict[str, Any]:
    """Run the configuration suites on a stored version; raise with the summary if it fails.

    The verdict is recorded next to the store (``validation-v<version>.json``), which
    :func:`~keyplane.orchestration.rollout_steps.publish` requires. The snapshot's training weights
    are the key loads the suites route through the configuration
    (:func:`keyplane.orchestration.quality.predicted_instance_loads`), so a configuration that
    overloads an instance fails whatever its plan claimed. Only the operators the version changes
    are judged (:func:`changed_operators`), each over its active instances. ``version`` defaults to
    the run's proposal. When the proposal passes and rolls out in waves, each wave before it is
    recorded as validated with that reason: a wave routes every key either as the active version or
    as the proposal does, and it is a step on the way to a configuration that passed, not a plan of
    its own (as a rollback is recorded,
    :func:`~keyplane.orchestration.verification_steps.prepare_rollback`).
    """
    from keyplane.orchestration.quality import OperatorPrediction, QualitySettings, locked_context
    from keyplane.orchestration.quality import validate_configuration as run_suites

    proposal, proposed = run_records.read_proposal(deployment, run_id)
    if version is not None and version != proposal.version:
        config = config_store.load(deployment.routing_store, version)
    else:
        config = proposed
    snapshot = run_records.snapshot(deployment, run_id)
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
        decision_steps.not_published(
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
    """Record a version's verdict next to the store, once;
    :func:`~keyplane.orchestration.rollout_steps.publish` requires it."""
    return run_records.write_once(
        run_records.validation_path(deployment, version),
        {
            "version": version,
            "checksum": config_store.checksum(deployment.routing_store, version),
            "success": success,
            "summary": summary,
            "data_docs": str(data_docs),
        },
    )


def _first_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())
