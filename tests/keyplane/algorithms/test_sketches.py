"""Tests of keyplane.algorithms.sketches: SpaceSaving bounds, merging, serialisation, decay."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Hashable, Mapping

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.sketches import EpochTopK, SpaceSaving, aggregate_items

streams = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=300)
capacities = st.integers(min_value=1, max_value=12)
chunk_counts = st.integers(min_value=1, max_value=6)


def _feed(sketch: SpaceSaving, items: list[int], chunks: int) -> None:
    for chunk in np.array_split(np.array(items, dtype=np.int64), chunks):
        sketch.update_many(chunk)


def _assert_bounds(sketch: SpaceSaving, truth: Mapping[Hashable, float], universe: list) -> None:
    """The SpaceSaving guarantees, checked for every item of the universe."""
    n, m = sketch.total, sketch.capacity
    assert n == pytest.approx(sum(truth.values()))
    assert len(sketch) <= m
    for item in universe:
        true = truth.get(item, 0)
        est, err = sketch.estimate(item), sketch.error(item)
        assert true <= est + 1e-9
        assert est - err <= true + 1e-9
        assert est - true <= n / m + 1e-9
        assert err <= n / m + 1e-9
        if true > n / m:
            assert item in sketch


@settings(max_examples=150, deadline=None)
@given(streams, capacities, chunk_counts)
def test_spacesaving_bounds_hold_for_chunked_int_streams(items, m, chunks):
    sketch = SpaceSaving(m)
    _feed(sketch, items, chunks)
    _assert_bounds(sketch, Counter(items), list(range(41)))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(1, 5)), min_size=1, max_size=200
    ),
    capacities,
    chunk_counts,
)
def test_spacesaving_bounds_hold_for_weighted_pairs(rows, m, chunks):
    arr = np.array(rows, dtype=np.int64)
    sketch = SpaceSaving(m)
    for chunk in np.array_split(arr, chunks):
        sketch.update_many(chunk[:, :2], weights=chunk[:, 2])
    truth: Counter[Hashable] = Counter()
    for a, b, w in rows:
        truth[(a, b)] += w
    _assert_bounds(sketch, truth, [(a, b) for a in range(7) for b in range(7)])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([-(2**40), -1, 0, 2**33, 2**62]), st.integers(-3, 3)),
        max_size=120,
    ),
    capacities,
)
def test_spacesaving_bounds_hold_for_pairs_outside_31_bits(pairs, m):
    sketch = SpaceSaving(m)
    if pairs:
        sketch.update_many(np.array(pairs, dtype=np.int64))
    universe = [(a, b) for a in [-(2**40), -1, 0, 2**33, 2**62] for b in range(-3, 4)]
    _assert_bounds(sketch, Counter(pairs), universe)


@settings(max_examples=120, deadline=None)
@given(st.lists(streams, min_size=2, max_size=4), capacities)
def test_merge_preserves_bounds_on_the_merged_stream(parts, m):
    sketches = []
    for part in parts:
        sketch = SpaceSaving(m)
        _feed(sketch, part, 2)
        sketches.append(sketch)
    merged = sketches[0]
    for other in sketches[1:]:
        merged = merged.merge(other)
    whole = [x for part in parts for x in part]
    _assert_bounds(merged, Counter(whole), list(range(41)))


def test_merge_of_unfull_sketches_is_exact_and_leaves_inputs_unchanged():
    a, b = SpaceSaving(10), SpaceSaving(10)
    a.update_many(np.array([1, 1, 2]))
    b.update_many(np.array([2, 3, 3, 3]))
    merged = a.merge(b)
    assert merged.counts() == {1: 2, 2: 2, 3: 3}
    assert all(merged.error(k) == 0 for k in (1, 2, 3))
    assert merged.total == 7
    assert a.counts() == {1: 2, 2: 1} and b.counts() == {2: 1, 3: 3}


def test_merge_rejects_different_capacities():
    with pytest.raises(ValueError, match="capacity"):
        SpaceSaving(3).merge(SpaceSaving(4))


def test_new_item_replaces_the_minimum_and_inherits_its_count():
    sketch = SpaceSaving(2)
    for item in [1, 1, 2, 3]:
        sketch.update(item)
    assert sketch.counts() == {1: 2, 3: 2}
    assert sketch.error(3) == 1 and sketch.error(1) == 0
    assert sketch.estimate(2) == 2  # unmonitored: bounded by the minimum counter
    assert [f.item for f in sketch.top(1)] == [1]


def test_chunk_newcomers_enter_by_decreasing_weight_so_a_heavy_one_survives():
    sketch = SpaceSaving(2)
    sketch.update_many(np.array([5, 6, 7, 7, 7, 7]))
    assert 7 in sketch
    assert sketch.top(1)[0].item == 7


def test_pairs_are_stored_as_tuples_and_counted_exactly_when_they_fit():
    sketch = SpaceSaving(100)
    pairs = np.array([[1, 2], [1, 2], [2, 1], [1, 3]], dtype=np.int64)
    sketch.update_many(pairs)
    assert sketch.counts() == {(1, 2): 2, (2, 1): 1, (1, 3): 1}


def test_generic_hashables_and_negative_weights():
    sketch = SpaceSaving(4)
    sketch.update_many(["a", "b", "a"])
    assert sketch.counts() == {"a": 2, "b": 1}
    with pytest.raises(ValueError, match="non-negative"):
        sketch.update_many(np.array([1]), weights=np.array([-1.0]))


def test_aggregate_items_sums_weights_per_distinct_item():
    items, weights = aggregate_items(np.array([3, 1, 3]), np.array([0.5, 2.0, 1.5]))
    assert dict(zip(items, weights, strict=True)) == {1: 2.0, 3: 2.0}


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        SpaceSaving(0)


@pytest.mark.parametrize(
    "items",
    [np.array([5, 5, 9, 1, 2, 2, 2], dtype=np.int64), np.array([[1, 2], [1, 2], [3, 4], [5, 6]])],
)
def test_dict_round_trip_is_json_and_arrow_friendly_and_behaves_identically(items):
    sketch = SpaceSaving(3)
    sketch.update_many(items)
    data = sketch.to_dict()
    restored = SpaceSaving.from_dict(json.loads(json.dumps(data)))
    table = pa.table({k: v for k, v in data.items() if isinstance(v, list)})
    assert table.num_rows == len(sketch)
    from_arrow = SpaceSaving.from_dict(
        {**table.to_pydict(), "capacity": data["capacity"], "total": data["total"]}
    )
    for copy in (restored, from_arrow):
        assert copy.counts() == sketch.counts()
        assert copy.total == sketch.total
    sketch.update_many(items[:3])
    restored.update_many(items[:3])
    assert restored.counts() == sketch.counts()


def test_columns_are_equal_length_numpy_arrays():
    sketch = SpaceSaving(5)
    sketch.update_many(np.array([[1, 2], [3, 4], [3, 4]]))
    cols = sketch.columns()
    assert set(cols) == {"key_0", "key_1", "count", "error"}
    assert {len(c) for c in cols.values()} == {2}
    assert sorted(cols["count"].tolist()) == [1, 2]


def test_scale_multiplies_counts_and_total_and_zero_forgets():
    sketch = SpaceSaving(4)
    sketch.update_many(np.array([1, 1, 1, 1, 2, 2]))
    sketch.scale(0.25)
    assert sketch.counts() == {1: 1.0, 2: 0.5}
    assert sketch.total == 1.5
    sketch.update(2, 1)
    assert sketch.estimate(2) == pytest.approx(1.5)
    sketch.scale(0.0)
    assert len(sketch) == 0 and sketch.total == 0


def test_items_at_least_returns_only_heavy_items():
    sketch = SpaceSaving(8)
    sketch.update_many(np.array([1] * 10 + [2] * 3 + [3]))
    assert sketch.items_at_least(3) == {1: 10, 2: 3}


def test_epoch_topk_replace_min_inherits_min_plus_one():
    topk = EpochTopK(capacity=2, decay=0.5)
    topk.update_many(np.array([1, 1, 1, 2]))
    topk.update_many(np.array([3]))
    assert topk.frequencies() == {1: 3.0, 3: 2.0}


def test_epoch_topk_decays_once_per_epoch_not_per_tuple():
    topk = EpochTopK(capacity=4, decay=0.5)
    topk.update_many(np.array([7, 7]))
    topk.update_many(np.array([7, 7]))
    assert topk.frequencies() == {7: 4.0}
    topk.end_epoch()
    assert topk.frequencies() == {7: 2.0}
    assert topk.total == 2.0
    topk.end_epoch(epochs=2)
    assert topk.frequencies() == {7: 0.5}
    assert topk.epochs == 3


def test_epoch_topk_prefers_recent_keys_where_lifetime_counting_does_not():
    recent = EpochTopK(capacity=8, decay=0.5)
    lifetime = SpaceSaving(8)
    old_burst = np.full(100, 1, dtype=np.int64)
    recent.update_many(old_burst)
    lifetime.update_many(old_burst)
    recent.end_epoch()
    for _ in range(3):
        steady = np.full(30, 2, dtype=np.int64)
        recent.update_many(steady)
        lifetime.update_many(steady)
        recent.end_epoch()
    assert lifetime.estimate(1) > lifetime.estimate(2)
    freqs = recent.frequencies()
    assert freqs[2] == pytest.approx(30 * (0.5 + 0.25 + 0.125))
    assert freqs[1] == pytest.approx(100 * 0.5**4)
    assert recent.frequencies_at_least(0.5) == {2: freqs[2]}


def test_epoch_topk_stays_exact_over_hundreds_of_epochs():
    topk = EpochTopK(capacity=4, decay=0.5)
    for _ in range(700):
        topk.update_many(np.array([1]))
        topk.end_epoch()
    assert topk.frequencies()[1] == pytest.approx(1.0)
    assert topk.total == pytest.approx(1.0)
    topk.update_many(np.array([2, 2]))
    assert topk.frequencies()[2] == pytest.approx(2.0)


def test_epoch_topk_merge_combines_streams():
    a, b = EpochTopK(4, 0.5), EpochTopK(4, 0.5)
    a.update_many(np.array([1, 1]))
    b.update_many(np.array([1, 2]))
    merged = a.merge(b)
    assert merged.frequencies() == {1: 3.0, 2: 1.0}
    with pytest.raises(ValueError, match="decay"):
        a.merge(EpochTopK(4, 0.9))


def test_epoch_topk_rejects_bad_decay():
    with pytest.raises(ValueError, match="decay"):
        EpochTopK(4, 1.5)
