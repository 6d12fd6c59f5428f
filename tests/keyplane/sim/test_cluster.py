import pytest

from keyplane.sim.cluster import ClusterConfig


def test_block_placement_and_capacity() -> None:
    cluster = ClusterConfig(n_servers=3, instances_per_server=2, service_time=0.5)
    assert cluster.n_instances == 6
    assert cluster.server_of_instance().tolist() == [0, 0, 1, 1, 2, 2]
    assert cluster.stage_capacity() == pytest.approx(12.0)


def test_heterogeneous_service_times_per_instance() -> None:
    cluster = ClusterConfig(n_servers=2, service_time=(1.0, 0.5))
    assert cluster.mean_service_times().tolist() == [1.0, 0.5]
    assert cluster.stage_capacity() == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_servers": 0}, "n_servers"),
        ({"n_servers": 2, "instances_per_server": 0}, "instances_per_server"),
        ({"n_servers": 2, "service_time": 0.0}, "service times"),
        ({"n_servers": 2, "service_time": (1.0,)}, "2 instances"),
        ({"n_servers": 2, "network_delay": -1.0}, "network_delay"),
        ({"n_servers": 2, "link_bandwidth": 0.0}, "link_bandwidth"),
        ({"n_servers": 2, "tuple_bytes": -1}, "tuple_bytes"),
        ({"n_servers": 2, "source_rate": float("inf")}, "source_rate"),
        ({"n_servers": 2, "service_distribution": "pareto"}, "service_distribution"),
    ],
)
def test_invalid_configs_fail_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)
