import numpy as np
import pytest

from keyplane.algorithms.baselines import (
    DChoicesPartitioner,
    HashPartitioner,
    PKGPartitioner,
    ShufflePartitioner,
    WChoicesPartitioner,
)
from keyplane.algorithms.hotkeys import FishPartitioner
from keyplane.algorithms.locality_plan import TableRouter
from keyplane.algorithms.partitioner import KeyArray, TimeArray, WorkerArray
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.sim.cluster import ClusterConfig
from keyplane.sim.engine import Stage, simulate
from keyplane.sim.metrics import summarize
from keyplane.sim.trace import Trace


class FakeTableRouter:
    """Routes key k to table[k]; records what it was fed."""

    def __init__(self, table: list[int], n_workers: int, name: str = "fake-table") -> None:
        self.table = np.asarray(table, dtype=np.int64)
        self.n_workers = n_workers
        self.name = name
        self.seen_keys: list[int] = []
        self.seen_times: list[float] = []

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        self.seen_keys.extend(keys.tolist())
        self.seen_times.extend(times.tolist())
        return self.table[keys]


def one_field(keys: list[int], times: list[float]) -> Trace:
    return Trace(fields=(np.asarray(keys),), times=np.asarray(times))


def test_single_instance_fifo_completions_and_latencies_are_exact_with_fake_router() -> None:
    cluster = ClusterConfig(n_servers=1, service_time=2.0)
    trace = one_field([0, 1, 0, 1], [0.0, 1.0, 1.5, 5.0])
    result = simulate(trace, [Stage(FakeTableRouter([0, 0], 1))], cluster)
    stage = result.stages[0]
    assert stage.completions.tolist() == [2.0, 4.0, 6.0, 8.0]
    metrics = summarize(result)
    assert metrics.makespan == 8.0
    assert metrics.latency_mean == pytest.approx((2.0 + 3.0 + 4.5 + 3.0) / 4)
    assert metrics.throughput == pytest.approx(0.5)
    assert metrics.hop_locality == ()


def test_source_rate_spaces_emissions_when_trace_has_no_times_with_fake_router() -> None:
    cluster = ClusterConfig(n_servers=1, service_time=1.0, source_rate=4.0)
    trace = Trace(fields=(np.zeros(3, dtype=np.int64),))
    result = simulate(trace, [Stage(FakeTableRouter([0], 1))], cluster)
    assert result.source_times.tolist() == [0.0, 0.25, 0.5]
    assert result.stages[0].completions.tolist() == [1.0, 2.0, 3.0]


def test_two_stages_remote_hop_adds_network_delay_with_fake_routers() -> None:
    cluster = ClusterConfig(n_servers=2, service_time=1.0, network_delay=0.5)
    trace = Trace(fields=(np.array([0, 0]), np.array([1, 0])), times=np.zeros(2))
    stages = [
        Stage(FakeTableRouter([0, 1], 2, "a"), key_field=0),
        Stage(FakeTableRouter([0, 1], 2, "b"), key_field=1),
    ]
    result = simulate(trace, stages, cluster)
    first, second = result.stages
    assert first.completions.tolist() == [1.0, 2.0]
    # tuple 0 goes to server 1 (remote, +0.5), tuple 1 stays on server 0
    assert second.arrivals.tolist() == [1.5, 2.0]
    assert second.completions.tolist() == [2.5, 3.0]
    metrics = summarize(result)
    assert metrics.locality == 0.5
    assert metrics.latency_p50 == pytest.approx(2.75)


def test_remote_hops_queue_on_the_sending_link_with_fake_routers() -> None:
    cluster = ClusterConfig(n_servers=2, service_time=1.0, network_delay=0.5, link_bandwidth=50.0)
    trace = Trace(
        fields=(np.zeros(3, dtype=np.int64), np.ones(3, dtype=np.int64)),
        times=np.zeros(3),
        sizes=np.full(3, 100.0),
    )
    stages = [
        Stage(FakeTableRouter([0, 1], 2), key_field=0),
        Stage(FakeTableRouter([0, 1], 2), key_field=1),
    ]
    result = simulate(trace, stages, cluster)
    # A finishes at 1, 2, 3; the link needs 2 s per tuple: leaves at 3, 5, 7; +0.5 delay
    assert result.stages[1].arrivals.tolist() == [3.5, 5.5, 7.5]
    assert result.stages[1].completions.tolist() == [4.5, 6.5, 8.5]
    assert summarize(result).locality == 0.0


def test_second_stage_routes_in_upstream_departure_order_with_fake_routers() -> None:
    cluster = ClusterConfig(n_servers=2, service_time=(3.0, 1.0))
    trace = Trace(fields=(np.array([0, 1]), np.array([0, 1])), times=np.zeros(2))
    downstream = FakeTableRouter([0, 0], 2, "down")
    stages = [Stage(FakeTableRouter([0, 1], 2), 0), Stage(downstream, 1)]
    simulate(trace, stages, cluster)
    # tuple 1 leaves the fast instance at t=1, before tuple 0 at t=3
    assert downstream.seen_keys == [1, 0]
    assert downstream.seen_times == [1.0, 3.0]


