"""The version timeline, hot keys and moved keys, from what the control plane stored.

Where each figure comes from (all written by others; read here, never written):

* version, parent, created_at, created_by: the configuration store
  (:func:`keyplane.routing.config.stored_versions` / :func:`keyplane.routing.config.load`);
* validation verdict: ``<store>/validation-v<version>.json``, written by the
  DAG's ``validate_configuration`` step (or by ``prepare_rollback`` for a
  rollback version, which is recorded as validated);
* backtest gain, cost and the decision: ``decision.json`` of the run that
  proposed the version (``<snapshots>/<run>/``), else the gain recomputed
  from its ``backtest.json`` with the DAG's rule;
* migration duration: the controller's state file (``controller.json``: the
  PREPARE and DONE timestamps of the rollout in flight and of the last one),
  else the job-side switch window measured from the metrics topic
  (:func:`keyplane.dashboard.metrics.switch_windows`);
* rollback: ``rollback.json`` of the run whose verification regressed;
* Data Docs: the per-run pages Great Expectations built under the GX project
  (``<gx_root>/gx/uncommitted/data_docs/local_site/``), found by the run names
  the DAG gives its validations.

Each reader tolerates missing or broken files: a record that cannot be read,
or a field of the wrong type in it, shows as unknown and adds a problem line
(:mod:`keyplane.dashboard.records`) rather than failing the page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.controller_protocol import ControllerState, Reconfiguration
from keyplane.dashboard.metrics import SwitchWindow, switch_windows
from keyplane.dashboard.records import (
    DecisionRecord,
    ProposalRecord,
    RollbackRecord,
    ValidationRecord,
    check,
    read_json,
    read_record,
)
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig

TOP_KEYS = 15
"""Hot keys and moved keys listed per operator: enough to recognise a change."""

Status = Literal[
    "active",
    "in flight",
    "superseded",
    "aborted",
    "rolled back",
    "refused",
    "not published",
    "stored",
]
"""Where a version stands. ``superseded``: an ancestor of the active version, so it
ran before; ``stored``: nothing says it ever ran or was refused."""


@dataclass(frozen=True)
class DashboardPaths:
    """Where the control plane keeps what the dashboard reads.

    The same layout as :class:`keyplane.orchestration.deployment.Deployment`,
    so the page reads exactly what the DAG and ``keyplane config publish``
    wrote.
    """

    routing_store: Path
    snapshots: Path
    controller_state: Path
    gx_root: Path
    scale_runs: Path | None = None
    """The scale DAG's run folders (``$KEYPLANE_HOME/scale``); None: none are read."""

    @property
    def data_docs(self) -> Path:
        """The Data Docs site of :func:`keyplane.orchestration.quality.quality_context`."""
        return self.gx_root / "gx" / "uncommitted" / "data_docs" / "local_site"

    @classmethod
    def from_environment(cls) -> DashboardPaths:
        from keyplane.orchestration.deployment import Deployment

        deployment = Deployment.from_environment()
        return cls(
            routing_store=deployment.routing_store,
            snapshots=deployment.snapshots,
            controller_state=deployment.controller_state,
            gx_root=deployment.gx_root,
            scale_runs=deployment.home / "scale",
        )


@dataclass(frozen=True)
class DocLink:
    """One Data Docs page, by its path relative to the Data Docs site."""

    label: str
    path: str


@dataclass(frozen=True)
class Migration:
    """How long a rollout took, and which record says so."""

    seconds: float | None
    detail: str
    source: Literal["controller", "metrics"]


@dataclass(frozen=True)
class VersionRow:
    """One stored configuration version on the timeline."""

    version: int
    parent_version: int | None
    created_at: datetime | None
    created_by: str
    status: Status
    validation: Literal["passed", "failed", "not validated"] | None
    """None: the validation record holds no readable verdict."""
    validation_summary: str | None
    gain: float | None
    cost: float | None
    decision: str | None
    migration: Migration | None
    rollback: str | None
    run_id: str | None
    data_docs: tuple[DocLink, ...]
    problem: str | None = None
    dag_id: str | None = None
    """The DAG whose run stored the version (for the link to the run in Airflow)."""
    predicted_locality: float | None = None
    """The locality the run predicted for the version: the backtest's on the hold-out,
    or the scale plan's."""


