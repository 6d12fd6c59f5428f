"""Inter-node traffic of TurboStream's placement (paper 004 §V) against traffic-blind baselines.

For synthetic task-to-task traffic matrices this script places the tasks on
nodes with

* round-robin (task i on node i mod N: the default of Storm and JStorm),
* random (balanced, averaged over five seeds),
* TurboStream as written (004 §V Algorithms 1 and 2: consolidation with the
  first unvisited neighbour, breadth-first queue),
* keyplane's default (the same with the weak-link rule and the
  traffic-ranked frontier, see ``keyplane.algorithms.placement.PlacementSettings``),
* METIS k-way (pymetis, 3 % imbalance allowed) as an outside reference,

and reports the cut (traffic between nodes) as a share of all traffic, the
quantity TurboStream's Table II calls inter-node IPC. All placements except
METIS keep node loads within ±1 task.

Topologies (all with key-correlated streams: task k of one stage sends a
share ``locality`` of its tuples to one task of the next stage, the rest
uniformly, as when consecutive stages are keyed by correlated fields):

* ``chain``: L stages of p tasks;
* ``diamond``: a source stage fanning out to two stages that join in a fourth;
* ``key-pairs``: two stages keyed by two fields of Zipf-skewed key pairs
  (keyplane's stage A → stage B): the traffic is counted from generated
  tuples, not drawn per task.

    python bench/reproduce_turbostream.py [--quick] [--seeds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pymetis
from _output import emit

from keyplane.algorithms.placement import (
    NodeAssignment,
    PlacementSettings,
    TrafficMatrix,
    node_loads,
    random_placement,
    round_robin_placement,
    traffic_aware_placement,
    traffic_cut,
)


def correlated_stream(
    matrix: TrafficMatrix,
    sources: range,
    targets: range,
    locality: float,
    rng: np.random.Generator,
) -> None:
    """Add a key-correlated stream: each source task sends ``locality`` of its rate to one
    target task (a random one-to-one pairing) and the rest evenly to all targets."""
    partner = rng.permutation(len(targets))
    for k, task in enumerate(sources):
        rate = rng.uniform(50.0, 150.0)
        matrix[task, targets.start : targets.stop] += rate * (1.0 - locality) / len(targets)
        matrix[task, targets[partner[k]]] += rate * locality


def chain(stages: int, parallelism: int, locality: float, seed: int) -> TrafficMatrix:
    rng = np.random.default_rng(seed)
    matrix = np.zeros((stages * parallelism, stages * parallelism))
    for s in range(stages - 1):
        correlated_stream(
            matrix,
            range(s * parallelism, (s + 1) * parallelism),
            range((s + 1) * parallelism, (s + 2) * parallelism),
            locality,
            rng,
        )
    return matrix


def diamond(parallelism: int, locality: float, seed: int) -> TrafficMatrix:
    rng = np.random.default_rng(seed)
    p = parallelism
    matrix = np.zeros((4 * p, 4 * p))
    src, left, right, join = (range(i * p, (i + 1) * p) for i in range(4))
    for a, b in ((src, left), (src, right), (left, join), (right, join)):
        correlated_stream(matrix, a, b, locality, rng)
    return matrix


def key_pairs(parallelism: int, locality: float, seed: int, tuples: int = 200_000) -> TrafficMatrix:
    """Stage A keyed by field 1, stage B by field 2. Each first key has a home second key
    (probability ``locality``), otherwise any; first keys are Zipf(1.1)-popular."""
    rng = np.random.default_rng(seed)
    n_keys = 20 * parallelism
    first = np.minimum(rng.zipf(1.1, tuples) - 1, n_keys - 1)
    home = rng.integers(0, n_keys, n_keys)
    second = np.where(rng.random(tuples) < locality, home[first], rng.integers(0, n_keys, tuples))
    task_of_first = rng.integers(0, parallelism, n_keys)
    task_of_second = parallelism + rng.integers(0, parallelism, n_keys)
    matrix = np.zeros((2 * parallelism, 2 * parallelism))
    np.add.at(matrix, (task_of_first[first], task_of_second[second]), 1.0)
    return matrix


def metis_placement(matrix: TrafficMatrix, n_nodes: int, seed: int) -> NodeAssignment:
    w = matrix + matrix.T
    np.fill_diagonal(w, 0.0)
    if n_nodes == 1:
        return np.zeros(w.shape[0], dtype=np.int64)
    index_type = pymetis.zero_copy_dtype()
    xadj, adjncy, weights = [0], [], []
    scale = 1000.0 / max(float(w.max()), 1e-12)
    for i in range(w.shape[0]):
        nbrs = np.nonzero(w[i])[0]
        adjncy.extend(nbrs.tolist())
        weights.extend(np.maximum(np.rint(w[i, nbrs] * scale), 1).astype(int).tolist())
        xadj.append(len(adjncy))
    result = pymetis.part_graph(
        n_nodes,
        adjacency=pymetis.CSRAdjacency(
            np.asarray(xadj, dtype=index_type), np.asarray(adjncy, dtype=index_type)
        ),
        eweights=np.asarray(weights, dtype=index_type),
        options=pymetis.Options(ufactor=30, seed=seed),
    )
    return np.asarray(result.vertex_part, dtype=np.int64)


@dataclass(frozen=True)
class Case:
    topology: str
    n_nodes: int
    build: Callable[[int], TrafficMatrix]


def cases(quick: bool) -> list[Case]:
    all_cases = [
        Case("chain 4×8", 4, lambda s: chain(4, 8, 0.8, s)),
        Case("chain 4×16", 8, lambda s: chain(4, 16, 0.8, s)),
        Case("chain 4×32", 8, lambda s: chain(4, 32, 0.8, s)),
        Case("chain 4×64", 16, lambda s: chain(4, 64, 0.8, s)),
        Case("chain 4×64", 4, lambda s: chain(4, 64, 0.8, s)),
        Case("chain 4×32, locality 0.5", 8, lambda s: chain(4, 32, 0.5, s)),
        Case("diamond 4×32", 8, lambda s: diamond(32, 0.8, s)),
        Case("key-pairs 2×64", 4, lambda s: key_pairs(64, 0.8, s)),
        Case("key-pairs 2×128", 16, lambda s: key_pairs(128, 0.8, s)),
    ]
    return all_cases[:3] + all_cases[6:8] if quick else all_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller cases, one seed")
    parser.add_argument("--seeds", type=int, default=3, help="matrices per case")
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = parser.parse_args()
    seeds = 1 if args.quick else args.seeds

    literal = "TurboStream as written"
    default = "keyplane default"
    methods = ["round-robin", "random", literal, default, "METIS (ref.)"]
    lines = [
        f"Inter-node traffic as a share of all traffic, mean of {seeds} matrix seed(s); "
        "lower is better. Loads: max − min tasks per node (METIS row only; the others are ±1).",
        "",
        "| topology | tasks | nodes | " + " | ".join(methods) + " | METIS load spread "
        "| keyplane vs round-robin | keyplane time (ms) |",
        "|---|---|---|" + "---|" * (len(methods) + 3),
    ]
    for case in cases(args.quick):
        shares: dict[str, list[float]] = {m: [] for m in methods}
        spread: list[int] = []
        millis: list[float] = []
        n_tasks = 0
        for seed in range(seeds):
            matrix = case.build(seed)
            n_tasks = matrix.shape[0]
            total = float(matrix.sum())
            n = case.n_nodes

            def share(assignment: npt.ArrayLike, matrix: TrafficMatrix = matrix) -> float:
                return traffic_cut(matrix, assignment) / float(matrix.sum())

            shares["round-robin"].append(share(round_robin_placement(n_tasks, n)))
            shares["random"].append(
                statistics.fmean(share(random_placement(n_tasks, n, r)) for r in range(5))
            )
            as_written = PlacementSettings.for_cluster(n_tasks, n, 0.0, "fifo")
            shares[literal].append(share(traffic_aware_placement(matrix, n, as_written)))
            start = time.perf_counter()
            ours = traffic_aware_placement(matrix, n)
            millis.append(1000.0 * (time.perf_counter() - start))
            shares[default].append(share(ours))
            metis = metis_placement(matrix, n, seed)
            shares["METIS (ref.)"].append(share(metis))
            loads = node_loads(metis, n)
            spread.append(int(loads.max() - loads.min()))
            assert total > 0
        mean = {m: statistics.fmean(v) for m, v in shares.items()}
        cells = " | ".join(f"{100.0 * mean[m]:.1f} %" for m in methods)
        reduction = 1.0 - mean[default] / mean["round-robin"]
        lines.append(
            f"| {case.topology} | {n_tasks} | {case.n_nodes} | {cells} | {max(spread)} "
            f"| −{100.0 * reduction:.0f} % | {statistics.fmean(millis):.0f} |"
        )
    table = "\n".join(lines)
    emit(table, args.out)


if __name__ == "__main__":
    main()
