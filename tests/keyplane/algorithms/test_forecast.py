from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.costmodel import CostModel
from keyplane.algorithms.forecast import (
    Backtest,
    ForecastSettings,
    Memory,
    StageForecast,
    WeightForecast,
    reweighted,
    reweighted_chain,
    share_error,
)
from keyplane.algorithms.key_graph import _KeyGraph
from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import LocalityPlan, spark_workers
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import KeyWeights, PairStatistics
from keyplane.algorithms.plan_choice import choose_plan, hash_plan, score

KEYS = np.arange(100, dtype=np.int64)


def weights(values: np.ndarray) -> KeyWeights:
    return KeyWeights(KEYS[: values.size], values)


def test_settings_refuse_bad_memories_with_one_line_errors() -> None:
    with pytest.raises(ValueError, match="carry"):
        Memory(1.0)
    with pytest.raises(ValueError, match="trend"):
        Memory(0.5, trend=1.5)
    with pytest.raises(ValueError, match="default memory"):
        ForecastSettings(memories=(Memory(0.0),), default=Memory(0.5))
    with pytest.raises(ValueError, match="distinct"):
        ForecastSettings(memories=(Memory(0.5), Memory(0.5)))
    with pytest.raises(ValueError, match="backtest_windows"):
        ForecastSettings(backtest_windows=0)


def test_share_error_compares_shares_not_totals() -> None:
    same = weights(np.array([1.0, 3.0]))
    assert share_error(same, weights(np.array([10.0, 30.0]))) == pytest.approx(0.0)
    # shares (0.25, 0.75, 0) against (0, 0.5, 0.5)
    other = KeyWeights(np.array([1, 2]), np.array([1.0, 1.0]))
    assert share_error(same, other) == pytest.approx(0.25**2 + 0.25**2 + 0.5**2)


def test_backtest_uses_the_default_until_scored_then_the_best_recent_mean() -> None:
    backtest = Backtest(["a", "b"], "b", 2, lower_is_better=True)
    assert backtest.chosen == "b"
    backtest.record({"a": 1.0, "b": 5.0})
    assert backtest.chosen == "a"
    backtest.record({"a": 9.0, "b": 1.0})
    backtest.record({"a": 9.0, "b": 1.0})  # the first window has left the memory of 2
    assert backtest.means() == {"a": 9.0, "b": 1.0}
    assert backtest.chosen == "b"
    higher = Backtest(["a", "b"], "a", 3, lower_is_better=False)
    higher.record({"a": 1.0, "b": 2.0})
    assert higher.chosen == "b"
    with pytest.raises(ValueError, match="expected scores"):
        backtest.record({"a": 1.0})
    with pytest.raises(ValueError, match="not finite"):
        backtest.record({"a": float("nan"), "b": 1.0})


def test_a_trend_memory_forecasts_a_linear_trend_that_a_decayed_average_lags() -> None:
    trend = StageForecast(ForecastSettings(memories=(Memory(0.0, 1.0), Memory(0.5))), 4)
    rising = np.array([100.0, 300.0])
    step = np.array([10.0, -10.0])
    for t in range(8):
        trend.add(weights(rising + t * step))
    # the undamped trend memory converges on the line, the average lags behind it
    assert trend.memory == Memory(0.0, 1.0)
    forecast = trend.forecast()
    assert forecast.weights == pytest.approx(rising + 8 * step, rel=0.02)
    errors = trend.backtest()
    assert errors["carry 0, trend 1"] < errors["carry 0.5"] / 10


def _stage_series(kind: str, rng: np.random.Generator, windows: int) -> list[KeyWeights]:
    base = np.linspace(400.0, 100.0, KEYS.size)
    out = []
    log_walk = np.zeros(KEYS.size)
    phase = rng.random(KEYS.size)
    for t in range(windows):
        if kind == "walk":
            mean = base * np.exp(log_walk)
            log_walk = log_walk + rng.normal(0.0, 0.3, KEYS.size)
        elif kind == "cycle":
            mean = base * (1.0 + 0.8 * np.sin(2 * np.pi * (t / 24 + phase)))
        else:  # noise around fixed weights
            mean = base
        out.append(weights(rng.poisson(mean).astype(np.float64) + 1.0))
    return out


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("walk", Memory(0.0)),  # a random walk: the last window is the best guess
        ("cycle", Memory(0.0, 0.8)),  # a smooth cycle: follow its trend
        ("noise", Memory(0.75)),  # sampling noise only: average as long as possible
    ],
)
def test_the_backtest_picks_the_memory_that_suits_the_workload(kind: str, expected: Memory) -> None:
    stage = StageForecast(ForecastSettings(backtest_windows=8), 6)
    for window in _stage_series(kind, np.random.default_rng(3), 24):
        stage.add(window)
    assert stage.memory == expected, stage.backtest()


