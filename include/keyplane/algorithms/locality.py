"""Locality-aware routing tables from key-pair statistics (paper 000 §3.2-§3.3).

A chain of stateful stages routes each stage by its own key. When a pair of
keys (a, b) of two consecutive stages is frequent, putting a and b on the
same instance keeps the tuples between the stages on one server; hashing
gets that right only with probability 1/n (000 §3.2). This module turns the
observed pair counts into routing tables, one per stage, that co-locate
correlated keys while keeping each stage's load within an imbalance bound α
(000 §3.1). The whole chain is planned at once (:func:`build_chain_plan`),
since a key of a middle stage is paired with keys upstream and downstream;
:func:`build_plan` is its two-stage view, for stages A and B.

1. Build the k-partite key graph: a vertex per (stage, key) weighted by the
   key's frequency, an edge per pair of keys of consecutive stages weighted
   by its count (000 §3.3). A one-stage chain has no edge: its plan is
   balance and hot-key splitting only.
2. Take out the *heavy* keys, whose weight alone exceeds α times the stage's
   mean instance load (heavy keys included, so that the test does not
   cascade): no partition can meet α with one. They go to the hot-key
   splitter (paper 001 §4.2), or are pinned to the least loaded instance on
   request, as far as the table budget has room.
3. Keep the most valuable keys within the table budget: first by the pair
   weight they can make local, then by frequency. Other keys use the hash
   fallback (000 §3.3), which fixes their instance: the caller says where
   (``hash_parts``; by default Spark's hash of the key's decimal string,
   :func:`spark_workers`, the placement the job uses).
4. Partition the table keys of all stages jointly with METIS (000 §3.3),
   target part sizes set to the capacity the hashed keys leave on each
   instance. pymetis exposes one balance constraint only (no ``ncon``), so a
   vertex weighs its key's share of its own stage's total: every stage
   counts equally in that constraint, and step 5 enforces α per stage, which
   is what a multi-constraint partition (one constraint per stage) would.
5. One constraint does not bound each stage's balance, and METIS may
   overshoot its tolerance. A greedy pass moves the cheapest keys (locality
   lost per unit of load moved) out of overloaded instances; when none fits, it
   moves or splits the key that saves most batch time under the
   :class:`~keyplane.algorithms.costmodel.CostModel`, and stops when none saves any (or
   half a stage's keys are split), since splitting just to meet α on the
   training window buys a balance the next window does not keep
   (``split_rule="alpha"`` splits until α holds, for comparisons).

An instance's load (here and in :func:`evaluate`) is the summed weight of the
stage's keys placed on it: table keys at their table instance, hashed keys at
their hash instance, split keys spread evenly, pinned keys where pinned.

:func:`choose_plan` is the planner: it builds a plan with balance headroom
sized from the drift :class:`PairHistory` measured, keeps it only if the cost
model predicts it beats keeping hash routing and keeping the current tables
on the next window, and states the imbalance the next window is expected to
keep (``promised_imbalance``). The weights it balances may be a forecast of
the next window's (:mod:`keyplane.algorithms.forecast`), whose drift is then
the forecasts' error rather than the history's lag.

Beyond the paper, :class:`PairHistory` keeps pair statistics across windows
with FISH-style decay (paper 001 §4.1) instead of 000 §3.2's reset.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import pymetis
import scipy.sparse as sp

from keyplane.algorithms.costmodel import (
    PROMISE_CONFIDENCE,
    CostModel,
    Drift,
    StageProfile,
    measure_drift,
    next_window,
)
from keyplane.algorithms.partitioner import KeyArray, TimeArray, WorkerArray
from keyplane.routing.routedkeys import spark_partitions

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
HashParts = Callable[[int, npt.NDArray[np.int64]], npt.NDArray[np.int64]]
"""Where the hash fallback puts keys outside the table: given the stage's
position in the chain (0 is the most upstream) and key ids, the instance
(part) of each."""

HeavyKeyPolicy = Literal["split", "pin"]
HeavyRule = Literal["mean", "cascade"]
SplitRule = Literal["pays", "alpha"]
HistoryMode = Literal["reset", "decay"]
CandidateName = Literal["hash", "current", "plan"]

_METIS_VERTEX_SCALE = 1_000_000_000
_METIS_EDGE_SCALE = 1_000_000
_MIN_PART_TARGET = 1e-6
_MIN_VERTICES_PER_PART = 2
# Loads are sums of floats: a move or a split aims a hair below the bound, so
# that the recomputed loads land within α and the key is not moved back.
_BOUND_MARGIN = 1.0 - 1e-12


def spark_workers(keys: npt.ArrayLike, n: int) -> npt.NDArray[np.int64]:
    """The instance Spark's hash partitioning gives each integer key: the job's placement.

    The job groups by the key's string, so an id is hashed as its decimal
    string (:func:`keyplane.routing.routedkeys.spark_partitions`, Murmur3 as Spark's
    ``HashPartitioning``). Planner, :func:`evaluate` and :class:`TableRouter`
    all use it, so a plan's figures are the job's.
    """
    ids = np.asarray(keys, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    return spark_partitions(ids.astype(str).tolist(), n)


def _weighted_counts(index: npt.ArrayLike, weights: FloatArray, size: int) -> FloatArray:
    """Sum of ``weights`` per index value in ``[0, size)``."""
    return np.bincount(index, weights=weights, minlength=size).astype(np.float64, copy=False)


def _stage_loads(placement: npt.NDArray[np.int64], weight: FloatArray, n: int) -> FloatArray:
    """Instance loads of one stage's keys; unplaced (split) keys, at -1, spread evenly.

    The rebalancer's stop test and the reported imbalance both use this, so
    they sum the same floats in the same order and agree to the last bit.
    """
    counts = _weighted_counts(placement + 1, weight, n + 1)
    return counts[1:] + counts[0] / n


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
    the larger of its frequency and its pair total, since every tuple of a pair
    is also a tuple of each of its keys.
    """

    a_keys: KeyArray
    b_keys: KeyArray
    counts: FloatArray
    freq_a: KeyWeights | None = None
    freq_b: KeyWeights | None = None

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

    def chain(self) -> ChainStatistics:
        """The same window as a two-stage chain."""
        return ChainStatistics(
            (self.freq_a, self.freq_b), (KeyPairs(self.a_keys, self.b_keys, self.counts),)
        )

    def stage_weights(self, stage: Literal["a", "b"]) -> KeyWeights:
        """Every known key of ``stage`` with its weight (max of frequency, pair total)."""
        pair_keys = self.a_keys if stage == "a" else self.b_keys
        frequencies = self.freq_a if stage == "a" else self.freq_b
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

    A key's weight is the largest of its frequency and its pair totals with
    either neighbour, since every tuple of a pair is also a tuple of each of
    its keys (statistics keep only the top pairs).
    """

    frequencies: tuple[KeyWeights | None, ...]
    links: tuple[KeyPairs, ...] = ()

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

    @property
    def n_stages(self) -> int:
        return len(self.frequencies)

    def stage_weights(self, stage: int) -> KeyWeights:
        """Every known key of the ``stage``-th stage with its weight (class docstring)."""
        sides: list[tuple[KeyArray, FloatArray]] = []
        if stage > 0:
            link = self.links[stage - 1]
            sides.append((link.down_keys, link.counts))
        if stage < len(self.links):
            link = self.links[stage]
            sides.append((link.up_keys, link.counts))
        known: list[tuple[KeyArray, FloatArray]] = []
        for pair_keys, counts in sides:
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


@dataclass(frozen=True)
class PlanSettings:
    """Knobs of :func:`build_plan`, validated once.

    ``alpha`` is 000 §3.1's imbalance bound (1.03 is METIS' default tolerance,
    000 §4.3). ``max_table_entries`` bounds each stage's table (the routing
    table lives in every upstream task); ``None`` means no bound.
    ``heavy_rule`` and ``split_rule`` choose how keys are given to the
    splitter (module docstring); ``cost`` is the model a split must pay under.
    """

    n_instances: int
    alpha: float = 1.03
    max_table_entries: int | None = None
    seed: int = 0
    heavy_key_policy: HeavyKeyPolicy = "split"
    heavy_rule: HeavyRule = "mean"
    split_rule: SplitRule = "pays"
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.n_instances < 1:
            raise ValueError(f"n_instances must be ≥ 1, got {self.n_instances}")
        if not np.isfinite(self.alpha) or self.alpha < 1.0:
            raise ValueError(f"alpha is an imbalance bound and must be ≥ 1, got {self.alpha}")
        if self.max_table_entries is not None and self.max_table_entries < 0:
            raise ValueError(f"max_table_entries must be ≥ 0 or None, got {self.max_table_entries}")
        if self.heavy_key_policy not in ("split", "pin"):
            raise ValueError(
                f"heavy_key_policy must be 'split' or 'pin', got {self.heavy_key_policy!r}"
            )
        if self.heavy_rule not in ("mean", "cascade"):
            raise ValueError(f"heavy_rule must be 'mean' or 'cascade', got {self.heavy_rule!r}")
        if self.split_rule not in ("pays", "alpha"):
            raise ValueError(f"split_rule must be 'pays' or 'alpha', got {self.split_rule!r}")

    @property
    def metis_ufactor(self) -> int:
        """METIS' load tolerance in thousandths: α = 1.03 → 30 (at least 1)."""
        return max(1, round((self.alpha - 1.0) * 1000))


