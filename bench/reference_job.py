"""The reference job, the routed job and plain Spark counting, side by side.

All four read the same topic through keyplane's Kafka source with the same
batch cap, each in its own process, one after the other:

* ``native-counts``: the same per-key counts of both fields from one plain
  Spark ``groupBy`` (JVM aggregation, no Python stateful stage);
* ``two-stage``: the reference job, two chained Python stateful stages;
* ``routed-python``: the routed job (live routing, hand-off rows, metrics),
  on an initial all-hash configuration, its stages in Python;
* ``routed``: the same job with its stages in the JVM
  (:mod:`keyplane.spark.jvm`), as it runs by default;
* ``routed-event-time``: ``routed`` on a checkpoint whose stage A runs in
  event-time mode, as earlier versions of keyplane wrote them
  (:mod:`keyplane.spark.watermark`);
* ``routed-stages-jar``: ``routed`` on the JVM stages of ``--stages-jar``, a
  jar another version of keyplane built (``python -m keyplane.spark.jvm
  --out PATH`` in its checkout), to compare its stages with this version's
  side by side. The jar must take this version's rows.
* ``routed-checkout``: ``routed`` as another version of keyplane runs it,
  the one checked out at ``--checkout`` (``git worktree add PATH COMMIT``):
  its ``include/`` comes first on the job's ``PYTHONPATH``, which Spark
  passes on to the job's Python workers, and its JVM stages are built from
  its own source. It must take this version's job flags.

The throughput ratios are the cost of the Python stateful stages and of
live routing (issue goal: routed ≥ 0.9 × plain Spark).

One run of a variant varies by up to half its rate on a 2-core machine, so
``--repeats N`` runs the variants N times, taking turns, and pools each
variant's steady batches over the runs. The default 200,000 events give each
run three steady batches; ``--events 1000000`` gives nineteen, the steady
state (at another ``--batch``, twenty times it), and ``--variants routed``
runs the routed job and plain Spark only. The routed job's extra time is a
roughly fixed cost per batch, so the ratio rises with ``--batch``
(docs/benchmarks.md, "Throughput against plain Spark").

    python bench/reference_job.py [--events 200000] [--batch 50000] [--tags 2000]
        [--repeats 3] [--variants VARIANT ...] [--stages-jar JAR] [--checkout DIR]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from _harness import private_broker, run_job, steady_rate
from _output import emit

from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import GeoTagsWorkload
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.spark.jvm import JAR_ENV
from keyplane.testing import routed_job_topics

VARIANTS = (
    "native-counts",
    "two-stage",
    "routed-python",
    "routed",
    "routed-event-time",
    "routed-stages-jar",
    "routed-checkout",
)
OTHER_VERSIONS = ("routed-stages-jar", "routed-checkout")
"""The variants that run another version's code: not run unless asked for."""


def settings(
    bootstrap: str, tmp: Path, variant: str, batch: int, total: int, run: int = 0
) -> CountsJobSettings:
    """Run ``run`` of ``variant``: its own checkpoint, output, routing store and topics."""
    routed = variant.startswith("routed")
    name = f"{variant}-{run}"
    return CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic="reference",
        checkpoint=tmp / f"ck-{name}",
        output=tmp / f"out-{name}",
        max_offsets_per_trigger=batch,
        stop_at_offset_total=total,
        pipeline="two-stage" if routed else variant,
        routing_store=tmp / f"store-{name}" if routed else None,
        stage_engine="python" if variant == "routed-python" else "auto",
        new_checkpoint_time_mode="EventTime" if variant == "routed-event-time" else "None",
        **(routed_job_topics(name) if routed else {}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tags", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--quick", action="store_true", help="50k events, 10k per batch")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the variants")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=[v for v in VARIANTS if v not in OTHER_VERSIONS],
        help="which variants to run (plain Spark always runs: the ratios are to it)",
    )
    parser.add_argument(
        "--stages-jar", type=Path, help="the JVM stages of variant routed-stages-jar"
    )
    parser.add_argument(
        "--checkout", type=Path, help="the keyplane checkout of variant routed-checkout"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = [v for v in VARIANTS if v in args.variants or v == "native-counts"]
    if "routed-stages-jar" in variants and (
        args.stages_jar is None or not args.stages_jar.is_file()
    ):
        parser.error("variant routed-stages-jar needs --stages-jar, an existing jar")
    if "routed-checkout" in variants and (
        args.checkout is None or not (args.checkout / "include" / "keyplane").is_dir()
    ):
        parser.error("variant routed-checkout needs --checkout, a keyplane checkout")
    envs: dict[str, dict[str, str]] = {}
    if args.stages_jar:
        envs["routed-stages-jar"] = {**os.environ, JAR_ENV: str(args.stages_jar)}
    if args.checkout:
        path = [str(args.checkout.resolve() / "include"), os.environ.get("PYTHONPATH", "")]
        envs["routed-checkout"] = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    events, batch = (50_000, 10_000) if args.quick else (args.events, args.batch)

    with private_broker() as (bootstrap, tmp):
        spec = GeoTagsWorkload(n_events=events, n_tags=args.tags, seed=3)
        produce_workload(spec, bootstrap, "reference", partitions=8)
        runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
        for run in range(args.repeats):
            for v in variants:
                progress = run_job(settings(bootstrap, tmp, v, batch, events, run), envs.get(v))
                runs[v].append(progress)
                print(f"run {run + 1}/{args.repeats} {v}: {steady_rate(progress):,.0f} rows/s")

    def median_s(progress: list[dict[str, Any]]) -> float:
        return statistics.median(p["duration_ms"] for p in progress) / 1000

    # Pooled: every run's steady batches (all but each run's first) as one.
    rates = {v: steady_rate([p for progress in runs[v] for p in progress[1:]]) for v in variants}
    per_run = {v: [steady_rate(progress) for progress in runs[v]] for v in variants}
    native = rates["native-counts"]

    def ratio(v: str) -> str:
        native_runs = per_run["native-counts"]
        each = ", ".join(f"{r / n:.2f}" for r, n in zip(per_run[v], native_runs, strict=True))
        return f"**{rates[v] / native:.2f}**" + (f" ({each})" if args.repeats > 1 else "")

    lines = [
        f"events: {events:,} geo-tags ({args.tags:,} tags), {batch:,} per micro-batch, local[2], "
        f"{args.repeats} run(s) of each variant, taking turns",
        "",
        "| pipeline | batches per run | median batch s | steady rows/s | vs plain Spark (runs) |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {v} | {len(runs[v][0])} | "
            f"{median_s([p for progress in runs[v] for p in progress]):.1f} | "
            f"{rates[v]:,.0f} | {ratio(v)} |"
            for v in variants
        ],
        "",
        ", ".join(
            f"routed / {name}: **{rates['routed'] / rates[v]:.2f}**"
            for v, name in (
                ("routed-event-time", "routed-event-time"),
                ("routed-stages-jar", "routed-stages-jar"),
                ("routed-checkout", "routed-checkout"),
                ("routed-python", "routed-python"),
                ("native-counts", "plain Spark"),
            )
            if "routed" in rates and v in rates
        ),
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
