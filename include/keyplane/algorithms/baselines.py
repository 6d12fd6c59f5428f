"""Baseline stream partitioners that keyplane's routing is compared against.

Every class here implements the :class:`keyplane.algorithms.partitioner.Partitioner`
protocol. They are the comparison points of paper 000 §4 (hash-based fields
grouping) and paper 001 §6 (shuffle grouping, partial key grouping, D-Choices
and W-Choices).

:func:`hash_worker` is also the *hash fallback* of keyplane's routing tables
(paper 000 §3.3): a key absent from a table goes to ``hash_worker(key, n)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.partitioner import KeyArray, TimeArray, WorkerArray
from keyplane.algorithms.sketches import SpaceSaving

Int64Array = npt.NDArray[np.int64]
UInt64Array = npt.NDArray[np.uint64]

_SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_MULT_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MULT_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_30 = np.uint64(30)
_SHIFT_27 = np.uint64(27)
_SHIFT_31 = np.uint64(31)


def mix64(keys: npt.ArrayLike, seed: int = 0) -> UInt64Array:
    """Hash int64 ids to well-mixed uint64 values (SplitMix64 finaliser).

    Why this hash: it is fixed (no per-process salt, unlike Python's ``hash``
    of strings), a bijection on 64 bits, passes avalanche tests, and is a few
    vectorised numpy operations, so every process and every language can
    reproduce a key's worker. ``seed`` selects an independent member of the
    family (``seed`` is added as ``seed * golden_gamma`` before mixing), which
    partial key grouping uses for its second choice.

    The value for id ``x`` and seed ``s`` is ``splitmix64(x + (s + 1) * γ)``
    with ``γ = 0x9E3779B97F4A7C15`` and all arithmetic modulo 2^64.
    """
    z = np.asarray(keys, dtype=np.int64).astype(np.uint64, copy=True)
    offset = np.array([seed + 1], dtype=np.uint64) * _SPLITMIX_GAMMA
    z += offset
    z ^= z >> _SHIFT_30
    z *= _MIX_MULT_1
    z ^= z >> _SHIFT_27
    z *= _MIX_MULT_2
    z ^= z >> _SHIFT_31
    return z


def hash_worker(keys: npt.ArrayLike, n_workers: int, seed: int = 0) -> Int64Array:
    """Worker of each key under hash-based fields grouping: ``mix64(key) mod n``.

    This is the hash fallback of paper 000 §3.3 and the baseline of §4: a key
    always goes to the same worker, whatever its load. ``n_workers`` must be
    positive.
    """
    if n_workers <= 0:
        raise ValueError(f"n_workers must be positive, got {n_workers}")
    return (mix64(keys, seed) % np.uint64(n_workers)).astype(np.int64)


def _check_workers(n_workers: int) -> int:
    if not isinstance(n_workers, int | np.integer) or n_workers < 1:
        raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
    return int(n_workers)


def _as_keys(keys: KeyArray) -> Int64Array:
    return np.asarray(keys, dtype=np.int64).reshape(-1)


class HashPartitioner:
    """Fields grouping: every tuple of a key goes to ``hash_worker(key, n)``.

    The baseline of paper 000 §4 and paper 001 §2.2 ("FG"): no state
    duplication, but a hot key overloads its one worker.
    """

    name = "hash"

    def __init__(self, n_workers: int) -> None:
        self.n_workers = _check_workers(n_workers)

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        """Route a chunk; ``times`` is ignored."""
        return hash_worker(_as_keys(keys), self.n_workers)


class ShufflePartitioner:
    """Shuffle grouping: tuples go round-robin, whatever their key (001 §2.2, "SG").

    Perfect balance, but every worker ends up holding state for almost every
    key: the memory upper bound FISH is compared with.
    """

    name = "shuffle"

    def __init__(self, n_workers: int) -> None:
        self.n_workers = _check_workers(n_workers)
        self._next = 0

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        """Route a chunk; continues the rotation where the last chunk stopped."""
        size = _as_keys(keys).size
        out = (np.arange(size, dtype=np.int64) + self._next) % self.n_workers
        self._next = (self._next + size) % self.n_workers
        return out


def two_choices(keys: KeyArray, n_workers: int) -> tuple[Int64Array, Int64Array]:
    """The two hash choices of partial key grouping: seeds 0 and 1 of :func:`hash_worker`.

    The first choice is the key's fields-grouping worker. The choices are
    independent hashes, as in PKG, so they coincide for about 1/n of keys.
    """
    return hash_worker(keys, n_workers, seed=0), hash_worker(keys, n_workers, seed=1)


class PKGPartitioner:
    """Partial key grouping (Nasir et al. 2015; paper 001 §2.2, "PKG").

    Each key has two hashed workers; each tuple goes to the one this source
    has sent fewer tuples to (local load estimation: sources never talk to
    each other or to workers). A key's state is split over at most two
    workers, which is not enough when one key alone exceeds 2/n of the
    stream (001 §2.3).
    """

    name = "pkg"

    def __init__(self, n_workers: int) -> None:
        self.n_workers = _check_workers(n_workers)
        self._load = [0] * self.n_workers

    @property
    def load(self) -> Int64Array:
        """Tuples this partitioner has sent to each worker."""
        return np.array(self._load, dtype=np.int64)

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        """Route a chunk; a tuple-by-tuple loop, since each choice sees the previous ones."""
        first, second = two_choices(_as_keys(keys), self.n_workers)
        load = self._load
        out: list[int] = []
        append = out.append
        for a, b in zip(first.tolist(), second.tolist(), strict=True):
            if load[b] < load[a]:
                a = b
            load[a] += 1
            append(a)
        return np.array(out, dtype=np.int64)


@dataclass(frozen=True)
class ChoicesSettings:
    """Parameters of D-Choices and W-Choices (Nasir et al. 2016), validated at construction.

    Attributes:
        theta_scale: a key is a heavy hitter ("head") when its share of the
            stream is at least ``θ = theta_scale / n``. Default 0.2: the
            paper's θ = 1/(5n).
        sketch_capacity: SpaceSaving counters that find the head. Must be at
            least ``1/θ`` (checked by the partitioners), since at most ``1/θ``
            keys can have share θ. Default 1024.
        refresh_tuples: the head set and ``d`` are recomputed every this many
            tuples rather than per tuple, so membership can be tested in one
            vectorised lookup per segment. Default 1000.
        epsilon: tolerance of the D-Choices balance condition
            (:func:`dchoices_worker_count`). Default 1e-4.
    """

    theta_scale: float = 0.2
    sketch_capacity: int = 1024
    refresh_tuples: int = 1000
    epsilon: float = 1e-4

    def __post_init__(self) -> None:
        if not 0.0 < self.theta_scale <= 1.0:
            raise ValueError(f"theta_scale must be in (0, 1], got {self.theta_scale}")
        if self.sketch_capacity < 1:
            raise ValueError(f"sketch_capacity must be positive, got {self.sketch_capacity}")
        if self.refresh_tuples < 1:
            raise ValueError(f"refresh_tuples must be positive, got {self.refresh_tuples}")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon}")


def dchoices_worker_count(
    head_shares: Sequence[float], tail_share: float, n_workers: int, epsilon: float = 1e-4
) -> int:
    """Choices per head key under D-Choices (Nasir et al. 2016), the authors' own rule.

    Hashes collide: ``d`` hashed choices reach only ``b(d) = n − n((n−1)/n)^d``
    distinct workers in expectation, so the rule is written in reached
    workers, not in ``d``. With ``h`` head keys of total share ``p_H``, the
    hottest of share ``p_1``, and tail share ``p_T``, ``d`` is the smallest
    value from ``max(2, round(p_1·n))`` meeting both

        p_H + p_T · (b(h·d)/n)^2 <= b(h·d)/n + ε
            (the workers the whole head reaches take the head and the tail
            tuples whose two PKG choices both fall among them, within their
            fair share), and
        p_1 + (p_H − p_1) · (b(d)/n)^d + p_T · (b(d)/n)^2 <= b(d)/n + ε
            (the same for the workers the hottest key alone reaches).

    ``n`` when no ``d < n`` does: the head key may then use every worker, as
    under W-Choices (:class:`DChoicesPartitioner` gives it all ``n``, not ``n``
    colliding hashes). Never fewer than PKG's two choices.
    """
    n = _check_workers(n_workers)
    shares = sorted((float(s) for s in head_shares), reverse=True)
    if not shares or n <= 2:
        return min(2, n)
    head, top, tail = sum(shares), shares[0], float(tail_share)
    miss = (n - 1) / n

    def meets(d: int) -> bool:
        reached_head = 1.0 - miss ** (len(shares) * d)
        reached_top = 1.0 - miss**d
        whole_head = head + tail * reached_head**2 <= reached_head + epsilon
        hottest = (
            top + (head - top) * reached_top**d + tail * reached_top**2 <= reached_top + epsilon
        )
        return whole_head and hottest

    for d in range(max(2, round(top * n)), n):
        if meets(d):
            return d
    return n


class _HeadChoicesPartitioner:
    """Shared machinery of D-Choices and W-Choices: PKG for the tail, more choices for the head.

    A lifetime SpaceSaving sketch (not decayed: that is what paper 001 §6.4
    criticises) finds the head. Head membership and ``d`` are refreshed every
    ``refresh_tuples`` tuples; the routing itself is a per-tuple loop because
    every choice depends on the loads left by the previous one.
    """

    name = "choices"

    def __init__(self, n_workers: int, settings: ChoicesSettings | None) -> None:
        self.n_workers = _check_workers(n_workers)
        self.settings = settings or ChoicesSettings()
        most_head = math.ceil(n_workers / self.settings.theta_scale)
        if self.settings.sketch_capacity < most_head:
            raise ValueError(
                f"sketch_capacity {self.settings.sketch_capacity} cannot hold the up to "
                f"{most_head} head keys of {n_workers} workers"
            )
        self._sketch = SpaceSaving(self.settings.sketch_capacity)
        self._load = [0] * self.n_workers
        self._head: dict[int, tuple[int, ...]] = {}
        self._head_keys = np.empty(0, dtype=np.int64)

    @property
    def load(self) -> Int64Array:
        """Tuples this partitioner has sent to each worker."""
        return np.array(self._load, dtype=np.int64)

    @property
    def head_choices(self) -> dict[int, tuple[int, ...]]:
        """Current head keys and the workers each may use."""
        return dict(self._head)

    def _head_workers(
        self, head: Mapping[int, float], tail_share: float
    ) -> dict[int, tuple[int, ...]]:
        raise NotImplementedError

    def _refresh_head(self) -> None:
        total = float(self._sketch.total)
        if total <= 0:
            return
        cutoff = self.settings.theta_scale / self.n_workers * total
        head = {
            int(key): float(count) / total  # type: ignore[call-overload]
            for key, count in self._sketch.items_at_least(cutoff).items()
        }
        self._head = self._head_workers(head, max(0.0, 1.0 - sum(head.values())))
        self._head_keys = np.array(sorted(self._head), dtype=np.int64)

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        """Route a chunk; ``times`` is ignored."""
        key_arr = _as_keys(keys)
        out = np.empty(key_arr.size, dtype=np.int64)
        step = self.settings.refresh_tuples
        for start in range(0, key_arr.size, step):
            segment = key_arr[start : start + step]
            out[start : start + segment.size] = self._route_segment(segment)
            self._sketch.update_many(segment)
            self._refresh_head()
        return out

    def _route_segment(self, keys: Int64Array) -> Int64Array:
        first, second = two_choices(keys, self.n_workers)
        head_keys = self._head_keys
        if head_keys.size:
            index = np.minimum(np.searchsorted(head_keys, keys), head_keys.size - 1)
            is_head = (head_keys[index] == keys).tolist()
        else:
            is_head = [False] * keys.size
        load, head, pick = self._load, self._head, self._load.__getitem__
        out: list[int] = []
        append = out.append
        for key, a, b, in_head in zip(
            keys.tolist(), first.tolist(), second.tolist(), is_head, strict=True
        ):
            if in_head:
                a = min(head[key], key=pick)
            elif load[b] < load[a]:
                a = b
            load[a] += 1
            append(a)
        return np.array(out, dtype=np.int64)


class DChoicesPartitioner(_HeadChoicesPartitioner):
    """D-Choices (Nasir et al. 2016; paper 001 §2.2, "D-C").

    Tail keys use PKG's two choices; each head key gets ``d`` hashed choices
    (seeds ``0 … d−1`` of :func:`hash_worker`), ``d`` from
    :func:`dchoices_worker_count`, and goes to the least loaded of them. When
    ``d`` reaches ``n`` a head key may use every worker, as the authors'
    simulator does: ``n`` hashed seeds would reach only about 63 % of them.
    """

    name = "d-choices"

    def __init__(self, n_workers: int, settings: ChoicesSettings | None = None) -> None:
        super().__init__(n_workers, settings)

    @property
    def d(self) -> int:
        """Choices each head key currently has (2 while there is no head)."""
        return max((len(w) for w in self._head.values()), default=min(2, self.n_workers))

    def _head_workers(
        self, head: Mapping[int, float], tail_share: float
    ) -> dict[int, tuple[int, ...]]:
        if not head:
            return {}
        d = dchoices_worker_count(
            list(head.values()), tail_share, self.n_workers, self.settings.epsilon
        )
        if d >= self.n_workers:
            return dict.fromkeys(head, tuple(range(self.n_workers)))
        keys = np.array(list(head), dtype=np.int64)
        choices = np.stack([hash_worker(keys, self.n_workers, seed=j) for j in range(d)], axis=1)
        return {k: tuple(row) for k, row in zip(keys.tolist(), choices.tolist(), strict=True)}


class WChoicesPartitioner(_HeadChoicesPartitioner):
    """W-Choices (Nasir et al. 2016; paper 001 §2.2, "W-C").

    Like D-Choices, but a head key may go to any worker: the least loaded of
    all ``n``. Best balance of the family, at the price of a head key's state
    on every worker.
    """

    name = "w-choices"

    def __init__(self, n_workers: int, settings: ChoicesSettings | None = None) -> None:
        super().__init__(n_workers, settings)

    def _head_workers(
        self, head: Mapping[int, float], tail_share: float
    ) -> dict[int, tuple[int, ...]]:
        everyone = tuple(range(self.n_workers))
        return dict.fromkeys(head, everyone)
