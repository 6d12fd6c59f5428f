"""The k-partite key graph and its METIS partitioning (paper 000 §3.3).

Steps 1 and 4 of :mod:`keyplane.algorithms.locality`'s planner. The graph has
a vertex per (stage, key) weighted by the key's frequency and an edge per pair
of keys of consecutive stages weighted by its count (000 §3.3).

The table keys of all stages are partitioned jointly with METIS (000 §3.3),
target part sizes set to the capacity the hashed keys leave on each
instance. pymetis exposes one balance constraint only (no ``ncon``), so a
vertex weighs its key's share of its own stage's total: every stage counts
equally in that constraint, and the rebalancer
(:mod:`keyplane.algorithms.rebalancing`) enforces α per stage, which is what a
multi-constraint partition (one constraint per stage) would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pymetis
import scipy.sparse as sp

from keyplane.algorithms.pair_statistics import (
    BoolArray,
    ChainStatistics,
    FloatArray,
    aggregate_pairs,
)
from keyplane.algorithms.partitioner import KeyArray
from keyplane.algorithms.plan_settings import PlanSettings

_METIS_VERTEX_SCALE = 1_000_000_000
_METIS_EDGE_SCALE = 1_000_000
_MIN_PART_TARGET = 1e-6
_MIN_VERTICES_PER_PART = 2


@dataclass
class _KeyGraph:
    """The k-partite key graph of 000 §3.3: the first stage's keys, then the next's, ...

    ``starts[s]:starts[s + 1]`` are stage s's vertices; ``edge_up`` and
    ``edge_down`` the two ends of every pair of keys of consecutive stages.
    """

    keys: KeyArray
    weight: FloatArray
    starts: npt.NDArray[np.int64]
    adjacency: sp.csr_matrix
    edge_up: npt.NDArray[np.int64]
    edge_down: npt.NDArray[np.int64]
    edge_weight: FloatArray

    @classmethod
    def from_statistics(cls, chain: ChainStatistics) -> _KeyGraph:
        weights = [chain.stage_weights(stage) for stage in range(chain.n_stages)]
        starts = np.cumsum([0, *(w.keys.size for w in weights)]).astype(np.int64)
        ups, downs, counts = [], [], []
        for stage, link in enumerate(chain.links):
            up, down, count = aggregate_pairs(link.up_keys, link.down_keys, link.counts)
            ups.append(starts[stage] + np.searchsorted(weights[stage].keys, up))
            downs.append(starts[stage + 1] + np.searchsorted(weights[stage + 1].keys, down))
            counts.append(count)
        edge_up = np.concatenate([np.zeros(0, dtype=np.int64), *ups]).astype(np.int64)
        edge_down = np.concatenate([np.zeros(0, dtype=np.int64), *downs]).astype(np.int64)
        edge_weight = np.concatenate([np.zeros(0), *counts])
        size = int(starts[-1])
        adjacency = sp.csr_matrix(
            (
                np.concatenate([edge_weight, edge_weight]),
                (np.r_[edge_up, edge_down], np.r_[edge_down, edge_up]),
            ),
            shape=(size, size),
        )
        adjacency.sum_duplicates()
        adjacency.sort_indices()
        return cls(
            keys=np.concatenate([np.zeros(0, dtype=np.int64), *(w.keys for w in weights)]),
            weight=np.concatenate([np.zeros(0), *(w.weights for w in weights)]),
            starts=starts,
            adjacency=adjacency,
            edge_up=edge_up,
            edge_down=edge_down,
            edge_weight=edge_weight,
        )

    @property
    def n_stages(self) -> int:
        return int(self.starts.size) - 1

    def stage(self, stage: int) -> npt.NDArray[np.int64]:
        return np.arange(self.starts[stage], self.starts[stage + 1])

    def stage_slice(self, stage: int) -> slice:
        """The stage's vertices as a slice: views of per-vertex arrays, no copy."""
        return slice(int(self.starts[stage]), int(self.starts[stage + 1]))

    def stage_of(self, vertices: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return np.searchsorted(self.starts, vertices, side="right").astype(np.int64) - 1

    def neighbours(self, vertex: int) -> tuple[npt.NDArray[np.int32], FloatArray]:
        start, end = self.adjacency.indptr[vertex], self.adjacency.indptr[vertex + 1]
        return self.adjacency.indices[start:end], self.adjacency.data[start:end]


def _metis_parts(
    graph: _KeyGraph,
    tabled: BoolArray,
    fixed_loads: dict[int, FloatArray],
    stage_totals: dict[int, float],
    settings: PlanSettings,
) -> npt.NDArray[np.int64]:
    """Partition the table keys of every stage jointly with METIS (000 §3.3); returns
    a part per table key.

    Vertex weights are each stage's share of its own total, so one balance
    constraint weighs every stage equally (module docstring). A
    part's target is the capacity the hashed keys leave on its instance,
    summed over stages.
    """
    n = settings.n_instances
    vertices = np.flatnonzero(tabled)
    if vertices.size == 0 or n == 1:
        return np.zeros(vertices.size, dtype=np.int64)
    stage_total = np.asarray([stage_totals[s] for s in range(graph.n_stages)])[
        graph.stage_of(vertices)
    ]
    shares = np.divide(
        graph.weight[vertices], stage_total, out=np.zeros(vertices.size), where=stage_total > 0
    )
    vertex_weights = np.rint(shares * _METIS_VERTEX_SCALE).astype(np.int64)

    capacity = np.zeros(n)
    for stage, total in stage_totals.items():
        if total > 0:
            capacity += np.maximum(0.0, total / n - fixed_loads[stage]) / total
    capacity = np.maximum(capacity, _MIN_PART_TARGET)
    if vertices.size < _MIN_VERTICES_PER_PART * n:
        return _fill_by_capacity(shares, capacity)
    targets = [float(c) for c in capacity / capacity.sum()]
    targets[-1] = 1.0 - sum(targets[:-1])

    sub = graph.adjacency[vertices][:, vertices].tocsr()
    sub.sort_indices()
    edge_weights = sub.data
    if edge_weights.size:
        scaled = np.rint(edge_weights / edge_weights.max() * _METIS_EDGE_SCALE)
        edge_weights = np.maximum(scaled, 1.0)
    index_type = pymetis.zero_copy_dtype()
    result = pymetis.part_graph(
        n,
        adjacency=pymetis.CSRAdjacency(
            sub.indptr.astype(index_type), sub.indices.astype(index_type)
        ),
        vweights=vertex_weights.astype(index_type),
        eweights=edge_weights.astype(index_type),
        tpwgts=targets,
        options=pymetis.Options(ufactor=settings.metis_ufactor, seed=settings.seed),
    )
    return np.asarray(result.vertex_part, dtype=np.int64)


def _fill_by_capacity(shares: FloatArray, capacity: FloatArray) -> npt.NDArray[np.int64]:
    """Heaviest key first onto the part with most room left.

    Used instead of METIS for graphs with too few vertices per part, which
    METIS' recursive bisection cannot split (it then reports errors).
    """
    room = capacity.copy()
    parts = np.zeros(shares.size, dtype=np.int64)
    for vertex in np.argsort(-shares, kind="stable"):
        part = int(np.argmax(room))
        parts[vertex] = part
        room[part] -= shares[vertex]
    return parts
