"""Hot-key splitting vs hash routing on a stream whose hottest key carries over half the load.

Under hash routing the instance that owns the hottest key is the straggler of
every micro-batch (paper 001 §1): the batch lasts as long as that one task.
The routed job splits the hot key of each stage over all instances (001
§4.1.2, partial counts merged exactly downstream). The hot key does not
move during the run (a stationary Zipf stream), so the split chosen up front
stays right. Both variants run the
routed job on the same topic, one after the other; only the starting
configuration differs.

Reported: p50/p99 micro-batch duration, steady throughput, and max/avg
tuples per instance of stage A over the run (from the job's metrics topic).
Goals: p99 with splitting ≤ 0.6 × hash; max/avg ≤ 1.2 with splitting.

    python bench/hot_key_split.py [--events 200000] [--exponent 2.0] [--out FILE]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from _harness import (
    emit,
    percentile,
    private_broker,
    read_topic,
    run_job,
    steady_rate,
)

from keyplane.config import OperatorRouting, RoutingConfig, save
from keyplane.kafka.producer import produce_workload
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import routed_job_topics
from keyplane.verification import expected_counts
from keyplane.workloads import ZipfEvolvingWorkload

P = 4
VARIANTS = ("hash", "split")


def initial_config(variant: str, hot_a: str, hot_b: str) -> RoutingConfig:
    everywhere = tuple(range(P))
    hot = {"A": {hot_a: everywhere}, "B": {hot_b: everywhere}} if variant == "split" else {}
    return RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            name: OperatorRouting(parallelism=P, hot_keys=hot.get(name, {})) for name in ("A", "B")
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--exponent", type=float, default=2.0)
    parser.add_argument("--keys", type=int, default=5_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = ZipfEvolvingWorkload(
        n_events=args.events, n_keys=args.keys, exponent=args.exponent, shifts=(), seed=4
    )
    truth = expected_counts(spec)
    top = truth.sort_values("count", ascending=False).groupby("stage").head(1)
    hot = dict(zip(top["stage"], top["key"], strict=True))
    share = float(top.loc[top["stage"] == "A", "count"].iloc[0]) / args.events
    rows = {}
    with private_broker() as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "hot", partitions=8)
        for variant in VARIANTS:
            store = tmp / f"store-{variant}"
            save(initial_config(variant, hot["A"], hot["B"]), store)
            topics = routed_job_topics(variant)
            progress = run_job(
                CountsJobSettings(
                    bootstrap_servers=bootstrap,
                    events_topic="hot",
                    checkpoint=tmp / f"ck-{variant}",
                    output=tmp / f"out-{variant}",
                    shuffle_partitions=P,
                    max_offsets_per_trigger=args.batch,
                    stop_at_offset_total=args.events,
                    routing_store=store,
                    **topics,
                )
            )
            load: Counter[str] = Counter()
            for record in read_topic(bootstrap, topics["metrics_topic"]):
                load.update({k: v for k, v in record["load"]["A"].items()})
            steady = progress[1:] or progress
            durations = [p["duration_ms"] / 1000 for p in steady]
            per_instance = [load.get(str(i), 0) for i in range(P)]
            rows[variant] = {
                "p50": percentile(durations, 50),
                "p99": percentile(durations, 99),
                "rate": steady_rate(progress),
                "imbalance": max(per_instance) / (sum(per_instance) / P),
            }
    lines = [
        f"events: {args.events:,} zipf-evolving (s = {args.exponent}, {args.keys:,} keys), "
        f"hottest stage-A key {share:.0%} of tuples; {args.batch:,} per batch, {P} instances, "
        "local[2]",
        "",
        "| routing | p50 batch s | p99 batch s | steady rows/s | stage A max/avg tuples |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {v} | {r['p50']:.2f} | {r['p99']:.2f} | {r['rate']:,.0f} | {r['imbalance']:.2f} |"
            for v, r in rows.items()
        ],
        "",
        f"p99 split / hash: **{rows['split']['p99'] / rows['hash']['p99']:.2f}**, "
        f"throughput split / hash: **{rows['split']['rate'] / rows['hash']['rate']:.2f}**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
