"""FISH: recent hot keys split over workers picked by inferred waiting time (paper 001 §4–5).

Three pieces, each a pure function, put together by :class:`FishPartitioner`:

1. *Classification* (001 §4.1.2, Algorithm 2 "CHK"): a key is hot when its
   decayed recent frequency share is at least θ. A hot key gets ``d``
   workers, more for more frequent keys, never fewer than ``d_min``, and its
   ``d`` never shrinks while it stays hot. :func:`assign_hot_keys` is this
   step; the control plane calls it on statistics gathered by Spark.
2. *Candidates* (001 §5): the ``d`` workers are the first ``d`` distinct
   workers clockwise from the key on a consistent-hash ring. A cold key goes
   to the first of them only, so splitting a key never moves its existing
   state, and adding or removing a worker remaps few keys.
3. *Worker choice* (001 §4.2): among a hot key's candidates, the tuple goes
   to the worker with the least inferred waiting time. The source infers it
   from what it sent and each worker's sampled capacity; it never asks the
   workers.

The paper's numeric defaults are missing from its text. The defaults of
:class:`FishSettings` are justified field by field there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from keyplane.partitioner import KeyArray, TimeArray, WorkerArray
from keyplane.ring import DEFAULT_VIRTUAL_NODES, ConsistentHashRing
from keyplane.sketches import EpochTopK

HotAssignment = dict[int, tuple[int, ...]]
"""Hot key → its workers (candidate instances), in ring order."""


@dataclass(frozen=True)
class FishSettings:
    """Parameters of FISH (paper 001), validated at construction.

    Attributes:
        theta_scale: the hot threshold is ``θ = theta_scale / n`` (share of the
            recent stream). Default 0.2, i.e. θ = 1/(5n): D-Choices' rule, which
            001 §6.3 cites as its reference. 001 §6.3 reports that only much
            larger thresholds hurt balance and smaller ones only cost memory.
        d_min: fewest workers a hot key gets (001 Algorithm 2). Default 2: a hot
            key gets at least the two choices of partial key grouping.
        decay: factor all counts are multiplied by at each epoch end (001
            §4.1.1). Default 0.5, the middle of the range 001 §6.3 explores:
            1 never forgets (lifetime counting, which 001 §6.4 shows misses
            recent hot keys) and 0 forgets everything each epoch (001 §6.3:
            false non-hot keys, 2.65x memory). 0.5 halves the past each epoch,
            an effective window of ``1/(1 - decay) = 2`` epochs.
        epoch_unit: whether ``epoch_length`` counts tuples or seconds of
            arrival time.
        epoch_length: epoch size. Default 1000 tuples: 001 §4.1.1 says its
            default epoch cuts decay updates "by three orders of magnitude"
            compared with per-tuple decay, i.e. about 10^3 tuples per epoch.
        top_k_capacity: counters of the recent hot-key table. Default 1024. It
            must exceed ``1/θ = 5n`` (the most keys that can be hot at once);
            :class:`FishPartitioner` checks it. Counts are overestimated by at
            most ``total / capacity``, under a fifth of θ's share for n ≤ 40.
        virtual_nodes: ring positions per worker (see ``keyplane.ring``).
        waiting_interval_s: the fixed interval ``T`` of 001 §4.2.1 (10 s), over
            which sent tuples are counted and a worker is assumed to process
            ``capacity × T`` of them.
        default_capacity: tuples/s a worker is assumed to process until a
            capacity sample arrives. Default 10 000/s (on the order of one
            Structured Streaming executor core for simple stateful
            operators). With equal capacities only its absolute value
            matters, and only for how fast inferred backlog drains.
    """

    theta_scale: float = 0.2
    d_min: int = 2
    decay: float = 0.5
    epoch_unit: Literal["tuples", "seconds"] = "tuples"
    epoch_length: float = 1000.0
    top_k_capacity: int = 1024
    virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    waiting_interval_s: float = 10.0
    default_capacity: float = 10_000.0

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
        if self.top_k_capacity < 1:
            raise ValueError(f"top_k_capacity must be positive, got {self.top_k_capacity}")
        if self.virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be positive, got {self.virtual_nodes}")
        if not self.waiting_interval_s > 0:
            raise ValueError(f"waiting_interval_s must be positive, got {self.waiting_interval_s}")
        if not (self.default_capacity > 0 and math.isfinite(self.default_capacity)):
            raise ValueError(f"default_capacity must be positive, got {self.default_capacity}")

    def hot_threshold(self, n_workers: int) -> float:
        """θ: the recent-frequency share from which a key is hot."""
        if n_workers < 1:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        return self.theta_scale / n_workers


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
    gaps: on Zipf(1.2) over 16 workers, 3 workers were reached by no hot key
    and max/avg load stayed at 1.13. Memory stays bounded: only hot keys are
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
    ring: ConsistentHashRing | None = None,
) -> HotAssignment:
    """Hot keys and their workers, from recent key frequencies (001 §4.1.2 and §5).

    ``freqs`` maps keys to recent (decayed) frequencies; ``total`` is the
    recent weight of the whole stream (default: the sum of ``freqs``, right
    when ``freqs`` covers every key). Keys with share ``>= θ`` are hot; each
    gets :func:`hot_key_worker_count` workers, at least as many as in
    ``previous`` while it stays hot (stickiness: shrinking would strand
    partial state on the dropped workers), at most ``n``. Workers come from
    ``ring`` (default: a ring over ``0 … n - 1`` with the settings' virtual
    nodes). Ring walks are prefix-stable, so a hot key's previous workers
    stay among its new ones. Cold keys are absent from the result.
    """
    if ring is None:
        ring = ConsistentHashRing.of_size(n_workers, settings.virtual_nodes)
    elif len(ring) != n_workers:
        raise ValueError(f"ring has {len(ring)} workers but n_workers is {n_workers}")
    stream_weight = float(sum(freqs.values())) if total is None else float(total)
    if stream_weight <= 0:
        return {}
    cutoff = settings.hot_threshold(n_workers) * stream_weight
    hot = {int(k): float(f) for k, f in freqs.items() if f > 0 and f >= cutoff}
    hottest = max(hot.values(), default=0.0)
    previous = previous or {}
    assignment: HotAssignment = {}
    for key, frequency in sorted(hot.items(), key=lambda kv: (-kv[1], kv[0])):
        d = hot_key_worker_count(frequency, hottest, n_workers, settings.d_min)
        d = min(max(d, len(previous.get(key, ()))), n_workers)
        assignment[key] = ring.candidates(key, d)
    return assignment


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


class FishPartitioner:
    """FISH grouping (paper 001) as a :class:`~keyplane.partitioner.Partitioner`.

    Per chunk, in stream order and split at epoch and interval boundaries:

    * the hot set in force is the one computed at the last epoch end, so it
      changes once per epoch, when the counts decay (001 §4.1); this lets
      the cold keys of a segment be routed in one vectorised ring lookup;
    * cold keys go to their ring owner; hot keys go, tuple by tuple, to the
      candidate with the least inferred waiting time;
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
    samples of 001 §4.2.1; until then ``default_capacity``.

    Time is the running maximum of ``times`` (a late tuple does not move the
    clock back).
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
        most_hot = math.ceil(1.0 / self.settings.hot_threshold(n_workers))
        if self.settings.top_k_capacity < most_hot:
            raise ValueError(
                f"top_k_capacity {self.settings.top_k_capacity} cannot hold the up to "
                f"{most_hot} hot keys of {n_workers} workers; raise it or theta_scale"
            )
        if capacities is None:
            cap = np.full(n_workers, self.settings.default_capacity, dtype=np.float64)
        else:
            cap = np.array(capacities, dtype=np.float64).reshape(-1)
            if cap.shape != (n_workers,) or np.any(~(cap > 0)) or not np.all(np.isfinite(cap)):
                raise ValueError(f"capacities must be {n_workers} positive finite numbers")
        self._capacity = cap
        self._ring = ConsistentHashRing.of_size(n_workers, self.settings.virtual_nodes)
        self._topk = EpochTopK(self.settings.top_k_capacity, self.settings.decay)
        self._hot: HotAssignment = {}
        self._hot_keys = np.empty(0, dtype=np.int64)
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
        out = np.empty(key_arr.size, dtype=np.int64)
        if key_arr.size == 0:
            return out
        clock = np.maximum.accumulate(np.maximum(time_arr, self._clock))
        self._clock = float(clock[-1])
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
            self._route_segment(key_arr[pos:end], out[pos:end])
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
        self._topk.end_epoch(epochs)
        self._epoch_tuples = 0
        self._hot = assign_hot_keys(
            self._topk.frequencies_at_least(self.settings.hot_threshold(self.n_workers)),
            self.n_workers,
            self.settings,
            previous=self._hot,
            total=float(self._topk.total),
            ring=self._ring,
        )
        self._hot_keys = np.array(sorted(self._hot), dtype=np.int64)

    def _route_segment(self, keys: KeyArray, out: WorkerArray) -> None:
        hot_keys = self._hot_keys
        if hot_keys.size:
            index = np.minimum(np.searchsorted(hot_keys, keys), hot_keys.size - 1)
            is_hot = hot_keys[index] == keys
        else:
            is_hot = np.zeros(keys.size, dtype=bool)
        cold = ~is_hot
        if cold.any():
            cold_workers = self._ring.owners(keys[cold])
            out[cold] = cold_workers
            self._sent += np.bincount(cold_workers, minlength=self.n_workers)
        if not is_hot.any():
            return
        hot_positions = np.flatnonzero(is_hot)
        inverse_capacity = (1.0 / self._capacity).tolist()
        busy = (self._sent / self._capacity).tolist()
        workers_of = self._hot
        chosen = []
        for key in keys[hot_positions].tolist():
            worker = min(workers_of[key], key=busy.__getitem__)
            busy[worker] += inverse_capacity[worker]
            chosen.append(worker)
        chosen_arr = np.array(chosen, dtype=np.int64)
        out[hot_positions] = chosen_arr
        self._sent += np.bincount(chosen_arr, minlength=self.n_workers)