@dataclass(frozen=True)
class RunRecords:
    """The JSON records one DAG run left in its snapshot folder (absent ones are None).

    ``problems`` name the records, and the fields in them, that could not be read.
    """

    run_id: str
    proposal: ProposalRecord | None
    backtest: Mapping[str, Any] | None
    decision: DecisionRecord | None
    rollout: Mapping[str, Any] | None
    verification: Mapping[str, Any] | None
    rollback: RollbackRecord | None
    problems: tuple[str, ...] = ()
    dag_id: str = "keyplane_reconfigure"
    predicted_locality: float | None = None


@dataclass(frozen=True)
class HotKeyRow:
    operator: str
    key: str
    split: int
    instances: tuple[int, ...]
    weight: float | None


@dataclass(frozen=True)
class MovedKeyRow:
    operator: str
    key: str
    old: tuple[int, ...]
    new: tuple[int, ...]
    kind: str
    weight: float | None


@dataclass(frozen=True)
class Dashboard:
    """Everything the page shows except the plots (which come from the metrics read)."""

    rows: tuple[VersionRow, ...]
    active_version: int | None
    hot_keys: tuple[HotKeyRow, ...]
    moved_keys: tuple[MovedKeyRow, ...] | None
    """None: the keys moved by the last migration could not be computed (see ``problems``)."""
    moved_from: int | None
    moved_to: int | None
    problems: tuple[str, ...]
    hidden: int = 0
    """Versions left out of ``rows``: planned by a run that did not publish them."""
    configs: Mapping[int, RoutingConfig | str] = field(default_factory=dict)
    """Every stored version, or why it could not be read."""
    validations: Mapping[int, ValidationRecord] = field(default_factory=dict)
    controller: ControllerState | None = None
    weights: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Each stage's key weights in the newest readable snapshot."""


def _json(path: Path) -> dict[str, Any] | None:
    return read_json(path)[0]


def read_runs(snapshots: Path) -> list[RunRecords]:
    """The records of every run folder under ``snapshots``, oldest folder name first."""
    from keyplane.orchestration import run_records

    if not snapshots.is_dir():
        return []
    runs = []
    for folder in sorted(p for p in snapshots.iterdir() if p.is_dir()):
        proposal = read_record(ProposalRecord, folder / run_records.PROPOSAL)
        decision = read_record(DecisionRecord, folder / run_records.DECISION)
        rollback = read_record(RollbackRecord, folder / run_records.ROLLBACK)
        backtest, backtest_problem = read_json(folder / run_records.BACKTEST)
        problems = proposal.problems + decision.problems + rollback.problems
        runs.append(
            RunRecords(
                run_id=folder.name,
                proposal=proposal.record,
                backtest=backtest,
                decision=decision.record,
                rollout=_json(folder / run_records.ROLLOUT),
                verification=_json(folder / run_records.VERIFICATION),
                rollback=rollback.record,
                problems=problems + (() if backtest_problem is None else (backtest_problem,)),
            )
        )
    return runs


def read_scale_runs(folder: Path | None) -> list[RunRecords]:
    """The scale DAG's runs that stored a version, as :class:`RunRecords`.

    The decision's reason, with the locality the scaled version is predicted
    to keep (a scale-in folds keys onto fewer instances), stands as the
    version's decision; the run id is the one the run recorded (the folder's
    name is a cleaned copy of it).
    """
    from keyplane.orchestration import run_records, scale_steps

    if folder is None or not folder.is_dir():
        return []
    runs = []
    for run in sorted(p for p in folder.iterdir() if p.is_dir()):
        raw, _ = read_json(run / scale_steps.PROPOSAL)
        if raw is None:
            continue
        proposal = check(ProposalRecord, raw, run / scale_steps.PROPOSAL)
        decision = read_record(DecisionRecord, run / scale_steps.DECISION)
        reason = decision.record.reason if decision.record is not None else None
        before, after = raw.get("locality_before"), raw.get("locality_after")
        if isinstance(before, float | int) and isinstance(after, float | int):
            reason = f"{reason or 'scaled'}; predicted locality {before:.1%} → {after:.1%}"
        scaled = DecisionRecord(
            publish=None if decision.record is None else decision.record.publish,
            reason=reason,
        )
        run_id = raw.get("run_id")
        runs.append(
            RunRecords(
                run_id=run_id if isinstance(run_id, str) else run.name,
                proposal=proposal.record,
                backtest=None,
                decision=scaled,
                rollout=_json(run / run_records.ROLLOUT),
                verification=_json(run / run_records.VERIFICATION),
                rollback=None,
                problems=proposal.problems + decision.problems,
                dag_id=run_records.SCALE_DAG_ID,
                predicted_locality=float(after) if isinstance(after, float | int) else None,
            )
        )
    return runs


