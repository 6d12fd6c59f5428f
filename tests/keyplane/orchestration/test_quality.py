"""Tests of the Great Expectations gates for statistics and configurations.

Every validation here is a real GX run against a real file data context
(created once per module: importing GX and scaffolding the context is the slow
part). Configurations that the model itself would refuse are built with
``model_construct``, the way a configuration written by another tool, or
edited by hand, can reach the gate without passing the model's validation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pytest

from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import evaluate
from keyplane.algorithms.pair_statistics import PairStatistics
from keyplane.orchestration.quality import (
    CONFIGURATION_KEYS_SUITE,
    CONFIGURATION_OPERATORS_SUITE,
    STATISTICS_SUITE,
    OperatorPrediction,
    QualityResult,
    QualitySettings,
    ValidationFailed,
    config_frames,
    gx_lock,
    predicted_instance_loads,
    quality_context,
    stage_key_loads,
    validate_configuration,
    validate_statistics,
)
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.routedkeys import fold_instance, spark_partition

if TYPE_CHECKING:
    from great_expectations.data_context import FileDataContext

N = 4
N_TUPLES = 20_000
HOT_A = 500


@pytest.fixture(scope="module")
def gx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gx")


@pytest.fixture(scope="module")
def context(gx_root: Path) -> FileDataContext:
    return quality_context(gx_root)


def window_pairs() -> PairStatistics:
    """Correlated pairs (A key k mostly meets B keys of its group of ten) plus one hot A key.

    The hot key carries 30 % of the tuples, above α / n = 25.75 %, so the
    planner must hand it to the splitter.
    """
    rng = np.random.default_rng(7)
    a_keys = rng.integers(0, 120, N_TUPLES)
    b_keys = 1000 + (a_keys // 10) * 10 + rng.integers(0, 10, N_TUPLES)
    a_keys[: int(0.3 * N_TUPLES)] = HOT_A
    return PairStatistics(a_keys, b_keys, np.ones(N_TUPLES))


def snapshot(pairs: PairStatistics) -> pd.DataFrame:
    """The statistics snapshot of one window: one row per (stage, key), epoch 0."""
    frames = []
    for stage, keys in (("A", pairs.a_keys), ("B", pairs.b_keys)):
        unique, counts = np.unique(keys, return_counts=True)
        frames.append(
            pd.DataFrame(
                {
                    "stage": stage,
                    "key": [str(k) for k in unique],
                    "count": counts.astype(np.int64),
                    "epoch": 0,
                    "window_start": 0,
                    "window_end": N_TUPLES,
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def planned() -> tuple[RoutingConfig, dict[str, OperatorPrediction], pd.DataFrame]:
    """A configuration from keyplane's own planner, with its predictions, replacing hashing."""
    pairs = window_pairs()
    statistics = snapshot(pairs)
    plan = build_plan(pairs, N)
    assert plan.heavy_keys_a == (HOT_A,)
    current = evaluate(({}, {}), pairs, N)
    operators = {}
    predictions = {}
    for name, stage, table, heavy, imbalance in (
        ("stage_a", "A", plan.table_a, plan.heavy_keys_a, plan.predicted_imbalance_a),
        ("stage_b", "B", plan.table_b, plan.heavy_keys_b, plan.predicted_imbalance_b),
    ):
        operators[name] = OperatorRouting(
            parallelism=N,
            table={str(k): v for k, v in table.items()},
            hot_keys={str(k): tuple(range(N)) for k in heavy},
        )
        predictions[name] = OperatorPrediction(
            predicted_imbalance=imbalance,
            predicted_locality=plan.predicted_locality,
            current_locality=current.locality,
            alpha=plan.alpha,
            table_budget=1000,
            key_loads=stage_key_loads(statistics, stage),
        )
    config = RoutingConfig(version=2, parent_version=1, created_by="schedule", operators=operators)
    return config, predictions, statistics


