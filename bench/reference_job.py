"""The reference two-stage job vs Spark's native streaming count, side by side.

Both read the same topic through keyplane's Kafka source with the same batch
cap; one runs the two chained Python stateful stages (the reference job),
the other Spark's native ``groupBy(a).count()``. The ratio of their
steady-state throughput is the cost of the Python stateful stages, which the
routed job (issue: live routing) has to keep near 1.

    python bench/reference_job.py [--events 200000] [--tags 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import produce_workload
from keyplane.spark.counts_job import PROGRESS_PREFIX, CountsJobSettings, job_command
from keyplane.testing import free_port
from keyplane.workloads import GeoTagsWorkload

PIPELINES = ("count-by-first-key", "two-stage")


def run_job(
    bootstrap: str, topic: str, tmp: Path, pipeline: str, batch: int, total: int
) -> list[dict]:  # type: ignore[type-arg]
    cmd = job_command(
        CountsJobSettings(
            bootstrap_servers=bootstrap,
            events_topic=topic,
            checkpoint=tmp / f"ck-{pipeline}",
            output=tmp / f"out-{pipeline}",
            max_offsets_per_trigger=batch,
            stop_at_offset_total=total,
            pipeline=pipeline,
        )
    )
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [
        json.loads(line[len(PROGRESS_PREFIX) :])
        for line in out.splitlines()
        if line.startswith(PROGRESS_PREFIX)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tags", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--quick", action="store_true", help="50k events, 10k per batch")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    events, batch = (50_000, 10_000) if args.quick else (args.events, args.batch)

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        broker = EmbeddedBroker(tmp, free_port())
        bootstrap = broker.start().bootstrap_servers
        try:
            spec = GeoTagsWorkload(n_events=events, n_tags=args.tags, seed=3)
            produce_workload(spec, bootstrap, "reference", partitions=8)
            results = {p: run_job(bootstrap, "reference", tmp, p, batch, events) for p in PIPELINES}
        finally:
            broker.stop()

    def steady(progress: list[dict]) -> float:  # type: ignore[type-arg]
        # The first batch pays for JVM and Python worker start-up.
        rest = progress[1:] or progress
        return sum(p["rows"] for p in rest) / (sum(p["duration_ms"] for p in rest) / 1000)

    def median_s(progress: list[dict]) -> float:  # type: ignore[type-arg]
        return statistics.median(p["duration_ms"] for p in progress) / 1000

    rates = {p: steady(results[p]) for p in PIPELINES}
    lines = [
        f"events: {events:,} geo-tags ({args.tags:,} tags), {batch:,} per micro-batch, local[2]",
        "",
        "| pipeline | batches | median batch s | steady rows/s |",
        "|---|---:|---:|---:|",
        *[
            f"| {p} | {len(results[p])} | {median_s(results[p]):.1f} | {rates[p]:,.0f} |"
            for p in PIPELINES
        ],
        "",
        "two-stage / native count throughput ratio: "
        f"**{rates['two-stage'] / rates['count-by-first-key']:.2f}**",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
