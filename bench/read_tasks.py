"""How many tasks read a micro-batch: one per Kafka partition, or one per core.

A task of a Python data source costs about a tenth of a second whatever it
reads: its launch, the hand-off to a Python worker, the shuffle files it
writes. Spark's Kafka connector reads each Kafka partition in a task of its
own, and so did keyplane's sources; on two cores, a batch of an 8-partition
topic paid that eight times. ``CountsJobSettings.read_tasks`` (the sources'
``maxPartitions``) now defaults to the session's cores, so partitions share
tasks.

Two pipelines read the same topic, each with both settings, taking turns:

* ``routed``: the routed job (JVM stages, all-hash configuration);
* ``native-counts``: the same counts from one plain Spark ``groupBy``.

Reported: steady throughput pooled over the runs (all but each run's first
batch), and each pipeline's ratio of cores-many tasks to a task per partition.

    python bench/read_tasks.py [--events 200000] [--batch 20000] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from _harness import private_broker, run_job, steady_rate
from _output import emit

from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import routed_job_topics

PARTITIONS = 8
CORES = 2
PIPELINES = ("routed", "native-counts")
TASKS = (PARTITIONS, CORES)


def settings(
    bootstrap: str, tmp: Path, pipeline: str, tasks: int, args: argparse.Namespace, run: int
) -> CountsJobSettings:
    """Run ``run`` of ``pipeline`` reading with ``tasks`` tasks: its own checkpoint and topics."""
    routed = pipeline == "routed"
    name = f"{pipeline}-{tasks}-{run}"
    return CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic="read-tasks",
        checkpoint=tmp / f"ck-{name}",
        output=tmp / f"out-{name}",
        master=f"local[{CORES}]",
        max_offsets_per_trigger=args.batch,
        stop_at_offset_total=args.events,
        pipeline="two-stage" if routed else "native-counts",
        routing_store=tmp / f"store-{name}" if routed else None,
        read_tasks=tasks,
        **(routed_job_topics(name) if routed else {}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    variants = [(pipeline, tasks) for pipeline in PIPELINES for tasks in TASKS]
    runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {v: [] for v in variants}
    with private_broker() as (bootstrap, tmp):
        spec = ZipfEvolvingWorkload(
            n_events=args.events, n_keys=20_000, exponent=0.6, shifts=(0.9,), seed=12
        )
        produce_workload(spec, bootstrap, "read-tasks", partitions=PARTITIONS)
        for run in range(args.repeats):
            for pipeline, tasks in variants:
                progress = run_job(settings(bootstrap, tmp, pipeline, tasks, args, run))
                runs[pipeline, tasks].append(progress)
                print(
                    f"run {run + 1}/{args.repeats} {pipeline}, {tasks} tasks: "
                    f"{steady_rate(progress):,.0f} rows/s",
                    flush=True,
                )

    def pooled(variant: tuple[str, int]) -> float:
        return steady_rate([p for progress in runs[variant] for p in progress[1:]])

    def median_s(variant: tuple[str, int]) -> float:
        seconds = [p["duration_ms"] / 1000 for progress in runs[variant] for p in progress[1:]]
        return statistics.median(seconds)

    def ratio(pipeline: str) -> str:
        each = ", ".join(
            f"{steady_rate(few[1:]) / steady_rate(many[1:]):.2f}"
            for few, many in zip(runs[pipeline, CORES], runs[pipeline, PARTITIONS], strict=True)
        )
        total = pooled((pipeline, CORES)) / pooled((pipeline, PARTITIONS))
        return f"**{total:.2f}**" + (f" ({each})" if args.repeats > 1 else "")

    lines = [
        f"events: {args.events:,} zipf-evolving (20,000 keys, s = 0.6) in {PARTITIONS} "
        f"partitions, {args.batch:,} per batch, local[{CORES}]; {args.repeats} run(s) of each "
        "variant, taking turns",
        "",
        "| pipeline | tasks per batch | median batch s | steady rows/s |",
        "|---|---:|---:|---:|",
        *[
            f"| {pipeline} | {tasks} | {median_s((pipeline, tasks)):.2f} | "
            f"{pooled((pipeline, tasks)):,.0f} |"
            for pipeline, tasks in variants
        ],
        "",
        *[
            f"{pipeline}: {CORES} tasks / {PARTITIONS} tasks throughput {ratio(pipeline)}"
            for pipeline in PIPELINES
        ],
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