def single_operator(
    routing: OperatorRouting, loads: dict[str, float], **claims: float
) -> tuple[RoutingConfig, dict[str, OperatorPrediction]]:
    """A one-operator configuration (not revalidated, so ``routing`` may be invalid)."""
    config = RoutingConfig.model_construct(
        version=1, created_by="initial", operators={"op": routing}
    )
    prediction = OperatorPrediction(
        predicted_imbalance=claims.get("imbalance", 1.01),
        predicted_locality=claims.get("locality", 0.5),
        current_locality=claims.get("current", 0.4),
        key_loads=loads,
    )
    return config, {"op": prediction}


def failed_lines(result: QualityResult) -> list[str]:
    return [line for line in result.summary.splitlines() if "passed" not in line]


def test_config_frames_flatten_routed_keys_and_route_loads_like_the_job() -> None:
    routing = OperatorRouting(parallelism=3, table={"t0": 0, "t1": 2}, hot_keys={"h": (1, 2)})
    loads = {"t0": 6.0, "t1": 3.0, "h": 4.0, "cold": 5.0}
    config, predictions = single_operator(routing, loads)

    keys, summary = config_frames(config, predictions)

    assert keys.to_dict("records") == [
        {"operator": "op", "key": "t0", "kind": "table", "instance": 0, "d": 1, "parallelism": 3},
        {"operator": "op", "key": "t1", "kind": "table", "instance": 2, "d": 1, "parallelism": 3},
        {"operator": "op", "key": "h", "kind": "hot", "instance": 1, "d": 2, "parallelism": 3},
        {"operator": "op", "key": "h", "kind": "hot", "instance": 2, "d": 2, "parallelism": 3},
    ]
    expected = np.array([6.0, 2.0, 3.0 + 2.0])
    expected[spark_partition("cold", 3)] += 5.0
    np.testing.assert_allclose(predicted_instance_loads(routing, loads), expected)
    row = summary.iloc[0]
    assert row["load_max_over_mean"] == pytest.approx(expected.max() / expected.mean())
    assert row["locality_change"] == pytest.approx(0.1)
    assert (row["table_size"], row["hot_keys"]) == (2, 1)
    assert pd.isna(row["table_budget"])


def test_a_scaled_in_operator_is_balanced_over_its_active_instances_with_folded_fallback() -> None:
    # Instances 2 and 3 are released: their natural keys fold onto 0 and 1
    # (003 §5.3), and the released instances, idle by design, are not imbalance.
    routing = OperatorRouting(parallelism=4, table={"t": 1}, active_instances=(0, 1))
    loads = {"t": 10.0, **{f"k{i}": 1.0 for i in range(40)}}
    expected = np.array([0.0, 10.0])
    for i in range(40):
        expected[fold_instance(spark_partition(f"k{i}", 4), (0, 1), 4)] += 1.0
    config, predictions = single_operator(routing, loads)

    _, summary = config_frames(config, predictions)

    np.testing.assert_allclose(predicted_instance_loads(routing, loads), expected)
    assert summary.iloc[0]["load_max_over_mean"] == pytest.approx(expected.max() / expected.mean())


@pytest.mark.integration
def test_creating_the_context_twice_keeps_one_copy_of_everything(
    context: FileDataContext, gx_root: Path
) -> None:
    before = {s.name: [e.id for e in s.expectations] for s in context.suites.all()}

    again = quality_context(gx_root)

    after = {s.name: [e.id for e in s.expectations] for s in again.suites.all()}
    names = {STATISTICS_SUITE, CONFIGURATION_KEYS_SUITE, CONFIGURATION_OPERATORS_SUITE}
    assert set(after) == names
    assert after == before
    project = gx_root / "gx"
    assert len(list((project / "expectations").glob("*.json"))) == 3
    assert len(list((project / "checkpoints").glob("*.json"))) == 3
    assert len(list((project / "validation_definitions").glob("*.json"))) == 3
    assert set(again.data_sources.get("keyplane").get_asset_names()) == names


