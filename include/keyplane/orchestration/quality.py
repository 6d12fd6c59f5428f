"""Great Expectations gates for statistics snapshots and routing configurations.

Why a gate. A routing configuration is published to a running query and
migrates live state (paper 000 §3.4). A bad one costs a full migration to
install and another to roll back, so it is checked before it is published:
the statistics it was computed from must be trustworthy, and the configuration
must keep the promises the planner makes. The checks are Great Expectations
suites, so every run leaves a validation result and a Data Docs page that
show what was checked and why a configuration was refused.

Three suites, each over one pandas frame (GX validates one suite against one
batch, and the frames have different columns):

* ``keyplane_statistics``: one row per (stage, key, epoch) of a statistics
  snapshot. No null fields, counts ≥ 0, stage one of the pipeline's stages,
  one row per (stage, key, epoch), enough keys and tuples, and the snapshot's offset windows
  cover the range it claims to describe.
* ``keyplane_configuration_keys``: one row per routed key per operator
  (a table key is one row; a hot key split over d instances is d rows). Every
  routed key goes to an existing instance, and a hot key's d lies in
  [d_min, n] (paper 001 §4; n is the operator's parallelism).
* ``keyplane_configuration_operators``: one row per operator. The predicted
  imbalance is within α (paper 000 §3.3), the predicted locality is not
  below the current configuration's by more than a tolerance, the routing
  table fits its size budget, and an independent recomputation of every
  instance's predicted load from the statistics keeps max/mean within α.

The last check does not trust the planner's own imbalance figure: it routes
the statistics' per-key loads through the configuration as published, exactly
as the job will (:func:`keyplane.routing.routedkeys.predicted_instance_loads`), so a
configuration mistranslated or tampered with after planning fails even when
the plan's prediction looks fine; a route outside ``[0, P)`` carries no load
there, and the keys suite reports it.

Thresholds that change between runs are suite parameters supplied at run
time, so the stored suites never change. Great Expectations is imported
lazily: importing it takes seconds, and Airflow parses DAG files that import
this module under a timeout. The file data context is not safe for
concurrent writers, and both DAGs validate under one ``gx_root``, so
:func:`locked_context` holds an exclusive lock (:func:`gx_lock`) from
building the context until its checkpoints have run.
"""

from __future__ import annotations

import fcntl
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import numpy as np
import numpy.typing as npt
import pandas as pd

from keyplane.algorithms.hotkeys import FishSettings
from keyplane.control.operators import stage_names
from keyplane.routing.config import RoutingConfig
from keyplane.routing.routedkeys import predicted_instance_loads
from keyplane.settings import Settings

if TYPE_CHECKING:
    from great_expectations.checkpoint.checkpoint import CheckpointResult
    from great_expectations.core.expectation_suite import ExpectationSuite
    from great_expectations.core.expectation_validation_result import (
        ExpectationValidationResult,
    )
    from great_expectations.data_context import FileDataContext
    from great_expectations.expectations.expectation import Expectation

STATISTICS_SUITE = "keyplane_statistics"
CONFIGURATION_KEYS_SUITE = "keyplane_configuration_keys"
CONFIGURATION_OPERATORS_SUITE = "keyplane_configuration_operators"
CONFIGURATION_SUITES = (CONFIGURATION_KEYS_SUITE, CONFIGURATION_OPERATORS_SUITE)

LOCK_NAME = ".lock"
"""The file under ``gx_root`` whose lock a validation holds (:func:`gx_lock`)."""
DATASOURCE_NAME = "keyplane"
BATCH_DEFINITION_NAME = "whole_frame"
DATA_DOCS_SITE = "local_site"
INDEX_RUNS = 200
"""Validation runs the Data Docs index lists, newest first (every run keeps its own page)."""

STATISTICS_COLUMNS = ("stage", "key", "count", "epoch", "window_start", "window_end")
KEYS_COLUMNS = ("operator", "key", "kind", "instance", "d", "parallelism")
SUMMARY_COLUMNS = (
    "operator",
    "parallelism",
    "alpha",
    "predicted_imbalance",
    "predicted_locality",
    "current_locality",
    "locality_change",
    "table_size",
    "table_budget",
    "hot_keys",
    "load_max_over_mean",
)

KINDS = ("table", "hot")

