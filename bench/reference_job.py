"""The reference job, the routed job and plain Spark counting, side by side.

All three read the same topic through keyplane's Kafka source with the same
batch cap, each in its own process, one after the other:

* ``native-counts``: the same per-key counts of both fields from one plain
  Spark ``groupBy`` (JVM aggregation, no Python stateful stage);
* ``two-stage``: the reference job, two chained Python stateful stages;
* ``routed``: the routed job (live routing, hand-off rows, metrics), on an
  initial all-hash configuration.

The throughput ratios are the cost of the Python stateful stages and of
live routing (issue goal: routed ≥ 0.9 × plain Spark).

    python bench/reference_job.py [--events 200000] [--tags 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _harness import emit, private_broker, run_job, steady_rate

from keyplane.kafka.producer import produce_workload
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import routed_job_topics
from keyplane.workloads import GeoTagsWorkload

VARIANTS = ("native-counts", "two-stage", "routed")


def settings(bootstrap: str, tmp: Path, variant: str, batch: int, total: int) -> CountsJobSettings:
    routed = variant == "routed"
    return CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic="reference",
        checkpoint=tmp / f"ck-{variant}",
        output=tmp / f"out-{variant}",
        max_offsets_per_trigger=batch,
        stop_at_offset_total=total,
        pipeline="two-stage" if routed else variant,
        routing_store=tmp / "store" if routed else None,
        **(routed_job_topics(variant) if routed else {}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tags", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--quick", action="store_true", help="50k events, 10k per batch")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    events, batch = (50_000, 10_000) if args.quick else (args.events, args.batch)

    with private_broker() as (bootstrap, tmp):
        spec = GeoTagsWorkload(n_events=events, n_tags=args.tags, seed=3)
        produce_workload(spec, bootstrap, "reference", partitions=8)
        results = {v: run_job(settings(bootstrap, tmp, v, batch, events)) for v in VARIANTS}

    def median_s(progress: list[dict]) -> float:  # type: ignore[type-arg]
        return statistics.median(p["duration_ms"] for p in progress) / 1000

    rates = {v: steady_rate(results[v]) for v in VARIANTS}
    native = rates["native-counts"]
    lines = [
        f"events: {events:,} geo-tags ({args.tags:,} tags), {batch:,} per micro-batch, local[2]",
        "",
        "| pipeline | batches | median batch s | steady rows/s | vs plain Spark |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {v} | {len(results[v])} | {median_s(results[v]):.1f} | {rates[v]:,.0f} "
            f"| {rates[v] / native:.2f} |"
            for v in VARIANTS
        ],
        "",
        f"routed / two-stage: **{rates['routed'] / rates['two-stage']:.2f}**, "
        f"routed / plain Spark: **{rates['routed'] / native:.2f}**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