class Evaluation(NamedTuple):
    """Locality and per-stage imbalance (max / mean instance load) of a window."""

    locality: float
    imbalance_a: float
    imbalance_b: float


@dataclass(frozen=True)
class ChainPlan:
    """Routing tables for each stage of a chain, upstream first, and what they are
    predicted to achieve on the statistics they were built from.

    ``heavy_keys[s]`` are stage s's keys too heavy for α, heaviest first
    (:class:`LocalityPlan` says what the policies do with them).
    ``predicted_locality`` is the share of all consecutive pairs' weight
    kept on one instance; 0 for a one-stage chain, which has no pairs.
    """

    n_instances: int
    alpha: float
    tables: tuple[dict[int, int], ...]
    heavy_keys: tuple[tuple[int, ...], ...]
    predicted_locality: float
    predicted_imbalance: tuple[float, ...]
    heavy_key_policy: HeavyKeyPolicy = "split"

    def split_keys(self, stage: int) -> tuple[int, ...]:
        """The ``stage``-th stage's keys the splitter spreads: heavy keys not in its table."""
        return tuple(key for key in self.heavy_keys[stage] if key not in self.tables[stage])


@dataclass(frozen=True)
class LocalityPlan:
    """Routing tables for stages A and B and what they are predicted to achieve.

    ``heavy_keys_a``/``heavy_keys_b`` are the keys too heavy for α, heaviest
    first: with the ``split`` policy they are not in the tables and the hot-key
    splitter must spread them; with ``pin`` those the table budget had room
    for are in the tables too, and the others are split keys.
    Predictions are measured on the training statistics (see the module
    docstring for what the imbalance counts). ``candidate`` says which of
    :func:`choose_plan`'s candidates this is, ``predicted_throughput`` what
    the cost model predicts for it on the next window (0 when no model
    scored it). ``promised_imbalance`` is the bound the plan expects the next
    window's worse stage to keep with :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE`
    (0 when not scored, ``math.inf`` when no drift has been measured yet, see
    :func:`score`): α stays the operator's target, the promise is what
    this plan tells the operator to expect. ``model_promise`` is the drift
    model's bound before calibration (0 when no drift was measured) and
    ``promise_ratios`` how far earlier plans' next windows went, in units of
    their model's slack (:func:`choose_plan`).
    """

    n_instances: int
    alpha: float
    table_a: dict[int, int]
    table_b: dict[int, int]
    heavy_keys_a: tuple[int, ...]
    heavy_keys_b: tuple[int, ...]
    predicted_locality: float
    predicted_imbalance_a: float
    predicted_imbalance_b: float
    heavy_key_policy: HeavyKeyPolicy = "split"
    candidate: CandidateName = "plan"
    predicted_throughput: float = 0.0
    promised_imbalance: float = 0.0
    model_promise: float = 0.0
    promise_ratios: tuple[float, ...] = ()

    @property
    def tables(self) -> tuple[dict[int, int], dict[int, int]]:
        return self.table_a, self.table_b

    @property
    def split_keys_a(self) -> tuple[int, ...]:
        """Stage A's keys the splitter spreads: heavy keys not pinned in the table."""
        return tuple(key for key in self.heavy_keys_a if key not in self.table_a)

    @property
    def split_keys_b(self) -> tuple[int, ...]:
        return tuple(key for key in self.heavy_keys_b if key not in self.table_b)

    def routers(self) -> tuple[TableRouter, TableRouter]:
        """Routers running the plan in the simulator: tables, split keys spread, Spark hash."""
        n = self.n_instances
        return (
            TableRouter(self.table_a, n, "a", spread=self.split_keys_a),
            TableRouter(self.table_b, n, "b", spread=self.split_keys_b),
        )

    def evaluate(self, window: PairStatistics) -> Evaluation:
        """Score the plan on another window, e.g. the next one (held-out)."""
        return evaluate(
            self.tables,
            window,
            self.n_instances,
            split_keys_a=self.split_keys_a,
            split_keys_b=self.split_keys_b,
        )


