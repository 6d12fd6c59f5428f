"""Key-pair statistics of one window: what the planner plans from (paper 000 §3.2).

A window's statistics are the counts of the key pairs of consecutive stages
and, optionally, each stage's key frequencies. Statistics keep only the top
pairs, so a key's weight (its vertex weight in 000 §3.3's graph) is by default
the largest of its frequency and its pair totals: every tuple of a pair is also
a tuple of each of its keys. Statistics whose frequencies are a forecast of the
next window's loads set the two apart (:data:`StageWeighting`): the pairs
weigh the cut, the frequencies the balance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.partitioner import KeyArray

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

StageWeighting = Literal["max", "frequencies"]
"""How a stage's key weights, the loads the planner balances (000 §3.1), are read.

``"max"``: the larger of a key's frequency and its pair totals (module
docstring). ``"frequencies"``: the frequencies as given, every pair key among
them; the pair counts then weigh only the cut (000 §3.3's edge weights). A
forecast of the next window's loads is balanced this way while the cut keeps
a longer memory of which keys go together: a key forecast to fade still
weighs its pairs as often as they were seen, and stays with its partners
(:func:`keyplane.algorithms.forecast.reweighted`)."""


def _weighted_counts(index: npt.ArrayLike, weights: FloatArray, size: int) -> FloatArray:
    """Sum of ``weights`` per index value in ``[0, size)``."""
    return np.bincount(index, weights=weights, minlength=size).astype(np.float64, copy=False)


def _int64_keys(values: npt.ArrayLike, what: str) -> KeyArray:
    """Key ids as int64, refusing unsigned ids above the int64 range: the cast
    would wrap them onto negative ids (2**64 - 1 onto -1), merging two keys."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must hold integer key ids, got dtype {array.dtype}")
    int64_max = np.iinfo(np.int64).max
    if array.size and array.dtype.kind == "u" and int(array.max()) > int64_max:
        raise ValueError(f"{what} must hold key ids within int64, got {int(array.max())}")
    return array.astype(np.int64, copy=False)


def _weights(values: npt.ArrayLike, length: int, what: str) -> FloatArray:
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (length,):
        raise ValueError(f"{what} must have shape ({length},), got {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{what} must be finite and non-negative")
    return array


@dataclass(frozen=True)
class KeyWeights:
    """Per-key weights of one stage (key frequencies = vertex weights, 000 §3.3)."""

    keys: KeyArray
    weights: FloatArray

    def __post_init__(self) -> None:
        keys = _int64_keys(self.keys, "KeyWeights.keys")
        weights = _weights(self.weights, keys.size, "KeyWeights.weights")
        if np.unique(keys).size != keys.size:
            raise ValueError("KeyWeights.keys must be distinct")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "weights", weights)


