"""Tests of key-pair statistics and their validation (paper 000 §3.2)."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.algorithms.pair_statistics import KeyWeights, PairStatistics, aggregate_pairs


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