class TableRouter:
    """Routes by a key → instance table, hashing keys it does not hold (000 §3.3).

    Lookups are vectorised: the table is kept as sorted keys and a parallel
    instance array, and each chunk is resolved with one ``searchsorted``.
    The hash fallback is Spark's (:func:`spark_workers`). Keys in ``spread``
    (split keys) go round-robin over all instances, as evenly as a splitter
    spreads them.
    """

    def __init__(
        self,
        table: Mapping[int, int],
        n_workers: int,
        name: str = "table",
        *,
        spread: Collection[int] = (),
    ) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers must be ≥ 1, got {n_workers}")
        self._spread = np.unique(np.fromiter(spread, dtype=np.int64, count=len(spread)))
        self._next = 0
        keys = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
        workers = np.fromiter(table.values(), dtype=np.int64, count=len(table))
        if workers.size and (workers.min() < 0 or workers.max() >= n_workers):
            raise ValueError(f"table instances must lie in [0, {n_workers})")
        order = np.argsort(keys, kind="stable")
        self._keys = keys[order]
        self._workers = workers[order]
        self.name = name
        self.n_workers = n_workers

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        keys = np.asarray(keys, dtype=np.int64)
        workers = np.empty(keys.size, dtype=np.int64)
        if self._keys.size:
            position = np.minimum(np.searchsorted(self._keys, keys), self._keys.size - 1)
            found = self._keys[position] == keys
            workers[found] = self._workers[position[found]]
        else:
            found = np.zeros(keys.size, dtype=np.bool_)
        spread = np.isin(keys, self._spread) & ~found
        if spread.any():
            count = int(spread.sum())
            workers[spread] = (np.arange(count) + self._next) % self.n_workers
            self._next = (self._next + count) % self.n_workers
        missing = ~found & ~spread
        if missing.any():
            workers[missing] = spark_workers(keys[missing], self.n_workers)
        return workers


def _imbalance(loads: FloatArray) -> float:
    """max / mean of instance loads; 1.0 when there is no load at all or all are equal
    (a load spread evenly over ``n`` instances is not exactly ``total / n`` in floats)."""
    total = float(loads.sum())
    if total <= 0.0 or float(loads.max() - loads.min()) <= 1e-12 * float(loads.max()):
        return 1.0
    return float(loads.max()) / (total / loads.size)


def evaluate(
    tables: tuple[Mapping[int, int], Mapping[int, int]],
    pairs_window: PairStatistics,
    n: int,
    *,
    split_keys_a: Collection[int] = (),
    split_keys_b: Collection[int] = (),
) -> Evaluation:
    """Locality and per-stage imbalance of routing tables on a window.

    Keys outside a table take Spark's hash fallback (000 §3.3), so a plan
    trained on window t can be scored on window t+1. Split keys (hot keys
    spread by the splitter) count as local with probability 1/n and their
    load is spread evenly over the instances, exactly as in
    :func:`build_plan`'s predictions.
    """
    table_a, table_b = tables
    router_a = TableRouter(table_a, n, "a")
    router_b = TableRouter(table_b, n, "b")
    no_times = np.zeros(0)
    split_a = np.fromiter(split_keys_a, dtype=np.int64)
    split_b = np.fromiter(split_keys_b, dtype=np.int64)

    a_keys, b_keys, counts = aggregate_pairs(
        pairs_window.a_keys, pairs_window.b_keys, pairs_window.counts
    )
    worker_a = router_a.route(a_keys, no_times)
    worker_b = router_b.route(b_keys, no_times)
    spread = np.isin(a_keys, split_a) | np.isin(b_keys, split_b)
    local = np.where(spread, 1.0 / n, (worker_a == worker_b).astype(np.float64))
    total = float(counts.sum())
    locality = float((counts * local).sum() / total) if total > 0 else 0.0

    return Evaluation(
        locality,
        _imbalance(_instance_loads(pairs_window.stage_weights("a"), router_a, split_a, n)[0]),
        _imbalance(_instance_loads(pairs_window.stage_weights("b"), router_b, split_b, n)[0]),
    )


def _instance_loads(
    weights: KeyWeights, router: TableRouter, split: KeyArray, n: int
) -> tuple[FloatArray, FloatArray]:
    """Each instance's load (split keys spread evenly) and the summed squared weight
    of the unsplit keys on it, what drifts with them
    (:class:`~keyplane.algorithms.costmodel.Drift`)."""
    keep = ~np.isin(weights.keys, split)
    workers = router.route(weights.keys[keep], np.zeros(0))
    spread = float(weights.weights[~keep].sum()) / n
    loads = _weighted_counts(workers, weights.weights[keep], n) + spread
    return loads, _weighted_counts(workers, weights.weights[keep] ** 2, n)