@dataclass(frozen=True)
class PairStatistics:
    """Observed key pairs between stage A and stage B of one window (000 §3.2).

    ``counts[i]`` is how many tuples carried stage-A key ``a_keys[i]`` and
    stage-B key ``b_keys[i]``; a pair may repeat (counts add up). ``freq_a`` and
    ``freq_b`` are optional per-key frequencies: statistics keep only the top
    pairs, so a key can be more frequent than its pairs show. A key's weight is
    read as ``weighting`` says (:data:`StageWeighting`): by default the larger
    of its frequency and its pair total, since every tuple of a pair is also a
    tuple of each of its keys.
    """

    a_keys: KeyArray
    b_keys: KeyArray
    counts: FloatArray
    freq_a: KeyWeights | None = None
    freq_b: KeyWeights | None = None
    weighting: StageWeighting = "max"

    def __post_init__(self) -> None:
        a_keys = _int64_keys(self.a_keys, "a_keys")
        b_keys = _int64_keys(self.b_keys, "b_keys")
        if a_keys.size != b_keys.size:
            raise ValueError(
                f"a_keys and b_keys must have the same length, got {a_keys.size} and {b_keys.size}"
            )
        counts = _weights(self.counts, a_keys.size, "counts")
        object.__setattr__(self, "a_keys", a_keys)
        object.__setattr__(self, "b_keys", b_keys)
        object.__setattr__(self, "counts", counts)
        if self.weighting != "max":
            self.chain()  # the chain's checks of the weighting, with its errors

    def chain(self) -> ChainStatistics:
        """The same window as a two-stage chain."""
        return ChainStatistics(
            (self.freq_a, self.freq_b),
            (KeyPairs(self.a_keys, self.b_keys, self.counts),),
            self.weighting,
        )

    def stage_weights(self, stage: Literal["a", "b"]) -> KeyWeights:
        """Every known key of ``stage`` with its weight (:data:`StageWeighting`)."""
        pair_keys = self.a_keys if stage == "a" else self.b_keys
        frequencies = self.freq_a if stage == "a" else self.freq_b
        if self.weighting == "frequencies" and frequencies is not None:
            return frequencies
        keys, inverse = np.unique(pair_keys, return_inverse=True)
        pair_total = _weighted_counts(inverse, self.counts, keys.size)
        if frequencies is None:
            return KeyWeights(keys, pair_total)
        all_keys = np.union1d(keys, frequencies.keys)
        weights = np.zeros(all_keys.size)
        weights[np.searchsorted(all_keys, keys)] = pair_total
        at = np.searchsorted(all_keys, frequencies.keys)
        weights[at] = np.maximum(weights[at], frequencies.weights)
        return KeyWeights(all_keys, weights)


