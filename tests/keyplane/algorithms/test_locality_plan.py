"""Tests of routing plans' routers and their evaluation on a window (paper 000 §3.3)."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.algorithms.locality_plan import TableRouter, evaluate, spark_workers
from keyplane.algorithms.pair_statistics import PairStatistics
from keyplane.algorithms.partitioner import Partitioner
from keyplane.routing.routedkeys import spark_partition
from tests.keyplane.algorithms.locality_workloads import brute_force_locality, correlated_window


def test_table_router_is_a_partitioner_routing_table_keys_and_hashing_the_rest() -> None:
    router = TableRouter({5: 2, -3: 0, 1 << 40: 1}, 3, "locality-a")
    keys = np.array([5, 7, -3, 1 << 40, 8, 5], dtype=np.int64)

    workers = router.route(keys, np.zeros(keys.size))

    assert isinstance(router, Partitioner)
    fallback = spark_workers(np.array([7, 8]), 3)
    assert workers.tolist() == [2, int(fallback[0]), 0, 1, int(fallback[1]), 2]
    assert TableRouter({}, 3).route(keys, np.zeros(6)).tolist() == spark_workers(keys, 3).tolist()


def test_table_router_rejects_instances_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        TableRouter({1: 2}, 2)


def test_table_router_spreads_split_keys_round_robin() -> None:
    router = TableRouter({1: 0}, 4, spread=[9])
    keys = np.array([9, 9, 1, 9, 9, 9, 9, 9, 9], dtype=np.int64)
    out = router.route(keys, np.zeros(keys.size))
    assert out[2] == 0
    assert np.bincount(out[keys == 9], minlength=4).tolist() == [2, 2, 2, 2]


def test_spark_workers_is_sparks_hash_partitioning_of_the_decimal_key() -> None:
    keys = np.array([0, 7, -3, 1 << 40, 123456789], dtype=np.int64)
    expected = [spark_partition(str(key), 6) for key in keys.tolist()]
    assert spark_workers(keys, 6).tolist() == expected


def test_evaluate_with_empty_tables_is_hash_routing() -> None:
    pairs = correlated_window(seed=7, n_keys=100, n_tuples=2_000)
    assert evaluate(({}, {}), pairs, 5).locality == pytest.approx(
        brute_force_locality(pairs, {}, {}, 5)
    )


def test_evaluate_spreads_a_split_keys_load_over_the_instances() -> None:
    # One key carrying everything, split: the real spread is perfect.
    pairs = PairStatistics(np.array([1, 1]), np.array([5, 6]), np.array([60.0, 40.0]))
    measured = evaluate(({}, {}), pairs, 4, split_keys_a=[1])
    assert measured.imbalance_a == 1.0
    assert measured.locality == pytest.approx(0.25)
