"""Tests of the planner's choice among hash, current and new plans, and its promise."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.costmodel import CostModel, Drift
from keyplane.algorithms.locality_plan import ChainPlan, LocalityPlan, spark_workers
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import (
    ChainStatistics,
    PairStatistics,
)
from keyplane.algorithms.plan_choice import (
    _calibration,
    choose_chain_plan,
    choose_plan,
    drift_margin,
    hash_chain,
    hash_plan,
    plan_candidate,
    score,
    score_candidate,
)
from tests.keyplane.algorithms.locality_workloads import correlated_window, skewed_graphs


@settings(max_examples=60, deadline=None)
@given(skewed_graphs())
def test_property_the_chosen_plan_is_never_predicted_slower_than_hash(
    case: tuple[PairStatistics, int, float, int | None, int],
) -> None:
    pairs, n, alpha, budget, seed = case
    cost = CostModel(remote=float(seed % 5) / 2.0)
    plan = choose_plan(pairs, n, alpha=alpha, max_table_entries=budget, cost=cost)
    hashed = score(hash_plan(n, alpha), pairs, cost)
    assert plan.predicted_throughput >= hashed.predicted_throughput
    assert plan.predicted_throughput == pytest.approx(cost.throughput(*plan.evaluate(pairs)))


def test_choose_plan_keeps_the_current_plan_when_nothing_beats_it() -> None:
    pairs = correlated_window(seed=1)
    first = choose_plan(pairs, 8)
    assert first.candidate == "plan" and first.predicted_locality > 0.5
    again = choose_plan(pairs, 8, current=first)
    assert again.candidate == "current"
    assert again.table_a == first.table_a


def _drifting_windows(seed: int, windows: int) -> list[PairStatistics]:
    """300 stage-A keys whose log-shares walk randomly (σ 0.1 a window), each
    paired with its own B key 85 % of the time: a drifting generator."""
    rng = np.random.default_rng(seed)
    log_share = np.log(np.arange(1, 301, dtype=np.float64) ** -0.8)
    out = []
    for _ in range(windows):
        shares = np.exp(log_share) / np.exp(log_share).sum()
        a = rng.choice(shares.size, size=20_000, p=shares)
        b = np.where(rng.random(a.size) < 0.85, a, rng.integers(0, shares.size, a.size)) + 1_000
        out.append(PairStatistics(a, b, np.ones(a.size)))
        log_share = log_share + rng.normal(0.0, 0.1, shares.size)
    return out


def test_the_promise_holds_on_ninety_percent_of_next_windows_of_a_drifting_workload() -> None:
    windows = _drifting_windows(seed=5, windows=41)
    history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.05), n_instances=6)
    current: LocalityPlan | None = None
    within_promise, within_training = [], []
    for t in range(len(windows) - 1):
        history.add(windows[t])
        current = choose_plan(
            history.statistics,
            6,
            current=current,
            drift=history.drift,
            followed=windows[t],
        )
        # No drift is measured before the second window: the first promise
        # rests on the prior drift, and every window counts.
        assert np.isfinite(current.promised_imbalance)
        assert (current.model_promise > 0.0) == (t > 0)
        following = current.evaluate(windows[t + 1])
        worse = max(following.imbalance_a, following.imbalance_b)
        within_promise.append(worse <= current.promised_imbalance)
        within_training.append(
            worse <= max(current.predicted_imbalance_a, current.predicted_imbalance_b)
        )
    assert np.mean(within_promise) >= 0.9
    # The training window's own imbalance is no promise: the drift breaks it.
    assert np.mean(within_training) < 0.5


def test_with_no_drift_the_promise_is_the_training_imbalance_and_headroom_is_the_default() -> None:
    pairs = correlated_window(seed=2)
    plan = choose_plan(pairs, 8)
    assert plan.promised_imbalance == pytest.approx(
        max(plan.predicted_imbalance_a, plan.predicted_imbalance_b)
    )
    assert max(plan.predicted_imbalance_a, plan.predicted_imbalance_b) <= 1.015 + 1e-9
    assert drift_margin(pairs, (Drift(), Drift()), 8) == 0.0


def test_a_drift_that_measured_no_window_yet_promises_under_the_prior_not_in_sample() -> None:
    windows = _drifting_windows(seed=3, windows=2)
    history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.05), n_instances=6)
    history.add(windows[0])
    assert all(stage.windows == 0 for stage in history.drift)
    first = choose_plan(history.statistics, 6, drift=history.drift)
    assert first.model_promise == 0.0  # nothing measured: no calibration ratio against it
    hashed = score(hash_plan(6), history.statistics, CostModel(), history.drift)
    assert np.isfinite(hashed.promised_imbalance)
    assert hashed.promised_imbalance > max(
        hashed.predicted_imbalance_a, hashed.predicted_imbalance_b
    )
    # The in-sample imbalance does not hold on the next window; the prior's promise does.
    following = first.evaluate(windows[1])
    worse = max(following.imbalance_a, following.imbalance_b)
    assert worse > max(first.predicted_imbalance_a, first.predicted_imbalance_b)
    assert worse <= first.promised_imbalance
    # The promise is the prior drift's bound, not the narrower one of sampling noise alone.
    chain = history.statistics.chain()
    noise_only = tuple(
        Drift(tally=1.0 / float(chain.stage_weights(stage).weights.sum()), windows=1)
        for stage in range(2)
    )
    sampled = choose_plan(history.statistics, 6, drift=noise_only)
    assert sampled.promised_imbalance < first.promised_imbalance
    history.add(windows[1])
    second = choose_plan(history.statistics, 6, current=first, drift=history.drift)
    assert np.isfinite(second.promised_imbalance)
    assert second.promised_imbalance >= max(
        second.predicted_imbalance_a, second.predicted_imbalance_b
    )


def test_the_promise_calibration_is_the_split_conformal_rank_of_earlier_ratios() -> None:
    # Too few ratios for the 95 % rank: the largest; never below the model's own bound.
    assert _calibration(()) == 1.0
    assert _calibration((0.2, 0.5)) == 1.0
    assert _calibration((0.5, 2.5, 1.5)) == 2.5
    # 39 ratios 1..39: the ⌈40 · 0.95⌉ = 38th smallest.
    assert _calibration(tuple(float(r) for r in range(39, 0, -1))) == 38.0


def test_the_chosen_plans_promise_is_its_model_bound_widened_by_the_calibration() -> None:
    pairs = correlated_window(seed=2)
    drift = (Drift(relative=0.2, windows=1), Drift(relative=0.2, windows=1))
    first = choose_plan(pairs, 8, drift=drift)
    assert first.promised_imbalance == pytest.approx(first.model_promise)
    carried = dataclasses.replace(first, promise_ratios=(3.0,))
    again = choose_plan(pairs, 8, current=carried, drift=drift)
    assert again.promise_ratios == (3.0,)
    assert again.promised_imbalance == pytest.approx(1.0 + 3.0 * (again.model_promise - 1.0))


def test_when_the_drift_takes_the_slack_the_plan_keeps_alpha_and_promises_more() -> None:
    pairs = correlated_window(seed=2)
    drift = (Drift(relative=0.5, windows=1), Drift(relative=0.5, windows=1))
    assert drift_margin(pairs, drift, 8) > 0.03
    loose = choose_plan(pairs, 8, drift=drift)
    assert loose.candidate == "plan"
    assert max(loose.predicted_imbalance_a, loose.predicted_imbalance_b) <= 1.03 + 1e-9
    assert loose.promised_imbalance > max(loose.predicted_imbalance_a, loose.predicted_imbalance_b)


@settings(max_examples=30, deadline=None)
@given(skewed_graphs(), st.sampled_from([0.0, 0.05, 0.3]))
def test_property_under_drift_the_chosen_plan_is_never_predicted_slower_than_hash(
    case: tuple[PairStatistics, int, float, int | None, int], relative: float
) -> None:
    pairs, n, alpha, budget, seed = case
    cost = CostModel(remote=float(seed % 5) / 2.0)
    drift = (Drift(relative=relative, tally=1e-4, windows=1), Drift(relative=relative, windows=1))
    plan = choose_plan(pairs, n, alpha=alpha, max_table_entries=budget, cost=cost, drift=drift)
    hashed = score(hash_plan(n, alpha), pairs, cost, drift)
    assert plan.predicted_throughput >= hashed.predicted_throughput
    assert plan.promised_imbalance >= 1.0


N = 6


def _chain_events(seed: int, count: int = 30_000) -> np.ndarray:
    """A three-stage chain with correlated keys: a user, their session group (mostly
    a function of the user), their page group (mostly of the session)."""
    rng = np.random.default_rng(seed)
    users = np.minimum(rng.pareto(1.5, count) * 40, 599).astype(np.int64)
    sessions = np.where(rng.random(count) < 0.9, users // 3, rng.integers(0, 200, count))
    pages = np.where(rng.random(count) < 0.9, sessions // 2, rng.integers(0, 100, count))
    return np.column_stack([users, 1_000 + sessions, 2_000 + pages]).astype(np.int64)


def _event_figures(plan: ChainPlan, events: np.ndarray) -> tuple[float, list[float]]:
    """Locality and per-stage max/mean of routing every event through ``plan``:
    table entry, else Spark's hash; a split key's tuples spread evenly."""
    n = plan.n_instances
    routed = []
    for stage in range(events.shape[1]):
        keys = events[:, stage]
        instance = spark_workers(keys, n)
        table = plan.tables[stage]
        listed = np.fromiter((k in table for k in keys.tolist()), np.bool_, keys.size)
        instance[listed] = [table[k] for k in keys[listed].tolist()]
        instance[np.isin(keys, plan.split_keys(stage))] = -1
        routed.append(instance)
    hops = [
        np.where((up < 0) | (down < 0), 1.0 / n, (up == down).astype(np.float64))
        for up, down in itertools.pairwise(routed)
    ]
    imbalances = []
    for instance in routed:
        loads = np.bincount(instance[instance >= 0], minlength=n).astype(np.float64)
        loads += float((instance < 0).sum()) / n
        imbalances.append(float(loads.max() / loads.mean()))
    return float(np.mean(np.concatenate(hops))), imbalances


def test_a_three_stage_chain_choice_is_scored_as_its_events_route_and_kept_if_unbeaten() -> None:
    events = _chain_events(0)
    statistics = ChainStatistics.of_events(events)
    chosen = choose_chain_plan(statistics, N)
    assert chosen.candidate == "plan"
    assert len(chosen.plan.tables) == 3
    throughputs = chosen.choice.throughputs
    assert throughputs["plan"] > throughputs["hash"]
    locality, imbalances = _event_figures(chosen.plan, events)
    hash_locality, _ = _event_figures(hash_chain(N, 3), events)
    assert chosen.choice.chosen.locality == pytest.approx(locality, abs=1e-9)
    assert chosen.choice.chosen.locality > 0.7 > 0.3 > hash_locality
    assert chosen.choice.chosen.imbalances == pytest.approx(imbalances, rel=1e-9)
    assert max(imbalances) <= 1.015 + 1e-9  # built with the default headroom
    # Scored on the window it runs on (no drift given): the promise is in-sample.
    assert chosen.promised_imbalance == pytest.approx(max(imbalances))
    again = choose_chain_plan(statistics, N, current=chosen)
    assert again.candidate == "current"
    assert again.plan.tables == chosen.plan.tables


def test_on_a_chain_a_prior_promise_before_drift_and_the_next_calibrated_on_the_last() -> None:
    windows = [ChainStatistics.of_events(_chain_events(seed)) for seed in range(3)]
    unmeasured = choose_chain_plan(windows[0], N, drift=(Drift(), Drift(), Drift()))
    assert max(unmeasured.choice.chosen.imbalances) < unmeasured.promised_imbalance < math.inf
    assert unmeasured.choice.model_promise == 0.0
    drift = tuple(Drift(relative=0.3, tally=1e-4, windows=1) for _ in range(3))
    first = choose_chain_plan(windows[0], N, drift=drift)
    assert first.choice.model_promise > max(first.choice.chosen.imbalances)
    assert first.promised_imbalance == pytest.approx(first.choice.model_promise)
    # The window that ran under the first plan, measured independently.
    _, fared = _event_figures(first.plan, _chain_events(1))
    ratio = (max(fared) - 1.0) / (first.choice.model_promise - 1.0)
    second = choose_chain_plan(windows[1], N, current=first, drift=drift, followed=windows[1])
    assert second.choice.promise_ratios == pytest.approx((ratio,))
    assert second.promised_imbalance == pytest.approx(
        1.0 + (second.choice.model_promise - 1.0) * max(1.0, ratio)
    )
    third = choose_chain_plan(windows[2], N, current=second, drift=drift, followed=windows[2])
    assert len(third.choice.promise_ratios) == 2
    assert third.choice.promise_ratios[0] == pytest.approx(ratio)


@st.composite
def skewed_chains(draw: st.DrawFn) -> tuple[ChainStatistics, int, float, int | None, CostModel]:
    """Chains of one to four stages, Zipf-skewed keys, each stage's key partly a
    function of the upstream one."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 8))
    stages = draw(st.integers(1, 4))
    count = draw(st.integers(1, 1_500))
    exponent = draw(st.floats(1.05, 3.0))
    columns = [(rng.zipf(exponent, count) - 1) % draw(st.integers(1, 60))]
    for stage in range(1, stages):
        keys = draw(st.integers(1, 60))
        own = (rng.zipf(exponent, count) - 1) % keys
        follows = rng.random(count) < draw(st.floats(0.0, 1.0))
        columns.append(np.where(follows, columns[-1] % keys, own) + 1_000 * stage)
    statistics = ChainStatistics.of_events(np.column_stack(columns).astype(np.int64))
    alpha = draw(st.sampled_from([1.0, 1.01, 1.03, 1.1, 1.5]))
    budget = draw(st.one_of(st.none(), st.integers(0, 40)))
    cost = CostModel(remote=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])))
    return statistics, n, alpha, budget, cost


