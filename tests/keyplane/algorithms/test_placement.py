"""Tests of keyplane.algorithms.placement: traffic-aware placement (004 §V), system tasks."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.placement import (
    FrontierOrder,
    PlacementSettings,
    SystemTaskInstance,
    balanced_node_loads,
    consolidate_tasks,
    dedicated_worker_name,
    node_loads,
    plan_system_tasks,
    random_placement,
    round_robin_placement,
    traffic_aware_placement,
    traffic_cut,
)

Matrix = npt.NDArray[np.float64]


def clustered_traffic(
    seed: int, n_nodes: int, clusters_per_node: int, cluster_size: int, noise_total: float
) -> tuple[Matrix, npt.NDArray[np.int64]]:
    """Dense traffic (5–10 per pair) inside clusters whose sizes tile the nodes exactly,
    sparse noise between clusters summing to ``noise_total``, task ids shuffled.

    Returns the matrix and each task's cluster label.
    """
    rng = np.random.default_rng(seed)
    n_clusters = n_nodes * clusters_per_node
    labels = rng.permutation(np.repeat(np.arange(n_clusters), cluster_size))
    n = labels.size
    same = labels[:, None] == labels[None, :]
    noise = rng.uniform(0.0, 1.0, (n, n)) * (rng.random((n, n)) < 0.3) * ~same
    if noise.sum() > 0:
        noise *= noise_total / noise.sum()
    matrix = np.where(same, rng.uniform(5.0, 10.0, (n, n)), noise)
    np.fill_diagonal(matrix, 0.0)
    return matrix, labels


def keeps_clusters_together(
    assignment: npt.NDArray[np.int64], labels: npt.NDArray[np.int64]
) -> bool:
    return all(len(set(assignment[labels == c].tolist())) == 1 for c in np.unique(labels))


def key_correlated_chain(seed: int, n_operators: int, parallelism: int, locality: float) -> Matrix:
    """Operators in a chain; task k of one stage sends ``locality`` of its tuples to one
    task of the next stage (keys correlated across the two grouping fields) and the rest
    uniformly."""
    rng = np.random.default_rng(seed)
    n = n_operators * parallelism
    matrix = np.zeros((n, n))
    for stage in range(n_operators - 1):
        partner = rng.permutation(parallelism)
        nxt = slice((stage + 1) * parallelism, (stage + 2) * parallelism)
        for k in range(parallelism):
            task = stage * parallelism + k
            rate = rng.uniform(50.0, 150.0)
            matrix[task, nxt] += rate * (1.0 - locality) / parallelism
            matrix[task, (stage + 1) * parallelism + partner[k]] += rate * locality
    return matrix


# --- balance helpers and baselines --------------------------------------------------------


def test_balanced_node_loads_put_the_remainder_first() -> None:
    assert balanced_node_loads(10, 4) == (3, 3, 2, 2)
    assert balanced_node_loads(3, 5) == (1, 1, 1, 0, 0)


def test_traffic_cut_counts_only_traffic_between_nodes() -> None:
    matrix = np.array([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0], [3.0, 4.0, 0.0]])
    assert traffic_cut(matrix, [0, 0, 1]) == pytest.approx(1.0 + 3.0 + 4.0)
    assert traffic_cut(matrix, [0, 0, 0]) == 0.0
    assert traffic_cut(matrix, [0, 1, 2]) == pytest.approx(matrix.sum())


def test_baselines_are_balanced() -> None:
    assert round_robin_placement(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    loads = node_loads(random_placement(50, 8, seed=3), 8)
    assert loads.max() - loads.min() <= 1
    assert not np.array_equal(random_placement(50, 8, seed=3), round_robin_placement(50, 8))


def test_bad_inputs_are_rejected() -> None:
    unknown_strategy: Any = "lifo"
    with pytest.raises(ValueError, match="square"):
        traffic_aware_placement(np.zeros((2, 3)), 2)
    with pytest.raises(ValueError, match=">= 0"):
        traffic_aware_placement(-np.ones((2, 2)), 2)
    with pytest.raises(ValueError, match="n_nodes"):
        traffic_aware_placement(np.zeros((2, 2)), 0)
    with pytest.raises(ValueError, match="one node per task"):
        traffic_cut(np.zeros((3, 3)), [0, 1])
    with pytest.raises(ValueError, match="frontier"):
        PlacementSettings(4, 4, frontier=unknown_strategy)


# --- consolidation ------------------------------------------------------------------------


def test_consolidation_merges_the_heaviest_pairs_first() -> None:
    matrix = np.zeros((4, 4))
    matrix[0, 2] = 9.0
    matrix[1, 3] = 7.0
    matrix[0, 1] = 1.0
    matrix[2, 3] = 1.0
    groups = consolidate_tasks(matrix, PlacementSettings(max_group_size=2, group_count_threshold=2))
    assert sorted(g.tasks for g in groups) == [(0, 2), (1, 3)]
    assert all(g.parts is not None for g in groups)


def test_consolidation_respects_the_group_size_bound() -> None:
    matrix = key_correlated_chain(seed=0, n_operators=4, parallelism=8, locality=0.9)
    groups = consolidate_tasks(matrix, PlacementSettings(max_group_size=4, group_count_threshold=1))
    assert max(g.size for g in groups) <= 4
    assert sorted(t for g in groups for t in g.tasks) == list(range(32))


def test_weak_link_rule_keeps_a_leftover_out_of_a_foreign_cluster() -> None:
    # Clusters {0, 1, 2} and {3, 4, 5}: pairing leaves one task of each alone.
    # The paper's rule (share 0) glues the two leftovers along a weak link;
    # with share 0.5 they wait and join their own clusters a level later.
    matrix = np.zeros((6, 6))
    for a, b in [(0, 1), (0, 2), (1, 2), (3, 4), (3, 5), (4, 5)]:
        matrix[a, b] = 10.0 + a + b
    matrix[0, 3] = 0.1
    literal = consolidate_tasks(matrix, PlacementSettings(3, 2, min_link_share=0.0))
    waiting = consolidate_tasks(matrix, PlacementSettings(3, 2, min_link_share=0.5))
    assert (0, 3) in [g.tasks for g in literal]
    assert sorted(g.tasks for g in waiting) == [(0, 1, 2), (3, 4, 5)]


# --- traffic-aware placement --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    n_tasks=st.integers(1, 40),
    n_nodes=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    density=st.floats(0.0, 1.0),
)
def test_placement_is_balanced_within_one_task(
    n_tasks: int, n_nodes: int, seed: int, density: float
) -> None:
    rng = np.random.default_rng(seed)
    matrix = rng.uniform(0.0, 10.0, (n_tasks, n_tasks)) * (rng.random((n_tasks, n_tasks)) < density)
    assignment = traffic_aware_placement(matrix, n_nodes)
    loads = node_loads(assignment, n_nodes)
    assert loads.tolist() == list(balanced_node_loads(n_tasks, n_nodes))
    assert int(loads.max() - loads.min()) <= 1


@pytest.mark.parametrize("frontier", ["traffic", "fifo"])
def test_separable_clusters_are_placed_with_zero_cut(frontier: FrontierOrder) -> None:
    for seed in range(8):
        matrix, labels = clustered_traffic(seed, 4, 2, 3, noise_total=0.0)
        settings_ = PlacementSettings.for_cluster(24, 4, frontier=frontier)
        assignment = traffic_aware_placement(matrix, 4, settings_)
        assert traffic_cut(matrix, assignment) == 0.0
        assert keeps_clusters_together(assignment, labels)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n_nodes=st.integers(2, 6),
    clusters_per_node=st.integers(1, 3),
    cluster_size=st.integers(2, 5),
)
def test_clustered_traffic_is_cut_less_than_round_robin(
    seed: int, n_nodes: int, clusters_per_node: int, cluster_size: int
) -> None:
    # Noise totals 4, less than any single intra-cluster pair (>= 5 each way):
    # a placement that keeps every cluster on one node cuts at most 4, one
    # that splits a cluster cuts more.
    matrix, labels = clustered_traffic(seed, n_nodes, clusters_per_node, cluster_size, 4.0)
    n = labels.size
    assignment = traffic_aware_placement(matrix, n_nodes)
    baseline = round_robin_placement(n, n_nodes)
    assert keeps_clusters_together(assignment, labels)
    assert traffic_cut(matrix, assignment) <= 4.0 + 1e-9
    if not keeps_clusters_together(baseline, labels):
        assert traffic_cut(matrix, assignment) < traffic_cut(matrix, baseline)


@pytest.mark.parametrize(("n_operators", "parallelism", "n_nodes"), [(4, 8, 4), (3, 16, 8)])
def test_key_correlated_chain_beats_round_robin_and_random(
    n_operators: int, parallelism: int, n_nodes: int
) -> None:
    for seed in range(5):
        matrix = key_correlated_chain(seed, n_operators, parallelism, locality=0.8)
        n = matrix.shape[0]
        cut = traffic_cut(matrix, traffic_aware_placement(matrix, n_nodes))
        assert cut <= 0.5 * traffic_cut(matrix, round_robin_placement(n, n_nodes))
        assert cut <= 0.5 * traffic_cut(matrix, random_placement(n, n_nodes, seed))
        # every key chain intact leaves only the uniform share crossing nodes
        assert cut <= 1.05 * 0.2 * (n_nodes - 1) / n_nodes * matrix.sum()


# --- system tasks (002 §V) ----------------------------------------------------------------

WORKERS = {"n1": ["w1", "w2"], "n2": ["w3"], "n3": []}


def test_opw_places_one_replica_of_each_system_task_on_every_worker() -> None:
    plan = plan_system_tasks(WORKERS, "opw", ["metrics", "control"])
    assert plan.dedicated_workers == ()
    for worker in ("w1", "w2", "w3"):
        hosted = sorted(i.task for i in plan.instances if i.worker == worker)
        assert hosted == ["control", "metrics"]
    assert SystemTaskInstance("metrics", 2, "n2", "w3") in plan.instances
    assert len(plan.instances) == 2 * 3


def test_iq_isolates_replicas_on_one_dedicated_worker_per_used_node() -> None:
    plan = plan_system_tasks(WORKERS, "iq", ["acks"])
    assert plan.dedicated_workers == ("n1/system", "n2/system")
    assert [(i.replica, i.node, i.worker) for i in plan.instances] == [
        (0, "n1", "n1/system"),
        (1, "n2", "n2/system"),
        (2, "n1", "n1/system"),
    ]
    assert not {"w1", "w2", "w3"} & {i.worker for i in plan.instances}
    assert dedicated_worker_name("n3") not in plan.dedicated_workers


def test_iq_and_opw_deploy_the_same_number_of_replicas() -> None:
    tasks = ["metrics", "control", "acks"]
    opw = plan_system_tasks(WORKERS, "opw", tasks)
    iq = plan_system_tasks(WORKERS, "iq", tasks)
    assert len(opw.instances) == len(iq.instances) == 3 * len(tasks)


def test_system_task_planner_validation() -> None:
    unknown_strategy: Any = "even"
    with pytest.raises(ValueError, match="unique"):
        plan_system_tasks({"n1": ["w"], "n2": ["w"]}, "opw", ["acks"])
    with pytest.raises(ValueError, match="already taken"):
        plan_system_tasks({"n1": ["n1/system"]}, "iq", ["acks"])
    with pytest.raises(ValueError, match="at least one worker"):
        plan_system_tasks({"n1": []}, "iq", ["acks"])
    with pytest.raises(ValueError, match="distinct"):
        plan_system_tasks(WORKERS, "opw", ["acks", "acks"])
    with pytest.raises(ValueError, match="kind"):
        plan_system_tasks(WORKERS, unknown_strategy, ["acks"])
