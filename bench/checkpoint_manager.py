"""Checkpoint files through Hadoop's FileContext, its FileSystem, or keyplane's manager.

Every micro-batch writes checkpoint files: each state store partition a
changelog, the driver an offset and a commit log entry, each a small file
written under a temporary name and renamed into place. Spark writes them
through ``FileContext`` by default. keyplane's sessions switch to
``FileSystem`` (:func:`keyplane.spark.session.use_file_system_checkpoint_manager`),
and, where the session has keyplane's jar, to keyplane's manager over it,
which creates and renames local files in Java rather than through Hadoop's
local file system, which starts a ``chmod`` process for each file it creates
and refuses to rename onto an existing one
(``keyplane.spark.jvm.LocalCheckpointFileManager``).

The routed job and plain Spark's ``groupBy`` counts (pipelines of
``bench/reference_job.py``; also the routed job on a checkpoint whose stage
A runs in event time, ``routed, event time``) run on the same topic with
each manager, taking turns. Spark's event log gives, per steady batch (all but each run's first),
its duration, each stateful operator's ``commitTimeMs`` and state store load
time (``rocksdbLoadLatencyMs``, which includes opening the batch's changelog
file), summed over its partitions, and the driver's offset and commit log
writes (``walCommit`` + ``commitOffsets``).

    python bench/checkpoint_manager.py [--events 600000] [--batch 50000] [--repeats 3]
        [--managers NAME ...] [--pipelines NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from _harness import event_log_env, private_broker, run_job
from _output import emit
from reference_job import settings as pipeline_settings

from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import GeoTagsWorkload
from keyplane.spark.jvm import CHECKPOINT_FILE_MANAGER
from keyplane.spark.progress import progress_of
from keyplane.spark.session import (
    CHECKPOINT_FILE_MANAGER_KEY,
    SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS,
)

MANAGERS = {
    "FileContext": "org.apache.spark.sql.execution.streaming.checkpointing."
    "FileContextBasedCheckpointFileManager",
    "FileSystem": SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS[0],
    "keyplane": CHECKPOINT_FILE_MANAGER,
}
PIPELINES = {
    "routed": "routed",
    "routed, event time": "routed-event-time",
    "plain Spark": "native-counts",
}


def progress_events(log_dir: Path) -> list[dict[str, Any]]:
    """The query's progress reports from the event log, in batch order."""
    found = []
    for path in sorted(p for p in log_dir.iterdir() if p.is_file()):
        for line in path.read_text().splitlines():
            if "QueryProgressEvent" in line:
                found.append(json.loads(line)["progress"])
    return sorted(found, key=lambda p: p["batchId"])


def rate_of(batches: list[dict[str, Any]]) -> float:
    """Events per second over ``batches``."""
    seconds = sum(p["durationMs"]["triggerExecution"] for p in batches) / 1000
    return sum(progress_of(p).rows for p in batches) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=600_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--managers", nargs="+", choices=MANAGERS, default=list(MANAGERS))
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    cells = [(pipeline, manager) for pipeline in args.pipelines for manager in args.managers]
    batches: dict[tuple[str, str], list[dict[str, Any]]] = {cell: [] for cell in cells}
    run_rates: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    with private_broker() as (bootstrap, tmp):
        produce_workload(
            GeoTagsWorkload(n_events=args.events, n_tags=2_000, seed=3),
            bootstrap,
            "reference",
            partitions=8,
        )
        for run in range(args.repeats):
            for number, (pipeline, manager) in enumerate(cells):
                variant = PIPELINES[pipeline]
                work = tmp / f"run-{run}-{number}"
                env = event_log_env(work / "events")
                conf = Path(env["SPARK_CONF_DIR"]) / "spark-defaults.conf"
                conf.write_text(
                    conf.read_text() + f"{CHECKPOINT_FILE_MANAGER_KEY} {MANAGERS[manager]}\n"
                )
                job = pipeline_settings(
                    bootstrap, work, variant, args.batch, args.events, run * 100 + number
                )
                run_job(job, env=env)
                steady = [p for p in progress_events(work / "events")[1:] if progress_of(p).rows]
                batches[(pipeline, manager)] += steady
                run_rates[(pipeline, manager)].append(rate_of(steady))
                print(
                    f"run {run + 1}/{args.repeats} {pipeline}, {manager}: "
                    f"{len(steady)} steady batches",
                    flush=True,
                )

    def per_operator(cell: tuple[str, str], metric: str) -> float:
        values = [
            float((op.get("customMetrics") or {}).get(metric, op.get(metric, 0)))
            for p in batches[cell]
            for op in p["stateOperators"]
        ]
        return statistics.median(values)

    def median_batch_s(cell: tuple[str, str]) -> float:
        return statistics.median(p["durationMs"]["triggerExecution"] for p in batches[cell]) / 1000

    def driver_logs(cell: tuple[str, str]) -> float:
        return statistics.median(
            p["durationMs"].get("walCommit", 0) + p["durationMs"].get("commitOffsets", 0)
            for p in batches[cell]
        )

    def table_row(cell: tuple[str, str]) -> str:
        pipeline, manager = cell
        return (
            f"| {pipeline} | {manager} | {median_batch_s(cell):.2f} | "
            f"{rate_of(batches[cell]):,.0f} | "
            f"{', '.join(f'{r:,.0f}' for r in run_rates[cell])} | "
            f"{per_operator(cell, 'commitTimeMs'):.0f} | "
            f"{per_operator(cell, 'rocksdbLoadLatencyMs'):.0f} | {driver_logs(cell):.0f} |"
        )

    lines = [
        f"events: {args.events:,} geo-tags in 8 partitions, {args.batch:,} per batch, local[2], "
        f"4 partitions per stateful operator (the routed job has 2, plain Spark 1); "
        f"{args.repeats} run(s) of each pipeline and manager, taking turns; steady batches",
        "",
        "| pipeline | checkpoint files through | median batch s | steady rows/s | per run | "
        "commitTimeMs per operator (median) | state store load ms per operator (median) | "
        "offset + commit log ms (median) |",
        "|---|---|---:|---:|---|---:|---:|---:|",
        *map(table_row, cells),
        "",
    ]
    lines += [
        "Stateful operators as Spark's progress lists them, from the sink down (medians):",
        "",
    ]
    for cell in cells:
        operators = []
        for index in range(len(batches[cell][0]["stateOperators"])):
            ops = [p["stateOperators"][index] for p in batches[cell]]
            updated = statistics.median(op["numRowsUpdated"] for op in ops)
            timers = statistics.median(
                (op.get("customMetrics") or {}).get("timerProcessingTimeMs", 0) for op in ops
            )
            operators.append(f"{updated:,.0f} keys updated, timerProcessingTimeMs {timers:.0f}")
        lines.append(f"- {cell[0]}, {cell[1]}: " + "; ".join(operators))
    lines.append("")
    for pipeline in args.pipelines:
        if "FileSystem" in args.managers and "keyplane" in args.managers:
            gain = rate_of(batches[(pipeline, "keyplane")]) / rate_of(
                batches[(pipeline, "FileSystem")]
            )
            lines.append(f"{pipeline}: keyplane / FileSystem steady rows/s: **{gain:.2f}**")
    routed = [pipeline for pipeline in args.pipelines if pipeline.startswith("routed")]
    if "plain Spark" in args.pipelines:
        for pipeline in routed:
            for manager in args.managers:
                ratio = rate_of(batches[(pipeline, manager)]) / rate_of(
                    batches[("plain Spark", manager)]
                )
                lines.append(f"{pipeline} / plain Spark with {manager}: **{ratio:.2f}**")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