def read_controller(state_file: Path) -> ControllerState | None:
    """The controller's protocol state, or None when no rollout ever started or it is unreadable."""
    record = _json(state_file)
    if record is None or "protocol" not in record:
        return None
    try:
        return ControllerState.model_validate(record["protocol"])
    except ValidationError:
        return None


def backtest_gain(record: Mapping[str, Any]) -> float | None:
    """``(L_new − L_cur) + (I_cur − I_new)`` of a backtest record (the DAG's decision rule)."""
    try:
        new, current = record["new"], record["current"]
        worst_new = max(new["imbalance"].values(), default=1.0)
        worst_cur = max(current["imbalance"].values(), default=1.0)
        return float(new["locality"] - current["locality"] + worst_cur - worst_new)
    except (KeyError, TypeError, AttributeError):
        return None


def rollout_migration(rollout: Reconfiguration) -> Migration:
    """PREPARE sent → DONE sent of one rollout, with each operator's PROPAGATE → MIGRATED."""
    per_operator = ", ".join(
        f"{op} {(rollout.migrated[op].sent_at - sent.sent_at).total_seconds():.1f} s"
        for op, sent in rollout.propagated.items()
        if op in rollout.migrated
    )
    suffix = f" ({per_operator})" if per_operator else ""
    if rollout.finish is None:
        return Migration(None, "in flight" + suffix, "controller")
    if rollout.finish.type == "ABORT":
        return Migration(None, "aborted", "controller")
    seconds = (rollout.finish.sent_at - rollout.prepare.sent_at).total_seconds()
    return Migration(seconds, f"{seconds:.1f} s{suffix}", "controller")


def _window_migration(window: SwitchWindow) -> Migration:
    return Migration(
        window.seconds,
        f"≈{window.seconds:.1f} s over {window.batches} batches "
        f"({window.first_batch}–{window.last_batch})",
        "metrics",
    )


def data_docs_pages(site: Path, run_name: str) -> tuple[DocLink, ...]:
    """The Data Docs pages of the validations GX ran under ``run_name``, one per suite.

    GX lays its pages out as ``validations/<suite>/<run name>/<run time>/<batch>.html``.
    """
    found = []
    for page in sorted(site.glob(f"validations/*/{run_name}/*/*.html")):
        suite = page.relative_to(site).parts[1]
        found.append(DocLink(suite, page.relative_to(site).as_posix()))
    return tuple(found)


def _status(
    version: int,
    active: int | None,
    controller: ControllerState | None,
    validation: ValidationRecord | None,
    decision: DecisionRecord | None,
    replaced_by_rollback: bool,
    ancestors: frozenset[int],
) -> Status:
    current = controller.current if controller is not None else None
    if current is not None and current.version == version:
        return "in flight"
    if version == active:
        return "active"
    if replaced_by_rollback:
        return "rolled back"
    last = controller.last if controller is not None else None
    finish = last.finish if last is not None and last.version == version else None
    if finish is not None and finish.type == "ABORT":
        return "aborted"
    # An unreadable verdict or decision (None) says neither yes nor no.
    if validation is not None and validation.success is False:
        return "refused"
    if decision is not None and decision.publish is False:
        return "not published"
    return "superseded" if version in ancestors else "stored"


def _ancestors(configs: Mapping[int, RoutingConfig | str], version: int | None) -> frozenset[int]:
    """The versions ``version`` descends from, through the stored parents."""
    found: set[int] = set()
    current = configs.get(version) if version is not None else None
    while isinstance(current, RoutingConfig) and current.parent_version is not None:
        if current.parent_version in found:
            break
        found.add(current.parent_version)
        current = configs.get(current.parent_version)
    return frozenset(found)


def active_version(
    controller: ControllerState | None, records: Sequence[BatchMetrics], stored: Sequence[int]
) -> int | None:
    """The version the job runs: the controller's, else the newest batch's, else the newest stored.

    The same order of trust as the DAG's ``active_version`` step.
    """
    if controller is not None:
        return controller.active_version
    for record in sorted(records, key=lambda r: r.batch_id, reverse=True):
        versions = set(record.versions.values())
        if len(versions) == 1:
            return versions.pop()
    return stored[-1] if stored else None


