"""FISH: recent hot keys split over workers picked by inferred waiting time (paper 001 §4–5).

Three pieces, each a pure function, put together by :class:`FishPartitioner`:

1. *Classification* (001 §4.1.2, Algorithm 2 "CHK"): a key is hot when its
   recent frequency share (decayed history plus the epoch just closed) is at
   least θ. A hot key gets ``d`` workers, more for more frequent keys, never
   fewer than ``d_min``, and its ``d`` never shrinks while it stays hot.
   :func:`assign_hot_keys` is this step; the control plane calls it on
   statistics gathered by Spark.
2. *Candidates* (001 §5): the ``d`` workers are the first ``d`` distinct
   workers clockwise from the key on a consistent-hash ring. A cold key goes
   to the first of them only, so splitting a key never moves its existing
   state, and adding or removing a worker remaps few keys. ``hash mod n``
   can replace the ring for the ablation of 001 §6.5.
3. *Worker choice* (001 §4.2): among a hot key's candidates, the tuple goes
   to the worker with the least inferred waiting time. The source infers it
   from what it sent and each worker's sampled capacity; it never asks the
   workers.

The paper's numeric defaults are missing from its text. The defaults of
:class:`FishSettings` are justified field by field there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.partitioner import KeyArray, TimeArray, WorkerArray
from keyplane.algorithms.ring import (
    DEFAULT_VIRTUAL_NODES,
    CandidatePlacement,
    make_placement,
)
from keyplane.algorithms.sketches import EpochTopK

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

HotAssignment = dict[int, tuple[int, ...]]
"""Hot key → its workers (candidate instances), in ring order."""

BULK_CANDIDATES = 48
"""From this many candidates on, a hot key's tuples in a segment are placed in
bulk by :func:`greedy_fill` instead of one ``min`` over the candidates per
tuple, which costs O(d) interpreted steps per tuple; below it, the per-tuple
loop is cheaper than greedy_fill's fixed cost of some twenty numpy calls."""


