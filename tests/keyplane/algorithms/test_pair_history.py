"""Tests of pair statistics carried across windows (reset, FISH-style decay)."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import PairStatistics


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
