import numpy as np
import pytest

from keyplane.sim.queueing import fifo_completion_times


def naive_fifo(arrivals: np.ndarray, services: np.ndarray, queues: np.ndarray) -> np.ndarray:
    done = np.empty_like(arrivals)
    free: dict[int, float] = {}
    for i in sorted(range(len(arrivals)), key=lambda j: (arrivals[j], j)):
        start = max(arrivals[i], free.get(int(queues[i]), -np.inf))
        done[i] = start + services[i]
        free[int(queues[i])] = done[i]
    return done


def test_single_queue_matches_hand_computed_recurrence() -> None:
    arrivals = np.array([0.0, 1.0, 1.5, 5.0, 20.0])
    services = np.full(5, 2.0)
    done = fifo_completion_times(arrivals, services, np.zeros(5, dtype=np.int64), 1)
    assert done.tolist() == [2.0, 4.0, 6.0, 8.0, 22.0]


def test_queues_are_independent_and_order_by_arrival_not_input() -> None:
    arrivals = np.array([3.0, 0.0, 0.0, 1.0])
    services = np.array([1.0, 2.0, 4.0, 1.0])
    queues = np.array([0, 0, 1, 1], dtype=np.int64)
    done = fifo_completion_times(arrivals, services, queues, 2)
    # queue 0: job 1 at 0 -> 2, job 0 at 3 -> 4; queue 1: job 2 at 0 -> 4, job 3 -> 5
    assert done.tolist() == [4.0, 2.0, 4.0, 5.0]


def test_ties_are_served_in_input_order() -> None:
    arrivals = np.zeros(3)
    services = np.array([1.0, 2.0, 3.0])
    done = fifo_completion_times(arrivals, services, np.zeros(3, dtype=np.int64), 1)
    assert done.tolist() == [1.0, 3.0, 6.0]


def test_matches_event_by_event_simulation_on_random_input() -> None:
    rng = np.random.default_rng(7)
    n = 2_000
    arrivals = np.sort(rng.uniform(0, 100, n))
    rng.shuffle(arrivals)
    services = rng.exponential(0.3, n)
    queues = rng.integers(0, 5, n)
    done = fifo_completion_times(arrivals, services, queues, 5)
    np.testing.assert_allclose(done, naive_fifo(arrivals, services, queues), rtol=1e-12)


def test_rejects_mismatched_lengths_and_out_of_range_queue() -> None:
    with pytest.raises(ValueError, match="same length"):
        fifo_completion_times(np.zeros(2), np.ones(3), np.zeros(2, dtype=np.int64), 1)
    with pytest.raises(ValueError, match="out of range"):
        fifo_completion_times(np.zeros(2), np.ones(2), np.array([0, 3]), 2)