@dataclass(frozen=True)
class FishSettings:
    """Parameters of FISH (paper 001), validated at construction.

    Attributes:
        theta_scale: the hot threshold is ``θ = theta_scale / n`` (share of the
            recent stream). Default 0.1, i.e. θ = 1/(10n). 001 §6.3 takes
            D-Choices' analysis as its reference and reports that smaller
            thresholds favour balance and larger ones memory; its chosen value
            is lost from our copy. D-Choices' 1/(5n) bounds imbalance for
            tails routed by two choices (PKG), but FISH routes a cold key to
            one worker, so nothing evens out the cold load afterwards: a key
            just under 1/(5n) carries a fifth of a worker's fair share, and
            on many workers a few such keys meeting on one overload it by
            their cold load alone. Under 1/(10n) a cold key carries at most a
            tenth; FISH then keeps shuffle grouping's balance for a memory
            cost inside the range 001 §6.2 reports
            (``docs/reproduction/001-fish.md``).
        d_min: fewest workers a hot key gets (001 Algorithm 2). Default 2: a hot
            key gets at least the two choices of partial key grouping.
        decay: factor all counts are multiplied by at each epoch end (001
            §4.1.1). Default 0.5, the middle of the range 001 §6.3 explores:
            1 never forgets (lifetime counting, which 001 §6.4 shows misses
            recent hot keys) and 0 keeps only the last epoch (001 §6.3: fast,
            but false non-hot keys cost up to 2.65x memory). 0.5 halves the
            past each epoch, an effective window of ``1/(1 - decay) = 2``
            epochs. Keys are classified on the counts before the epoch's
            decay, so ``decay`` weighs the history, never the epoch just seen.
        epoch_unit: whether ``epoch_length`` counts tuples or seconds of
            arrival time.
        epoch_length: epoch size. Default 1000 tuples: 001 §4.1.1 says its
            default epoch cuts decay updates "by three orders of magnitude"
            compared with per-tuple decay, i.e. about 10^3 tuples per epoch.
            Shorter epochs notice a new hot key sooner but classify on fewer
            tuples, so more keys flicker into the hot set (memory); see the
            epoch rows of the reproduction.
        top_k_capacity: counters of the recent hot-key table. Default ``None``:
            :meth:`counter_capacity` sizes it from θ. A set value must be at
            least ``1/θ`` (the most keys that can be hot at once);
            :class:`FishPartitioner` checks it.
        virtual_nodes: ring positions per worker (see ``keyplane.algorithms.ring``).
        waiting_interval_s: the fixed interval ``T`` of 001 §4.2.1 (10 s), over
            which sent tuples are counted and a worker is assumed to process
            ``capacity × T`` of them.
        default_capacity: tuples/s a worker is assumed to process until a
            capacity sample arrives. Default 10 000/s (on the order of one
            Structured Streaming executor core for simple stateful
            operators). With equal capacities only its absolute value
            matters, and only for how fast inferred backlog drains.
        candidate_selection: where keys may go. ``"ring"`` (default) is 001
            §5's consistent hashing; ``"modulo"`` is ``hash mod n``
            (:class:`keyplane.algorithms.ring.ModuloPlacement`), the "FISH w/o CH" arm
            of the Fig. 17 ablation (001 §6.5), which remaps almost every key
            when the number of workers changes.
    """

    theta_scale: float = 0.1
    d_min: int = 2
    decay: float = 0.5
    epoch_unit: Literal["tuples", "seconds"] = "tuples"
    epoch_length: float = 1000.0
    top_k_capacity: int | None = None
    virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    waiting_interval_s: float = 10.0
    default_capacity: float = 10_000.0
    candidate_selection: Literal["ring", "modulo"] = "ring"

    def __post_init__(self) -> None:
        if not 0.0 < self.theta_scale <= 1.0:
            raise ValueError(f"theta_scale must be in (0, 1], got {self.theta_scale}")
        if self.d_min < 1:
            raise ValueError(f"d_min must be at least 1, got {self.d_min}")
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay}")
        if self.epoch_unit not in ("tuples", "seconds"):
            raise ValueError(f"epoch_unit must be 'tuples' or 'seconds', got {self.epoch_unit!r}")
        if not self.epoch_length > 0:
            raise ValueError(f"epoch_length must be positive, got {self.epoch_length}")
        if self.epoch_unit == "tuples" and self.epoch_length != int(self.epoch_length):
            raise ValueError(f"an epoch in tuples needs a whole length, got {self.epoch_length}")
        if self.top_k_capacity is not None and self.top_k_capacity < 1:
            raise ValueError(f"top_k_capacity must be positive, got {self.top_k_capacity}")
        if self.virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be positive, got {self.virtual_nodes}")
        if not self.waiting_interval_s > 0:
            raise ValueError(f"waiting_interval_s must be positive, got {self.waiting_interval_s}")
        if not (self.default_capacity > 0 and math.isfinite(self.default_capacity)):
            raise ValueError(f"default_capacity must be positive, got {self.default_capacity}")
        if self.candidate_selection not in ("ring", "modulo"):
            raise ValueError(
                f"candidate_selection must be 'ring' or 'modulo', got {self.candidate_selection!r}"
            )

    def hot_threshold(self, n_workers: int) -> float:
        """θ: the recent-frequency share from which a key is hot."""
        if n_workers < 1:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        return self.theta_scale / n_workers

    def counter_capacity(self, n_workers: int) -> int:
        """Counters of the recent hot-key table for ``n_workers`` workers.

        ``top_k_capacity`` if set, else ``max(1024, ceil(4 / θ))``: SpaceSaving
        overestimates a count by at most ``total / capacity``, i.e. here by at
        most a quarter of the hot threshold, so no key below ``¾ θ`` can look
        hot, and the table holds far more than the ``1/θ`` keys that can be hot
        at once.
        """
        if self.top_k_capacity is not None:
            return self.top_k_capacity
        return max(1024, math.ceil(4.0 / self.hot_threshold(n_workers) - 1e-9))


