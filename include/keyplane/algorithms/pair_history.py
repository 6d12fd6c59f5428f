"""Pair statistics carried across windows, and the drift between them.

Beyond the paper, :class:`PairHistory` keeps pair statistics across windows
with FISH-style decay (paper 001 §4.1) instead of 000 §3.2's reset, and
measures how far each window's key shares moved from the history before it:
the drift a plan built on the history should expect
(:class:`~keyplane.algorithms.costmodel.Drift`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from keyplane.algorithms.costmodel import Drift, measure_drift
from keyplane.algorithms.pair_statistics import (
    BoolArray,
    KeyWeights,
    PairStatistics,
    aggregate_pairs,
)
from keyplane.algorithms.partitioner import KeyArray

HistoryMode = Literal["reset", "decay"]


@dataclass(frozen=True)
class HistoryPolicy:
    """How pair statistics carry over from one window to the next.

    ``reset`` keeps only the latest window, as paper 000 §3.2 does after each
    reconfiguration. ``decay`` multiplies the history by ``decay`` before adding
    each new window, FISH's inter-epoch decaying (paper 001 §4.1): older windows
    are weighted down, not dropped. FISH's own factor is missing from our copy
    of the paper; 0.5 (a window's weight halves per window, so the history
    spans about two windows) is our default. ``max_entries`` bounds the pairs
    and each stage's frequencies kept (heaviest first), as a SpaceSaving
    summary would. ``min_weight`` forgets entries that decayed below it, as
    :class:`keyplane.algorithms.statistics.StatisticsSettings` does (0: none is).
    """

    mode: HistoryMode = "decay"
    decay: float = 0.5
    max_entries: int | None = None
    min_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("reset", "decay"):
            raise ValueError(f"mode must be 'reset' or 'decay', got {self.mode!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must lie in (0, 1], got {self.decay}")
        if self.max_entries is not None and self.max_entries < 1:
            raise ValueError(f"max_entries must be ≥ 1 or None, got {self.max_entries}")
        if not (np.isfinite(self.min_weight) and self.min_weight >= 0):
            raise ValueError(f"min_weight must be ≥ 0, got {self.min_weight}")


def _merge_weights(
    old: KeyWeights, new: KeyWeights, decay: float, min_weight: float = 0.0
) -> KeyWeights:
    keys = np.union1d(old.keys, new.keys)
    weights = np.zeros(keys.size)
    np.add.at(weights, np.searchsorted(keys, old.keys), decay * old.weights)
    np.add.at(weights, np.searchsorted(keys, new.keys), new.weights)
    fresh = np.zeros(keys.size, dtype=np.bool_)
    fresh[np.searchsorted(keys, new.keys)] = new.weights > 0
    keep = fresh | (weights >= min_weight)
    return KeyWeights(keys[keep], weights[keep])


def _top_weights(weights: KeyWeights, limit: int | None) -> KeyWeights:
    if limit is None or weights.keys.size <= limit:
        return weights
    keep = np.sort(np.lexsort((weights.keys, -weights.weights))[:limit])
    return KeyWeights(weights.keys[keep], weights.weights[keep])


def _pairs_in(
    a_keys: KeyArray, b_keys: KeyArray, among_a: KeyArray, among_b: KeyArray
) -> BoolArray:
    """Whether each pair (a_keys[i], b_keys[i]) is one of the pairs (among_a, among_b)."""
    if among_a.size == 0:
        return np.zeros(a_keys.size, dtype=np.bool_)
    keys = np.unique(np.r_[a_keys, b_keys, among_a, among_b])
    width = np.int64(keys.size)
    code = np.searchsorted(keys, a_keys) * width + np.searchsorted(keys, b_keys)
    among = np.searchsorted(keys, among_a) * width + np.searchsorted(keys, among_b)
    return np.isin(code, among)


def _measured(before: KeyWeights, after: KeyWeights, n: int) -> Drift:
    return measure_drift(before.keys, before.weights, after.keys, after.weights, n)


class PairHistory:
    """Pair statistics accumulated over windows under a :class:`HistoryPolicy`."""

    def __init__(self, policy: HistoryPolicy | None = None, n_instances: int = 8) -> None:
        """``n_instances``: the parallelism the drift is probed on
        (:func:`~keyplane.algorithms.costmodel.measure_drift`)."""
        self.policy = policy if policy is not None else HistoryPolicy()
        self.n_instances = n_instances
        self._statistics = PairStatistics(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
        self.windows = 0
        self.drift: tuple[Drift, Drift] = (Drift(), Drift())
        """Per stage, how far each window's key shares moved from the statistics
        accumulated before it, exponentially smoothed: the drift a plan built on
        :attr:`statistics` should expect from the next window."""

    @property
    def statistics(self) -> PairStatistics:
        """The accumulated statistics, ready for
        :func:`~keyplane.algorithms.locality.build_plan`."""
        return self._statistics

    def add(self, window: PairStatistics) -> None:
        """Fold one window in: replace (``reset``) or decay-and-add (``decay``)."""
        if self.policy.mode == "reset" or self.windows == 0:
            old = PairStatistics(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
            decay = 0.0
        else:
            old = self._statistics
            decay = self.policy.decay
            n = self.n_instances
            self.drift = (
                self.drift[0].blend(
                    _measured(old.stage_weights("a"), window.stage_weights("a"), n)
                ),
                self.drift[1].blend(
                    _measured(old.stage_weights("b"), window.stage_weights("b"), n)
                ),
            )
        a_keys, b_keys, counts = aggregate_pairs(
            np.r_[old.a_keys, window.a_keys],
            np.r_[old.b_keys, window.b_keys],
            np.r_[decay * old.counts, window.counts],
        )
        if self.policy.min_weight > 0 and counts.size:
            seen_a, seen_b, _ = aggregate_pairs(window.a_keys, window.b_keys, window.counts)
            seen = _pairs_in(a_keys, b_keys, seen_a, seen_b)
            keep = seen | (counts >= self.policy.min_weight)
            a_keys, b_keys, counts = a_keys[keep], b_keys[keep], counts[keep]
        limit = self.policy.max_entries
        if limit is not None and counts.size > limit:
            keep = np.sort(np.lexsort((b_keys, a_keys, -counts))[:limit])
            a_keys, b_keys, counts = a_keys[keep], b_keys[keep], counts[keep]
        floor = self.policy.min_weight
        freq_a = _merge_weights(old.stage_weights("a"), window.stage_weights("a"), decay, floor)
        freq_b = _merge_weights(old.stage_weights("b"), window.stage_weights("b"), decay, floor)
        self._statistics = PairStatistics(
            a_keys,
            b_keys,
            counts,
            freq_a=_top_weights(freq_a, limit),
            freq_b=_top_weights(freq_b, limit),
        )
        self.windows += 1