_INDEX_COLUMNS: dict[str, list[str]] = {
    STATISTICS_SUITE: ["stage", "key"],
    CONFIGURATION_KEYS_SUITE: ["operator", "key"],
    CONFIGURATION_OPERATORS_SUITE: ["operator"],
}
_SHOWN_ROWS = 5
_HIDDEN_KWARGS = frozenset({"batch_id", "result_format", "catch_exceptions", "row_condition"})

FloatArray = npt.NDArray[np.float64]


class ValidationFailed(Exception):
    """A snapshot or configuration failed its suite; the message says which checks.

    Airflow tasks raise it so that the task fails with the readable summary in
    its log, and the configuration is not published.
    """

    def __init__(self, result: QualityResult) -> None:
        super().__init__(result.summary)
        self.result = result


@dataclass(frozen=True)
class QualityResult:
    """The outcome of one validation run.

    ``summary`` has one line per failed expectation (suite, what the check
    guards, expectation type and arguments, and the offending rows or the
    observed value) and one line for each suite that passed.
    ``data_docs_path`` is the Data Docs index, rebuilt by the run.
    """

    success: bool
    summary: str
    data_docs_path: Path

    def raise_if_failed(self) -> None:
        """Raise :class:`ValidationFailed` unless every expectation passed."""
        if not self.success:
            raise ValidationFailed(self)


@dataclass(frozen=True)
class QualitySettings:
    """Thresholds of the suites, validated at construction.

    Attributes:
        min_keys: fewest rows (stage, key, epoch) a snapshot may have. Default
            1: an empty snapshot can never be planned from.
        min_total_count: fewest tuples the snapshot's counts may add up to.
            Default 10 000: an instance's load counted from m tuples is off by
            about 1/√m, and keeping that under α − 1 = 3 % takes about 1 100
            tuples per instance, i.e. 10 000 for up to 9 instances. Raise it
            with the parallelism.
        locality_tolerance: how far (as a share of pair weight) a new
            configuration's predicted locality may fall below the current
            configuration's on the same statistics. Default 0.02: METIS is a
            heuristic and the per-stage balance repair trades locality for
            balance (000 §3.3), so a re-plan may land a point or two below a
            configuration already tuned to similar data; a larger drop is a
            regression.
        d_min: fewest instances a hot key may be split over (001 §4, Algorithm
            2). Default: :class:`~keyplane.algorithms.hotkeys.FishSettings`' ``d_min``.
    """

    min_keys: int = 1
    min_total_count: int = 10_000
    locality_tolerance: float = 0.02
    d_min: int = field(default_factory=lambda: FishSettings().d_min)

    def __post_init__(self) -> None:
        if self.min_keys < 0:
            raise ValueError(f"min_keys must be ≥ 0, got {self.min_keys}")
        if self.min_total_count < 0:
            raise ValueError(f"min_total_count must be ≥ 0, got {self.min_total_count}")
        if not (math.isfinite(self.locality_tolerance) and 0.0 <= self.locality_tolerance <= 1.0):
            raise ValueError(
                f"locality_tolerance must lie in [0, 1], got {self.locality_tolerance}"
            )
        if self.d_min < 1:
            raise ValueError(f"d_min must be ≥ 1, got {self.d_min}")


@dataclass(frozen=True)
class OperatorPrediction:
    """What the planner predicts for one operator, and the figures to check it against.

    Attributes:
        predicted_imbalance: the plan's max/mean instance load for this
            operator's stage (``ChainPlan.predicted_imbalance`` of the stage).
        predicted_locality: the plan's share of pair weight kept on one
            instance (``LocalityPlan.predicted_locality``; the same for both
            operators of a pair).
        current_locality: the locality of the configuration in force, measured
            on the same statistics (``keyplane.algorithms.locality_plan.evaluate``).
        alpha: the imbalance bound α the plan was built for (000 §3.3).
        table_budget: most table entries allowed, ``None`` for no bound.
        key_loads: each key's load in the statistics (e.g.
            :func:`stage_key_loads`), used to recompute per-instance loads.
    """

    predicted_imbalance: float
    predicted_locality: float
    current_locality: float
    alpha: float = 1.03
    table_budget: int | None = None
    key_loads: Mapping[str, float] = field(default_factory=dict)


def default_gx_root() -> Path:
    """``<KEYPLANE_HOME>/gx``: the data context lives with the rest of keyplane's state."""
    return Settings().home / "gx"