def hot_key_worker_count(frequency: float, max_frequency: float, n_workers: int, d_min: int) -> int:
    """Number of workers ``d`` for a hot key (001 §4.1.2, Algorithm 2 lines 1–4).

    The paper's formula is lost from its text. What survives: more frequent
    keys get more workers; the inputs of Algorithm 2 include "the highest
    frequency" ``f_max`` (Table I); the result is raised to ``d_min``. We use

        d = clamp(ceil(n · f / f_max), d_min, n)

    so the hottest key may use every worker and the others a proportional
    number. Why: fields-grouped cold keys leave some workers above and some
    below average, and only hot tuples can fill the gaps, so some hot key
    must be able to reach every worker. A rule that shares the cluster among
    the hot keys by ``n · f / F_hot`` (``F_hot`` the hot keys' total) leaves
    gaps: some workers are reached by no hot key, and the load stays
    unbalanced. Memory stays bounded: only hot keys are
    split, and there are at most ``1/θ`` of them.
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be positive, got {n_workers}")
    if not (frequency > 0 and max_frequency >= frequency):
        raise ValueError(
            f"need 0 < frequency <= max_frequency, got {frequency} and {max_frequency}"
        )
    proportional = math.ceil(n_workers * frequency / max_frequency - 1e-9)
    return max(min(d_min, n_workers), min(proportional, n_workers))


def assign_hot_keys(
    freqs: Mapping[int, float],
    n_workers: int,
    settings: FishSettings,
    previous: Mapping[int, Sequence[int]] | None = None,
    *,
    total: float | None = None,
    placement: CandidatePlacement | None = None,
) -> HotAssignment:
    """Hot keys and their workers, from recent key frequencies (001 §4.1.2 and §5).

    ``freqs`` maps keys to recent frequencies (the decayed history plus the
    epoch just closed); ``total`` is the recent weight of the whole stream
    (default: the sum of ``freqs``, right when ``freqs`` covers every key).
    Keys with share ``>= θ`` are hot; each gets :func:`hot_key_worker_count`
    workers, at least as many as in ``previous`` while it stays hot
    (stickiness: shrinking would strand partial state on the dropped
    workers), at most ``n``. Workers come from ``placement`` (default: the
    settings' ``candidate_selection`` over ``0 … n - 1``), and ``previous``
    must come from the same placement. Placements are prefix-stable, so a
    hot key's previous workers stay among its new ones, and a key whose
    ``d`` did not grow keeps its previous tuple without a new lookup.
    Cold keys are absent from the result. The result is ordered hottest
    first.

    Keys are int64 ids, as everywhere in FISH (the ring hashes a key's 8
    bytes, :func:`keyplane.algorithms.ring.key_bucket`, and partitioners take
    ``int64`` key arrays); any other key is refused by name rather than
    truncated (``1.5`` would become key 1) or left to fail inside numpy.
    Frequencies are counts (001 §4.1.1), so a negative or non-finite one is
    refused: a negative one would shrink the default ``total`` and make a
    cold key hot, an infinite one has no share of the stream. A ``previous``
    entry that does not fit the placement (a worker it lacks, e.g. outside
    ``[0, n)`` after a scale-in, or the same worker twice) is recomputed,
    keeping its ``d`` up to ``n``.
    """
    _check_keys(freqs)
    values = np.fromiter(freqs.values(), dtype=np.float64, count=len(freqs))
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError("key frequencies must be finite and non-negative")
    if total is not None and not (math.isfinite(total) and total >= 0):
        raise ValueError(f"total must be finite and non-negative, got {total}")
    if placement is None:
        placement = make_placement(settings.candidate_selection, n_workers, settings.virtual_nodes)
    elif len(placement) != n_workers:
        raise ValueError(f"placement has {len(placement)} workers but n_workers is {n_workers}")
    stream_weight = float(sum(freqs.values())) if total is None else float(total)
    if stream_weight <= 0 or not freqs:
        return {}
    keys = np.fromiter(freqs.keys(), dtype=np.int64, count=len(freqs))
    cutoff = settings.hot_threshold(n_workers) * stream_weight
    hot = (values > 0) & (values >= cutoff)
    if not hot.any():
        return {}
    keys, values = keys[hot], values[hot]
    order = np.lexsort((keys, -values))
    keys, values = keys[order], values[order]
    # hot_key_worker_count, vectorised over the hot keys
    proportional = np.ceil(n_workers * values / values[0] - 1e-9)
    counts = np.clip(proportional, min(settings.d_min, n_workers), n_workers).astype(np.int64)
    previous = previous or {}
    candidates = placement.candidates
    workers = frozenset(placement.workers)
    assignment: HotAssignment = {}
    for key, d in zip(keys.tolist(), counts.tolist(), strict=True):
        before = previous.get(key)
        if before is None:
            assignment[key] = candidates(key, d)
        elif not _fits(before, workers):
            assignment[key] = candidates(key, max(d, min(len(before), n_workers)))
        elif len(before) >= d:
            # prefix stability: the walk for len(before) is before itself
            assignment[key] = tuple(before)
        else:
            assignment[key] = candidates(key, d)
    return assignment


def _check_keys(keys: Iterable[object]) -> None:
    """Refuse any key that is not an int64 id, naming it (see :func:`assign_hot_keys`)."""
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, int | np.integer):
            raise TypeError(
                f"hot-key classification takes int64 key ids; key {key!r} is a {type(key).__name__}"
            )
        if not _INT64_MIN <= key <= _INT64_MAX:
            raise ValueError(
                f"hot-key classification takes int64 key ids, in [-2**63, 2**63 - 1]; "
                f"key {key} is outside it"
            )


def _fits(chosen: Sequence[int], workers: frozenset[int]) -> bool:
    """Whether ``chosen`` are distinct workers of the placement (so at most ``n`` of them)."""
    return len(set(chosen)) == len(chosen) and workers.issuperset(chosen)


def inferred_waiting_times(
    sent: npt.ArrayLike, capacity: npt.ArrayLike, elapsed: float
) -> npt.NDArray[np.float64]:
    """Each worker's inferred waiting time (001 §4.2.1–4.2.2).

    ``sent`` tuples went to each worker during the last ``elapsed`` seconds;
    a worker processes ``capacity`` tuples per second, so it still holds
    ``unprocessed = max(0, sent − capacity · elapsed)`` tuples and a new
    tuple waits ``unprocessed / capacity`` seconds.
    """
    sent_arr = np.asarray(sent, dtype=np.float64)
    cap = np.asarray(capacity, dtype=np.float64)
    if np.any(cap <= 0):
        raise ValueError("capacities must be positive")
    unprocessed = np.maximum(sent_arr - cap * elapsed, 0.0)
    return np.asarray(unprocessed / cap, dtype=np.float64)


def least_waiting_worker(
    candidates: Sequence[int], sent: npt.ArrayLike, capacity: npt.ArrayLike, elapsed: float
) -> int:
    """The candidate with the least inferred waiting time (001 §4.2.2, Algorithm 3).

    Ties, e.g. between idle workers, go to the worker that would become idle
    first, then to the earlier candidate (ring order).
    """
    if not candidates:
        raise ValueError("candidates must not be empty")
    waits = inferred_waiting_times(sent, capacity, elapsed)
    sent_arr = np.asarray(sent, dtype=np.float64)
    cap = np.asarray(capacity, dtype=np.float64)
    return min(candidates, key=lambda w: (waits[w], sent_arr[w] / cap[w]))


def greedy_fill(levels: npt.ArrayLike, capacity: npt.ArrayLike, count: int) -> npt.NDArray[np.intp]:
    """Where ``count`` tuples of one key go, placed one by one by least waiting time.

    ``levels`` are the candidates' inferred busy times (``sent / capacity``)
    and each tuple adds ``1 / capacity`` to its worker's. Placing the tuples
    one at a time on the least busy candidate (001 §4.2.2, ties to the
    earlier candidate) picks, in order, the ``count`` smallest values of the
    multiset ``{levels[w] + j / capacity[w] : j >= 0}``, ordered by value and
    then candidate. This computes them in bulk: the continuous water level
    ``L`` with ``Σ max(0, L − levels[w]) · capacity[w] = count`` bounds the
    last pick, since at least ``count`` values lie at or below it. Returns
    the index (into the candidates) of each tuple's worker, in tuple order.
    """
    base = np.asarray(levels, dtype=np.float64).reshape(-1)
    cap = np.asarray(capacity, dtype=np.float64).reshape(-1)
    if base.shape != cap.shape or base.size == 0:
        raise ValueError("levels and capacity must be non-empty and of equal length")
    if count <= 0:
        return np.empty(0, dtype=np.intp)
    order = np.argsort(base, kind="stable")
    sorted_levels, sorted_cap = base[order], cap[order]
    water = (count + np.cumsum(sorted_levels * sorted_cap)) / np.cumsum(sorted_cap)
    next_level = np.append(sorted_levels[1:], np.inf)
    level = float(water[int(np.argmax(water <= next_level))])
    per_worker = np.clip(np.floor((level - base) * cap).astype(np.int64) + 2, 0, count)
    while int(per_worker.sum()) < count:
        per_worker = np.minimum(per_worker + 1, count)
    worker = np.repeat(np.arange(base.size), per_worker)
    starts = np.cumsum(per_worker) - per_worker
    step = np.arange(worker.size) - np.repeat(starts, per_worker)
    values = base[worker] + step / cap[worker]
    return worker[np.argsort(values, kind="stable")[:count]]


class FishPartitioner:
    """FISH grouping (paper 001) as a :class:`~keyplane.algorithms.partitioner.Partitioner`.

    Per chunk, in stream order and split at epoch and interval boundaries:

    * the hot set in force is the one computed at the last epoch end (001
      §4.1), from the counts of the decayed history plus that epoch, taken
      before the epoch's decay is applied: with ``decay = 0`` the hot set is
      exactly that of the last epoch (001 §6.3), with ``decay = 1`` that of
      the whole stream;
    * cold keys go to their single worker of the placement (ring owner, or
      ``hash mod n`` with ``candidate_selection="modulo"``), looked up for
      the whole chunk at once; hot keys go, tuple by tuple, to the candidate
      with the least inferred waiting time, the most constrained first
      (see ``_route_segment``);
    * every tuple then counts in the current epoch of the :class:`EpochTopK`.

    Waiting time: over each interval ``T`` (``waiting_interval_s``) the
    partitioner counts what it sent to each worker; at the interval's end
    the worker is assumed to have processed ``capacity × T`` of it, and the
    rest (``unprocessed = sent − capacity × T``) carries over. Inside an
    interval every worker's waiting time is ``sent_w / capacity_w −
    elapsed`` (clamped at 0), and ``elapsed`` is common to all candidates, so
    choosing the least ``sent_w / capacity_w`` is choosing the least
    waiting time, with ties between idle workers broken towards the least
    busy one. Capacities come from :meth:`observe_capacity`, the periodic
    samples of 001 §4.2.1; until then ``default_capacity``. Within a
    segment (at most one epoch) the cold tuples are counted before the hot
    ones are placed, so hot tuples fill the gaps the cold ones leave.

    Time is the running maximum of ``times`` (a late tuple does not move the
    clock back); a NaN or infinite time is refused, as no interval or epoch
    can hold it.
    """

    name = "fish"

    def __init__(
        self,
        n_workers: int,
        settings: FishSettings | None = None,
        capacities: npt.ArrayLike | None = None,
    ) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        self.settings = settings or FishSettings()
        self.n_workers = n_workers
        counters = self.settings.counter_capacity(n_workers)
        most_hot = math.ceil(1.0 / self.settings.hot_threshold(n_workers) - 1e-9)
        if counters < most_hot:
            raise ValueError(
                f"top_k_capacity {counters} cannot hold the up to "
                f"{most_hot} hot keys of {n_workers} workers; raise it or theta_scale"
            )
        if capacities is None:
            cap = np.full(n_workers, self.settings.default_capacity, dtype=np.float64)
        else:
            cap = np.array(capacities, dtype=np.float64).reshape(-1)
            if cap.shape != (n_workers,) or np.any(~(cap > 0)) or not np.all(np.isfinite(cap)):
                raise ValueError(f"capacities must be {n_workers} positive finite numbers")
        self._capacity = cap
        self._placement = make_placement(
            self.settings.candidate_selection, n_workers, self.settings.virtual_nodes
        )
        self._topk = EpochTopK(counters, self.settings.decay)
        self._hot: HotAssignment = {}
        self._hot_keys = np.empty(0, dtype=np.int64)
        self._wide_keys = np.empty(0, dtype=np.int64)
        self._wide_order: list[tuple[int, npt.NDArray[np.int64]]] = []
        self._sent = np.zeros(n_workers, dtype=np.float64)
        self._clock = -math.inf
        self._window_start: float | None = None
        self._epoch_start: float | None = None
        self._epoch_tuples = 0

    @property
    def hot_assignment(self) -> HotAssignment:
        """The hot keys in force and their workers."""
        return dict(self._hot)

    @property
    def placement(self) -> CandidatePlacement:
        """Where keys may go: the ring, or ``hash mod n`` (``candidate_selection``)."""
        return self._placement

    @property
    def capacities(self) -> npt.NDArray[np.float64]:
        """Current capacity estimate of each worker, tuples per second."""
        return self._capacity.copy()

    @property
    def recent_counts(self) -> EpochTopK:
        """The epoch top-K counter (read it, do not feed it)."""
        return self._topk

    def observe_capacity(self, worker: int, tuples: float, busy_seconds: float) -> None:
        """Record a capacity sample: ``worker`` processed ``tuples`` in ``busy_seconds``.

        001 §4.2.1 samples each worker's processing rate periodically, and its
        Observation 2 (a worker takes the same time for the same batch) is why
        the latest sample replaces the previous one.
        """
        if not 0 <= worker < self.n_workers:
            raise ValueError(f"worker must be in [0, {self.n_workers}), got {worker}")
        if not (tuples > 0 and busy_seconds > 0):
            raise ValueError("a capacity sample needs positive tuples and busy_seconds")
        self._capacity[worker] = tuples / busy_seconds

    def waiting_times(self, now: float) -> npt.NDArray[np.float64]:
        """Inferred waiting time of every worker at time ``now`` (seconds)."""
        start = now if self._window_start is None else self._window_start
        return inferred_waiting_times(self._sent, self._capacity, max(0.0, now - start))

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        """Route one chunk of tuples (see the class docstring)."""
        key_arr = np.asarray(keys, dtype=np.int64).reshape(-1)
        time_arr = np.asarray(times, dtype=np.float64).reshape(-1)
        if key_arr.shape != time_arr.shape:
            raise ValueError(f"keys and times differ in length: {key_arr.size} vs {time_arr.size}")
        if not np.all(np.isfinite(time_arr)):
            raise ValueError("times must be finite: they place tuples in intervals and epochs")
        out = np.empty(key_arr.size, dtype=np.int64)
        if key_arr.size == 0:
            return out
        clock = np.maximum.accumulate(np.maximum(time_arr, self._clock))
        self._clock = float(clock[-1])
        owners = self._placement.owners(key_arr)
        settings = self.settings
        by_tuples = settings.epoch_unit == "tuples"
        pos, size = 0, key_arr.size
        while pos < size:
            self._advance_to(float(clock[pos]))
            end = size
            rest = clock[pos:]
            assert self._window_start is not None
            window_end = self._window_start + settings.waiting_interval_s
            end = min(end, pos + int(np.searchsorted(rest, window_end, side="left")))
            if by_tuples:
                end = min(end, pos + int(settings.epoch_length) - self._epoch_tuples)
            else:
                assert self._epoch_start is not None
                epoch_end = self._epoch_start + settings.epoch_length
                end = min(end, pos + int(np.searchsorted(rest, epoch_end, side="left")))
            end = max(end, pos + 1)
            self._route_segment(key_arr[pos:end], owners[pos:end], out[pos:end])
            self._topk.update_many(key_arr[pos:end])
            self._epoch_tuples += end - pos
            if by_tuples and self._epoch_tuples >= settings.epoch_length:
                self._close_epochs(1)
            pos = end
        return out

    def _advance_to(self, now: float) -> None:
        """Roll the waiting-time interval and, for epochs in seconds, the epoch."""
        settings = self.settings
        if self._window_start is None:
            self._window_start = now
        interval = settings.waiting_interval_s
        passed = math.floor((now - self._window_start) / interval)
        if passed >= 1:
            drained = self._capacity * (passed * interval)
            self._sent = np.maximum(self._sent - drained, 0.0)
            self._window_start += passed * interval
        if settings.epoch_unit == "seconds":
            if self._epoch_start is None:
                self._epoch_start = now
            epochs = math.floor((now - self._epoch_start) / settings.epoch_length)
            if epochs >= 1:
                self._epoch_start += epochs * settings.epoch_length
                self._close_epochs(epochs)

    def _close_epochs(self, epochs: int) -> None:
        """Close ``epochs`` epochs, the first holding the counted tuples, the rest empty.

        The hot set is classified at the close of the last of them, on its
        counts before that epoch's decay (001 §4.1: decay once per epoch,
        after the epoch's counting), then the decay is applied. Classifying
        after the decay would make ``decay = 0`` forget the epoch before
        looking at it, so no key would ever be hot.
        """
        topk = self._topk
        if epochs > 1:
            topk.end_epoch(epochs - 1)
        self._epoch_tuples = 0
        hot = assign_hot_keys(
            topk.frequencies_at_least(self.settings.hot_threshold(self.n_workers)),
            self.n_workers,
            self.settings,
            previous=self._hot,
            total=float(topk.total),
            placement=self._placement,
        )
        topk.end_epoch(1)
        if hot != self._hot:
            if hot.keys() != self._hot.keys():
                self._hot_keys = np.array(sorted(hot), dtype=np.int64)
            wide = sorted(
                (
                    (len(workers), key)
                    for key, workers in hot.items()
                    if len(workers) >= BULK_CANDIDATES
                ),
            )
            self._wide_order = [(key, np.array(hot[key], dtype=np.int64)) for _, key in wide]
            self._wide_keys = np.array(sorted(key for _, key in wide), dtype=np.int64)
        self._hot = hot

    def _route_segment(self, keys: KeyArray, owners: WorkerArray, out: WorkerArray) -> None:
        """Route one segment: cold tuples, then few-candidate hot tuples, then wide hot keys.

        The order is most constrained first: cold tuples have one worker,
        then the tuples of hot keys with fewer than :data:`BULK_CANDIDATES`
        candidates are placed one by one in arrival order, then each wide
        key's tuples (narrowest key first) by :func:`greedy_fill`, which is
        the same least-waiting-time rule applied to that key's tuples in a
        row, computed in bulk. Wide keys are the most flexible, so they fill
        the gaps the others leave.
        """
        n = self.n_workers
        hot_keys = self._hot_keys
        out[:] = owners
        if hot_keys.size:
            index = np.minimum(np.searchsorted(hot_keys, keys), hot_keys.size - 1)
            is_hot = hot_keys[index] == keys
        else:
            is_hot = np.zeros(keys.size, dtype=bool)
        if not is_hot.any():
            self._sent += np.bincount(owners, minlength=n)
            return
        self._sent += np.bincount(owners[~is_hot], minlength=n)
        capacity = self._capacity
        hot_positions = np.flatnonzero(is_hot)
        hot_of_tuple = keys[hot_positions]
        wide_keys = self._wide_keys
        if wide_keys.size:
            is_wide = np.isin(hot_of_tuple, wide_keys)
            narrow_positions = hot_positions[~is_wide]
        else:
            is_wide = np.zeros(hot_positions.size, dtype=bool)
            narrow_positions = hot_positions
        if narrow_positions.size:
            inverse_capacity = (1.0 / capacity).tolist()
            busy = (self._sent / capacity).tolist()
            pick = busy.__getitem__
            workers_of = self._hot
            chosen: list[int] = []
            append = chosen.append
            for key in keys[narrow_positions].tolist():
                worker = min(workers_of[key], key=pick)
                busy[worker] += inverse_capacity[worker]
                append(worker)
            chosen_arr = np.array(chosen, dtype=np.int64)
            out[narrow_positions] = chosen_arr
            self._sent += np.bincount(chosen_arr, minlength=n)
        if not is_wide.any():
            return
        wide_positions = hot_positions[is_wide]
        wide_of_tuple = hot_of_tuple[is_wide]
        for key, candidates in self._wide_order:
            positions = wide_positions[wide_of_tuple == key]
            if positions.size == 0:
                continue
            picks = candidates[
                greedy_fill(
                    self._sent[candidates] / capacity[candidates],
                    capacity[candidates],
                    positions.size,
                )
            ]
            out[positions] = picks
            self._sent += np.bincount(picks, minlength=n)
