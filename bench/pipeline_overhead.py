"""The cost of the pipeline API's generality: the chain engine against the reference engine.

The routed job runs the reference pipeline (``keyplane.reference.pipeline:counts``,
the job's default pipeline) on one of its stage engines
(:data:`keyplane.settings.StageEngine`), each variant in its own process on
the same topic, the same events and the same batch cap, taking turns:

* ``chain``: the engine of any pipeline (``--stage-engine chain``): Spark
  parses and keys the Kafka records, an Arrow step routes and combines them
  (:func:`keyplane.spark.pipeline_frames.routed_rows`), one Python
  ``transformWithState`` per stage (:mod:`keyplane.spark.chain_stages`);
* ``python``: the reference engine with its stages in Python
  (``--stage-engine python``), the like-for-like comparison;
* ``jvm``: the reference engine with its stages in the JVM, what ``auto``,
  the default, picks for the reference running count.

Each run's throughput is its steady rate (every batch but its first, which
pays for the JVM and workers starting); a variant's number is the median of
its runs, with their spread. The issue's goal: chain ≥ 0.95× the current job.

``--stage-times`` says where a batch's time goes instead: Spark writes each
run's event log, and the table gives, per variant, the median wall time of
a steady batch's Spark stages (:func:`_harness.batch_stage_seconds`): the
one that reads the source (and, in the chain, parses, keys, routes and
combines the events in the same tasks), and each keyed stage. Writing the
log costs time of its own, so its rates are not the throughput's.

    python bench/pipeline_overhead.py [--events 200000] [--batch 50000] [--tags 2000]
        [--repeats 5] [--variants chain python jvm] [--stage-times] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from _harness import (
    batch_stage_seconds,
    event_log_env,
    private_broker,
    run_job,
    steady_rate,
)
from _output import emit, load_average

from keyplane.kafka.producer import produce_workload
from keyplane.orchestration.deployment import routed_job_topics
from keyplane.reference.pipeline import REFERENCE_PIPELINE
from keyplane.reference.workloads import GeoTagsWorkload
from keyplane.settings import StageEngine
from keyplane.spark.counts_job import CountsJobSettings

VARIANTS: tuple[StageEngine, ...] = ("chain", "python", "jvm")
GOAL = 0.95
TOPIC = "reference"


def settings(
    bootstrap: str, tmp: Path, engine: StageEngine, batch: int, total: int, run: int
) -> CountsJobSettings:
    """Run ``run`` of the routed job on ``engine``: its own checkpoint, output, routing store
    and protocol topics, so that no run reads another's state or messages."""
    name = f"{engine}-{run}"
    return CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic=TOPIC,
        checkpoint=tmp / f"ck-{name}",
        output=tmp / f"out-{name}",
        max_offsets_per_trigger=batch,
        stop_at_offset_total=total,
        routing_store=tmp / f"store-{name}",
        stage_engine=engine,
        **routed_job_topics(name),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tags", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--stage-times", action="store_true", help="where a batch's time goes (event logs)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants: list[StageEngine] = [v for v in VARIANTS if v in args.variants]
    # Every variant runs the reference pipeline, whatever the environment names: the job's
    # default pipeline, so that all three write the same per-routed-key partials.
    os.environ["KEYPLANE_PIPELINE"] = REFERENCE_PIPELINE
    loads = [load_average()]

    with private_broker() as (bootstrap, tmp):
        spec = GeoTagsWorkload(n_events=args.events, n_tags=args.tags, seed=3)
        produce_workload(spec, bootstrap, TOPIC, partitions=8)
        runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
        stages: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for run in range(args.repeats):
            for v in variants:
                log_dir = tmp / f"log-{v}-{run}"
                env = event_log_env(log_dir) if args.stage_times else None
                progress = run_job(settings(bootstrap, tmp, v, args.batch, args.events, run), env)
                runs[v].append(progress)
                if args.stage_times:
                    by_batch = batch_stage_seconds(log_dir)
                    steady = sorted(b for b, took in by_batch.items() if "scan" in took)[1:]
                    stages[v] += [by_batch[b] for b in steady]
                print(f"run {run + 1}/{args.repeats} {v}: {steady_rate(progress):,.0f} rows/s")
            loads.append(load_average())

    if args.stage_times:
        emit(stage_table(args, loads, stages), args.out)
        return
    per_run = {v: [steady_rate(progress) for progress in runs[v]] for v in variants}
    median = {v: statistics.median(per_run[v]) for v in variants}

    def ratio(other: str) -> str:
        each = ", ".join(
            f"{c / o:.2f}" for c, o in zip(per_run["chain"], per_run[other], strict=True)
        )
        return f"chain / {other}: **{median['chain'] / median[other]:.2f}×** (runs: {each})"

    lines = [
        f"events: {args.events:,} geo-tags ({args.tags:,} tags) in 8 partitions, "
        f"{args.batch:,} per micro-batch, local[2], the reference pipeline, "
        f"{args.repeats} run(s) of each variant, taking turns",
        f"load average (1, 5, 15 min) before the runs and after each round: {' | '.join(loads)}",
        "",
        "| stage engine | batches per run | steady rows/s, median | min–max | runs |",
        "|---|---:|---:|---:|---|",
        *[
            f"| {v} | {len(runs[v][0])} | {median[v]:,.0f} | "
            f"{min(per_run[v]):,.0f}–{max(per_run[v]):,.0f} | "
            f"{', '.join(f'{r:,.0f}' for r in per_run[v])} |"
            for v in variants
        ],
        "",
        *[
            f"{ratio(other)}; goal ≥ {GOAL}×: "
            f"**{'MET' if median['chain'] / median[other] >= GOAL else 'NOT MET'}**  "
            for other in ("python", "jvm")
            if "chain" in median and other in median
        ],
    ]
    emit("\n".join(lines), args.out)


def stage_table(
    args: argparse.Namespace, loads: list[str], stages: dict[str, list[dict[str, float]]]
) -> str:
    """Per variant, the median seconds of a steady batch's source stage and keyed stages."""

    def median_s(took: list[dict[str, float]], part: str) -> str:
        values = [t[part] for t in took if part in t]
        return f"{statistics.median(values):.2f}" if values else "–"

    return "\n".join(
        [
            f"events: {args.events:,} geo-tags ({args.tags:,} tags) in 8 partitions, "
            f"{args.batch:,} per micro-batch, local[2], the reference pipeline, "
            f"{args.repeats} run(s) of each variant with Spark's event log, taking turns",
            f"load average (1, 5, 15 min) before the runs and after each round: "
            f"{' | '.join(loads)}",
            "",
            "| stage engine | steady batches | source stage s | first keyed stage s | "
            "second keyed stage s |",
            "|---|---:|---:|---:|---:|",
            *[
                f"| {v} | {len(took)} | {median_s(took, 'scan')} | {median_s(took, 'A')} | "
                f"{median_s(took, 'B')} |"
                for v, took in stages.items()
            ],
        ]
    )


if __name__ == "__main__":
    main()
