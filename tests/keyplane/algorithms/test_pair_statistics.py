"""Tests of key-pair statistics and their validation (paper 000 §3.2)."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.algorithms.pair_statistics import (
    ChainStatistics,
    KeyPairs,
    KeyWeights,
    PairStatistics,
    aggregate_pairs,
)


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


def test_pair_statistics_reject_unequal_lengths_and_negative_counts() -> None:
    with pytest.raises(ValueError, match="same length"):
        PairStatistics(np.array([1, 2]), np.array([1]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="non-negative"):
        PairStatistics(np.array([1]), np.array([1]), np.array([-1.0]))


def test_chain_statistics_of_events_counts_every_key_and_consecutive_pair() -> None:
    events = np.array([[1, 10, 100], [1, 10, 101], [2, 10, 100], [1, 11, 100]])
    chain = ChainStatistics.of_events(events)
    assert chain.n_stages == 3
    middle = chain.stage_weights(1)
    assert dict(zip(middle.keys.tolist(), middle.weights.tolist(), strict=True)) == {
        10: 3.0,
        11: 1.0,
    }
    first, second = chain.links
    assert sorted(
        zip(first.up_keys.tolist(), first.down_keys.tolist(), first.counts.tolist(), strict=True)
    ) == [
        (1, 10, 2.0),
        (1, 11, 1.0),
        (2, 10, 1.0),
    ]
    assert sorted(
        zip(second.up_keys.tolist(), second.down_keys.tolist(), second.counts.tolist(), strict=True)
    ) == [
        (10, 100, 2.0),
        (10, 101, 1.0),
        (11, 100, 1.0),
    ]


def test_chain_statistics_of_events_refuses_a_flat_array() -> None:
    with pytest.raises(ValueError, match=r"\(tuples, stages\) array"):
        ChainStatistics.of_events(np.array([1, 2, 3]))


def test_given_weights_are_balanced_as_given_and_must_weigh_every_pair_key() -> None:
    links = (KeyPairs(np.array([1, 2]), np.array([10, 10]), np.array([8.0, 4.0])),)
    forecast = (
        KeyWeights(np.array([1, 2]), np.array([1.0, 6.0])),
        KeyWeights(np.array([10]), np.array([7.0])),
    )
    as_max = ChainStatistics(forecast, links)
    given = ChainStatistics(forecast, links, "frequencies")
    # by default a key weighs at least its pairs (8 > 1, 12 > 7); given, it weighs its frequency
    np.testing.assert_allclose(as_max.stage_weights(0).weights, [8.0, 6.0])
    np.testing.assert_allclose(as_max.stage_weights(1).weights, [12.0])
    assert given.stage_weights(0) == forecast[0] and given.stage_weights(1) == forecast[1]
    pairs = PairStatistics(
        links[0].up_keys, links[0].down_keys, links[0].counts, *forecast, weighting="frequencies"
    )
    assert pairs.stage_weights("a") == forecast[0] and pairs.chain().weighting == "frequencies"

    with pytest.raises(ValueError, match="stage 1 has none"):
        ChainStatistics((forecast[0], None), links, "frequencies")
    with pytest.raises(
        ValueError, match=r"stage 0's frequencies miss 1 of its pair keys \(e.g. 2\)"
    ):
        ChainStatistics(
            (KeyWeights(np.array([1]), np.array([1.0])), forecast[1]), links, "frequencies"
        )
    with pytest.raises(ValueError, match="stage 1's frequencies miss"):
        PairStatistics(
            links[0].up_keys, links[0].down_keys, links[0].counts, forecast[0],
            KeyWeights(np.array([11]), np.array([1.0])), weighting="frequencies",
        )  # fmt: skip
    with pytest.raises(ValueError, match="weighting must be"):
        ChainStatistics(forecast, links, "sum")
