import numpy as np
import pytest

from keyplane.sim.metrics import imbalance, instance_loads, key_replicas, locality


def test_imbalance_is_max_over_mean_including_idle_instances() -> None:
    loads = instance_loads(np.array([0, 0, 0, 1]), 4)
    assert loads.tolist() == [3.0, 1.0, 0.0, 0.0]
    assert imbalance(loads) == 3.0
    assert imbalance(np.array([2.0, 2.0])) == 1.0
    assert np.isnan(imbalance(np.zeros(3)))


def test_weighted_loads_sum_busy_time() -> None:
    loads = instance_loads(np.array([0, 1, 1]), 2, weights=np.array([3.0, 1.0, 1.0]))
    assert loads.tolist() == [3.0, 2.0]
    assert imbalance(loads) == pytest.approx(1.2)


def test_locality_compares_servers() -> None:
    servers = np.array([0, 0, 1])
    assert locality(np.array([0, 1, 2]), np.array([1, 2, 2]), servers) == pytest.approx(2 / 3)
    assert np.isnan(locality(np.array([], dtype=np.int64), np.array([], dtype=np.int64), servers))


def test_key_replicas_counts_distinct_pairs_for_any_key_range() -> None:
    keys = np.array([5, 5, 5, 7, 7])
    instances = np.array([0, 0, 1, 1, 1])
    assert key_replicas(keys, instances, 2) == 3
    huge = np.array([-(2**62), -(2**62), 2**62])
    assert key_replicas(huge, np.array([0, 1, 1]), 2) == 3
