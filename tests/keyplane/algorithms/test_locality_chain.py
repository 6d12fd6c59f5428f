"""The k-partite planner (paper 000 §3.3 over a chain): locality, balance and hot keys per stage.

The plans are scored here by routing the events themselves through the
tables, not by the planner's own predictions.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from keyplane.algorithms.locality import build_chain_plan, build_plan
from keyplane.algorithms.locality_plan import ChainPlan, spark_workers
from keyplane.algorithms.pair_statistics import ChainStatistics, KeyPairs, KeyWeights

N = 6


def _chain_events(seed: int, hot: dict[int, int] | None = None) -> np.ndarray:
    """Events of a three-stage chain with correlated keys: a user, their session
    group (mostly a function of the user), their page group (mostly of the session)."""
    rng = np.random.default_rng(seed)
    count = 30_000
    users = rng.integers(0, 600, count)
    sessions = np.where(rng.random(count) < 0.9, users // 3, rng.integers(0, 200, count))
    pages = np.where(rng.random(count) < 0.9, sessions // 2, rng.integers(0, 100, count))
    events = np.column_stack([users, 1_000 + sessions, 2_000 + pages]).astype(np.int64)
    for stage, key in (hot or {}).items():
        events[rng.random(count) < 0.3, stage] = key
    return events


def _routed(plan: ChainPlan, events: np.ndarray) -> list[np.ndarray]:
    """Each event's instance per stage: table entry, else Spark's hash; split keys -1."""
    out = []
    for stage in range(events.shape[1]):
        keys = events[:, stage]
        table = plan.tables[stage]
        instance = spark_workers(keys, N)
        listed = np.fromiter((k in table for k in keys.tolist()), np.bool_, keys.size)
        instance[listed] = [table[k] for k in keys[listed].tolist()]
        instance[np.isin(keys, plan.split_keys(stage))] = -1
        out.append(instance)
    return out


def _locality(plan: ChainPlan, events: np.ndarray) -> float:
    routed = _routed(plan, events)
    hops = [
        np.where((up < 0) | (down < 0), 1.0 / N, (up == down).astype(np.float64))
        for up, down in pairwise(routed)
    ]
    return float(np.mean(np.concatenate(hops)))


def _imbalances(plan: ChainPlan, events: np.ndarray) -> list[float]:
    result = []
    for instance in _routed(plan, events):
        loads = np.bincount(instance[instance >= 0], minlength=N).astype(np.float64)
        loads += float((instance < 0).sum()) / N
        result.append(float(loads.max() / loads.mean()))
    return result


def test_a_three_stage_plan_keeps_correlated_keys_together_where_hashing_cannot() -> None:
    events = _chain_events(0)
    plan = build_chain_plan(ChainStatistics.of_events(events), N, alpha=1.05, split_rule="alpha")
    hashed = ChainPlan(N, 1.05, ({}, {}, {}), ((), (), ()), 0.0, (1.0, 1.0, 1.0))

    assert len(plan.tables) == 3
    assert _locality(hashed, events) < 0.3
    assert _locality(plan, events) > 0.75
    assert _locality(plan, events) == pytest.approx(plan.predicted_locality, abs=1e-9)
    for measured, predicted in zip(
        _imbalances(plan, events), plan.predicted_imbalance, strict=True
    ):
        assert measured <= 1.05 + 1e-9
        assert measured == pytest.approx(predicted, rel=1e-9)


def test_each_stage_of_the_chain_gets_its_own_hot_key_split() -> None:
    events = _chain_events(1, hot={1: 1_050, 2: 2_070})
    plan = build_chain_plan(ChainStatistics.of_events(events), N, alpha=1.05)

    assert 1_050 in plan.split_keys(1)
    assert 2_070 in plan.split_keys(2)
    assert not set(plan.split_keys(0)) & {1_050, 2_070}
    assert 1_050 not in plan.tables[1]
    assert max(_imbalances(plan, events)) <= 1.05 + 1e-9


def test_a_one_stage_pipeline_gets_balance_and_hot_key_splitting_and_no_locality() -> None:
    events = _chain_events(2, hot={0: 7})[:, :1]
    plan = build_chain_plan(ChainStatistics.of_events(events), N, alpha=1.03)

    assert plan.heavy_keys == ((7,),)
    assert plan.split_keys(0) == (7,)
    assert plan.predicted_locality == 0.0
    (measured,) = _imbalances(plan, events)
    assert measured <= 1.03 + 1e-9
    assert measured == pytest.approx(plan.predicted_imbalance[0], rel=1e-9)


def test_the_two_stage_planner_is_the_chain_planner_on_two_stages() -> None:
    events = _chain_events(3)[:, :2]
    chain = ChainStatistics.of_events(events)
    (link,) = chain.links
    from keyplane.algorithms.pair_statistics import PairStatistics

    pairs = PairStatistics(link.up_keys, link.down_keys, link.counts, *chain.frequencies)
    two = build_plan(pairs, N, alpha=1.05)
    joint = build_chain_plan(chain, N, alpha=1.05)

    assert (two.table_a, two.table_b) == joint.tables
    assert (two.heavy_keys_a, two.heavy_keys_b) == joint.heavy_keys
    assert two.predicted_locality == joint.predicted_locality


def test_a_chain_with_missing_links_is_refused() -> None:
    weights = KeyWeights(np.array([1, 2]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="3 stages has 2 links, got 1"):
        ChainStatistics((weights, weights, weights), (KeyPairs([1], [2], [1.0]),))
