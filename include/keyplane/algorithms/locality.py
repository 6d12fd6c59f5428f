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

1. Build the k-partite key graph (:mod:`keyplane.algorithms.key_graph`,
   000 §3.3). A one-stage chain has no edge: its plan is balance and hot-key
   splitting only.
2. Take out the heavy keys, which no partition can balance
   (:mod:`keyplane.algorithms.rebalancing`, 001 §4.2).
3. Keep the most valuable keys within the table budget: first by the pair
   weight they can make local, then by frequency. Other keys use the hash
   fallback (000 §3.3), which fixes their instance: the caller says where
   (``hash_parts``; by default Spark's hash of the key's decimal string,
   :func:`~keyplane.algorithms.locality_plan.spark_workers`, the placement the
   job uses).
4. Partition the table keys of all stages jointly with METIS
   (:mod:`keyplane.algorithms.key_graph`, 000 §3.3).
5. Repair each stage's balance greedily, splitting keys only where it pays
   (:mod:`keyplane.algorithms.rebalancing`).

What a plan's figures count is in :mod:`keyplane.algorithms.locality_plan`;
:mod:`keyplane.algorithms.plan_choice` decides whether a plan is deployed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.costmodel import CostModel
from keyplane.algorithms.key_graph import _KeyGraph, _metis_parts
from keyplane.algorithms.locality_plan import (
    ChainPlan,
    LocalityPlan,
    _imbalance,
    _stage_loads,
    spark_workers,
)
from keyplane.algorithms.pair_statistics import (
    BoolArray,
    ChainStatistics,
    FloatArray,
    PairStatistics,
    _weighted_counts,
)
from keyplane.algorithms.plan_settings import HeavyKeyPolicy, HeavyRule, PlanSettings, SplitRule
from keyplane.algorithms.rebalancing import _heavy_mask, _pin_heavy, _Rebalancer, _split_cap

HashParts = Callable[[int, npt.NDArray[np.int64]], npt.NDArray[np.int64]]
"""Where the hash fallback puts keys outside the table: given the stage's
position in the chain (0 is the most upstream) and key ids, the instance
(part) of each."""


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
    return LocalityPlan.of_chain(chain)


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
    :func:`~keyplane.algorithms.locality_plan.spark_workers`, the job's
    placement. With ``split_rule="alpha"`` (``split`` policy) each stage's
    predicted imbalance on ``chain`` is ≤ ``alpha``; with ``"pays"`` it is ≤
    ``alpha`` unless meeting it would take a split that costs more than it
    saves under ``cost``. See the module docstring for the steps and
    :mod:`keyplane.algorithms.locality_plan` for what the balance counts.
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