def test_the_forecast_drift_is_the_chosen_memorys_error_and_smaller_than_the_historys() -> None:
    series = _stage_series("cycle", np.random.default_rng(4), 16)
    forecast = WeightForecast(2, 6)
    history = PairHistory(HistoryPolicy(decay=0.5), 6)
    for window in series:
        forecast.add((window, window))
        pairs = PairStatistics(window.keys, window.keys + 100, window.weights)
        history.add(pairs)
    assert forecast.drift[0].windows == 15
    shares = series[-1].weights / series[-1].weights.sum()
    even, squares = np.full(6, 1 / 6), np.full(6, float((shares**2).sum()) / 6)
    ahead = forecast.drift[0].instance_sd(even, squares, 6)
    behind = history.drift[0].instance_sd(even, squares, 6)
    assert ahead[0] < behind[0] / 1.5
    with pytest.raises(ValueError, match="expected 2"):
        forecast.add((series[0],))


def test_reweighted_balances_the_forecast_and_keeps_the_pairs_and_keys_it_missed() -> None:
    pairs = PairStatistics(
        np.array([1, 1, 2, 3]), np.array([10, 11, 10, 12]), np.array([6.0, 2.0, 4.0, 2.0])
    )
    ahead_a = KeyWeights(np.array([1, 2]), np.array([4.0, 8.0]))  # key 1 halves, key 2 doubles
    ahead_b = KeyWeights(np.array([10, 11]), np.array([10.0, 1.0]))
    out = reweighted(pairs, ahead_a, ahead_b)
    # the pairs, the cut's weights, are the history's as they were
    np.testing.assert_array_equal(out.counts, pairs.counts)
    a = out.stage_weights("a")
    b = out.stage_weights("b")
    # the balance is the forecast's, below the pair totals where a key fades (key 1: 4 < 8);
    # key 3 is not in the forecast: it keeps its weight at the forecast's overall scale
    assert dict(zip(a.keys.tolist(), a.weights, strict=True)) == pytest.approx(
        {1: 4.0, 2: 8.0, 3: 2.0 * 12 / 14}
    )
    assert dict(zip(b.keys.tolist(), b.weights, strict=True)) == pytest.approx(
        {10: 10.0, 11: 1.0, 12: 2.0 * 11 / 14}
    )
    assert out.chain().stage_weights(0) == a
    with pytest.raises(ValueError, match="one forecast"):
        reweighted_chain(pairs.chain(), (ahead_a,))


def test_graph_of_reweighted_statistics_cuts_on_the_pairs_and_balances_the_forecast() -> None:
    history = PairStatistics(np.array([1, 2, 2]), np.array([10, 10, 11]), np.array([9.0, 3.0, 6.0]))
    ahead_a = KeyWeights(np.array([1, 2]), np.array([1.0, 20.0]))  # key 1 fades, key 2 grows
    ahead_b = KeyWeights(np.array([10, 11]), np.array([5.0, 16.0]))
    graph = _KeyGraph.from_statistics(reweighted(history, ahead_a, ahead_b).chain())
    np.testing.assert_array_equal(graph.keys, [1, 2, 10, 11])
    np.testing.assert_allclose(graph.weight, [1.0, 20.0, 5.0, 16.0])
    edges = {
        (int(graph.keys[u]), int(graph.keys[d])): w
        for u, d, w in zip(graph.edge_up, graph.edge_down, graph.edge_weight, strict=True)
    }
    assert edges == {(1, 10): 9.0, (2, 10): 3.0, (2, 11): 6.0}


