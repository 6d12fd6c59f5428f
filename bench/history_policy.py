"""Next-window locality of the pair-history policies on a drifting trace.

Paper 000 §3.2 resets the pair statistics after every reconfiguration; keyplane
can instead keep them with FISH-style decay (paper 001 §4.1). This script
replays a drifting (region, hashtag) stream cut into windows: after each
window it folds the window into a :class:`keyplane.algorithms.pair_history.PairHistory`,
builds a plan from the history, and scores that plan on the *next* window.

    python bench/history_policy.py            # 12 windows of 100k events
    python bench/history_policy.py --quick    # 5 windows of 20k events
"""

from __future__ import annotations

import argparse
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
from _output import emit

from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import evaluate
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import PairStatistics
from keyplane.reference.workloads import GeoTagsWorkload


def window_statistics(workload: GeoTagsWorkload, start: int, stop: int) -> PairStatistics:
    events = workload.events(start, stop)
    return PairStatistics(events.a, events.b, np.ones(len(events)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 windows of 20k events")
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--window-events", type=int, default=100_000)
    parser.add_argument("--parts", type=int, default=6)
    parser.add_argument("--decays", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    if args.quick:
        args.windows, args.window_events = 5, 20_000

    size = args.window_events
    workload = GeoTagsWorkload(
        n_events=size * args.windows,
        seed=args.seed,
        drift_every=size,
        stable_favourites=3,
        flash_every=2 * size,
        flash_duration=size // 2,
    )
    windows = [window_statistics(workload, i * size, (i + 1) * size) for i in range(args.windows)]
    policies = [HistoryPolicy(mode="reset")] + [
        HistoryPolicy(mode="decay", decay=decay) for decay in args.decays
    ]
    hashed = np.mean([evaluate(({}, {}), w, args.parts).locality for w in windows[1:]])

    rows = [
        "| policy | decay | next-window locality | imbalance A | imbalance B | seconds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy in policies:
        history = PairHistory(policy)
        scores = []
        started = time.perf_counter()
        for current, following in pairwise(windows):
            history.add(current)
            plan = build_plan(history.statistics, args.parts, seed=args.seed)
            scores.append(plan.evaluate(following))
        seconds = time.perf_counter() - started
        decay = "–" if policy.mode == "reset" else f"{policy.decay}"
        rows.append(
            f"| {policy.mode} | {decay} | {np.mean([s.locality for s in scores]):.3f} "
            f"| {np.mean([s.imbalance_a for s in scores]):.3f} "
            f"| {np.mean([s.imbalance_b for s in scores]):.3f} | {seconds:.1f} |"
        )
    rows.append(f"| hash | – | {hashed:.3f} | | | |")
    table = "\n".join(rows)
    emit(table, args.out)


if __name__ == "__main__":
    main()