def aggregate_pairs(
    a_keys: KeyArray, b_keys: KeyArray, counts: FloatArray
) -> tuple[KeyArray, KeyArray, FloatArray]:
    """Sum the counts of repeated (a, b) pairs and drop zero counts."""
    if a_keys.size == 0:
        return a_keys, b_keys, counts
    a_unique, a_index = np.unique(a_keys, return_inverse=True)
    b_unique, b_index = np.unique(b_keys, return_inverse=True)
    code = a_index.astype(np.int64) * b_unique.size + b_index
    codes, inverse = np.unique(code, return_inverse=True)
    summed = _weighted_counts(inverse, counts, codes.size)
    keep = summed > 0
    codes = codes[keep]
    return a_unique[codes // b_unique.size], b_unique[codes % b_unique.size], summed[keep]


@dataclass(frozen=True)
class KeyPairs:
    """Key pairs between two consecutive stages: ``counts[i]`` tuples carried the
    upstream key ``up_keys[i]`` and the downstream key ``down_keys[i]``."""

    up_keys: KeyArray
    down_keys: KeyArray
    counts: FloatArray

    def __post_init__(self) -> None:
        up = _int64_keys(self.up_keys, "up_keys")
        down = _int64_keys(self.down_keys, "down_keys")
        if up.size != down.size:
            raise ValueError(
                f"up_keys and down_keys must have the same length, got {up.size} and {down.size}"
            )
        object.__setattr__(self, "up_keys", up)
        object.__setattr__(self, "down_keys", down)
        object.__setattr__(self, "counts", _weights(self.counts, up.size, "counts"))


@dataclass(frozen=True)
class ChainStatistics:
    """One window of a chain of k stages (000 §3.2): per-key frequencies of each
    stage (``None``: known from the pairs only) and the key pairs of each of
    the k − 1 consecutive stage pairs, upstream first.

    A key's weight is read as ``weighting`` says (:data:`StageWeighting`): by
    default the largest of its frequency and its pair totals with either
    neighbour, since every tuple of a pair is also a tuple of each of its keys
    (statistics keep only the top pairs).
    """

    frequencies: tuple[KeyWeights | None, ...]
    links: tuple[KeyPairs, ...] = ()
    weighting: StageWeighting = "max"

    def __post_init__(self) -> None:
        object.__setattr__(self, "frequencies", tuple(self.frequencies))
        object.__setattr__(self, "links", tuple(self.links))
        if not self.frequencies:
            raise ValueError("a chain has at least one stage")
        if len(self.links) != len(self.frequencies) - 1:
            raise ValueError(
                f"a chain of {len(self.frequencies)} stages has {len(self.frequencies) - 1} "
                f"links, got {len(self.links)}"
            )
        if self.weighting not in ("max", "frequencies"):
            raise ValueError(f"weighting must be 'max' or 'frequencies', got {self.weighting!r}")
        if self.weighting == "frequencies":
            self._check_given_weights()

    def _check_given_weights(self) -> None:
        """Every stage weighed, every pair key among its stage's weights: a key the
        balance does not know would otherwise weigh nothing and lose its table entry."""
        for stage, frequencies in enumerate(self.frequencies):
            if frequencies is None:
                raise ValueError(
                    f"weighting 'frequencies' needs every stage's frequencies; stage {stage} "
                    f"has none"
                )
            paired = self.paired_keys(stage)
            unweighed = paired[~np.isin(paired, frequencies.keys)]
            if unweighed.size:
                raise ValueError(
                    f"weighting 'frequencies': stage {stage}'s frequencies miss "
                    f"{unweighed.size} of its pair keys (e.g. {int(unweighed[0])})"
                )

    @classmethod
    def of_events(cls, events: npt.ArrayLike) -> ChainStatistics:
        """The exact statistics of a window of tuples, one row per tuple and one column
        of int64 keys per stage: every key's count and every consecutive pair's."""
        keys = np.asarray(events)
        if keys.ndim != 2 or keys.shape[1] == 0:
            raise ValueError(f"events must be a (tuples, stages) array, got shape {keys.shape}")

        def weights(column: KeyArray) -> KeyWeights:
            unique, counts = np.unique(column, return_counts=True)
            return KeyWeights(unique, counts.astype(np.float64))

        def pairs(up: KeyArray, down: KeyArray) -> KeyPairs:
            both, counts = np.unique(np.column_stack([up, down]), axis=0, return_counts=True)
            return KeyPairs(both[:, 0], both[:, 1], counts.astype(np.float64))

        stages = keys.shape[1]
        return cls(
            tuple(weights(keys[:, s]) for s in range(stages)),
            tuple(pairs(keys[:, s], keys[:, s + 1]) for s in range(stages - 1)),
        )

    @property
    def n_stages(self) -> int:
        return len(self.frequencies)

    def _sides(self, stage: int) -> list[tuple[KeyArray, FloatArray]]:
        """The ``stage``-th stage's keys in each link it is part of, with the pairs'
        counts: as the downstream side of the link before it, the upstream side of
        the link after it."""
        sides: list[tuple[KeyArray, FloatArray]] = []
        if stage > 0:
            link = self.links[stage - 1]
            sides.append((link.down_keys, link.counts))
        if stage < len(self.links):
            link = self.links[stage]
            sides.append((link.up_keys, link.counts))
        return sides

    def paired_keys(self, stage: int) -> KeyArray:
        """The keys of the ``stage``-th stage that appear in a pair with a neighbour,
        sorted and unique."""
        sides = [keys for keys, _ in self._sides(stage)]
        return np.unique(np.concatenate(sides)) if sides else np.zeros(0, dtype=np.int64)

    def stage_weights(self, stage: int) -> KeyWeights:
        """Every known key of the ``stage``-th stage with its weight (class docstring)."""
        given = self.frequencies[stage]
        if self.weighting == "frequencies" and given is not None:
            return given
        known: list[tuple[KeyArray, FloatArray]] = []
        for pair_keys, counts in self._sides(stage):
            keys, inverse = np.unique(pair_keys, return_inverse=True)
            known.append((keys, _weighted_counts(inverse, counts, keys.size)))
        frequencies = self.frequencies[stage]
        if frequencies is not None:
            known.append((frequencies.keys, frequencies.weights))
        if not known:
            return KeyWeights(np.zeros(0, dtype=np.int64), np.zeros(0))
        all_keys = np.unique(np.concatenate([keys for keys, _ in known]))
        weights = np.zeros(all_keys.size)
        for keys, values in known:
            at = np.searchsorted(all_keys, keys)
            weights[at] = np.maximum(weights[at], values)
        return KeyWeights(all_keys, weights)