def build_rows(
    configs: Mapping[int, RoutingConfig | str],
    validations: Mapping[int, ValidationRecord],
    runs: Sequence[RunRecords],
    controller: ControllerState | None,
    records: Sequence[BatchMetrics],
    data_docs_site: Path | None = None,
) -> list[VersionRow]:
    """The timeline rows, newest version first.

    ``configs`` maps each stored version to its configuration, or to the
    reason it could not be loaded. Pure except for globbing the Data Docs
    site when one is given.
    """
    by_version: dict[int, RunRecords] = {}
    # A run in waves stores versions before its proposal's; they belong to its run but
    # carry no decision of their own (the run decided on the whole change).
    wave_of: dict[int, RunRecords] = {}
    rollbacks: dict[int, RollbackRecord] = {}
    for records_of_run in runs:
        proposal, rolled = records_of_run.proposal, records_of_run.rollback
        if proposal is not None and proposal.version is not None:
            by_version[proposal.version] = records_of_run
            for wave in proposal.waves:
                wave_of[wave] = records_of_run
        if rolled is not None and rolled.version is not None:
            by_version.setdefault(rolled.version, records_of_run)
            rollbacks[rolled.version] = rolled
    replaced = {
        record.replaces: (version, record.reason or "")
        for version, record in rollbacks.items()
        if record.replaces is not None
    }
    windows = switch_windows(records)
    rollouts: dict[int, Reconfiguration] = {}
    if controller is not None:
        rollouts = {r.version: r for r in (controller.last, controller.current) if r is not None}
    active = active_version(controller, records, sorted(configs))
    ancestors = _ancestors(configs, active)
    rows = []
    for version in sorted(configs, reverse=True):
        loaded = configs[version]
        run = by_version.get(version)
        validation = validations.get(version)
        is_rollback = version in rollbacks
        decision = run.decision if run is not None and not is_rollback else None
        backtest = run.backtest if run is not None and not is_rollback else None
        gain = decision.gain if decision is not None else None
        if gain is None and backtest is not None:
            gain = backtest_gain(backtest)
        migration = None
        if version in rollouts:
            migration = rollout_migration(rollouts[version])
        elif version in windows and isinstance(loaded, RoutingConfig) and loaded.parent_version:
            migration = _window_migration(windows[version])
        rollback = None
        if version in replaced:
            by, reason = replaced[version]
            rollback = f"rolled back by v{by}: {reason}"
        elif is_rollback:
            record = rollbacks[version]
            restores = "—" if record.restores is None else f"v{record.restores}"
            rollback = f"restores {restores}: {record.reason or ''}"
        docs: tuple[DocLink, ...] = ()
        if data_docs_site is not None:
            docs = data_docs_pages(data_docs_site, f"configuration-v{version}")
            if run is not None and not is_rollback:
                from keyplane.algorithms.statistics import safe_run_id

                docs += data_docs_pages(data_docs_site, f"statistics-{safe_run_id(run.run_id)}")
        config = loaded if isinstance(loaded, RoutingConfig) else None
        verdict: Literal["passed", "failed", "not validated"] | None = "not validated"
        if validation is not None and validation.success is not None:
            verdict = "passed" if validation.success else "failed"
        elif validation is not None:
            verdict = None
        predicted = None
        if run is not None and not is_rollback:
            predicted = run.predicted_locality
            if predicted is None and backtest is not None:
                predicted = _predicted_locality(backtest)
        rows.append(
            VersionRow(
                version=version,
                parent_version=None if config is None else config.parent_version,
                created_at=None if config is None else config.created_at,
                created_by="?" if config is None else config.created_by,
                status=_status(
                    version,
                    active,
                    controller,
                    validation,
                    decision,
                    version in replaced,
                    ancestors,
                ),
                validation=verdict,
                validation_summary=None if validation is None else validation.summary,
                gain=gain,
                cost=None if decision is None else decision.cost,
                decision=None if decision is None else decision.reason,
                migration=migration,
                rollback=rollback,
                run_id=run.run_id if run is not None else _run_id(wave_of.get(version)),
                data_docs=docs,
                problem=loaded if isinstance(loaded, str) else None,
                dag_id=_dag_id(run or wave_of.get(version)),
                predicted_locality=predicted,
            )
        )
    return rows


