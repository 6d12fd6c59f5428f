"""Routing plans, their routers, and what they achieve on a window (paper 000 §3.1, §3.3).

A plan holds a routing table per stage and the keys too heavy for α, with
the locality and imbalance it is predicted to achieve. :func:`evaluate`
measures the same figures for tables on any window, so a plan trained on
window t can be scored on window t+1; keys outside a table take Spark's hash
fallback (:func:`spark_workers`), as in the job.

An instance's load (in the planner's predictions and in :func:`evaluate`)
is the summed weight of the stage's keys placed on it: table keys at their
table instance, hashed keys at their hash instance, split keys spread evenly,
pinned keys where pinned. A stage's imbalance is max / mean of those loads
(000 §3.1).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.costmodel import Drift, StageProfile
from keyplane.algorithms.pair_statistics import (
    FloatArray,
    KeyWeights,
    PairStatistics,
    _weighted_counts,
    aggregate_pairs,
)
from keyplane.algorithms.partitioner import KeyArray, TimeArray, WorkerArray
from keyplane.algorithms.plan_settings import HeavyKeyPolicy
from keyplane.routing.routedkeys import spark_partitions

CandidateName = Literal["hash", "current", "plan"]


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


def _stage_loads(placement: npt.NDArray[np.int64], weight: FloatArray, n: int) -> FloatArray:
    """Instance loads of one stage's keys; unplaced (split) keys, at -1, spread evenly.

    The rebalancer's stop test and the reported imbalance both use this, so
    they sum the same floats in the same order and agree to the last bit.
    """
    counts = _weighted_counts(placement + 1, weight, n + 1)
    return counts[1:] + counts[0] / n


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
    Predictions are measured on the training statistics (see the module docstring
    for what the imbalance counts). ``candidate`` says which of
    :func:`~keyplane.algorithms.plan_choice.choose_plan`'s candidates this is,
    ``predicted_throughput`` what the cost model predicts for it on the next window
    (0 when no model scored it). ``promised_imbalance`` is the bound the plan
    expects the next window's worse stage to keep with
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE` (0 when not scored,
    under the prior drift when none has been measured yet, see
    :func:`~keyplane.algorithms.plan_choice.score`): α stays the operator's target,
    the promise is what this plan tells the operator to expect. ``model_promise`` is
    the drift model's bound before calibration (0 when no drift was measured) and
    ``promise_ratios`` how far earlier plans' next windows went, in units of their
    model's slack (:func:`~keyplane.algorithms.plan_choice.choose_plan`).
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

    @classmethod
    def of_chain(cls, chain: ChainPlan) -> LocalityPlan:
        """A two-stage :class:`ChainPlan` in the two-stage form, with its own predictions."""
        if len(chain.tables) != 2:
            raise ValueError(f"a LocalityPlan has two stages, the chain has {len(chain.tables)}")
        return cls(
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

    def as_chain(self) -> ChainPlan:
        """The same tables and predictions as a two-stage :class:`ChainPlan`."""
        return ChainPlan(
            n_instances=self.n_instances,
            alpha=self.alpha,
            tables=self.tables,
            heavy_keys=(self.heavy_keys_a, self.heavy_keys_b),
            predicted_locality=self.predicted_locality,
            predicted_imbalance=(self.predicted_imbalance_a, self.predicted_imbalance_b),
            heavy_key_policy=self.heavy_key_policy,
        )

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
    :func:`~keyplane.algorithms.locality.build_plan`'s predictions.
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