def stage_profiles(
    plan: LocalityPlan, window: PairStatistics, drift: tuple[Drift, Drift]
) -> list[StageProfile]:
    """Both stages of ``window`` under ``plan`` as shares, for
    :func:`keyplane.algorithms.costmodel.next_window`."""
    profiles: list[StageProfile] = []
    n = plan.n_instances
    stages: tuple[Literal["a", "b"], ...] = ("a", "b")
    for stage, table, split, stage_drift in zip(
        stages,
        plan.tables,
        (plan.split_keys_a, plan.split_keys_b),
        drift,
        strict=True,
    ):
        router = TableRouter(table, n, stage)
        loads, squares = _instance_loads(
            window.stage_weights(stage), router, np.fromiter(split, dtype=np.int64), n
        )
        total = float(loads.sum())
        if total <= 0.0:  # an empty stage: nothing to drift
            profiles.append((np.full(n, 1.0 / n), np.zeros(n), stage_drift))
            continue
        profiles.append((loads / total, squares / total / total, stage_drift))
    return profiles


def _heavy_mask(weights: FloatArray, alpha: float, n: int, rule: HeavyRule = "mean") -> BoolArray:
    """Keys heavier than α × the stage's mean instance load (module docstring, step 2).

    ``cascade`` re-tests each next key against the mean of the keys that
    remain, which on a short key list marks one key after another.
    """
    if rule == "mean":
        return np.asarray(weights > alpha * float(weights.sum()) / n, dtype=np.bool_)
    heavy = np.zeros(weights.size, dtype=np.bool_)
    remaining = float(weights.sum())
    for index in np.argsort(-weights, kind="stable"):
        if remaining <= 0.0 or weights[index] <= alpha * remaining / n:
            break
        heavy[index] = True
        remaining -= float(weights[index])
    return heavy


def _split_cap(weights: FloatArray) -> int:
    """Most keys of a stage that may be split: half its keys with weight.

    A split key keeps state on several instances (paper 001 §6 counts these
    replicas as memory); splitting most keys of a short key list turns
    fields grouping into shuffle grouping, the memory cost the batch-time
    model does not see.
    """
    return int((weights > 0).sum()) // 2


def _table_mask(
    pair_weight: FloatArray, weight: FloatArray, eligible: BoolArray, budget: int | None
) -> BoolArray:
    """The most valuable eligible keys: by pair weight, then frequency, within budget."""
    candidates = np.flatnonzero(eligible & (weight > 0))
    order = np.lexsort((-weight[candidates], -pair_weight[candidates]))
    chosen = candidates[order] if budget is None else candidates[order[:budget]]
    mask = np.zeros(weight.size, dtype=np.bool_)
    mask[chosen] = True
    return mask


