"""How fast the simulator runs a 128-worker cluster over 10M tuples.

The reproductions of papers 000 and 001 sweep many configurations, so the
simulator must handle paper 001's scale (128 workers, §6.1) in minutes on
one core. This script times fields grouping (hash) and FISH on the
time-evolving Zipf workload, split into trace generation, routing (the
policy's own cost), the rest of the simulation (queues, network) and metrics,
and prints a markdown table.

    python bench/sim_speed.py            # 128 workers x 10M tuples
    python bench/sim_speed.py --quick    # 128 workers x 1M tuples
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _output import emit

from keyplane.algorithms.baselines import HashPartitioner
from keyplane.algorithms.hotkeys import FishPartitioner
from keyplane.algorithms.partitioner import Partitioner
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.sim import ClusterConfig, Stage, Trace, simulate, summarize
from keyplane.sim.report import Cell, markdown_table

SERVICE_TIME = 1e-4
"""Seconds per tuple per worker: 10k tuples/s, FISH's default capacity."""


def make_router(name: str, n_workers: int) -> Partitioner:
    if name == "hash":
        return HashPartitioner(n_workers)
    return FishPartitioner(n_workers, capacities=np.full(n_workers, 1.0 / SERVICE_TIME))


def main() -> None:
    parser = argparse.ArgumentParser(description="Simulator speed at 128 workers.")
    parser.add_argument("--quick", action="store_true", help="1M tuples instead of 10M")
    parser.add_argument("--tuples", type=int, default=None, help="override the tuple count")
    parser.add_argument("--workers", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=1 << 16)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    n = args.tuples or (1_000_000 if args.quick else 10_000_000)
    workers = args.workers

    started = time.perf_counter()
    workload = ZipfEvolvingWorkload(n_events=n, n_keys=1_000_000, exponent=1.0, seed=1)
    trace = Trace.from_batches(workload.batches(1 << 20))
    generate_s = time.perf_counter() - started

    cluster = ClusterConfig(
        n_servers=workers, service_time=SERVICE_TIME, source_rate=workers / SERVICE_TIME
    )
    rows: list[list[Cell]] = []
    for name in ("hash", "fish"):
        t0 = time.perf_counter()
        result = simulate(
            trace, [Stage(make_router(name, workers))], cluster, chunk_size=args.chunk_size
        )
        t1 = time.perf_counter()
        metrics = summarize(result)
        t2 = time.perf_counter()
        route_s = result.stages[0].route_seconds
        rows.append(
            [
                name,
                workers,
                n,
                generate_s,
                route_s,
                t1 - t0 - route_s,
                t2 - t1,
                t2 - t0,
                n / (t2 - t0) / 1e6,
                metrics.stages[0].imbalance,
            ]
        )
    table = markdown_table(
        [
            "policy",
            "workers",
            "tuples",
            "generate s",
            "route s",
            "queues s",
            "metrics s",
            "simulate+metrics s",
            "M tuples/s",
            "imbalance",
        ],
        rows,
    )
    emit(table, args.out)


if __name__ == "__main__":
    main()
