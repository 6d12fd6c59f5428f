"""Placement: which node runs each task (paper 004 §V) and each system task (paper 002 §V).

Traffic between tasks on different nodes crosses the network, and TurboStream
(paper 004 §II-B) measures that this inter-node hop dominates the processing
latency once intra-node IPC is cheap. Its coarse-grained scheduler therefore
places tasks from their task-to-task traffic matrix in two steps:

1. *consolidation* (004 §V-B, Algorithm 1): tasks that exchange the most
   traffic are merged, pair by pair and level by level, into groups that will
   share a node; the merges form a binary tree;
2. *assignment* (004 §V-C, Algorithm 2): from every group as a seed, groups
   are gathered from a frontier of neighbours up to a balanced share, the
   split with the least cut traffic is kept, and each half is split again
   until one node remains per part.

Two details depart from the paper where it loses traffic on noisy matrices;
both are settings (:class:`PlacementSettings`) whose literal values restore
the paper's rules, and the reproduction benchmark measures both.

keyplane balances the task count, not CPU, and keeps it exact: node loads
differ by at most one task. Groups therefore never exceed the smallest node
load, and a split that cannot be met with whole groups opens a group into its
two consolidated halves (down to single tasks, so an exact split always
exists).

System tasks (paper 002 §V) are placed separately; see
:func:`plan_system_tasks`.

Nothing at run time calls this module. keyplane does not place instances on
executors: Spark places each state partition on an executor, and keyplane
observes where (the metrics' ``executors``); keyplane only chooses which
instance holds each key. The module is the reproduction of paper 004
(``bench/reproduce_turbostream.py``) and the system-task sizing of paper 002
in the reliability benchmark (``bench/reliability_cost.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

TrafficMatrix = npt.NDArray[np.float64]
"""``m[i, j]``: traffic (tuples/s or bytes/s) sent from task ``i`` to task ``j``."""
NodeAssignment = npt.NDArray[np.int64]
"""``a[i]``: the node index (``0 ≤ a[i] < n_nodes``) that runs task ``i``."""


def _traffic(matrix: npt.ArrayLike) -> TrafficMatrix:
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"traffic matrix must be square n_tasks × n_tasks, got shape {m.shape}")
    if m.shape[0] == 0:
        raise ValueError("traffic matrix must describe at least one task")
    if not np.all(np.isfinite(m)) or np.any(m < 0):
        raise ValueError("traffic matrix entries must be finite and >= 0")
    return m


def _check_nodes(n_nodes: int) -> None:
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")


def balanced_node_loads(n_tasks: int, n_nodes: int) -> tuple[int, ...]:
    """Task count per node when ``n_tasks`` are spread within ±1: the first nodes take the extra."""
    _check_nodes(n_nodes)
    if n_tasks < 0:
        raise ValueError(f"n_tasks must be >= 0, got {n_tasks}")
    q, r = divmod(n_tasks, n_nodes)
    return tuple(q + 1 if i < r else q for i in range(n_nodes))


def node_loads(assignment: npt.ArrayLike, n_nodes: int) -> npt.NDArray[np.int64]:
    """Number of tasks on each node."""
    _check_nodes(n_nodes)
    a = np.asarray(assignment, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= n_nodes):
        raise ValueError(f"assignment uses node indices outside [0, {n_nodes})")
    return np.bincount(a, minlength=n_nodes).astype(np.int64)


def traffic_cut(matrix: npt.ArrayLike, assignment: npt.ArrayLike) -> float:
    """Inter-node traffic: the sum of ``matrix[i, j]`` over task pairs on different nodes."""
    m = _traffic(matrix)
    a = np.asarray(assignment, dtype=np.int64)
    if a.shape != (m.shape[0],):
        raise ValueError(f"assignment must give one node per task ({m.shape[0]}), got {a.shape}")
    return float(m[a[:, None] != a[None, :]].sum())


def round_robin_placement(n_tasks: int, n_nodes: int) -> NodeAssignment:
    """Task ``i`` on node ``i mod n_nodes``: the traffic-blind default of Storm and JStorm."""
    _check_nodes(n_nodes)
    return np.arange(n_tasks, dtype=np.int64) % n_nodes


def random_placement(n_tasks: int, n_nodes: int, seed: int) -> NodeAssignment:
    """A uniformly random placement that is still balanced within ±1 task."""
    rng = np.random.default_rng(seed)
    return rng.permutation(round_robin_placement(n_tasks, n_nodes))


@dataclass(frozen=True)
class TaskGroup:
    """Consolidated tasks that go to one node; ``parts`` are the two groups merged into it.

    The parts form the "relational binary tree" of 004 §V-B, which lets the
    assignment open a group when a balanced split needs fewer tasks.
    """

    tasks: tuple[int, ...]
    parts: tuple[TaskGroup, TaskGroup] | None = None

    @property
    def size(self) -> int:
        return len(self.tasks)


FrontierOrder = Literal["traffic", "fifo"]


@dataclass(frozen=True)
class PlacementSettings:
    """Bounds on consolidation (004 §V-B) and the frontier order of the bisection (004 §V-C).

    ``max_group_size`` keeps every group small enough to fit a node under the
    balance rule; ``group_count_threshold`` is the paper's *taskNumThreshold*:
    consolidation stops once there are no more groups than this.

    ``min_link_share`` departs from Algorithm 1, which merges a task with its
    first unvisited neighbour however weak the link: a group merges only with
    a neighbour whose link carries at least this share of the group's
    heaviest link. Otherwise the group waits a level, when the group that took
    its heavy partners can take it too; merging it with a stranger would glue
    two clusters together for good. ``0.0`` is the paper's rule.

    ``frontier`` chooses which neighbour the bisection gathers next.
    ``"fifo"`` is Algorithm 2 read literally: a breadth-first queue in which
    each gathered group's neighbours wait behind those queued earlier.
    ``"traffic"`` (the default) ranks the same frontier by traffic to the
    gathered set, as consolidation ranks neighbours (Algorithm 1, line 5): on
    noisy traffic a strict queue gathers the seed's weak neighbours before the
    strong neighbours of what it just gathered, and loses most of what
    consolidation won.
    """

    max_group_size: int
    group_count_threshold: int
    min_link_share: float = 0.5
    frontier: FrontierOrder = "traffic"

    def __post_init__(self) -> None:
        if self.max_group_size < 1:
            raise ValueError(f"max_group_size must be >= 1, got {self.max_group_size}")
        if self.group_count_threshold < 1:
            raise ValueError(
                f"group_count_threshold must be >= 1, got {self.group_count_threshold}"
            )
        if not 0.0 <= self.min_link_share <= 1.0:
            raise ValueError(f"min_link_share must be in [0, 1], got {self.min_link_share!r}")
        if self.frontier not in ("traffic", "fifo"):
            raise ValueError(f"frontier must be 'traffic' or 'fifo', got {self.frontier!r}")

    @classmethod
    def for_cluster(
        cls,
        n_tasks: int,
        n_nodes: int,
        min_link_share: float = 0.5,
        frontier: FrontierOrder = "traffic",
    ) -> PlacementSettings:
        """Groups no larger than the smallest balanced node load; about four groups per node.

        The paper leaves taskNumThreshold open. Four groups per node leaves the
        bisection room to balance while the groups still carry most of the
        traffic inside them.
        """
        smallest_load = min(balanced_node_loads(n_tasks, n_nodes))
        return cls(
            max_group_size=max(1, smallest_load),
            group_count_threshold=4 * n_nodes,
            min_link_share=min_link_share,
            frontier=frontier,
        )


def _symmetric(m: TrafficMatrix) -> TrafficMatrix:
    w = m + m.T
    np.fill_diagonal(w, 0.0)
    return w


def _group_traffic(w: TrafficMatrix, groups: Sequence[TaskGroup]) -> TrafficMatrix:
    """Traffic between groups: row and column sums of ``w`` by group label.

    Summed with ``np.add.at`` rather than a membership-matrix product, which
    is far slower for these small matrices when BLAS threads compete for cores.
    """
    labels = np.full(w.shape[0], -1, dtype=np.int64)
    for g, group in enumerate(groups):
        labels[list(group.tasks)] = g
    members = labels >= 0
    rows = np.zeros((len(groups), w.shape[0]), dtype=np.float64)
    np.add.at(rows, labels[members], w[members])
    between = np.zeros((len(groups), len(groups)), dtype=np.float64)
    np.add.at(between, labels[members], rows[:, members].T)
    between = between.T.copy()
    np.fill_diagonal(between, 0.0)
    return between


def consolidate_tasks(matrix: npt.ArrayLike, settings: PlacementSettings) -> tuple[TaskGroup, ...]:
    """Traffic-ranked consolidation, Algorithm 1 of 004 §V-B, repeated level by level.

    At each level every group, visited in descending order of its heaviest
    link, is merged with its unvisited neighbour of heaviest traffic, provided
    the merged group stays within ``max_group_size`` and the link is not
    weaker than ``min_link_share`` of the group's heaviest; a group with no
    such neighbour stays alone. The paper leaves the visiting order open;
    ranking by the heaviest link merges the most-communicating tasks first.
    Levels repeat until at most ``group_count_threshold`` groups remain or a
    level merges nothing.
    """
    w = _symmetric(_traffic(matrix))
    groups: list[TaskGroup] = [TaskGroup((i,)) for i in range(w.shape[0])]
    while len(groups) > settings.group_count_threshold:
        between = _group_traffic(w, groups)
        heaviest = between.max(axis=1)
        order = sorted(range(len(groups)), key=lambda g: (-heaviest[g], g))
        visited = np.zeros(len(groups), dtype=bool)
        merged: list[TaskGroup] = []
        merges = 0
        for v in order:
            if visited[v]:
                continue
            visited[v] = True
            room = settings.max_group_size - groups[v].size
            partner = -1
            for u in np.argsort(-between[v], kind="stable"):
                if between[v, u] <= 0.0 or between[v, u] < settings.min_link_share * heaviest[v]:
                    break
                if not visited[u] and groups[u].size <= room:
                    partner = int(u)
                    break
            if partner < 0:
                merged.append(groups[v])
                continue
            visited[partner] = True
            merges += 1
            pair = (groups[v], groups[partner])
            merged.append(TaskGroup(tuple(sorted(pair[0].tasks + pair[1].tasks)), pair))
        groups = merged
        if merges == 0:
            break
    return tuple(groups)


def _connection(to_chosen: npt.NDArray[np.float64], group: TaskGroup) -> float:
    return float(to_chosen[list(group.tasks)].sum())


def _split_groups(
    w: TrafficMatrix, groups: Sequence[TaskGroup], target: int, frontier: FrontierOrder
) -> tuple[list[TaskGroup], list[TaskGroup]]:
    """Algorithm 2 of 004 §V-C: the balanced split with the least cut traffic.

    From every group as a seed, gather groups from a frontier of neighbours,
    taking a group only when it keeps the gathered task count within
    ``target``; when the frontier runs dry, the unvisited group most connected
    to the gathered set joins it (Algorithm 2, line 23). ``frontier`` says
    which frontier group is tried next (see :class:`PlacementSettings`).
    If whole groups cannot reach ``target`` exactly, the best-connected group
    left out is opened into its two halves until they can. The split with the
    smallest cut is returned as (gathered, rest).
    """
    total = sum(g.size for g in groups)
    if target <= 0:
        return [], list(groups)
    if target >= total:
        return list(groups), []
    between = _group_traffic(w, groups)
    sizes = np.array([g.size for g in groups], dtype=np.int64)
    best: tuple[float, list[TaskGroup], list[TaskGroup]] | None = None
    for seed in range(len(groups)):
        gathered = np.zeros(len(groups), dtype=bool)
        visited = np.zeros(len(groups), dtype=bool)
        tried = np.zeros(len(groups), dtype=bool)
        pull = np.zeros(len(groups), dtype=np.float64)
        queue = deque([seed])
        visited[seed] = True
        weight = 0
        while weight < target:
            waiting = visited & ~tried
            if not waiting.any():
                if visited.all():
                    break
                nxt = int(np.argmax(np.where(visited, -np.inf, pull)))
                visited[nxt] = True
                queue.append(nxt)
                waiting[nxt] = True
            if frontier == "fifo":
                c = queue.popleft()
            else:
                c = int(np.argmax(np.where(waiting, pull, -np.inf)))
                queue.remove(c)
            tried[c] = True
            if weight + sizes[c] > target:
                continue
            gathered[c] = True
            weight += int(sizes[c])
            pull += between[c]
            neighbours = np.nonzero((between[c] > 0.0) & ~visited)[0]
            for u in neighbours[np.argsort(-between[c, neighbours], kind="stable")]:
                visited[u] = True
                queue.append(int(u))
        chosen = [groups[int(i)] for i in np.nonzero(gathered)[0]]
        rest = [groups[int(i)] for i in np.nonzero(~gathered)[0]]
        chosen_mask = np.zeros(w.shape[0], dtype=bool)
        for g in chosen:
            chosen_mask[list(g.tasks)] = True
        while weight < target:
            deficit = target - weight
            to_chosen = w[:, chosen_mask].sum(axis=1)
            fitting = [g for g in rest if g.size <= deficit]
            if fitting:
                pick = max(fitting, key=lambda g: _connection(to_chosen, g))
                rest.remove(pick)
                chosen.append(pick)
                chosen_mask[list(pick.tasks)] = True
                weight += pick.size
                continue
            opened = max(rest, key=lambda g: _connection(to_chosen, g))
            if opened.parts is None:
                raise AssertionError("a group larger than one task always has two parts")
            rest.remove(opened)
            rest.extend(opened.parts)
        rest_tasks = np.zeros(w.shape[0], dtype=bool)
        for g in rest:
            rest_tasks[list(g.tasks)] = True
        cut = float(w[np.ix_(chosen_mask, rest_tasks)].sum())
        if best is None or cut < best[0]:
            best = (cut, chosen, rest)
    if best is None:
        raise AssertionError("at least one seed is always tried")
    return best[1], best[2]


def traffic_aware_placement(
    matrix: npt.ArrayLike,
    n_nodes: int,
    settings: PlacementSettings | None = None,
) -> NodeAssignment:
    """TurboStream's coarse-grained scheduler (004 §V): consolidate, then bisect recursively.

    Returns task → node. Node ``i`` receives ``balanced_node_loads(n, n_nodes)[i]``
    tasks, so loads differ by at most one. Each bisection gives the first
    ``ceil(N/2)`` nodes their exact share of tasks (004 §V-C: the node count
    of a part is proportional to its load), and recursion stops at one node.
    ``settings`` defaults to :meth:`PlacementSettings.for_cluster`.
    """
    m = _traffic(matrix)
    _check_nodes(n_nodes)
    n_tasks = m.shape[0]
    if settings is None:
        settings = PlacementSettings.for_cluster(n_tasks, n_nodes)
    w = _symmetric(m)
    loads = balanced_node_loads(n_tasks, n_nodes)
    assignment = np.full(n_tasks, -1, dtype=np.int64)
    pending: list[tuple[list[TaskGroup], range]] = [
        (list(consolidate_tasks(m, settings)), range(n_nodes))
    ]
    while pending:
        groups, nodes = pending.pop()
        if len(nodes) == 1:
            for g in groups:
                assignment[list(g.tasks)] = nodes[0]
            continue
        half = math.ceil(len(nodes) / 2)
        first, second = nodes[:half], nodes[half:]
        target = sum(loads[i] for i in first)
        chosen, rest = _split_groups(w, groups, target, settings.frontier)
        pending.append((chosen, first))
        pending.append((rest, second))
    return assignment


SystemTaskStrategy = Literal["opw", "iq"]


@dataclass(frozen=True)
class SystemTaskInstance:
    """One replica of a system task (an acker in paper 002; in keyplane a metrics
    emitter, control listener or ack collector) and the worker that hosts it."""

    task: str
    replica: int
    node: str
    worker: str


@dataclass(frozen=True)
class SystemTaskPlan:
    """Where every system-task replica runs; ``dedicated_workers`` are the workers IQ adds."""

    strategy: SystemTaskStrategy
    instances: tuple[SystemTaskInstance, ...]
    dedicated_workers: tuple[str, ...]


def dedicated_worker_name(node: str) -> str:
    """The name of the isolated system-task worker IQ creates on ``node``."""
    return f"{node}/system"


def plan_system_tasks(
    workers_by_node: Mapping[str, Sequence[str]],
    kind: SystemTaskStrategy,
    tasks: Sequence[str],
) -> SystemTaskPlan:
    """Size and place system tasks, one replica per worker (paper 002 §V).

    Paper 002 measures that a single acker, or ackers crowded together,
    throttle the whole topology: every tuple produces acking messages, which
    can be over half the network traffic (002 §IV), and ackers that share a
    worker fill its common incoming queue until the JVM runs out of memory.
    Following the Even scheduler's heuristic, each system task gets as many
    replicas as there are workers (002 §V), placed by one of two strategies:

    * ``"opw"`` (one-per-worker, 002 §V-A): one replica on every existing
      worker, so the system load follows the data load and most control
      messages stay inside the worker that produced them;
    * ``"iq"`` (isolated queue, 002 §V-B, Algorithm 3): the same number of
      replicas, dealt round-robin over the nodes that host workers, each into
      a worker dedicated to system tasks on that node, created on first use.
      Data tasks and system tasks then no longer compete for one incoming
      queue; in paper 002's large-topology runs IQ cut latency by more than
      53 % against RAS at similar throughput (002 §VI).

    Nodes are visited in the mapping's order; nodes without workers are not
    used. Returns a :class:`SystemTaskPlan`.
    """
    if kind not in ("opw", "iq"):
        raise ValueError(f"kind must be 'opw' or 'iq', got {kind!r}")
    if len(set(tasks)) != len(tasks) or any(not t for t in tasks):
        raise ValueError(f"system task names must be distinct and non-empty, got {list(tasks)}")
    workers = [(node, w) for node, ws in workers_by_node.items() for w in ws]
    if not workers:
        raise ValueError("at least one worker is needed to place system tasks")
    names = [w for _, w in workers]
    if len(set(names)) != len(names):
        raise ValueError("worker names must be unique across nodes")
    instances: list[SystemTaskInstance] = []
    if kind == "opw":
        for task in tasks:
            for replica, (node, worker) in enumerate(workers):
                instances.append(SystemTaskInstance(task, replica, node, worker))
        return SystemTaskPlan("opw", tuple(instances), ())
    used_nodes = [node for node, ws in workers_by_node.items() if ws]
    clash = {dedicated_worker_name(n) for n in used_nodes} & set(names)
    if clash:
        raise ValueError(f"dedicated worker names {sorted(clash)} are already taken by workers")
    created: list[str] = []
    for task in tasks:
        for replica in range(len(workers)):
            node = used_nodes[replica % len(used_nodes)]
            worker = dedicated_worker_name(node)
            if worker not in created:
                created.append(worker)
            instances.append(SystemTaskInstance(task, replica, node, worker))
    return SystemTaskPlan("iq", tuple(instances), tuple(created))