@pytest.mark.integration
def test_a_planned_configuration_and_its_statistics_pass(context: FileDataContext) -> None:
    config, predictions, statistics = planned()

    statistics_result = validate_statistics(statistics, (0, N_TUPLES), context=context)
    config_result = validate_configuration(config, predictions, context=context)

    assert statistics_result.success, statistics_result.summary
    assert config_result.success, config_result.summary
    assert config_result.summary.splitlines() == [
        f"{CONFIGURATION_KEYS_SUITE}: all 13 expectations passed",
        f"{CONFIGURATION_OPERATORS_SUITE}: all 9 expectations passed",
    ]
    config_result.raise_if_failed()


@pytest.mark.integration
def test_an_all_hash_configuration_checks_an_empty_keys_frame(context: FileDataContext) -> None:
    config = RoutingConfig(
        version=1, created_by="initial", operators={"op": OperatorRouting(parallelism=N)}
    )
    predictions = {"op": OperatorPrediction(1.0, 0.25, 0.25, table_budget=0)}
    keys, _ = config_frames(config, predictions)
    assert keys.empty and keys["instance"].dtype == np.int64

    result = validate_configuration(config, predictions, context=context)

    assert result.success, result.summary


@pytest.mark.integration
def test_an_instance_with_three_times_the_average_load_fails(context: FileDataContext) -> None:
    loads = {f"k{i}": 1.0 for i in range(40)}
    table = {f"k{i}": 0 if i < 30 else 1 + i % 3 for i in range(40)}
    config, predictions = single_operator(OperatorRouting(parallelism=N, table=table), loads)
    assert config_frames(config, predictions)[1]["load_max_over_mean"].item() == 3.0

    result = validate_configuration(config, predictions, context=context)

    assert not result.success
    [line] = failed_lines(result)
    assert line.startswith(f"{CONFIGURATION_OPERATORS_SUITE}: Per-instance load")
    assert "expect_column_pair_values_a_to_be_greater_than_b(column_A='alpha'" in line
    assert "column_B='load_max_over_mean'" in line
    assert line.endswith("1 of 1 rows unexpected: operator='op' (alpha=1.03, load_max_over_mean=3)")
    with pytest.raises(ValidationFailed, match="load_max_over_mean=3") as raised:
        result.raise_if_failed()
    assert raised.value.result is result


@pytest.mark.integration
def test_a_key_routed_outside_the_instances_fails(context: FileDataContext) -> None:
    routing = OperatorRouting.model_construct(
        parallelism=N, table={"k0": 0, "k1": N, "k2": -1}, hot_keys={}
    )
    config, predictions = single_operator(routing, {})

    result = validate_configuration(config, predictions, context=context)

    assert not result.success
    failures = failed_lines(result)
    assert len(failures) == 2
    below, above = failures
    assert "expect_column_values_to_be_between(column='instance', min_value=0)" in below
    assert below.endswith("1 of 3 rows unexpected: operator='op' key='k2' (instance=-1)")
    assert "column_A='parallelism', column_B='instance', or_equal=False" in above
    assert above.endswith(
        "1 of 3 rows unexpected: operator='op' key='k1' (parallelism=4, instance=4)"
    )
    assert all(line.startswith(CONFIGURATION_KEYS_SUITE) for line in failures)