@settings(max_examples=40, deadline=None)
@given(skewed_chains(), st.sampled_from([None, 0.0, 0.05, 0.3]))
def test_property_on_chains_the_choice_is_never_predicted_slower_than_keeping_hash(
    case: tuple[ChainStatistics, int, float, int | None, CostModel], relative: float | None
) -> None:
    statistics, n, alpha, budget, cost = case
    drift = (
        None
        if relative is None
        else tuple(Drift(relative=relative, tally=1e-4, windows=1) for _ in statistics.frequencies)
    )
    chosen = choose_chain_plan(
        statistics, n, alpha=alpha, max_table_entries=budget, cost=cost, drift=drift
    )
    hashed = score_candidate(
        plan_candidate(hash_chain(n, statistics.n_stages, alpha), "hash"), statistics, cost, drift
    )
    assert chosen.choice.chosen.throughput >= hashed.throughput
    assert chosen.choice.throughputs["hash"] == hashed.throughput
    assert chosen.promised_imbalance >= 1.0


@st.composite
def few_key_chains(draw: st.DrawFn) -> tuple[ChainStatistics, int, float]:
    """Chains of two or three stages with fewer distinct keys per stage than twice the
    instances."""
    n = draw(st.integers(2, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    concentration = draw(st.sampled_from([0.3, 1.0, 5.0]))
    columns: list[np.ndarray] = []
    for stage in range(draw(st.integers(2, 3))):
        keys = draw(st.integers(1, 2 * n - 1))
        own = rng.choice(keys, size=2_000, p=rng.dirichlet(np.full(keys, concentration)))
        if columns:
            follows = rng.random(own.size) < draw(st.floats(0.0, 1.0))
            own = np.where(follows, (columns[-1] - 100 * (stage - 1)) % keys, own)
        columns.append(own + 100 * stage)
    statistics = ChainStatistics.of_events(np.column_stack(columns).astype(np.int64))
    return statistics, n, draw(st.sampled_from([1.0, 1.01, 1.03, 1.1]))


@settings(max_examples=40, deadline=None)
@given(few_key_chains())
def test_property_on_chains_fewer_keys_than_twice_the_instances_never_splits_most_keys(
    case: tuple[ChainStatistics, int, float],
) -> None:
    statistics, n, alpha = case
    chosen = choose_chain_plan(statistics, n, alpha=alpha)
    for stage in range(statistics.n_stages):
        distinct = int((statistics.stage_weights(stage).weights > 0).sum())
        assert len(chosen.plan.split_keys(stage)) <= distinct / 2