def stage_key_loads(statistics: pd.DataFrame, stage: str) -> dict[str, float]:
    """Each key's summed count in one stage of a statistics snapshot (null keys skipped)."""
    rows = statistics[statistics["stage"] == stage]
    sums = rows.groupby("key", dropna=True)["count"].sum()
    return {str(key): float(count) for key, count in sums.items()}


def _max_over_mean(loads: FloatArray) -> float:
    total = float(loads.sum())
    if total <= 0.0:
        return 1.0
    return float(loads.max()) / (total / loads.size)


def config_frames(
    config: RoutingConfig, predictions: Mapping[str, OperatorPrediction]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Flatten a configuration into the frames the configuration suites check.

    Returns ``(keys, summary)``: ``keys`` has one row per routed key per
    operator (columns :data:`KEYS_COLUMNS`; ``d`` is 1 for a table key and
    the number of instances for a hot key, whose d rows name one instance
    each); ``summary`` has one row per operator (columns
    :data:`SUMMARY_COLUMNS`; ``locality_change`` is predicted minus current
    locality, ``load_max_over_mean`` comes from
    :func:`keyplane.routing.routedkeys.predicted_instance_loads`). Pure: no GX involved.
    """
    missing = [name for name in config.operators if name not in predictions]
    unknown = [name for name in predictions if name not in config.operators]
    if missing or unknown:
        raise ValueError(
            f"predictions must name exactly the configuration's operators; "
            f"missing {missing}, unknown {unknown}"
        )
    key_rows: list[tuple[str, str, str, int, int, int]] = []
    summary_rows: list[dict[str, Any]] = []
    for name, routing in config.operators.items():
        p = routing.parallelism
        for key in sorted(routing.table):
            key_rows.append((name, key, "table", routing.table[key], 1, p))
        for key in sorted(routing.hot_keys):
            instances = routing.hot_keys[key]
            key_rows.extend((name, key, "hot", i, len(instances), p) for i in instances)
        prediction = predictions[name]
        loads = predicted_instance_loads(routing, prediction.key_loads)
        summary_rows.append(
            {
                "operator": name,
                "parallelism": p,
                "alpha": float(prediction.alpha),
                "predicted_imbalance": float(prediction.predicted_imbalance),
                "predicted_locality": float(prediction.predicted_locality),
                "current_locality": float(prediction.current_locality),
                "locality_change": float(
                    prediction.predicted_locality - prediction.current_locality
                ),
                "table_size": len(routing.table),
                "table_budget": prediction.table_budget,
                "hot_keys": len(routing.hot_keys),
                "load_max_over_mean": _max_over_mean(loads),
            }
        )
    keys = pd.DataFrame(key_rows, columns=list(KEYS_COLUMNS)).astype(
        {"operator": object, "key": object, "kind": object, "instance": np.int64, "d": np.int64}
    )
    keys["parallelism"] = keys["parallelism"].astype(np.int64)
    summary = pd.DataFrame(summary_rows, columns=list(SUMMARY_COLUMNS))
    summary["table_budget"] = summary["table_budget"].astype("Int64")
    return keys, summary


def _statistics_expectations() -> list[Expectation]:
    import great_expectations as gx

    e = gx.expectations
    return [
        e.ExpectTableColumnsToMatchSet(
            column_set=list(STATISTICS_COLUMNS),
            exact_match=False,
            description="The snapshot has every statistics column.",
        ),
        *(
            e.ExpectColumnValuesToNotBeNull(
                column=column, description=f"Every statistic has a {column}."
            )
            for column in STATISTICS_COLUMNS
        ),
        e.ExpectColumnValuesToBeInSet(
            column="stage",
            value_set={"$PARAMETER": "stages"},
            description="Statistics describe the pipeline's stages.",
        ),
        e.ExpectColumnValuesToBeBetween(
            column="count", min_value=0, description="Counts are never negative."
        ),
        e.ExpectColumnValuesToBeBetween(
            column="epoch", min_value=0, description="Epochs count up from 0 (001 §4.1)."
        ),
        e.ExpectCompoundColumnsToBeUnique(
            column_list=["stage", "key", "epoch"],
            description="One row per (stage, key, epoch): a duplicate would count tuples twice.",
        ),
        e.ExpectTableRowCountToBeBetween(
            min_value={"$PARAMETER": "min_keys"},
            description="The snapshot holds enough keys to plan from.",
        ),
        e.ExpectColumnSumToBeBetween(
            column="count",
            min_value={"$PARAMETER": "min_total_count"},
            description="The snapshot counts enough tuples for per-instance loads within α.",
        ),
        e.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="window_end",
            column_B="window_start",
            or_equal=True,
            description="Every row's offset window ends at or after it starts.",
        ),
        e.ExpectColumnMinToBeBetween(
            column="window_start",
            max_value={"$PARAMETER": "window_start"},
            description="The snapshot starts at or before the expected first offset.",
        ),
        e.ExpectColumnMaxToBeBetween(
            column="window_end",
            min_value={"$PARAMETER": "window_end"},
            description="The snapshot reaches the expected end offset.",
        ),
    ]


def _configuration_keys_expectations() -> list[Expectation]:
    import great_expectations as gx
    from great_expectations.expectations.row_conditions import Column

    e = gx.expectations
    return [
        e.ExpectTableColumnsToMatchSet(
            column_set=list(KEYS_COLUMNS),
            exact_match=False,
            description="The routed-keys frame has every column.",
        ),
        *(
            e.ExpectColumnValuesToNotBeNull(
                column=column, description=f"Every routed key has a {column}."
            )
            for column in KEYS_COLUMNS
        ),
        e.ExpectColumnValuesToBeInSet(
            column="kind",
            value_set=list(KINDS),
            description="A routed key comes from the table or the hot keys.",
        ),
        e.ExpectColumnValuesToBeBetween(
            column="instance",
            min_value=0,
            description="Every key is routed to an existing instance (≥ 0).",
        ),
        e.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="parallelism",
            column_B="instance",
            or_equal=False,
            description="Every key is routed to an existing instance (< parallelism).",
        ),
        e.ExpectCompoundColumnsToBeUnique(
            column_list=["operator", "key", "instance"],
            description="A key is routed to an instance at most once per operator.",
        ),
        e.ExpectColumnValuesToBeBetween(
            column="d",
            min_value={"$PARAMETER": "d_min"},
            row_condition=Column("kind") == "hot",
            description="A hot key is split over at least d_min instances (001 §4).",
        ),
        e.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="parallelism",
            column_B="d",
            or_equal=True,
            description="A hot key is split over at most n instances (001 §4).",
        ),
    ]


def _configuration_operators_expectations() -> list[Expectation]:
    import great_expectations as gx

    e = gx.expectations
    return [
        e.ExpectTableColumnsToMatchSet(
            column_set=list(SUMMARY_COLUMNS),
            exact_match=False,
            description="The operator summary has every column.",
        ),
        e.ExpectColumnValuesToBeUnique(
            column="operator", description="One summary row per operator."
        ),
        e.ExpectColumnValuesToBeBetween(
            column="parallelism", min_value=1, description="Every operator has an instance."
        ),
        e.ExpectColumnValuesToBeBetween(
            column="alpha", min_value=1.0, description="α is an imbalance bound, so ≥ 1."
        ),
        e.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="alpha",
            column_B="predicted_imbalance",
            or_equal=True,
            description="The plan's predicted imbalance is within α (000 §3.3).",
        ),
        e.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="alpha",
            column_B="load_max_over_mean",
            or_equal=True,
            description="Per-instance load recomputed from the statistics: max/mean within α.",
        ),
        e.ExpectColumnValuesToBeBetween(
            column="predicted_locality",
            min_value=0.0,
            max_value=1.0,
            description="Locality is a share of pair weight.",
        ),
        e.ExpectColumnValuesToBeBetween(
            column="locality_change",
            min_value={"$PARAMETER": "min_locality_change"},
            description="Predicted locality is not below the current one beyond the tolerance.",
        ),
        e.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="table_budget",
            column_B="table_size",
            or_equal=True,
            ignore_row_if="either_value_is_missing",
            description="The routing table fits its size budget (no budget: unbounded).",
        ),
    ]


_SUITES: dict[str, Callable[[], list[Expectation]]] = {
    STATISTICS_SUITE: _statistics_expectations,
    CONFIGURATION_KEYS_SUITE: _configuration_keys_expectations,
    CONFIGURATION_OPERATORS_SUITE: _configuration_operators_expectations,
}


def _flag(settings: Any, name: str) -> Any:
    """A field of GX's progress-bar settings: an object when set in this process, a dict when
    read back from ``great_expectations.yml``."""
    if isinstance(settings, Mapping):
        return settings.get(name)
    return getattr(settings, name, None)


def _ensure_suite(
    context: FileDataContext, name: str, expectations: list[Expectation]
) -> ExpectationSuite:
    """Store the suite unless an identical one is stored already.

    ``SuiteFactory.add_or_update`` promises that unchanged expectations keep
    their ids, but in GX 1.24 it matches them by equality including the id,
    which a freshly built expectation does not have yet, so every call would
    re-issue every id. Matching ids are therefore copied over first, and an
    unchanged suite is not rewritten at all.
    """
    import great_expectations as gx
    from great_expectations.exceptions import DataContextError

    try:
        stored = context.suites.get(name)
    except DataContextError:
        return context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
    unchanged = len(stored.expectations) == len(expectations)
    for old, new in zip(stored.expectations, expectations, strict=False):
        new.id = old.id
        if new != old:
            new.id = None
            unchanged = False
    if unchanged:
        return stored
    return context.suites.add_or_update(gx.ExpectationSuite(name=name, expectations=expectations))


def _limit_data_docs_index(context: FileDataContext) -> None:
    """List only the latest :data:`INDEX_RUNS` runs on the Data Docs index page.

    Rebuilding the index loads every stored validation result unless the
    site's index builder has a ``validation_results_limit``, so without one
    each run gets slower as results accumulate run after run. Older result
    pages stay on disk; only the index stops linking them.
    """
    stored = context.list_data_docs_sites().get(DATA_DOCS_SITE)
    builder: dict[str, Any] = {"class_name": "DefaultSiteIndexBuilder"}
    if stored is not None:
        builder = dict(stored.get("site_index_builder") or builder)
        if builder.get("validation_results_limit") == INDEX_RUNS:
            return
    builder["validation_results_limit"] = INDEX_RUNS
    if stored is None:
        context.add_data_docs_site(
            DATA_DOCS_SITE,
            {
                "class_name": "SiteBuilder",
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": f"uncommitted/data_docs/{DATA_DOCS_SITE}/",
                },
                "site_index_builder": builder,
            },
        )
    else:
        updated = stored.copy()
        updated["site_index_builder"] = builder
        context.update_data_docs_site(DATA_DOCS_SITE, updated)


def quality_context(gx_root: Path | None = None) -> FileDataContext:
    """The file data context under ``gx_root`` with keyplane's suites and checkpoints.

    Idempotent: a first call scaffolds the project (``gx_root/gx/``), later
    calls find it and add-or-update every object by name, so nothing is
    duplicated. Each suite gets a pandas data asset, a whole-frame batch
    definition, a validation definition and a checkpoint of the suite's name
    whose action rebuilds Data Docs. Analytics and progress bars are turned
    off: validation runs inside Airflow tasks, which should neither phone home
    nor fill their logs with progress bars.
    """
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.data_context import FileDataContext
    from great_expectations.data_context.types.base import ProgressBarsConfig
    from great_expectations.datasource.fluent import PandasDatasource

    root = Path(gx_root) if gx_root is not None else default_gx_root()
    root.mkdir(parents=True, exist_ok=True)
    context = gx.get_context(mode="file", project_root_dir=root)
    if not isinstance(context, FileDataContext):
        raise TypeError(f"expected a file data context under {root}, got {type(context)}")
    if context.config.analytics_enabled is not False:
        context.enable_analytics(False)
    bars: Any = context.variables.progress_bars
    if any(_flag(bars, name) is not False for name in ("globally", "metric_calculations")):
        context.variables.progress_bars = ProgressBarsConfig(
            globally=False, metric_calculations=False
        )
        context.variables.save()

    _limit_data_docs_index(context)

    try:
        source = context.data_sources.get(DATASOURCE_NAME)
    except KeyError:
        source = context.data_sources.add_pandas(DATASOURCE_NAME)
    if not isinstance(source, PandasDatasource):
        raise TypeError(f"data source {DATASOURCE_NAME!r} in {root} is not a pandas source")

    for suite_name, expectations in _SUITES.items():
        try:
            asset = source.get_asset(suite_name)
        except LookupError:
            asset = source.add_dataframe_asset(suite_name)
        try:
            batch_definition = asset.get_batch_definition(BATCH_DEFINITION_NAME)
        except KeyError:
            batch_definition = asset.add_batch_definition_whole_dataframe(BATCH_DEFINITION_NAME)
        suite = _ensure_suite(context, suite_name, expectations())
        validation = context.validation_definitions.add_or_update(
            gx.ValidationDefinition(name=suite_name, data=batch_definition, suite=suite)
        )
        context.checkpoints.add_or_update(
            gx.Checkpoint(
                name=suite_name,
                validation_definitions=[validation],
                actions=[
                    UpdateDataDocsAction(name="update_data_docs", site_names=[DATA_DOCS_SITE])
                ],
                result_format={
                    "result_format": "SUMMARY",
                    "partial_unexpected_count": _SHOWN_ROWS,
                    "unexpected_index_column_names": _INDEX_COLUMNS[suite_name],
                },
            )
        )
    return context


@contextmanager
def gx_lock(gx_root: Path | None = None) -> Iterator[Path]:
    """Hold the exclusive lock of the GX project under ``gx_root`` (the root, yielded).

    An ``fcntl.flock`` on ``gx_root/.lock``: it serialises the validations of
    every process on the machine (an Airflow worker runs each task in a
    process of its own), and of threads too, each opening the file anew. The
    kernel drops it when its holder dies, so a killed task leaves no stale
    lock. Not reentrant: a holder that asks again waits for itself.
    """
    root = Path(gx_root) if gx_root is not None else default_gx_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / LOCK_NAME).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield root
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def locked_context(gx_root: Path | None = None) -> Iterator[FileDataContext]:
    """:func:`quality_context` under ``gx_root``, for this holder alone while open.

    Build the context and run its checkpoints inside the ``with``
    (:func:`gx_lock`): the file data context is not safe for concurrent
    writers, and two DAGs validate under one root.
    """
    with gx_lock(gx_root) as root:
        yield quality_context(root)


def _show(value: Any) -> str:
    if isinstance(value, float | np.floating):
        number = float(value)
        return str(int(number)) if number.is_integer() else f"{number:.4g}"
    if isinstance(value, np.integer):
        return str(int(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


def _condition(row_condition: Any) -> str:
    if isinstance(row_condition, Mapping) and row_condition.get("type") == "comparison":
        column = row_condition.get("column", {})
        name = column.get("name") if isinstance(column, Mapping) else column
        return (
            f" where {name} {row_condition.get('operator')} {_show(row_condition.get('parameter'))}"
        )
    return f" where {row_condition}" if row_condition else ""


def _exception_message(info: Any) -> str | None:
    if not isinstance(info, Mapping):
        return None
    if info.get("raised_exception"):
        return str(info.get("exception_message") or "raised an exception")
    for nested in info.values():
        message = _exception_message(nested)
        if message:
            return message
    return None


def _row(row: Any, index: list[str]) -> str:
    """``operator='op' key='k' (instance=4)``: the row's identity, then the checked values."""
    if not isinstance(row, Mapping):
        return _show(row)
    names = " ".join(f"{column}={_show(row[column])}" for column in index if column in row)
    values = ", ".join(f"{c}={_show(v)}" for c, v in row.items() if c not in index)
    return f"{names} ({values})" if values else names


def _detail(result: ExpectationValidationResult) -> str:
    raised = _exception_message(result.exception_info)
    if raised:
        return f"raised: {raised}"
    outcome: Mapping[str, Any] = result.result or {}
    if "unexpected_count" in outcome:
        rows = outcome.get("partial_unexpected_index_list") or []
        index = list(outcome.get("unexpected_index_column_names") or [])
        shown = list(dict.fromkeys(_row(row, index) for row in rows[:_SHOWN_ROWS]))
        if not shown:
            shown = [_show(v) for v in (outcome.get("partial_unexpected_list") or [])[:_SHOWN_ROWS]]
        count = outcome.get("unexpected_count")
        total = outcome.get("element_count")
        listing = "; ".join(shown)
        return f"{count} of {total} rows unexpected" + (f": {listing}" if listing else "")
    if "observed_value" in outcome:
        return f"observed {_show(outcome['observed_value'])}"
    return "failed"


def _failure_line(suite_name: str, result: ExpectationValidationResult) -> str:
    config = result.expectation_config
    if config is None:
        return f"{suite_name}: an expectation failed: {_detail(result)}"
    kwargs = config.kwargs
    arguments = ", ".join(
        f"{name}={_show(value)}" for name, value in kwargs.items() if name not in _HIDDEN_KWARGS
    )
    why = f"{config.description} " if config.description else ""
    return (
        f"{suite_name}: {why}{config.type}({arguments})"
        f"{_condition(kwargs.get('row_condition'))}: {_detail(result)}"
    )


def _summarise(context: FileDataContext, suite_name: str, outcome: CheckpointResult) -> list[str]:
    order = {e.id: i for i, e in enumerate(context.suites.get(suite_name).expectations)}
    results = [r for run in outcome.run_results.values() for r in run.results]
    failed = [r for r in results if not r.success]
    if not failed:
        return [f"{suite_name}: all {len(results)} expectations passed"]
    failed.sort(
        key=lambda r: order.get(r.expectation_config.id if r.expectation_config else None, 0)
    )
    return [_failure_line(suite_name, r) for r in failed]


def _data_docs_index(context: FileDataContext) -> Path:
    sites = context.get_docs_sites_urls(site_name=DATA_DOCS_SITE)
    url = sites[0]["site_url"] if sites else None
    if not url:
        raise RuntimeError(f"data docs site {DATA_DOCS_SITE!r} has no URL")
    return Path(unquote(urlparse(url).path))


def _run(
    context: FileDataContext,
    frames: Sequence[tuple[str, pd.DataFrame]],
    parameters: Mapping[str, Any],
    run_name: str,
) -> QualityResult:
    from great_expectations.core.run_identifier import RunIdentifier

    lines: list[str] = []
    success = True
    for suite_name, frame in frames:
        checkpoint = context.checkpoints.get(suite_name)
        outcome = checkpoint.run(
            batch_parameters={"dataframe": frame},
            expectation_parameters=dict(parameters),
            run_id=RunIdentifier(run_name=run_name),
        )
        success = success and bool(outcome.success)
        lines.extend(_summarise(context, suite_name, outcome))
    return QualityResult(success, "\n".join(lines), _data_docs_index(context))


def validate_statistics(
    statistics: pd.DataFrame,
    expected_window: tuple[int, int],
    *,
    context: FileDataContext | None = None,
    settings: QualitySettings | None = None,
    run_name: str | None = None,
    stages: Sequence[str] | None = None,
) -> QualityResult:
    """Check a statistics snapshot against ``keyplane_statistics``.

    ``expected_window`` is the ``[start, end)`` offset range the snapshot
    claims to describe: its smallest ``window_start`` must be ≤ ``start`` and
    its largest ``window_end`` ≥ ``end``. Every row's stage must be one of
    ``stages`` (default: the configured pipeline's,
    :func:`keyplane.control.operators.stage_names`). ``context`` defaults to
    :func:`locked_context` at :func:`default_gx_root`, held for the run; a
    caller's context is the caller's to lock.
    """
    start, end = expected_window
    if start > end:
        raise ValueError(f"expected_window must have start ≤ end, got {expected_window}")
    chosen = settings or QualitySettings()
    parameters = {
        "min_keys": chosen.min_keys,
        "min_total_count": chosen.min_total_count,
        "window_start": int(start),
        "window_end": int(end),
        "stages": list(stage_names() if stages is None else stages),
    }
    frames = [(STATISTICS_SUITE, statistics)]
    name = run_name or f"statistics-{start}-{end}"
    if context is not None:
        return _run(context, frames, parameters, name)
    with locked_context() as default:
        return _run(default, frames, parameters, name)


def validate_configuration(
    config: RoutingConfig,
    predictions: Mapping[str, OperatorPrediction],
    *,
    context: FileDataContext | None = None,
    settings: QualitySettings | None = None,
    run_name: str | None = None,
) -> QualityResult:
    """Check a routing configuration against the two configuration suites.

    The frames come from :func:`config_frames`. ``context`` defaults to
    :func:`locked_context` at :func:`default_gx_root`, held for the run; a
    caller's context is the caller's to lock.
    """
    chosen = settings or QualitySettings()
    keys, summary = config_frames(config, predictions)
    parameters = {
        "d_min": chosen.d_min,
        "min_locality_change": -chosen.locality_tolerance,
    }
    frames = [(CONFIGURATION_KEYS_SUITE, keys), (CONFIGURATION_OPERATORS_SUITE, summary)]
    name = run_name or f"configuration-v{config.version}"
    if context is not None:
        return _run(context, frames, parameters, name)
    with locked_context() as default:
        return _run(default, frames, parameters, name)