def test_locality_is_one_when_both_stages_share_a_table_with_fake_router() -> None:
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 50, 5_000)
    table = rng.integers(0, 8, 50).tolist()
    cluster = ClusterConfig(n_servers=4, instances_per_server=2, network_delay=1e-3)
    trace = Trace(fields=(keys, keys.copy()))
    stages = [Stage(FakeTableRouter(table, 8), 0), Stage(FakeTableRouter(table, 8), 1)]
    metrics = summarize(simulate(trace, stages, cluster, chunk_size=777))
    assert metrics.locality == 1.0
    assert metrics.stages[0].replicas == len(set(keys.tolist()))


def test_locality_counts_servers_not_instances_with_fake_routers() -> None:
    # instances 0 and 1 share server 0: a hop 0 -> 1 is local
    cluster = ClusterConfig(n_servers=2, instances_per_server=2)
    trace = Trace(fields=(np.array([0, 1, 2, 3]), np.array([1, 0, 0, 0])))
    stages = [Stage(FakeTableRouter([0, 1, 2, 3], 4), 0), Stage(FakeTableRouter([1, 0], 4), 1)]
    assert summarize(simulate(trace, stages, cluster)).locality == 0.5


def test_same_seed_same_run_other_seed_other_run_with_fake_router() -> None:
    cluster = ClusterConfig(n_servers=2, service_time=1e-3, service_distribution="exponential")
    keys = np.random.default_rng(3).integers(0, 10, 1_000)
    trace = Trace(fields=(keys,), times=np.arange(1_000) * 1e-3)

    def run(seed: int) -> np.ndarray:
        router = FakeTableRouter([k % 2 for k in range(10)], 2)
        return simulate(trace, [Stage(router)], cluster, seed=seed).stages[0].completions

    np.testing.assert_array_equal(run(5), run(5))
    assert not np.array_equal(run(5), run(6))


def test_rejects_mismatched_router_and_missing_field_with_fake_router() -> None:
    cluster = ClusterConfig(n_servers=2)
    trace = Trace(fields=(np.zeros(2, dtype=np.int64),))
    with pytest.raises(ValueError, match="3 workers"):
        simulate(trace, [Stage(FakeTableRouter([0], 3))], cluster)
    with pytest.raises(ValueError, match="field 1"):
        simulate(trace, [Stage(FakeTableRouter([0], 2), key_field=1)], cluster)
    with pytest.raises(ValueError, match="outside"):
        simulate(trace, [Stage(FakeTableRouter([5], 2))], cluster)
    with pytest.raises(TypeError, match="Partitioner"):
        Stage(object())


def zipf_trace(n: int = 20_000, n_keys: int = 2_000, seed: int = 0) -> Trace:
    workload = ZipfEvolvingWorkload(n_events=n, n_keys=n_keys, exponent=1.2, seed=seed)
    return Trace.from_batches(workload.batches(8_192))


def baseline_metrics(name: str, n_workers: int = 8) -> tuple[float, float, int, int]:
    routers = {
        "hash": HashPartitioner,
        "shuffle": ShufflePartitioner,
        "pkg": PKGPartitioner,
        "d-choices": DChoicesPartitioner,
        "w-choices": WChoicesPartitioner,
        "fish": FishPartitioner,
    }
    trace = zipf_trace()
    cluster = ClusterConfig(n_servers=n_workers, service_time=1e-4, source_rate=8e4)
    metrics = summarize(simulate(trace, [Stage(routers[name](n_workers))], cluster))
    stage = metrics.stages[0]
    return metrics.makespan, stage.imbalance, stage.replicas, stage.keys


def test_end_to_end_hash_keeps_one_replica_per_key_but_is_skewed() -> None:
    makespan, skew, replicas, keys = baseline_metrics("hash")
    assert replicas == keys
    assert skew > 1.5
    assert makespan > 20_000 / 8e4 * 1.5


def test_end_to_end_shuffle_is_perfectly_balanced_and_replicates_hot_keys() -> None:
    makespan, skew, replicas, keys = baseline_metrics("shuffle")
    assert skew == 1.0
    # round robin at exactly the capacity: no tuple ever waits
    assert makespan == pytest.approx((20_000 - 1) / 8e4 + 1e-4, rel=1e-9)
    assert replicas > 2 * keys


@pytest.mark.parametrize("name", ["pkg", "d-choices", "w-choices", "fish"])
def test_end_to_end_load_aware_baselines_beat_hash_on_skew(name: str) -> None:
    hash_makespan, hash_skew, _, keys = baseline_metrics("hash")
    makespan, skew, replicas, same_keys = baseline_metrics(name)
    assert same_keys == keys
    assert skew < hash_skew
    assert makespan < hash_makespan
    assert keys < replicas <= 8 * keys


def test_end_to_end_locality_of_hash_is_near_one_over_n_and_table_is_one() -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(0, 1_000, 30_000)
    trace = Trace(fields=(a, a + 1_000_000))
    cluster = ClusterConfig(n_servers=6)
    hashed = summarize(
        simulate(trace, [Stage(HashPartitioner(6), 0), Stage(HashPartitioner(6), 1)], cluster)
    )
    assert hashed.locality == pytest.approx(1 / 6, abs=0.05)
    table_a = {k: k % 6 for k in range(1_000)}
    table_b = {k + 1_000_000: k % 6 for k in range(1_000)}
    tabled = summarize(
        simulate(
            trace,
            [Stage(TableRouter(table_a, 6), 0), Stage(TableRouter(table_b, 6), 1)],
            cluster,
        )
    )
    assert tabled.locality == 1.0
