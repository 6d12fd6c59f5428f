"""Tests of the planner's choice among hash, current and new plans, and its promise."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.costmodel import CostModel, Drift
from keyplane.algorithms.locality_plan import LocalityPlan
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import PairStatistics
from keyplane.algorithms.plan_choice import (
    _calibration,
    choose_plan,
    drift_margin,
    hash_plan,
    score,
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
        # No drift is measured before the second window: no promise is made.
        assert np.isfinite(current.promised_imbalance) == (t > 0)
        if t == 0:
            continue
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


def test_a_drift_that_measured_no_window_yet_makes_no_promise_instead_of_an_in_sample_one() -> None:
    windows = _drifting_windows(seed=3, windows=2)
    history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.05), n_instances=6)
    history.add(windows[0])
    assert all(stage.windows == 0 for stage in history.drift)
    first = choose_plan(history.statistics, 6, drift=history.drift)
    assert first.promised_imbalance == math.inf
    assert first.model_promise == 0.0
    hashed = score(hash_plan(6), history.statistics, CostModel(), history.drift)
    assert hashed.promised_imbalance == math.inf
    # The in-sample imbalance the promise used to be does not hold on the next window.
    following = first.evaluate(windows[1])
    assert max(following.imbalance_a, following.imbalance_b) > max(
        first.predicted_imbalance_a, first.predicted_imbalance_b
    )
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