def _predicted_locality(backtest: Mapping[str, Any]) -> float | None:
    try:
        value = backtest["new"]["locality"]
    except (KeyError, TypeError):
        return None
    return float(value) if isinstance(value, float | int) and not isinstance(value, bool) else None


def _dag_id(run: RunRecords | None) -> str | None:
    return None if run is None else run.dag_id


def _run_id(run: RunRecords | None) -> str | None:
    return None if run is None else run.run_id


_WEIGHT_COLUMNS = ("stage", "key", "count")


def key_weights(
    snapshots: Path, runs: Sequence[RunRecords]
) -> tuple[dict[str, dict[str, float]], tuple[str, ...]]:
    """Each stage's key weights (``count``) in the newest readable snapshot; empty if none.

    Configurations store no frequencies, so the snapshot the newest plan was
    computed from is the best record of how heavy a hot or moved key is. A
    newer snapshot that cannot be read, lacks a column or counts in anything
    but numbers is skipped for an older one, and named in the problems returned.
    """
    from pandas.api.types import is_numeric_dtype

    from keyplane.algorithms.statistics import FREQUENCIES
    from keyplane.util.parquet_files import read_frame

    problems: list[str] = []
    for run in reversed(runs):
        path = snapshots / run.run_id / FREQUENCIES
        if not path.is_file():
            continue
        try:
            # Parquet reads skip requested columns the file lacks, so they are checked below.
            frame = read_frame(path, columns=_WEIGHT_COLUMNS)
        except (OSError, ValueError) as error:
            problems.append(f"{path}: unreadable, key weights from an older snapshot: {error}")
            continue
        missing = [column for column in _WEIGHT_COLUMNS if column not in frame.columns]
        if missing or not is_numeric_dtype(frame["count"]):
            what = f"no column {', '.join(missing)}" if missing else "column count is not numeric"
            problems.append(f"{path}: {what}, key weights from an older snapshot")
            continue
        weights: dict[str, dict[str, float]] = {}
        sums = frame.groupby(["stage", "key"])["count"].sum()
        for stage, key, count in zip(
            sums.index.get_level_values(0), sums.index.get_level_values(1), sums, strict=True
        ):
            weights.setdefault(str(stage), {})[str(key)] = float(count)
        return weights, tuple(problems)
    return {}, tuple(problems)


def hot_key_rows(
    config: RoutingConfig, weights: Mapping[str, Mapping[str, float]], top: int = TOP_KEYS
) -> list[HotKeyRow]:
    """Each operator's hot keys, heaviest first (widest split first when no weight is known)."""
    rows: list[HotKeyRow] = []
    for name, routing in config.operators.items():
        known = weights.get(name, {})
        ranked = sorted(
            routing.hot_keys.items(),
            key=lambda item: (-known.get(item[0], -1.0), -len(item[1]), item[0]),
        )
        rows.extend(
            HotKeyRow(name, key, len(instances), tuple(instances), known.get(key))
            for key, instances in ranked[:top]
        )
    return rows


def moved_key_rows(
    old: RoutingConfig,
    new: RoutingConfig,
    weights: Mapping[str, Mapping[str, float]],
    top: int = TOP_KEYS,
) -> list[MovedKeyRow]:
    """The keys a rollout from ``old`` to ``new`` moves, heaviest state first, per operator.

    The plan is :func:`keyplane.routing.migration.plan_migration` with Spark's hash
    fallback, the one the rollout itself runs.
    """
    from keyplane.routing.migration import plan_migration
    from keyplane.routing.routedkeys import spark_partition

    plan = plan_migration(old, new, spark_partition)
    rows: list[MovedKeyRow] = []
    for migration in plan.operators:
        known = weights.get(migration.operator, {})
        ranked = sorted(migration.moves, key=lambda move: (-known.get(move.key, -1.0), move.key))
        rows.extend(
            MovedKeyRow(migration.operator, m.key, m.old, m.new, m.kind, known.get(m.key))
            for m in ranked[:top]
        )
    return rows


def last_migration(
    controller: ControllerState | None, configs: Mapping[int, RoutingConfig | str]
) -> tuple[int, int] | None:
    """(from, to) of the last rollout: the controller's, else the newest version and its parent."""
    if controller is not None:
        rollout = controller.current or controller.last
        if rollout is not None:
            return rollout.base, rollout.version
    for version in sorted(configs, reverse=True):
        loaded = configs[version]
        if isinstance(loaded, RoutingConfig) and loaded.parent_version is not None:
            return loaded.parent_version, version
    return None


