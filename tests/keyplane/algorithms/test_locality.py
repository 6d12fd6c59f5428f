"""Tests of locality-aware routing tables (paper 000 §3.3) and pair history."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.costmodel import CostModel, Drift
from keyplane.algorithms.locality import (
    HistoryPolicy,
    KeyWeights,
    LocalityPlan,
    PairHistory,
    PairStatistics,
    PlanSettings,
    TableRouter,
    _calibration,
    _heavy_mask,
    aggregate_pairs,
    build_plan,
    choose_plan,
    drift_margin,
    evaluate,
    hash_plan,
    score,
    spark_workers,
)
from keyplane.algorithms.partitioner import Partitioner
from keyplane.routing.routedkeys import spark_partition


def correlated_window(
    seed: int, n_keys: int = 600, n_tuples: int = 30_000, noise: float = 0.1
) -> PairStatistics:
    """Tuples whose stage-B key is mostly one of three partners of the stage-A key.

    A key's partners come from its community of 30 keys, so the key graph has
    clear clusters. The partners are fixed (seed 0), so windows drawn with
    different seeds come from one distribution, like consecutive windows.
    """
    community = np.arange(n_keys) // 30
    offsets = np.random.default_rng(0).integers(0, 30, size=(n_keys, 3))
    partners = np.minimum(community[:, None] * 30 + offsets, n_keys - 1)
    rng = np.random.default_rng(seed)
    a_keys = np.minimum(rng.pareto(1.5, n_tuples) * 40, n_keys - 1).astype(np.int64)
    a_keys = np.random.default_rng(0).permutation(n_keys)[a_keys]
    b_keys = partners[a_keys, rng.integers(0, 3, n_tuples)]
    random = rng.random(n_tuples) < noise
    b_keys[random] = rng.integers(0, n_keys, int(random.sum()))
    return PairStatistics(a_keys, b_keys + 10_000, np.ones(n_tuples))


def brute_force_locality(
    pairs: PairStatistics,
    table_a: dict[int, int],
    table_b: dict[int, int],
    n: int,
    split: frozenset[int] = frozenset(),
) -> float:
    """Share of pair weight on one instance; a pair with a split key is local 1/n of the time."""
    local = 0.0
    for a, b, count in zip(pairs.a_keys.tolist(), pairs.b_keys.tolist(), pairs.counts, strict=True):
        if a in split or b in split:
            local += count / n
            continue
        worker_a = table_a.get(a, int(spark_workers(np.array([a]), n)[0]))
        worker_b = table_b.get(b, int(spark_workers(np.array([b]), n)[0]))
        local += count * (worker_a == worker_b)
    return local / float(pairs.counts.sum())


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


def test_a_key_with_30_percent_of_the_weight_is_reported_and_balance_still_holds() -> None:
    rng = np.random.default_rng(5)
    n_tuples = 20_000
    a_keys = rng.integers(1, 500, n_tuples)
    a_keys[: int(0.3 * n_tuples)] = 0
    b_keys = a_keys % 97 + 1_000
    pairs = PairStatistics(a_keys, b_keys, np.ones(n_tuples))

    plan = build_plan(pairs, 8)

    assert plan.heavy_keys_a == (0,)
    assert 0 not in plan.table_a
    assert plan.predicted_imbalance_a <= 1.03
    assert plan.predicted_imbalance_b <= 1.03
    evaluation = plan.evaluate(pairs)
    assert evaluation.imbalance_a == pytest.approx(plan.predicted_imbalance_a, rel=1e-9)


def test_pinned_heavy_key_goes_to_the_least_loaded_instance_and_imbalance_is_honest() -> None:
    rng = np.random.default_rng(6)
    n_tuples = 10_000
    a_keys = rng.integers(1, 300, n_tuples)
    a_keys[: int(0.3 * n_tuples)] = 0
    pairs = PairStatistics(a_keys, a_keys % 50 + 1_000, np.ones(n_tuples))

    plan = build_plan(pairs, 4, heavy_key_policy="pin")

    assert plan.heavy_keys_a == (0,)
    assert 0 in plan.table_a
    # 30 % of the load on one of 4 instances is 1.2 × the mean at least.
    assert plan.predicted_imbalance_a >= 1.2
    assert plan.evaluate(pairs).imbalance_a == pytest.approx(plan.predicted_imbalance_a)


def zipf_pairs(size: int = 5_000, n_keys: int = 300) -> PairStatistics:
    """Unit pairs of two independent Zipf(1.3) keys: skewed, uncorrelated."""
    rng = np.random.default_rng(0)
    a_keys = rng.zipf(1.3, size) % n_keys
    b_keys = rng.zipf(1.3, size) % n_keys
    return PairStatistics(a_keys, b_keys, np.ones(size))


def test_an_instance_left_without_keys_does_not_count_as_loaded() -> None:
    # Regression: loads were updated by subtraction, so the instance whose
    # keys all went to the splitter kept ~1e-16 of load and looked overloaded
    # with no key left to take: numpy's "argmax of an empty sequence".
    pairs = PairStatistics(np.array([0, 0, 3]), np.array([2, 1, 0]), np.array([1.0, 1.0, 0.1]))

    plan = build_plan(pairs, 2, split_rule="alpha")

    assert plan.predicted_imbalance_a <= 1.03
    assert plan.predicted_imbalance_b <= 1.03
    assert plan.evaluate(pairs).imbalance_b == pytest.approx(plan.predicted_imbalance_b)


def test_alpha_one_keeps_a_perfect_split_in_the_tables() -> None:
    # 000 §3.1 allows α = 1: a 4/4 split of 8 equal keys meets it exactly.
    # Regression: the bound was lowered by 1e-12, so the perfect split counted
    # as overloaded and every key was handed to the splitter, one by one.
    pairs = PairStatistics(np.arange(8), np.arange(8) + 100, np.ones(8))

    plan = build_plan(pairs, 2, alpha=1.0)

    assert plan.heavy_keys_a == () and plan.heavy_keys_b == ()
    assert len(plan.table_a) == 8 and len(plan.table_b) == 8
    assert plan.predicted_imbalance_a == 1.0
    assert plan.predicted_imbalance_b == 1.0


def test_a_small_table_budget_keeps_its_table_and_splits_few_keys() -> None:
    # Regression: with 10 table entries, hashed Zipf keys overload instances;
    # the rebalancer split the heaviest key of each, which lowered the mean and
    # overloaded the next, until both tables were empty and 80 keys were split.
    pairs = zipf_pairs()
    no_table = build_plan(pairs, 8, max_table_entries=0, split_rule="alpha")

    plan = build_plan(pairs, 8, max_table_entries=10, split_rule="alpha")

    assert len(plan.table_a) >= 5 and len(plan.table_b) >= 5
    split = len(plan.heavy_keys_a) + len(plan.heavy_keys_b)
    assert split < len(no_table.heavy_keys_a) + len(no_table.heavy_keys_b)
    assert plan.predicted_imbalance_a <= 1.03
    assert plan.predicted_imbalance_b <= 1.03


@pytest.mark.parametrize("budget", [0, 5, 10])
def test_pinning_heavy_keys_respects_the_table_budget(budget: int) -> None:
    # Regression: "pin" put every heavy key in the table, 42 and 38 entries
    # whatever the budget. Now the heaviest are pinned while entries last and
    # the rest are split keys, and the predictions count them as such.
    pairs = zipf_pairs()

    plan = build_plan(pairs, 8, max_table_entries=budget, heavy_key_policy="pin")

    for table, heavy in ((plan.table_a, plan.heavy_keys_a), (plan.table_b, plan.heavy_keys_b)):
        assert len(table) <= budget
        pinned = [key for key in heavy if key in table]
        assert pinned == list(heavy[: len(pinned)])
    measured = plan.evaluate(pairs)
    assert measured.imbalance_a == pytest.approx(plan.predicted_imbalance_a, rel=1e-9)
    assert measured.imbalance_b == pytest.approx(plan.predicted_imbalance_b, rel=1e-9)
    assert measured.locality == pytest.approx(plan.predicted_locality, rel=1e-9)


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


@st.composite
def skewed_graphs(draw: st.DrawFn) -> tuple[PairStatistics, int, float, int | None, int]:
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 8))
    alpha = draw(st.sampled_from([1.0, 1.01, 1.03, 1.1, 1.5]))
    budget = draw(st.one_of(st.none(), st.integers(0, 40)))
    n_a, n_b = draw(st.integers(1, 60)), draw(st.integers(1, 60))
    n_pairs = draw(st.integers(0, 300))
    exponent = draw(st.floats(1.05, 3.0))
    rng = np.random.default_rng(seed)
    a_keys = (rng.zipf(exponent, n_pairs) - 1) % n_a
    b_keys = (rng.zipf(exponent, n_pairs) - 1) % n_b + 1_000
    counts = np.floor(rng.pareto(1.2, n_pairs) * 10.0)
    freq_a = None
    if draw(st.booleans()):
        extra = np.arange(n_a + 5)
        freq_a = KeyWeights(extra, np.floor(rng.pareto(1.0, extra.size) * 5.0))
    pairs = PairStatistics(a_keys, b_keys, counts, freq_a=freq_a)
    return pairs, n, alpha, budget, seed


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


def test_table_router_is_a_partitioner_routing_table_keys_and_hashing_the_rest() -> None:
    router = TableRouter({5: 2, -3: 0, 1 << 40: 1}, 3, "locality-a")
    keys = np.array([5, 7, -3, 1 << 40, 8, 5], dtype=np.int64)

    workers = router.route(keys, np.zeros(keys.size))

    assert isinstance(router, Partitioner)
    fallback = spark_workers(np.array([7, 8]), 3)
    assert workers.tolist() == [2, int(fallback[0]), 0, 1, int(fallback[1]), 2]
    assert TableRouter({}, 3).route(keys, np.zeros(6)).tolist() == spark_workers(keys, 3).tolist()


def test_table_router_rejects_instances_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        TableRouter({1: 2}, 2)


def test_evaluate_with_empty_tables_is_hash_routing() -> None:
    pairs = correlated_window(seed=7, n_keys=100, n_tuples=2_000)
    assert evaluate(({}, {}), pairs, 5).locality == pytest.approx(
        brute_force_locality(pairs, {}, {}, 5)
    )


def test_settings_reject_bad_values_and_derive_the_metis_ufactor() -> None:
    assert PlanSettings(4, alpha=1.03).metis_ufactor == 30
    assert PlanSettings(4, alpha=1.0).metis_ufactor == 1
    with pytest.raises(ValueError, match="alpha"):
        PlanSettings(4, alpha=0.9)
    with pytest.raises(ValueError, match="n_instances"):
        PlanSettings(0)
    with pytest.raises(ValueError, match="max_table_entries"):
        PlanSettings(2, max_table_entries=-1)
    with pytest.raises(ValueError, match="same length"):
        PairStatistics(np.array([1, 2]), np.array([1]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="non-negative"):
        PairStatistics(np.array([1]), np.array([1]), np.array([-1.0]))


def test_unsigned_key_ids_beyond_int64_are_refused_not_wrapped() -> None:
    # Regression: uint64 2**64 - 1 was cast to -1, the id of another key.
    unsigned = np.array([2**64 - 1], dtype=np.uint64)
    with pytest.raises(ValueError, match="within int64"):
        PairStatistics(unsigned, np.array([-1]), np.array([1.0]))
    with pytest.raises(ValueError, match="within int64"):
        KeyWeights(unsigned, np.array([1.0]))
    small = PairStatistics(np.array([7], dtype=np.uint64), np.array([1]), np.array([1.0]))
    assert small.a_keys.tolist() == [7]


def test_aggregate_pairs_sums_repeats_and_drops_zero_counts() -> None:
    a, b, counts = aggregate_pairs(
        np.array([1, 1, 2, 3]), np.array([5, 5, 5, 6]), np.array([1.0, 2.0, 4.0, 0.0])
    )
    assert list(zip(a.tolist(), b.tolist(), counts.tolist(), strict=True)) == [
        (1, 5, 3.0),
        (2, 5, 4.0),
    ]


def window(pairs: list[tuple[int, int, float]]) -> PairStatistics:
    a, b, counts = zip(*pairs, strict=True)
    return PairStatistics(np.array(a), np.array(b), np.array(counts))


def as_dict(statistics: PairStatistics) -> dict[tuple[int, int], float]:
    return {
        (int(a), int(b)): float(c)
        for a, b, c in zip(statistics.a_keys, statistics.b_keys, statistics.counts, strict=True)
    }


def test_reset_history_keeps_only_the_latest_window() -> None:
    history = PairHistory(HistoryPolicy(mode="reset"))
    history.add(window([(1, 10, 4.0)]))
    history.add(window([(2, 20, 3.0)]))

    assert as_dict(history.statistics) == {(2, 20): 3.0}
    assert history.statistics.stage_weights("a").keys.tolist() == [2]


def test_decay_history_weights_older_windows_down_without_dropping_them() -> None:
    history = PairHistory(HistoryPolicy(mode="decay", decay=0.5))
    history.add(window([(1, 10, 4.0), (2, 20, 2.0)]))
    history.add(window([(1, 10, 1.0), (3, 30, 8.0)]))

    assert as_dict(history.statistics) == {(1, 10): 3.0, (2, 20): 1.0, (3, 30): 8.0}
    weights = history.statistics.stage_weights("a")
    assert dict(zip(weights.keys.tolist(), weights.weights.tolist(), strict=True)) == {
        1: 3.0,
        2: 1.0,
        3: 8.0,
    }
    assert history.windows == 2


def test_history_bound_keeps_the_heaviest_pairs() -> None:
    history = PairHistory(HistoryPolicy(decay=1.0, max_entries=2))
    history.add(window([(1, 10, 4.0), (2, 20, 2.0), (3, 30, 9.0)]))

    assert as_dict(history.statistics) == {(1, 10): 4.0, (3, 30): 9.0}


def test_history_policy_rejects_bad_decay() -> None:
    with pytest.raises(ValueError, match="decay"):
        HistoryPolicy(decay=0.0)
    with pytest.raises(ValueError, match="mode"):
        HistoryPolicy(mode="forever")


def few_keys_window(seed: int, n_keys: int = 16, top_share: float = 0.17) -> PairStatistics:
    """A stage with few distinct keys, the top one just above the mean instance load."""
    rng = np.random.default_rng(seed)
    rest = rng.dirichlet(np.ones(n_keys - 1)) * (1.0 - top_share)
    shares = np.r_[top_share, np.minimum(rest, top_share * 0.95)]
    shares /= shares.sum()
    a_keys = rng.choice(n_keys, size=20_000, p=shares)
    b_keys = np.where(rng.random(a_keys.size) < 0.8, a_keys, rng.integers(0, n_keys, a_keys.size))
    return PairStatistics(a_keys, b_keys + 1_000, np.ones(a_keys.size))


def test_heavy_rule_does_not_cascade_down_a_short_key_list() -> None:
    # 16 keys, n = 6, the top key at 17 % (α·mean = 17.2 %): no key is heavy.
    # Re-testing against the mean of the remaining keys marked one after another.
    weights = np.r_[17.0, np.full(15, 83.0 / 15)]
    assert not _heavy_mask(weights, 1.03, 6).any()
    weights = np.r_[18.0, 16.5, 16.0, np.full(13, 49.5 / 13)]
    assert _heavy_mask(weights, 1.03, 6).tolist() == [True] + [False] * 15
    assert _heavy_mask(weights, 1.03, 6, "cascade").sum() == 3


def test_evaluate_spreads_a_split_keys_load_over_the_instances() -> None:
    # One key carrying everything, split: the real spread is perfect.
    pairs = PairStatistics(np.array([1, 1]), np.array([5, 6]), np.array([60.0, 40.0]))
    measured = evaluate(({}, {}), pairs, 4, split_keys_a=[1])
    assert measured.imbalance_a == 1.0
    assert measured.locality == pytest.approx(0.25)


def test_spark_workers_is_sparks_hash_partitioning_of_the_decimal_key() -> None:
    keys = np.array([0, 7, -3, 1 << 40, 123456789], dtype=np.int64)
    expected = [spark_partition(str(key), 6) for key in keys.tolist()]
    assert spark_workers(keys, 6).tolist() == expected


def test_table_router_spreads_split_keys_round_robin() -> None:
    router = TableRouter({1: 0}, 4, spread=[9])
    keys = np.array([9, 9, 1, 9, 9, 9, 9, 9, 9], dtype=np.int64)
    out = router.route(keys, np.zeros(keys.size))
    assert out[2] == 0
    assert np.bincount(out[keys == 9], minlength=4).tolist() == [2, 2, 2, 2]


def test_a_split_is_made_only_when_it_pays() -> None:
    # The older rules split 22 of the 32 keys to meet α in sample.
    pairs = few_keys_window(seed=3)
    paying = build_plan(pairs, 6, alpha=1.03)
    legacy = build_plan(pairs, 6, alpha=1.03, split_rule="alpha", heavy_rule="cascade")
    split_paying = len(paying.split_keys_a) + len(paying.split_keys_b)
    assert split_paying < len(legacy.split_keys_a) + len(legacy.split_keys_b)
    assert paying.predicted_locality > legacy.predicted_locality
    cost = CostModel()
    assert cost.throughput(*paying.evaluate(pairs)) > cost.throughput(*legacy.evaluate(pairs))


@st.composite
def few_key_workloads(draw: st.DrawFn) -> tuple[PairStatistics, int, float]:
    n = draw(st.integers(2, 8))
    n_keys = draw(st.integers(1, 2 * n - 1))
    seed = draw(st.integers(0, 2**31))
    alpha = draw(st.sampled_from([1.0, 1.01, 1.03, 1.1]))
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(n_keys, draw(st.sampled_from([0.3, 1.0, 5.0]))))
    a_keys = rng.choice(n_keys, size=2_000, p=shares)
    local = rng.random(a_keys.size) < draw(st.floats(0.0, 1.0))
    b_keys = np.where(local, a_keys, rng.integers(0, n_keys, a_keys.size)) + 100
    return PairStatistics(a_keys, b_keys, np.ones(a_keys.size)), n, alpha


@settings(max_examples=60, deadline=None)
@given(few_key_workloads())
def test_property_fewer_keys_than_twice_the_instances_never_splits_most_keys(
    case: tuple[PairStatistics, int, float],
) -> None:
    pairs, n, alpha = case
    plan = choose_plan(pairs, n, alpha=alpha)
    for stage, split in (("a", plan.split_keys_a), ("b", plan.split_keys_b)):
        distinct = int((pairs.stage_weights(stage).weights > 0).sum())
        assert len(split) <= distinct / 2


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


def test_history_min_weight_forgets_entries_decayed_below_it_but_keeps_fresh_ones() -> None:
    history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.3))
    history.add(PairStatistics(np.array([1, 2]), np.array([10, 20]), np.array([1.0, 4.0])))
    history.add(PairStatistics(np.array([3]), np.array([30]), np.array([0.1])))
    kept = history.statistics
    pairs = set(zip(kept.a_keys.tolist(), kept.b_keys.tolist(), strict=True))
    assert pairs == {(1, 10), (2, 20), (3, 30)}
    history.add(PairStatistics(np.array([3]), np.array([30]), np.array([0.1])))
    kept = history.statistics
    pairs = set(zip(kept.a_keys.tolist(), kept.b_keys.tolist(), strict=True))
    assert pairs == {(2, 20), (3, 30)}
    assert history.statistics.stage_weights("a").keys.tolist() == [2, 3]


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