@pytest.mark.integration
def test_hot_keys_split_outside_d_min_to_n_fail(context: FileDataContext) -> None:
    too_few = OperatorRouting(parallelism=N, hot_keys={"h": (0, 1)})
    too_many = OperatorRouting.model_construct(
        parallelism=3, table={}, hot_keys={"g": (0, 1, 2, 3)}
    )
    config = RoutingConfig.model_construct(
        version=1, created_by="initial", operators={"few": too_few, "many": too_many}
    )
    prediction = OperatorPrediction(1.0, 0.5, 0.5)
    predictions = {"few": prediction, "many": prediction}
    settings = QualitySettings(d_min=3)

    result = validate_configuration(config, predictions, context=context, settings=settings)
    few_only = RoutingConfig(version=1, created_by="initial", operators={"few": too_few})
    default = validate_configuration(few_only, {"few": prediction}, context=context)

    assert not result.success
    outside, too_low, too_high = failed_lines(result)
    assert (
        "expect_column_values_to_be_between(column='d', min_value=3) where kind == 'hot'" in too_low
    )
    assert too_low.endswith("2 of 6 rows unexpected: operator='few' key='h' (d=2)")
    assert "column_B='instance'" in outside
    assert outside.endswith("operator='many' key='g' (parallelism=3, instance=3)")
    assert "column_A='parallelism', column_B='d', or_equal=True" in too_high
    assert too_high.endswith("4 of 6 rows unexpected: operator='many' key='g' (parallelism=3, d=4)")
    assert default.success, default.summary


BROKEN_SNAPSHOTS = {
    "null key": (lambda s: s.assign(key=s["key"].where(s.index != 3, None)), "column='key'"),
    "negative count": (
        lambda s: s.assign(count=s["count"].where(s.index != 3, -5)),
        "expect_column_values_to_be_between(column='count', min_value=0)",
    ),
    "unknown stage": (
        lambda s: s.assign(stage=s["stage"].where(s.index != 3, "C")),
        "expect_column_values_to_be_in_set(column='stage'",
    ),
    "duplicate row": (
        lambda s: pd.concat([s, s.iloc[[3]]], ignore_index=True),
        "expect_compound_columns_to_be_unique(column_list=['stage', 'key', 'epoch'])",
    ),
    "too few tuples": (
        lambda s: s.assign(count=1),
        "expect_column_sum_to_be_between(column='count', min_value=10000): observed 241",
    ),
    "window not covered": (
        lambda s: s.assign(window_end=N_TUPLES // 2),
        "expect_column_max_to_be_between(column='window_end', min_value=20000): observed 10000",
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(BROKEN_SNAPSHOTS))
def test_a_broken_statistics_snapshot_fails_naming_the_check(
    context: FileDataContext, case: str
) -> None:
    break_it, expected = BROKEN_SNAPSHOTS[case]
    statistics = break_it(snapshot(window_pairs()))

    result = validate_statistics(statistics, (0, N_TUPLES), context=context)

    assert not result.success
    [line] = failed_lines(result)
    assert line.startswith(f"{STATISTICS_SUITE}: ")
    assert expected in line


@pytest.mark.integration
def test_each_run_rebuilds_data_docs_inside_the_context(
    context: FileDataContext, gx_root: Path
) -> None:
    statistics = snapshot(window_pairs())

    result = validate_statistics(statistics, (0, N_TUPLES), context=context, run_name="docs-check")

    index = result.data_docs_path
    assert index.name == "index.html" and index.is_file()
    assert index.is_relative_to(gx_root)
    pages = list(index.parent.glob(f"validations/{STATISTICS_SUITE}/docs-check/*/*.html"))
    assert len(pages) == 1
    stored = list((gx_root / "gx" / "uncommitted" / "validations").rglob("docs-check/*/*.json"))
    assert json.loads(stored[0].read_text())["success"] is True


HOLD_LOCK = """
import sys
from pathlib import Path
from keyplane.orchestration.quality import gx_lock

with gx_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_the_gx_lock_keeps_a_second_process_out_until_the_first_lets_go(tmp_path: Path) -> None:
    """Two DAGs' validations run in two worker processes; the second waits."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held\n"
        entered = threading.Event()

        def second() -> None:
            with gx_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(1.0), "the second holder got in while the first held the lock"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert entered.wait(30)
        waiter.join(30)
        assert holder.wait(30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
