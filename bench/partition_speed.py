"""How fast locality-aware routing partitions a large key graph (paper 000 §3.3).

Builds a synthetic bipartite key graph shaped like pair statistics: stage-A and
stage-B keys fall into communities, most pairs join keys of one community, and
pair counts and key weights are heavy-tailed. It then times
:func:`keyplane.algorithms.locality.build_plan` (graph construction, METIS, balance repair)
on one core (METIS and the numpy steps are single-threaded) and reports the
achieved imbalance and locality next to hashing.

    python bench/partition_speed.py            # 200k vertices, 1M edges, 8 parts
    python bench/partition_speed.py --quick    # 20k vertices, 100k edges
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _output import emit

from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import evaluate
from keyplane.algorithms.pair_statistics import PairStatistics, aggregate_pairs


def community_graph(
    n_vertices: int, n_edges: int, n_communities: int, noise: float, seed: int
) -> PairStatistics:
    """About ``n_edges`` distinct pairs between ``n_vertices / 2`` keys per stage."""
    rng = np.random.default_rng(seed)
    per_stage = n_vertices // 2
    community_a = rng.integers(0, n_communities, per_stage)
    community_b = rng.integers(0, n_communities, per_stage)
    order_b = np.argsort(community_b, kind="stable")
    starts = np.searchsorted(community_b[order_b], np.arange(n_communities + 1))

    draws = int(n_edges * 1.15)
    a_keys = rng.integers(0, per_stage, draws)
    home = community_a[a_keys]
    sizes = np.maximum(starts[home + 1] - starts[home], 1)
    within = order_b[
        np.minimum(starts[home] + rng.integers(0, 1 << 62, draws) % sizes, per_stage - 1)
    ]
    random_b = rng.integers(0, per_stage, draws)
    b_keys = np.where(rng.random(draws) < noise, random_b, within)
    counts = np.floor(rng.pareto(1.5, draws) + 1.0)
    a_keys, b_keys, counts = aggregate_pairs(a_keys, b_keys, counts)
    keep = np.sort(rng.permutation(counts.size)[:n_edges])
    return PairStatistics(a_keys[keep], b_keys[keep], counts[keep])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small graph (20k vertices)")
    parser.add_argument("--vertices", type=int, default=200_000)
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=1.03)
    parser.add_argument("--communities", type=int, default=2_000)
    parser.add_argument("--noise", type=float, default=0.2, help="share of random pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    if args.quick:
        args.vertices, args.edges, args.communities = 20_000, 100_000, 200

    pairs = community_graph(args.vertices, args.edges, args.communities, args.noise, args.seed)
    n_vertices = np.unique(pairs.a_keys).size + np.unique(pairs.b_keys).size
    started = time.perf_counter()
    plan = build_plan(pairs, args.parts, alpha=args.alpha, seed=args.seed)
    seconds = time.perf_counter() - started
    hashed = evaluate(({}, {}), pairs, args.parts)

    rows = [
        "| vertices | edges | parts | α | seconds | imbalance A | imbalance B "
        "| heavy keys | locality | hash locality |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {n_vertices:,} | {pairs.counts.size:,} | {args.parts} | {args.alpha} "
        f"| {seconds:.2f} | {plan.predicted_imbalance_a:.4f} | {plan.predicted_imbalance_b:.4f} "
        f"| {len(plan.heavy_keys_a) + len(plan.heavy_keys_b)} "
        f"| {plan.predicted_locality:.3f} | {hashed.locality:.3f} |",
    ]
    table = "\n".join(rows)
    emit(table, args.out)


if __name__ == "__main__":
    main()
