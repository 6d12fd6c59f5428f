"""Tests of the locality planner end to end: routing tables from pair statistics
(paper 000 §3.3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import evaluate
from keyplane.algorithms.pair_statistics import KeyWeights, PairStatistics
from tests.keyplane.algorithms.locality_workloads import (
    brute_force_locality,
    correlated_window,
    skewed_graphs,
)


def test_correlated_pairs_give_locality_far_above_hash_and_it_holds_on_the_next_window() -> None:
    n = 6
    train, held_out = correlated_window(seed=1), correlated_window(seed=2)
    plan = build_plan(train, n)
    hashed = evaluate(({}, {}), held_out, n)
    next_window = plan.evaluate(held_out)

    assert plan.predicted_locality > 0.6
    assert hashed.locality < 0.25  # about 1/n
    assert next_window.locality > 0.55
    assert abs(next_window.locality - plan.predicted_locality) < 0.1
    assert plan.predicted_imbalance_a <= 1.03
    assert plan.predicted_imbalance_b <= 1.03


def test_predictions_equal_an_independent_evaluation_on_the_training_window() -> None:
    n = 4
    train = correlated_window(seed=3, n_keys=200, n_tuples=5_000)
    plan = build_plan(train, n)

    split = frozenset(plan.heavy_keys_a + plan.heavy_keys_b)
    assert plan.predicted_locality == pytest.approx(
        brute_force_locality(train, plan.table_a, plan.table_b, n, split), rel=1e-9
    )


def test_table_budget_keeps_the_keys_with_most_pair_weight() -> None:
    a_keys = np.array([1, 2, 3, 4, 5, 1, 2])
    b_keys = np.array([10, 20, 30, 40, 50, 10, 20])
    counts = np.array([50.0, 40.0, 30.0, 2.0, 1.0, 50.0, 40.0])
    plan = build_plan(PairStatistics(a_keys, b_keys, counts), 2, alpha=2.0, max_table_entries=3)

    assert set(plan.table_a) == {1, 2, 3}
    assert set(plan.table_b) == {10, 20, 30}


def test_keys_known_only_from_frequencies_are_counted_in_the_balance() -> None:
    pairs = PairStatistics(
        np.array([1, 2]),
        np.array([10, 20]),
        np.array([5.0, 5.0]),
        freq_a=KeyWeights(np.array([1, 3, 4, 5]), np.array([8.0, 5.0, 5.0, 5.0])),
    )
    weights = pairs.stage_weights("a")
    assert weights.keys.tolist() == [1, 2, 3, 4, 5]
    assert weights.weights.tolist() == [8.0, 5.0, 5.0, 5.0, 5.0]

    plan = build_plan(pairs, 2, alpha=1.2)
    assert plan.evaluate(pairs).imbalance_a == pytest.approx(plan.predicted_imbalance_a)
    assert plan.predicted_imbalance_a <= 1.2


@settings(max_examples=80, deadline=None)
@given(skewed_graphs())
def test_property_balance_is_within_alpha_on_the_training_graph(
    case: tuple[PairStatistics, int, float, int | None, int],
) -> None:
    pairs, n, alpha, budget, seed = case
    plan = build_plan(
        pairs, n, alpha=alpha, max_table_entries=budget, seed=seed % 1000, split_rule="alpha"
    )

    measured = plan.evaluate(pairs)
    assert measured.imbalance_a <= alpha
    assert measured.imbalance_b <= alpha
    assert plan.predicted_imbalance_a == pytest.approx(measured.imbalance_a, rel=1e-9)
    assert plan.predicted_imbalance_b == pytest.approx(measured.imbalance_b, rel=1e-9)
    assert plan.predicted_locality == pytest.approx(measured.locality, rel=1e-9, abs=1e-12)
    for table, heavy in ((plan.table_a, plan.heavy_keys_a), (plan.table_b, plan.heavy_keys_b)):
        assert all(0 <= worker < n for worker in table.values())
        assert not set(table) & set(heavy)
        if budget is not None:
            assert len(table) <= budget
