"""Tests of keyplane.algorithms.hotkeys: FISH classification, worker choice and the partitioner."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.baselines import hash_worker
from keyplane.algorithms.hotkeys import (
    BULK_CANDIDATES,
    FishPartitioner,
    FishSettings,
    assign_hot_keys,
    greedy_fill,
    hot_key_worker_count,
    inferred_waiting_times,
    least_waiting_worker,
)
from keyplane.algorithms.partitioner import Partitioner
from keyplane.algorithms.ring import ConsistentHashRing, ModuloPlacement


def zipf_stream(exponent: float, n_keys: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = np.arange(1, n_keys + 1, dtype=np.float64) ** -exponent
    ids = rng.choice(10**9, size=n_keys, replace=False).astype(np.int64)
    return ids[rng.choice(n_keys, size=size, p=p / p.sum())]


def route_in_chunks(partitioner, keys: np.ndarray, rate: float, chunks: int = 10) -> np.ndarray:
    times = np.arange(keys.size, dtype=np.float64) / rate
    parts = zip(np.array_split(keys, chunks), np.array_split(times, chunks), strict=True)
    return np.concatenate([partitioner.route(k, t) for k, t in parts])


def test_worked_example_of_001_section_4_2_3_picks_the_worker_waiting_40():
    # 001 §4.2.3: at time 500 the four workers were sent 400, 440, 280 and 180
    # tuples and their inferred waits are 50, 40, 100 and 60. The paper's
    # capacities are lost from the text; these are the ones that give those
    # waits (workers 0 and 1 are the faster pair).
    sent = np.array([400.0, 440.0, 280.0, 180.0])
    waits_in_paper = np.array([50.0, 40.0, 100.0, 60.0])
    capacity = sent / (waits_in_paper + 500.0)
    waits = inferred_waiting_times(sent, capacity, elapsed=500.0)
    assert waits == pytest.approx(waits_in_paper)
    assert least_waiting_worker([0, 1, 2, 3], sent, capacity, elapsed=500.0) == 1
    assert int(np.argmin(sent)) == 3  # counting tuples alone (PKG, D-C) would pick worker 3


def test_least_waiting_worker_breaks_ties_between_idle_workers_by_busyness():
    sent = np.array([5.0, 1.0, 3.0])
    capacity = np.array([1.0, 1.0, 1.0])
    assert least_waiting_worker([0, 2, 1], sent, capacity, elapsed=100.0) == 1


def test_settings_defaults_halve_the_d_choices_threshold_and_validate():
    s = FishSettings()
    assert s.hot_threshold(16) == pytest.approx(1 / 160)
    assert s.d_min == 2
    assert s.candidate_selection == "ring"
    # the table holds 4/θ counters: overestimates stay under a quarter of θ
    assert s.counter_capacity(16) == 1024
    assert s.counter_capacity(128) == 5120
    assert FishSettings(top_k_capacity=3000).counter_capacity(128) == 3000
    with pytest.raises(ValueError, match="candidate_selection"):
        FishSettings(candidate_selection=cast(Any, "rendezvous"))
    with pytest.raises(ValueError, match="decay"):
        FishSettings(decay=1.2)
    with pytest.raises(ValueError, match="epoch_unit"):
        FishSettings(epoch_unit=cast(Any, "minutes"))
    with pytest.raises(ValueError, match="whole length"):
        FishSettings(epoch_length=10.5)
    with pytest.raises(ValueError, match="d_min"):
        FishSettings(d_min=0)
    with pytest.raises(ValueError, match="top_k_capacity"):
        FishPartitioner(64, FishSettings(top_k_capacity=100))


def test_hot_key_worker_count_grows_with_frequency_within_d_min_and_n():
    assert hot_key_worker_count(100.0, 100.0, 16, 2) == 16
    assert hot_key_worker_count(50.0, 100.0, 16, 2) == 8
    assert hot_key_worker_count(30.0, 100.0, 16, 2) == 5
    assert hot_key_worker_count(1.0, 100.0, 16, 2) == 2
    assert hot_key_worker_count(1.0, 100.0, 1, 2) == 1
    with pytest.raises(ValueError, match="frequency"):
        hot_key_worker_count(2.0, 1.0, 4, 2)


freq_maps = st.dictionaries(
    st.integers(min_value=0, max_value=10**6),
    st.floats(min_value=0.1, max_value=1000.0),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(freq_maps, freq_maps, st.integers(min_value=1, max_value=24), st.integers(1, 4))
def test_assignment_d_stays_within_bounds_and_never_shrinks_while_hot(first, second, n, d_min):
    fish = FishSettings(d_min=d_min)
    ring = ConsistentHashRing.of_size(n, fish.virtual_nodes)
    before = assign_hot_keys(first, n, fish)
    after = assign_hot_keys({**first, **second}, n, fish, previous=before)
    for assignment, freqs, prior in (
        (before, first, {}),
        (after, {**first, **second}, before),
    ):
        total = sum(freqs.values())
        assert set(assignment) == {
            k for k, f in freqs.items() if f >= fish.hot_threshold(n) * total
        }
        hottest = max((freqs[k] for k in assignment), default=0.0)
        for key, workers in assignment.items():
            assert min(d_min, n) <= len(workers) <= n
            assert workers == ring.candidates(key, len(workers))
            wanted = hot_key_worker_count(freqs[key], hottest, n, d_min)
            assert len(workers) == max(wanted, len(prior.get(key, ())))
    for key in set(before) & set(after):
        assert len(after[key]) >= len(before[key])
        assert after[key][: len(before[key])] == before[key]


def test_a_hot_key_keeps_its_workers_when_it_cools_but_stays_hot():
    fish = FishSettings()
    first = assign_hot_keys({1: 1000.0, 2: 10.0}, 16, fish, total=1500.0)
    assert len(first[1]) == 16
    later = assign_hot_keys({1: 100.0, 3: 1000.0}, 16, fish, previous=first, total=1500.0)
    assert later[1] == first[1]
    assert 2 not in later
    gone = assign_hot_keys({3: 1000.0}, 16, fish, previous=later, total=1_000_000.0)
    assert gone == {}


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -4.0])
def test_assign_hot_keys_refuses_frequencies_that_are_not_counts(bad):
    # Regression: inf failed deep in the ring ("d must be in [1, 4], got
    # -9223372036854775808"); -4 shrank the total, so a 0.05 key became hot.
    with pytest.raises(ValueError, match="frequencies must be finite and non-negative"):
        assign_hot_keys({1: 5.0, 2: bad, 3: 0.05}, 4, FishSettings())
    with pytest.raises(ValueError, match="total"):
        assign_hot_keys({1: 5.0}, 4, FishSettings(), total=bad)


@pytest.mark.parametrize("selection", ["ring", "modulo"])
@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        ("user1", TypeError, "key 'user1' is a str"),
        (1.5, TypeError, "key 1.5 is a float"),
        (True, TypeError, "key True is a bool"),
        (None, TypeError, "key None is a NoneType"),
        (2**63, ValueError, f"key {2**63} is outside"),
        (np.uint64(2**64 - 1), ValueError, f"key {2**64 - 1} is outside"),
        (-(2**63) - 1, ValueError, f"key {-(2**63) - 1} is outside"),
    ],
)
def test_assign_hot_keys_names_a_key_that_is_not_an_int64_id(key, error, message, selection):
    # Regression: a str or a key past 2**63 - 1 failed inside numpy ("invalid
    # literal for int()", "Python int too large to convert to C long"), and
    # 1.5 or True came back silently as key 1.
    fish = FishSettings(candidate_selection=selection)
    with pytest.raises(error, match=re.escape(message)) as raised:
        assign_hot_keys({7: 5.0, key: 5.0}, 4, fish)
    assert "takes int64 key ids" in str(raised.value)


@pytest.mark.parametrize("selection", ["ring", "modulo"])
def test_assign_hot_keys_takes_every_int64_key(selection):
    placement = ConsistentHashRing.of_size(4) if selection == "ring" else ModuloPlacement(4)
    freqs = {-(2**63): 5.0, 2**63 - 1: 4.0, np.int64(-7): 3.0}
    assignment = assign_hot_keys(freqs, 4, FishSettings(), placement=placement)
    assert list(assignment) == [-(2**63), 2**63 - 1, -7]
    assert all(type(key) is int for key in assignment)
    assert assignment[2**63 - 1] == placement.candidates(2**63 - 1, len(assignment[2**63 - 1]))


@pytest.mark.parametrize("before", [(5, 6, 7), (0, 1, 2, 3), (1, 1)])
def test_a_previous_assignment_that_does_not_fit_the_workers_is_recomputed(before):
    # Regression: an entry from an 8-worker cluster was returned as is with
    # n = 2, naming instances the operator no longer has.
    ring = ConsistentHashRing.of_size(2)
    assignment = assign_hot_keys({1: 10.0}, 2, FishSettings(), previous={1: before})
    assert assignment == {1: ring.candidates(1, 2)}


def test_cold_keys_go_to_their_single_ring_worker():
    keys = np.arange(20_000, dtype=np.int64) % 5000
    fish = FishPartitioner(8)
    out = route_in_chunks(fish, keys, rate=1000.0)
    assert fish.hot_assignment == {}
    assert np.array_equal(out, ConsistentHashRing.of_size(8).owners(keys))


def test_fish_splits_a_hot_key_over_its_candidates_only():
    rng = np.random.default_rng(3)
    keys = np.where(rng.random(30_000) < 0.3, 42, rng.integers(1000, 100_000, 30_000))
    fish = FishPartitioner(8)
    out = route_in_chunks(fish, keys, rate=5000.0)
    workers_of_42 = fish.hot_assignment[42]
    late = np.arange(keys.size) >= 2000  # after the first epochs the key is known hot
    assert set(out[late & (keys == 42)].tolist()) == set(workers_of_42)
    assert len(workers_of_42) == 8  # the hottest key may use every worker


def test_fish_d_never_shrinks_while_a_key_stays_hot():
    rng = np.random.default_rng(5)
    phase1 = np.where(rng.random(20_000) < 0.4, 7, rng.integers(100, 10**6, 20_000))
    phase2 = np.where(rng.random(20_000) < 0.05, 7, rng.integers(100, 10**6, 20_000))
    phase2 = np.where(rng.random(20_000) < 0.3, 8, phase2)
    fish = FishPartitioner(16)
    route_in_chunks(fish, phase1, rate=10_000.0)
    d_hot = len(fish.hot_assignment[7])
    assert d_hot == 16
    route_in_chunks(fish, phase2, rate=10_000.0)
    assert 7 in fish.hot_assignment
    assert len(fish.hot_assignment[7]) == d_hot
    assert fish.recent_counts.estimate(8) > 4 * fish.recent_counts.estimate(7)


def test_fish_balances_zipf_1_2_over_16_workers_where_hash_does_not():
    keys = zipf_stream(1.2, 10_000, 120_000, seed=1)
    fish_load = np.bincount(route_in_chunks(FishPartitioner(16), keys, 20_000.0), minlength=16)
    hash_load = np.bincount(hash_worker(keys, 16), minlength=16)
    assert fish_load.max() / fish_load.mean() <= 1.1
    assert hash_load.max() / hash_load.mean() > 1.5


def test_fish_sends_more_hot_tuples_to_faster_workers():
    keys = np.full(40_000, 9, dtype=np.int64)
    capacities = np.array([2000.0, 1000.0, 2000.0, 1000.0])
    fish = FishPartitioner(4, capacities=capacities)
    out = route_in_chunks(fish, keys, rate=6000.0)
    steady = np.bincount(out[5000:], minlength=4)
    fast, slow = steady[[0, 2]].sum(), steady[[1, 3]].sum()
    assert fast / slow == pytest.approx(2.0, rel=0.05)


def test_observed_capacity_changes_the_choice():
    fish = FishPartitioner(2, FishSettings(epoch_length=100))
    fish.observe_capacity(0, tuples=3000, busy_seconds=1.0)
    fish.observe_capacity(1, tuples=1000, busy_seconds=1.0)
    assert fish.capacities.tolist() == [3000.0, 1000.0]
    out = fish.route(np.full(4100, 5, dtype=np.int64), np.zeros(4100))
    hot_part = np.bincount(out[100:], minlength=2)
    assert hot_part[0] / hot_part[1] == pytest.approx(3.0, rel=0.05)
    with pytest.raises(ValueError, match="capacity sample"):
        fish.observe_capacity(0, tuples=0, busy_seconds=1.0)


def test_inferred_backlog_drains_by_capacity_times_interval():
    settings_ = FishSettings(waiting_interval_s=10.0, default_capacity=100.0)
    fish = FishPartitioner(2, settings_)
    fish.route(np.arange(3000, dtype=np.int64), np.zeros(3000))
    sent = np.bincount(ConsistentHashRing.of_size(2).owners(np.arange(3000)), minlength=2)
    assert fish.waiting_times(0.0) == pytest.approx(sent / 100.0)
    assert fish.waiting_times(4.0) == pytest.approx(np.maximum(sent / 100.0 - 4.0, 0.0))
    fish.route(np.array([10**9], dtype=np.int64), np.array([25.0]))
    remaining = np.maximum(sent - 100.0 * 20.0, 0.0)
    owner = ConsistentHashRing.of_size(2).owner(10**9)
    remaining[owner] += 1
    assert fish.waiting_times(25.0) == pytest.approx(np.maximum(remaining / 100.0 - 5.0, 0.0))


def test_epochs_in_seconds_find_hot_keys_only_after_an_epoch_ends():
    fish = FishPartitioner(4, FishSettings(epoch_unit="seconds", epoch_length=2.0))
    keys = np.full(1000, 3, dtype=np.int64)
    fish.route(keys, np.linspace(0.0, 1.9, 1000))
    assert fish.hot_assignment == {}
    fish.route(keys, np.linspace(2.0, 3.0, 1000))
    assert len(fish.hot_assignment[3]) == 4
    assert fish.recent_counts.epochs == 1


def test_fish_is_a_partitioner_and_rejects_mismatched_input():
    fish = FishPartitioner(4)
    assert isinstance(fish, Partitioner)
    assert fish.name == "fish" and fish.n_workers == 4
    assert fish.route(np.empty(0, dtype=np.int64), np.empty(0)).size == 0
    with pytest.raises(ValueError, match="differ"):
        fish.route(np.arange(3, dtype=np.int64), np.zeros(2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fish_refuses_times_that_are_not_finite(bad):
    # Regression: a NaN or infinite time failed inside math.floor with a bare
    # "cannot convert float NaN to integer" (or an OverflowError).
    fish = FishPartitioner(4, FishSettings(epoch_unit="seconds", epoch_length=0.5))
    with pytest.raises(ValueError, match="times must be finite"):
        fish.route(np.array([1, 2], dtype=np.int64), np.array([0.0, bad]))
    assert fish.route(np.array([1, 2], dtype=np.int64), np.array([0.0, 1.0])).size == 2


def one_hot_epoch(rng: np.random.Generator, key: int, share: float, size: int = 1000) -> np.ndarray:
    """An epoch where ``key`` has about ``share`` of the tuples and the rest are all distinct."""
    rest = rng.choice(np.arange(10**6, 2 * 10**6), size=size, replace=False)
    return np.where(rng.random(size) < share, key, rest).astype(np.int64)


def test_decay_zero_classifies_on_the_last_epoch_alone():
    # Regression: the hot set used to be computed after the epoch's decay, so
    # with decay = 0 every count was already zero and no key was ever hot.
    rng = np.random.default_rng(11)
    first, second = one_hot_epoch(rng, 42, 0.3), one_hot_epoch(rng, 43, 0.0)
    forgetful = FishPartitioner(8, FishSettings(decay=0.0))
    forgetful.route(first, np.zeros(first.size))
    assert set(forgetful.hot_assignment) == {42}
    forgetful.route(second, np.zeros(second.size))
    assert forgetful.hot_assignment == {}  # 42 is absent from the last epoch
    remembering = FishPartitioner(8, FishSettings(decay=0.5))
    remembering.route(first, np.zeros(first.size))
    remembering.route(second, np.zeros(second.size))
    assert set(remembering.hot_assignment) == {42}  # 42 has 0.15/1.5 = 10% of the history


def test_decay_zero_splits_hot_keys_and_balances_zipf():
    keys = zipf_stream(1.2, 10_000, 120_000, seed=1)
    fish = FishPartitioner(16, FishSettings(decay=0.0))
    load = np.bincount(route_in_chunks(fish, keys, 20_000.0), minlength=16)
    assert len(fish.hot_assignment) > 0
    assert load.max() / load.mean() <= 1.1


def test_idle_epochs_count_as_epochs_so_decay_zero_forgets_across_a_gap():
    settings_ = FishSettings(epoch_unit="seconds", epoch_length=2.0)
    keys = np.full(1000, 3, dtype=np.int64)
    late = np.array([77], dtype=np.int64)
    for decay, still_hot in ((0.0, False), (0.5, True)):
        fish = FishPartitioner(4, dataclasses.replace(settings_, decay=decay))
        fish.route(keys, np.linspace(0.0, 1.9, 1000))
        fish.route(late, np.array([9.0]))  # closes [0, 2) and the empty [2, 4) … [6, 8)
        assert fish.recent_counts.epochs == 4
        assert (3 in fish.hot_assignment) is still_hot


def test_modulo_candidate_selection_routes_cold_keys_by_hash_mod_n():
    keys = np.arange(20_000, dtype=np.int64) % 5000
    fish = FishPartitioner(8, FishSettings(candidate_selection="modulo"))
    out = route_in_chunks(fish, keys, rate=1000.0)
    assert isinstance(fish.placement, ModuloPlacement)
    assert fish.hot_assignment == {}
    assert np.array_equal(out, hash_worker(keys, 8))


def test_modulo_candidate_selection_splits_a_hot_key_over_its_hashed_choices():
    rng = np.random.default_rng(3)
    keys = np.where(rng.random(30_000) < 0.1, 42, rng.integers(1000, 100_000, 30_000))
    fish = FishPartitioner(16, FishSettings(candidate_selection="modulo"))
    out = route_in_chunks(fish, keys, rate=5000.0)
    workers_of_42 = fish.hot_assignment[42]
    assert workers_of_42 == ModuloPlacement(16).candidates(42, len(workers_of_42))
    assert workers_of_42[0] == int(hash_worker(np.array([42]), 16)[0])
    late = np.arange(keys.size) >= 2000
    assert set(out[late & (keys == 42)].tolist()) == set(workers_of_42)


@pytest.mark.parametrize(
    ("selection", "low", "high"), [("ring", 0.02, 0.12), ("modulo", 0.85, 1.0)]
)
def test_only_the_ring_keeps_keys_in_place_when_a_worker_joins(selection, low, high):
    # 001 §6.5 (Fig. 17): without consistent hashing almost every key moves.
    keys = np.arange(50_000, dtype=np.int64)
    fish_settings = FishSettings(candidate_selection=selection)
    before = FishPartitioner(16, fish_settings).placement.owners(keys)
    after = FishPartitioner(17, fish_settings).placement.owners(keys)
    assert low < np.mean(before != after) < high


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 63), st.sampled_from([1.0, 2.0, 4.0, 8.0])),
        min_size=1,
        max_size=40,
    ),
    st.integers(min_value=1, max_value=300),
)
def test_greedy_fill_equals_placing_tuples_one_by_one(workers, count):
    # dyadic levels and capacities keep every sum exact, so ties are real ties
    levels = np.array([level / 8.0 for level, _ in workers])
    capacity = np.array([cap for _, cap in workers])
    busy = levels.tolist()
    expected = []
    for _ in range(count):
        worker = min(range(len(busy)), key=busy.__getitem__)
        busy[worker] += 1.0 / capacity[worker]
        expected.append(worker)
    assert greedy_fill(levels, capacity, count).tolist() == expected


def test_a_key_with_many_candidates_is_filled_in_bulk_evenly():
    n = 2 * BULK_CANDIDATES
    fish = FishPartitioner(n)
    keys = np.full(1000 * (n + 2), 5, dtype=np.int64)
    out = fish.route(keys, np.zeros(keys.size))
    assert len(fish.hot_assignment[5]) == n
    load = np.bincount(out, minlength=n)
    # the first epoch's 1000 tuples went to the ring owner; the others then
    # caught up with it before it got any more
    assert load.max() - load.min() <= 1