def load_configs(store: Path) -> dict[int, RoutingConfig | str]:
    """Every stored version, loaded and verified, or the reason it could not be."""
    configs: dict[int, RoutingConfig | str] = {}
    for version in config_store.stored_versions(store):
        try:
            configs[version] = config_store.load(store, version)
        except (config_store.ConfigStoreError, OSError, ValueError) as error:
            configs[version] = f"unreadable: {error}"
    return configs


def load_validations(store: Path) -> tuple[dict[int, ValidationRecord], tuple[str, ...]]:
    """The validation records next to the store, by version, and what could not be read."""
    found: dict[int, ValidationRecord] = {}
    problems: list[str] = []
    if not store.is_dir():
        return found, ()
    for path in sorted(store.glob("validation-v*.json")):
        raw, problem = read_json(path)
        if raw is None:
            problems.extend(() if problem is None else (problem,))
            continue
        checked = check(ValidationRecord, raw, path)
        problems.extend(checked.problems)
        record = checked.record
        if record is not None and record.version is not None:
            found[record.version] = record
        elif "version" not in raw:
            problems.append(f"{path}: field 'version' is missing")
    return found, tuple(problems)


def load_dashboard(paths: DashboardPaths, records: Sequence[BatchMetrics]) -> Dashboard:
    """Read every stored record and build the page's tables.

    ``records`` are the metrics already read (possibly none): they give the
    active version before any rollout and the job-side switch windows.
    """
    problems: list[str] = []
    configs = load_configs(paths.routing_store)
    if not configs:
        problems.append(f"no configuration stored in {paths.routing_store}")
    runs = read_runs(paths.snapshots) + read_scale_runs(paths.scale_runs)
    for run in runs:
        problems.extend(run.problems)
    validations, validation_problems = load_validations(paths.routing_store)
    problems.extend(validation_problems)
    controller = read_controller(paths.controller_state)
    if controller is None and paths.controller_state.exists():
        problems.append(f"{paths.controller_state} could not be read")
    rows = build_rows(
        configs,
        validations,
        runs,
        controller,
        records,
        paths.data_docs if paths.data_docs.is_dir() else None,
    )
    active = active_version(controller, records, sorted(configs))
    weights, weight_problems = key_weights(paths.snapshots, runs)
    problems.extend(weight_problems)
    hot: list[HotKeyRow] = []
    current = configs.get(active) if active is not None else None
    if isinstance(current, RoutingConfig):
        hot = hot_key_rows(current, weights)
    moved: tuple[MovedKeyRow, ...] | None = ()
    pair = last_migration(controller, configs)
    if pair is not None:
        old, new = configs.get(pair[0]), configs.get(pair[1])
        if isinstance(old, RoutingConfig) and isinstance(new, RoutingConfig):
            # Ranked by the snapshot the new version was planned from, which never
            # changes, so the table keeps its order as newer snapshots arrive.
            proposing = [
                r for r in runs if r.proposal is not None and r.proposal.version == pair[1]
            ]
            moved_weights = key_weights(paths.snapshots, proposing)[0] if proposing else weights
            try:
                moved = tuple(moved_key_rows(old, new, moved_weights))
            except ValueError as error:
                moved = None
                problems.append(f"moved keys of v{pair[0]} → v{pair[1]}: {error}")
        else:
            # Without both sides the moves are unknown, which is not "no key moved".
            moved = None
            unread = [
                f"v{version} {'is not stored' if loaded is None else 'could not be read'}"
                for version, loaded in zip(pair, (old, new), strict=True)
                if not isinstance(loaded, RoutingConfig)
            ]
            problems.append(f"moved keys of v{pair[0]} → v{pair[1]} unknown: {', '.join(unread)}")
    unpublished = config_store.not_published(paths.routing_store)
    shown = [r for r in rows if r.version not in unpublished or r.version == active]
    return Dashboard(
        rows=tuple(shown),
        hidden=len(rows) - len(shown),
        active_version=active,
        hot_keys=tuple(hot),
        moved_keys=moved,
        moved_from=None if pair is None else pair[0],
        moved_to=None if pair is None else pair[1],
        problems=tuple(problems),
        configs=configs,
        validations=validations,
        controller=controller,
        weights=weights,
    )