@dataclass
class _KeyGraph:
    """The k-partite key graph of 000 §3.3: the first stage's keys, then the next's, ...

    ``starts[s]:starts[s + 1]`` are stage s's vertices; ``edge_up`` and
    ``edge_down`` the two ends of every pair of keys of consecutive stages.
    """

    keys: KeyArray
    weight: FloatArray
    starts: npt.NDArray[np.int64]
    adjacency: sp.csr_matrix
    edge_up: npt.NDArray[np.int64]
    edge_down: npt.NDArray[np.int64]
    edge_weight: FloatArray

    @classmethod
    def from_statistics(cls, chain: ChainStatistics) -> _KeyGraph:
        weights = [chain.stage_weights(stage) for stage in range(chain.n_stages)]
        starts = np.cumsum([0, *(w.keys.size for w in weights)]).astype(np.int64)
        ups, downs, counts = [], [], []
        for stage, link in enumerate(chain.links):
            up, down, count = aggregate_pairs(link.up_keys, link.down_keys, link.counts)
            ups.append(starts[stage] + np.searchsorted(weights[stage].keys, up))
            downs.append(starts[stage + 1] + np.searchsorted(weights[stage + 1].keys, down))
            counts.append(count)
        edge_up = np.concatenate([np.zeros(0, dtype=np.int64), *ups]).astype(np.int64)
        edge_down = np.concatenate([np.zeros(0, dtype=np.int64), *downs]).astype(np.int64)
        edge_weight = np.concatenate([np.zeros(0), *counts])
        size = int(starts[-1])
        adjacency = sp.csr_matrix(
            (
                np.concatenate([edge_weight, edge_weight]),
                (np.r_[edge_up, edge_down], np.r_[edge_down, edge_up]),
            ),
            shape=(size, size),
        )
        adjacency.sum_duplicates()
        adjacency.sort_indices()
        return cls(
            keys=np.concatenate([np.zeros(0, dtype=np.int64), *(w.keys for w in weights)]),
            weight=np.concatenate([np.zeros(0), *(w.weights for w in weights)]),
            starts=starts,
            adjacency=adjacency,
            edge_up=edge_up,
            edge_down=edge_down,
            edge_weight=edge_weight,
        )

    @property
    def n_stages(self) -> int:
        return int(self.starts.size) - 1

    def stage(self, stage: int) -> npt.NDArray[np.int64]:
        return np.arange(self.starts[stage], self.starts[stage + 1])

    def stage_slice(self, stage: int) -> slice:
        """The stage's vertices as a slice: views of per-vertex arrays, no copy."""
        return slice(int(self.starts[stage]), int(self.starts[stage + 1]))

    def stage_of(self, vertices: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return np.searchsorted(self.starts, vertices, side="right").astype(np.int64) - 1

    def neighbours(self, vertex: int) -> tuple[npt.NDArray[np.int32], FloatArray]:
        start, end = self.adjacency.indptr[vertex], self.adjacency.indptr[vertex + 1]
        return self.adjacency.indices[start:end], self.adjacency.data[start:end]


def _metis_parts(
    graph: _KeyGraph,
    tabled: BoolArray,
    fixed_loads: dict[int, FloatArray],
    stage_totals: dict[int, float],
    settings: PlanSettings,
) -> npt.NDArray[np.int64]:
    """Partition the table keys of every stage jointly with METIS (000 §3.3); returns
    a part per table key.

    Vertex weights are each stage's share of its own total, so one balance
    constraint weighs every stage equally (module docstring, step 4). A
    part's target is the capacity the hashed keys leave on its instance,
    summed over stages.
    """
    n = settings.n_instances
    vertices = np.flatnonzero(tabled)
    if vertices.size == 0 or n == 1:
        return np.zeros(vertices.size, dtype=np.int64)
    stage_total = np.asarray([stage_totals[s] for s in range(graph.n_stages)])[
        graph.stage_of(vertices)
    ]
    shares = np.divide(
        graph.weight[vertices], stage_total, out=np.zeros(vertices.size), where=stage_total > 0
    )
    vertex_weights = np.rint(shares * _METIS_VERTEX_SCALE).astype(np.int64)

    capacity = np.zeros(n)
    for stage, total in stage_totals.items():
        if total > 0:
            capacity += np.maximum(0.0, total / n - fixed_loads[stage]) / total
    capacity = np.maximum(capacity, _MIN_PART_TARGET)
    if vertices.size < _MIN_VERTICES_PER_PART * n:
        return _fill_by_capacity(shares, capacity)
    targets = [float(c) for c in capacity / capacity.sum()]
    targets[-1] = 1.0 - sum(targets[:-1])

    sub = graph.adjacency[vertices][:, vertices].tocsr()
    sub.sort_indices()
    edge_weights = sub.data
    if edge_weights.size:
        scaled = np.rint(edge_weights / edge_weights.max() * _METIS_EDGE_SCALE)
        edge_weights = np.maximum(scaled, 1.0)
    index_type = pymetis.zero_copy_dtype()
    result = pymetis.part_graph(
        n,
        adjacency=pymetis.CSRAdjacency(
            sub.indptr.astype(index_type), sub.indices.astype(index_type)
        ),
        vweights=vertex_weights.astype(index_type),
        eweights=edge_weights.astype(index_type),
        tpwgts=targets,
        options=pymetis.Options(ufactor=settings.metis_ufactor, seed=settings.seed),
    )
    return np.asarray(result.vertex_part, dtype=np.int64)


def _fill_by_capacity(shares: FloatArray, capacity: FloatArray) -> npt.NDArray[np.int64]:
    """Heaviest key first onto the part with most room left.

    Used instead of METIS for graphs with too few vertices per part, which
    METIS' recursive bisection cannot split (it then reports errors).
    """
    room = capacity.copy()
    parts = np.zeros(shares.size, dtype=np.int64)
    for vertex in np.argsort(-shares, kind="stable"):
        part = int(np.argmax(room))
        parts[vertex] = part
        room[part] -= shares[vertex]
    return parts


class _Rebalancer:
    """Greedy repair of per-stage balance after METIS (step 5 of the module doc).

    ``connection[v, i]`` is the pair weight between key v and the keys placed
    on instance i, so moving v from p to q loses ``connection[v, p] -
    connection[v, q]`` of local pair weight; it is kept up to date per move.
    """

    def __init__(
        self,
        graph: _KeyGraph,
        placement: npt.NDArray[np.int64],
        tabled: BoolArray,
        heavy: BoolArray,
        settings: PlanSettings,
    ) -> None:
        self.graph = graph
        self.placement = placement
        self.tabled = tabled
        self.heavy = heavy
        self.settings = settings
        n = settings.n_instances
        placed = np.flatnonzero(placement >= 0)
        indicator = sp.csr_matrix(
            (np.ones(placed.size), (placed, placement[placed])), shape=(placement.size, n)
        )
        self.connection = np.asarray((graph.adjacency @ indicator).todense())
        self.pair_weight = np.asarray(graph.adjacency.sum(axis=1)).ravel()
        self.edge_total = float(graph.edge_weight.sum())

    def _shift(self, vertex: int, source: int, target: int | None) -> None:
        neighbours, weights = self.graph.neighbours(vertex)
        self.connection[neighbours, source] -= weights
        if target is not None:
            self.connection[neighbours, target] += weights

    def balance_stage(self, stage_index: int) -> None:
        """Move (or, when it pays, split) keys until the stage is within α (000 §3.1).

        The loads are recomputed from the placement on each round, as
        :func:`_finish_plan` sums them, and the stop test is the very
        ``max / mean ≤ α`` it reports, so with ``split_rule="alpha"`` the
        bound holds exactly, also at α = 1 for a perfect split. With
        ``"pays"``, once no move fits within α, the pass takes the action
        that saves most batch time under the cost model (a move that lowers
        the straggler without fitting, or a split) and stops when none saves
        any; splits stop at :func:`_split_cap`.
        """
        n = self.settings.n_instances
        alpha = self.settings.alpha
        stage = self.graph.stage_slice(stage_index)
        first = stage.start
        place = self.placement[stage]
        weight = self.graph.weight[stage]
        cap = _split_cap(weight)
        for _ in range(20 * (place.size + n)):
            loads = _stage_loads(place, weight, n)
            if _imbalance(loads) <= alpha:
                return
            total = float(loads.sum())
            bound = alpha * total / n * _BOUND_MARGIN
            overloaded = int(np.argmax(loads))
            excess = loads[overloaded] - bound
            room: FloatArray = bound - loads
            room[overloaded] = -np.inf
            on_part = first + np.flatnonzero((place == overloaded) & (weight > 0))
            movable = on_part[self.tabled[on_part]]
            move = self._cheapest_move(movable, overloaded, room, excess)
            if move is None and self.settings.split_rule == "pays":
                split_room = int((place < 0).sum()) < cap
                move = self._paying_action(on_part, loads, overloaded, stage_index, split_room)
                if move is None:
                    return
            if move is None or move[1] < 0:
                vertex = (
                    self._key_to_split(on_part, float(loads[overloaded]), total)
                    if move is None
                    else move[0]
                )
                self.heavy[vertex] = True
                self.tabled[vertex] = False
                self.placement[vertex] = -1
                self._shift(vertex, overloaded, None)
                continue
            vertex, target = move
            self.placement[vertex] = target
            self._shift(vertex, overloaded, target)

    def _key_to_split(self, on_part: npt.NDArray[np.int64], load: float, total: float) -> int:
        """The lightest key whose split brings its instance within the bound,
        else the heaviest key of the instance.

        A split key's weight is spread evenly (module doc), so it adds to
        every other instance; the lightest key that suffices adds least, so a
        split on one instance seldom overloads the next.
        """
        n = self.settings.n_instances
        alpha = self.settings.alpha
        weight = self.graph.weight[on_part]
        clears = load - weight + weight / n <= alpha * total / n * _BOUND_MARGIN
        if clears.any():
            candidates = np.flatnonzero(clears)
            return int(on_part[candidates[np.argmin(weight[candidates])]])
        return int(on_part[np.argmax(weight)])

    def _paying_action(
        self,
        on_part: npt.NDArray[np.int64],
        loads: FloatArray,
        overloaded: int,
        stage_index: int,
        split_room: bool,
    ) -> tuple[int, int] | None:
        """The move ``(key, target)`` or split ``(key, -1)`` of a key of the overloaded
        instance that saves most batch time under the cost model, if any saves some.

        Either lowers the straggler by what the stage's new maximum is below
        the old (the mean stays) and costs locality: a move loses the key's
        pairs local on its instance and gains those on the target; a split
        keeps them local only 1/n of the time.
        """
        if on_part.size == 0:
            return None
        n = self.settings.n_instances
        cost = self.settings.cost
        service = cost.stage_service(stage_index)
        edge_total = max(self.edge_total, 1e-300)
        weight = self.graph.weight[on_part]
        mean = float(loads.sum()) / n
        peak = float(loads.max())
        others = np.delete(loads, overloaded)
        rest = float(others.max()) if others.size else 0.0
        connection = self.connection[on_part]
        local_now = connection[:, overloaded]

        # Moves of table keys: the new max is over the source, the target and the rest.
        source_after = loads[overloaded] - weight
        target_after = loads[None, :] + weight[:, None]
        second = np.array([np.delete(others, i).max(initial=0.0) for i in range(n - 1)])
        rest_without = np.insert(second, overloaded, rest)
        move_max = np.maximum(np.maximum(source_after[:, None], target_after), rest_without)
        move_gain = service * (peak - move_max) / mean - cost.remote * (
            (local_now[:, None] - connection) / edge_total
        )
        move_gain[:, overloaded] = -np.inf
        move_gain[~self.tabled[on_part], :] = -np.inf

        best_gain, best = -np.inf, None
        if move_gain.size:
            row, column = np.unravel_index(int(np.argmax(move_gain)), move_gain.shape)
            best_gain, best = float(move_gain[row, column]), (int(on_part[row]), int(column))
        if split_room:
            after = np.broadcast_to(loads, (on_part.size, n)) + (weight / n)[:, None]
            after[:, overloaded] -= weight
            lost = (local_now - self.pair_weight[on_part] / n) / edge_total
            split_gain = service * (peak - after.max(axis=1)) / mean - cost.remote * lost
            pick = int(np.argmax(split_gain))
            if split_gain[pick] > best_gain:
                best_gain, best = float(split_gain[pick]), (int(on_part[pick]), -1)
        if best is None or best_gain <= 1e-12:
            return None
        return best

    def _cheapest_move(
        self,
        movable: npt.NDArray[np.int64],
        source: int,
        room: FloatArray,
        excess: float,
    ) -> tuple[int, int] | None:
        """The move losing least locality: one key clearing the excess, or the
        best loss-per-load key when a run of such keys is estimated cheaper."""
        if movable.size == 0:
            return None
        weight = self.graph.weight[movable]
        connection = self.connection[movable]
        loss = connection[:, [source]] - connection
        fits = weight[:, None] <= room[None, :]
        if not fits.any():
            return None
        rate = np.where(fits, loss / weight[:, None], np.inf)
        best_rate = np.unravel_index(int(np.argmin(rate)), rate.shape)
        clears = fits & (weight[:, None] >= excess)
        if clears.any():
            single = np.where(clears, loss, np.inf)
            best_single = np.unravel_index(int(np.argmin(single)), single.shape)
            if single[best_single] <= rate[best_rate] * excess:
                return int(movable[best_single[0]]), int(best_single[1])
        return int(movable[best_rate[0]]), int(best_rate[1])


def build_plan(
    pairs: PairStatistics,
    n_instances: int,
    *,
    alpha: float = 1.03,
    max_table_entries: int | None = None,
    seed: int = 0,
    heavy_key_policy: HeavyKeyPolicy = "split",
    hash_parts: HashParts | None = None,
    heavy_rule: HeavyRule = "mean",
    split_rule: SplitRule = "pays",
    cost: CostModel | None = None,
) -> LocalityPlan:
    """Routing tables for stages A and B from one window of pair statistics (000 §3.3):
    :func:`build_chain_plan` on the two-stage chain."""
    chain = build_chain_plan(
        pairs.chain(),
        n_instances,
        alpha=alpha,
        max_table_entries=max_table_entries,
        seed=seed,
        heavy_key_policy=heavy_key_policy,
        hash_parts=hash_parts,
        heavy_rule=heavy_rule,
        split_rule=split_rule,
        cost=cost,
    )
    return LocalityPlan(
        n_instances=chain.n_instances,
        alpha=chain.alpha,
        table_a=chain.tables[0],
        table_b=chain.tables[1],
        heavy_keys_a=chain.heavy_keys[0],
        heavy_keys_b=chain.heavy_keys[1],
        predicted_locality=chain.predicted_locality,
        predicted_imbalance_a=chain.predicted_imbalance[0],
        predicted_imbalance_b=chain.predicted_imbalance[1],
        heavy_key_policy=chain.heavy_key_policy,
    )


def build_chain_plan(
    chain: ChainStatistics,
    n_instances: int,
    *,
    alpha: float = 1.03,
    max_table_entries: int | None = None,
    seed: int = 0,
    heavy_key_policy: HeavyKeyPolicy = "split",
    hash_parts: HashParts | None = None,
    heavy_rule: HeavyRule = "mean",
    split_rule: SplitRule = "pays",
    cost: CostModel | None = None,
) -> ChainPlan:
    """Routing tables for every stage of a chain from one window of statistics (000 §3.3).

    The keys left out of a table (under ``max_table_entries``, per stage)
    are counted where ``hash_parts`` puts them; by default
    :func:`spark_workers`, the job's placement. With ``split_rule="alpha"``
    (``split`` policy) each stage's predicted imbalance on ``chain`` is ≤
    ``alpha``; with ``"pays"`` it is ≤ ``alpha`` unless meeting it would take
    a split that costs more than it saves under ``cost``. See the module
    docstring for the steps and for what the balance counts.
    """
    settings = PlanSettings(
        n_instances,
        alpha,
        max_table_entries,
        seed,
        heavy_key_policy,
        heavy_rule,
        split_rule,
        cost if cost is not None else CostModel(),
    )
    n = settings.n_instances
    graph = _KeyGraph.from_statistics(chain)
    pair_weight = np.asarray(graph.adjacency.sum(axis=1)).ravel()
    stages = range(graph.n_stages)

    heavy = np.zeros(graph.keys.size, dtype=np.bool_)
    tabled = np.zeros(graph.keys.size, dtype=np.bool_)
    for index in stages:
        stage = graph.stage(index)
        heavy[stage] = _heavy_mask(graph.weight[stage], settings.alpha, n, settings.heavy_rule)
        if settings.split_rule == "pays":
            stage_heavy = stage[heavy[stage]]
            keep = stage_heavy[np.argsort(-graph.weight[stage_heavy], kind="stable")]
            heavy[keep[_split_cap(graph.weight[stage]) :]] = False
        budget = settings.max_table_entries
        if budget is not None and settings.heavy_key_policy == "pin":
            budget = max(0, budget - int(heavy[stage].sum()))
        tabled[stage] = _table_mask(pair_weight[stage], graph.weight[stage], ~heavy[stage], budget)

    placement = np.full(graph.keys.size, -1, dtype=np.int64)
    hashed = ~heavy & ~tabled
    fixed_loads: dict[int, FloatArray] = {}
    stage_totals: dict[int, float] = {}
    for index in stages:
        stage = graph.stage(index)
        stage_hashed = stage[hashed[stage]]
        keys = graph.keys[stage_hashed]
        placement[stage_hashed] = (
            spark_workers(keys, n) if hash_parts is None else hash_parts(index, keys)
        )
        fixed_loads[index] = _weighted_counts(
            placement[stage_hashed], graph.weight[stage_hashed], n
        )
        stage_totals[index] = float(graph.weight[stage[~heavy[stage]]].sum())
    placement[tabled] = _metis_parts(graph, tabled, fixed_loads, stage_totals, settings)

    rebalancer = _Rebalancer(graph, placement, tabled, heavy, settings)
    for index in stages:
        rebalancer.balance_stage(index)

    if settings.heavy_key_policy == "pin":
        _pin_heavy(graph, placement, tabled, heavy, settings)

    return _finish_plan(graph, placement, tabled, heavy, settings)


def _pin_heavy(
    graph: _KeyGraph,
    placement: npt.NDArray[np.int64],
    tabled: BoolArray,
    heavy: BoolArray,
    settings: PlanSettings,
) -> None:
    """Put heavy keys, heaviest first, on their stage's least loaded instance.

    A pinned key takes a table entry, so at most the entries the table budget
    has left are pinned; the rest stay split keys. That covers the keys the
    rebalancer handed to the splitter too: they were not counted when the
    budget was first reserved for the heavy keys.
    """
    n = settings.n_instances
    for index in range(graph.n_stages):
        stage = graph.stage(index)
        placed = stage[placement[stage] >= 0]
        loads = _weighted_counts(placement[placed], graph.weight[placed], n)
        stage_heavy = stage[heavy[stage]]
        order = stage_heavy[np.argsort(-graph.weight[stage_heavy], kind="stable")]
        if settings.max_table_entries is not None:
            room = max(0, settings.max_table_entries - int(tabled[stage].sum()))
            order = order[:room]
        for vertex in order:
            target = int(np.argmin(loads))
            placement[vertex] = target
            tabled[vertex] = True
            loads[target] += graph.weight[vertex]


def _finish_plan(
    graph: _KeyGraph,
    placement: npt.NDArray[np.int64],
    tabled: BoolArray,
    heavy: BoolArray,
    settings: PlanSettings,
) -> ChainPlan:
    n = settings.n_instances
    split = heavy & (placement < 0)
    place_up = placement[graph.edge_up]
    place_down = placement[graph.edge_down]
    spread = split[graph.edge_up] | split[graph.edge_down]
    local = np.where(spread, 1.0 / n, (place_up == place_down).astype(np.float64))
    total = float(graph.edge_weight.sum())
    locality = float((graph.edge_weight * local).sum() / total) if total > 0 else 0.0

    def table(index: int) -> dict[int, int]:
        stage = graph.stage(index)
        chosen = stage[tabled[stage]]
        return dict(zip(graph.keys[chosen].tolist(), placement[chosen].tolist(), strict=True))

    def heavy_keys(index: int) -> tuple[int, ...]:
        stage = graph.stage(index)
        chosen = stage[heavy[stage]]
        chosen = chosen[np.argsort(-graph.weight[chosen], kind="stable")]
        return tuple(graph.keys[chosen].tolist())

    def imbalance(index: int) -> float:
        stage = graph.stage_slice(index)
        return _imbalance(_stage_loads(placement[stage], graph.weight[stage], n))

    stages = range(graph.n_stages)
    return ChainPlan(
        n_instances=n,
        alpha=settings.alpha,
        tables=tuple(table(index) for index in stages),
        heavy_keys=tuple(heavy_keys(index) for index in stages),
        predicted_locality=locality,
        predicted_imbalance=tuple(imbalance(index) for index in stages),
        heavy_key_policy=settings.heavy_key_policy,
    )


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
        """``n_instances``: the parallelism the drift is probed on (:func:`measure_drift`)."""
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
        """The accumulated statistics, ready for :func:`build_plan`."""
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


DEFAULT_HEADROOM = 0.5
"""Share of the slack ``α − 1`` a plan may use on its training window: it is
built to ``1 + headroom · (α − 1)`` so that the drift of the next window has
the rest (α = 1.03 → planned to 1.015)."""


def hash_plan(n_instances: int, alpha: float = 1.03) -> LocalityPlan:
    """Plain hash routing as a plan: no tables, no split keys."""
    return LocalityPlan(n_instances, alpha, {}, {}, (), (), 0.0, 1.0, 1.0, candidate="hash")


def score(
    plan: LocalityPlan,
    window: PairStatistics,
    cost: CostModel,
    drift: tuple[Drift, Drift] | None = None,
) -> LocalityPlan:
    """``plan`` with its predictions measured on ``window``, its predicted
    throughput and its promise on the next window.

    Under ``drift`` (per stage; :attr:`PairHistory.drift`) the throughput is
    the cost model's at the expected next-window imbalance and the promise the
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE` bound of
    :func:`keyplane.algorithms.costmodel.next_window`. Without ``drift`` both
    are in-sample: the caller scores a plan on the window it runs on. A
    ``drift`` that has measured no window yet is no evidence of how the next
    window moves, and the in-sample imbalance is a bound the next window
    breaks, so the promise is then unbounded (``math.inf``): none is made.
    """
    measured = plan.evaluate(window)
    ahead = next_window(stage_profiles(plan, window, drift or (Drift(), Drift())))
    bound = max(ahead.promise, 1.0)
    known = _measured_any(drift)
    return dataclasses.replace(
        plan,
        predicted_locality=measured.locality,
        predicted_imbalance_a=measured.imbalance_a,
        predicted_imbalance_b=measured.imbalance_b,
        predicted_throughput=cost.throughput(measured.locality, *ahead.imbalances),
        promised_imbalance=bound if drift is None or known else math.inf,
        model_promise=bound if known else 0.0,
    )


def _measured_any(drift: tuple[Drift, Drift] | None) -> bool:
    return drift is not None and any(stage.windows > 0 for stage in drift)


MAX_PROMISE_RATIOS = 48
"""Most of the earlier plans' outcomes :func:`choose_plan` calibrates its promise on."""


def _calibration(ratios: tuple[float, ...]) -> float:
    """Factor on the model's slack so that the promise would have held on the
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE` share of earlier plans
    (split conformal prediction: the ⌈(k+1)·q⌉-th smallest of k ratios, the
    largest when there are too few); never below 1, the model's own bound."""
    if not ratios:
        return 1.0
    ordered = np.sort(np.asarray(ratios, dtype=np.float64))
    rank = min(ordered.size, int(np.ceil((ordered.size + 1) * PROMISE_CONFIDENCE)))
    return max(1.0, float(ordered[rank - 1]))


def drift_margin(
    pairs: PairStatistics | ChainStatistics, drift: Sequence[Drift], n_instances: int
) -> float:
    """How far above 1 the next window's expected imbalance is for a plan balanced
    perfectly on ``pairs``: the slack the measured drift (one per stage, upstream
    first) takes by itself."""
    chain = pairs.chain() if isinstance(pairs, PairStatistics) else pairs
    profiles: list[StageProfile] = []
    for index, stage_drift in enumerate(drift):
        weights = chain.stage_weights(index)
        total = float(weights.weights.sum())
        squares = float(((weights.weights / total) ** 2).sum()) / n_instances if total > 0 else 0.0
        profiles.append(
            (np.full(n_instances, 1.0 / n_instances), np.full(n_instances, squares), stage_drift)
        )
    ahead = next_window(profiles)
    return max(ahead.imbalances, default=1.0) - 1.0


def choose_plan(
    pairs: PairStatistics,
    n_instances: int,
    *,
    alpha: float = 1.03,
    headroom: float = DEFAULT_HEADROOM,
    current: LocalityPlan | None = None,
    cost: CostModel | None = None,
    max_table_entries: int | None = None,
    seed: int = 0,
    heavy_key_policy: HeavyKeyPolicy = "split",
    drift: tuple[Drift, Drift] | None = None,
    followed: PairStatistics | None = None,
) -> LocalityPlan:
    """The planner: the candidate with the highest predicted next-window throughput.

    Candidates are keeping ``current`` (when given), plain hash routing
    (:func:`hash_plan`) and a new :func:`build_plan` built with balance
    headroom whose splits must pay under ``cost``. Without a measured
    ``drift`` (per stage, :attr:`PairHistory.drift`) the headroom is
    ``headroom`` (:data:`DEFAULT_HEADROOM`). With one, it is sized from the
    drift: the plan is built to α less the :func:`drift_margin` the drift
    takes by itself, and to α when the drift takes all of the slack (a
    tighter plan would then cost locality for a balance the next window does
    not keep). Every candidate is scored at its expected next-window
    imbalance by the same ruler (:func:`score`), so the chosen plan is never
    predicted slower than hash routing; on a tie the earlier candidate
    (current, then hash) wins, since it moves no state.

    The chosen plan's ``promised_imbalance`` is the drift model's bound,
    calibrated on how earlier plans fared: ``followed`` is the window that
    ran under ``current``, whose imbalance there is added to the ratios
    ``current`` carries (:func:`_calibration`). Before ``drift`` has measured
    a window there is no promise (``math.inf``, :func:`score`).
    """
    if not 0.0 <= headroom <= 1.0:
        raise ValueError(f"headroom must lie in [0, 1], got {headroom}")
    if not np.isfinite(alpha) or alpha < 1.0:
        raise ValueError(f"alpha is an imbalance bound and must be ≥ 1, got {alpha}")
    model = cost if cost is not None else CostModel()
    bound = 1.0 + headroom * (alpha - 1.0)
    if drift is not None and _measured_any(drift):
        margin = drift_margin(pairs, drift, n_instances)
        bound = alpha - margin if margin < alpha - 1.0 else alpha
    built = build_plan(
        pairs,
        n_instances,
        alpha=bound,
        max_table_entries=max_table_entries,
        seed=seed,
        heavy_key_policy=heavy_key_policy,
        cost=model,
    )
    candidates = [hash_plan(n_instances, alpha), dataclasses.replace(built, alpha=alpha)]
    ratios: tuple[float, ...] = ()
    if current is not None:
        if current.n_instances != n_instances:
            raise ValueError(
                f"the current plan has {current.n_instances} instances, not {n_instances}"
            )
        candidates.insert(0, dataclasses.replace(current, candidate="current"))
        ratios = current.promise_ratios
        if followed is not None and current.model_promise > 1.0:
            realized = max(current.evaluate(followed)[1:])
            ratio = (realized - 1.0) / (current.model_promise - 1.0)
            ratios = (*ratios, ratio)[-MAX_PROMISE_RATIOS:]
    scored = [score(candidate, pairs, model, drift) for candidate in candidates]
    best = scored[0]
    for candidate in scored[1:]:
        if candidate.predicted_throughput > best.predicted_throughput * (1.0 + 1e-9):
            best = candidate
    promise = best.promised_imbalance
    if best.model_promise > 1.0:
        promise = 1.0 + (best.model_promise - 1.0) * _calibration(ratios)
    return dataclasses.replace(best, promised_imbalance=promise, promise_ratios=ratios)