def _apart(n: int) -> tuple[int, int]:
    """A stage-A and a stage-B key id that Spark's hash puts on different instances."""
    for a in range(1, 100):
        for b in range(101, 200):
            if spark_workers([a], n)[0] != spark_workers([b], n)[0]:
                return a, b
    raise AssertionError("no two keys hash apart")


def test_a_key_whose_forecast_fades_stays_with_its_partner_by_its_long_memory_pairs() -> None:
    n = 4
    fading, partner = _apart(n)
    others = [k for k in range(1, 40) if k != fading][:12]
    a_keys = np.array([fading, *others], dtype=np.int64)
    b_keys = np.array([partner, *(k + 1_000 for k in others)], dtype=np.int64)
    # in the long memory the fading key's pair is the heaviest of all ...
    history = PairStatistics(a_keys, b_keys, np.array([100.0, *[50.0] * len(others)]))
    # ... but the forecast has it nearly gone on both sides
    ahead_a = KeyWeights(a_keys, np.array([2.0, *[50.0] * len(others)]))
    ahead_b = KeyWeights(b_keys, np.array([2.0, *[50.0] * len(others)]))
    budget = len(others)  # one key of each stage must take the hash fallback

    training = reweighted(history, ahead_a, ahead_b)
    plan = build_plan(training, n, max_table_entries=budget)
    assert fading in plan.table_a and partner in plan.table_b
    assert plan.table_a[fading] == plan.table_b[partner]
    weights_a = training.stage_weights("a")
    assert weights_a.weights[weights_a.keys == fading][0] == 2.0  # balanced as forecast
    fading_pair = PairStatistics(np.array([fading]), np.array([partner]), np.array([1.0]))
    assert plan.evaluate(fading_pair).locality == 1.0

    # pairs scaled down with the forecast: the fading pair is the lightest, loses its table
    # entries, and the hash fallback puts the two keys apart
    scaled = PairStatistics(
        a_keys, b_keys, history.counts * ahead_a.weights / history.counts, ahead_a, ahead_b
    )
    cut = build_plan(scaled, n, max_table_entries=budget)
    assert fading not in cut.table_a and partner not in cut.table_b
    assert cut.evaluate(fading_pair).locality == 0.0


@st.composite
def drifting_histories(draw: st.DrawFn) -> tuple[list[PairStatistics], int, float, CostModel]:
    n = draw(st.integers(2, 8))
    n_keys = draw(st.integers(3, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    log_share = rng.normal(0.0, draw(st.sampled_from([0.3, 1.0, 2.0])), n_keys)
    sigma = draw(st.sampled_from([0.0, 0.1, 0.5]))
    windows = []
    for _ in range(draw(st.integers(1, 6))):
        shares = np.exp(log_share) / np.exp(log_share).sum()
        a = rng.choice(n_keys, size=1_500, p=shares)
        b = np.where(rng.random(a.size) < 0.8, a, rng.integers(0, n_keys, a.size)) + 1_000
        windows.append(PairStatistics(a, b, np.ones(a.size)))
        log_share = log_share + rng.normal(0.0, sigma, n_keys)
    alpha = draw(st.sampled_from([1.0, 1.03, 1.1]))
    return windows, n, alpha, CostModel(remote=draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])))


@settings(max_examples=25, deadline=None)
@given(drifting_histories())
def test_property_planned_on_forecasts_the_chosen_plan_is_never_predicted_slower_than_hash(
    case: tuple[list[PairStatistics], int, float, CostModel],
) -> None:
    windows, n, alpha, cost = case
    forecast = WeightForecast(2, n)
    history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.05), n)
    current: LocalityPlan | None = None
    for window in windows:
        forecast.add((window.stage_weights("a"), window.stage_weights("b")))
        history.add(window)
        training = reweighted(history.statistics, *forecast.forecasts())
        drift_a, drift_b = forecast.drift
        current = choose_plan(
            training, n, alpha=alpha, current=current, cost=cost, drift=(drift_a, drift_b),
            followed=window,
        )  # fmt: skip
        hashed = score(hash_plan(n, alpha), training, cost, (drift_a, drift_b))
        assert current.predicted_throughput >= hashed.predicted_throughput
        assert current.promised_imbalance >= 1.0
