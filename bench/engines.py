"""keyplane's routed job against what a Spark user would run, on Apache Kafka.

One topic on a private Apache Kafka broker (one KRaft node), the reference
workload (paper 000 §4.2's pairs, 4,000 distinct keys in each field, so each
stage sees about 4,000 keys a batch), read 20,000 events a micro-batch
(``maxOffsetsPerTrigger``). Six variants, each its own process, taking turns
``--repeats`` times:

* ``connector-read``: Spark's own Kafka connector (``spark-sql-kafka-0-10``)
  reading the topic into a ``noop`` sink, no processing: the physical limit
  of reading on this machine;
* ``plain-spark``: the connector, ``from_json``, then one streaming
  ``groupBy(stage, key).count()`` that counts stage A's keys (field ``a``)
  and stage B's keys (field ``b``) from a single scan, update mode, ``noop``
  sink: the same per-key counts as the reference job's two stages, as a user
  would write them;
* ``routed-v1``: keyplane's routed job as ``keyplane job start`` runs it by
  default (keyplane's Kafka source, all-hash v1 made on start, stages in the
  JVM, its output, metrics and protocol topics);
* ``routed-v2``: the same job starting on a planned v2 published before the
  run (METIS tables and FISH hot keys planned from the stream's first batch,
  as the reconfiguration DAG would);
* ``routed-v1-connector`` and ``routed-v2-connector``: the same two jobs with
  their events read by Spark's connector (``--source jvm``,
  :mod:`keyplane.spark.connector_events`), keyplane's source planning each
  batch and reading a rollout's rows only.

All six run in keyplane's Spark session (``local[2]``, 4 shuffle partitions,
RocksDB state with changelog checkpoints, the job's 1-second trigger), so
that only the data path differs. A variant's rate is its steady rows per
second of batch time (every batch but the first, :func:`_harness.steady_rate`);
each variant's runs give a median and a min–max spread, and each ratio is
taken per round, between runs that ran one after the other.

    python bench/engines.py [--events 300000] [--batch 20000] [--keys 4000]
        [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from _harness import (
    planned_version,
    private_broker,
    run_job,
    run_progress_command,
    steady_rate,
)
from _output import emit

from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.counts_job import CountsJobSettings, stop_between_batches
from keyplane.testing import routed_job_topics

VARIANTS = (
    "connector-read",
    "plain-spark",
    "routed-v1",
    "routed-v2",
    "routed-v1-connector",
    "routed-v2-connector",
)
TOPIC = "reference"
PARTITIONS = 8
PARALLELISM = 4
"""Instances per stage: the job's default ``shuffle_partitions``."""
ALPHA = 1.1
"""The planner's imbalance bound for the planned v2."""
TRIGGER = CountsJobSettings.model_fields["trigger_interval"].default
SparkOnly = Literal["connector-read", "plain-spark"]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``; a clear error when there are none."""
    if not values:
        raise ValueError("no values to summarise")
    return statistics.median(values), min(values), max(values)


def spread_cell(values: Sequence[float], fmt: str) -> str:
    """``median (min–max)`` with ``fmt`` applied to each, for a result table."""
    mid, lo, hi = spread(values)
    return f"{mid:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"


def ratios(mine: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """Round by round: each run's rate over the rate of the run it took turns with."""
    return [m / t for m, t in zip(mine, theirs, strict=True)]


def runs_line(rates: Mapping[str, Sequence[float]]) -> str:
    """``runs (rows/s): name r1, r2, ...; ...``: every run's rate, for a result file."""
    return "runs (rows/s): " + "; ".join(
        f"{name} " + ", ".join(f"{r:,.0f}" for r in runs) for name, runs in rates.items()
    )


def spark_job(
    kind: SparkOnly,
    bootstrap: str,
    batch: int,
    events: int,
    checkpoint: Path,
    *,
    master: str = "local[2]",
    topic: str = TOPIC,
    parallelism: int = PARALLELISM,
) -> None:
    """One of the plain-Spark variants in this process, printing the job's progress lines
    (:data:`keyplane.spark.progress.PROGRESS_PREFIX`) until ``events`` are committed."""
    from pyspark.sql import functions as F

    from keyplane.spark.connector import connector_jars_setting
    from keyplane.spark.kafka_source import read_kafka
    from keyplane.spark.progress import PROGRESS_PREFIX, progress_of
    from keyplane.spark.running_counts import parse_events
    from keyplane.spark.session import build_session

    spark = build_session(
        f"bench-{kind}",
        master,
        shuffle_partitions=parallelism,
        extra={"spark.jars": connector_jars_setting()},
    )
    raw = read_kafka(spark, bootstrap, topic, max_offsets_per_trigger=batch, implementation="jvm")
    if kind == "connector-read":
        out, mode = raw, "append"
    else:
        keys = parse_events(raw).select(
            F.explode(
                F.array(
                    F.struct(F.lit("A").alias("stage"), F.col("a").alias("key")),
                    F.struct(F.lit("B").alias("stage"), F.col("b").alias("key")),
                )
            ).alias("k")
        )
        out, mode = keys.select("k.stage", "k.key").groupBy("stage", "key").count(), "update"
    query = (
        out.writeStream.format("noop")
        .outputMode(mode)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=TRIGGER)
        .start()
    )
    seen: set[int] = set()
    committed = 0
    try:
        while committed < events:
            if not query.isActive:
                raise RuntimeError(f"{kind} stopped: {query.exception()}")
            time.sleep(0.5)
            for raw_progress in query.recentProgress:
                p = progress_of(raw_progress)
                if p.batch_id in seen or p.rows == 0:
                    continue
                seen.add(p.batch_id)
                committed = max(committed, p.committed)
                print(PROGRESS_PREFIX + json.dumps(dataclasses.asdict(p)), flush=True)
    finally:
        stop_between_batches(query)
        spark.stop()


def run_variant(
    variant: str,
    bootstrap: str,
    work: Path,
    planned: RoutingConfig,
    batch: int,
    events: int,
    *,
    master: str = "local[2]",
    topic: str = TOPIC,
    parallelism: int = PARALLELISM,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One run of ``variant`` over the whole topic, in ``work``; its progress reports.
    ``routed-v2`` starts on ``planned``, saved over an all-hash v1; a ``-connector``
    variant reads through Spark's connector. ``master``, ``topic``,
    ``parallelism`` and ``env`` (the job process's environment) let a cluster run it."""
    work.mkdir()
    if variant in ("connector-read", "plain-spark"):
        command = [
            sys.executable,
            __file__,
            f"--spark-job={variant}",
            f"--bootstrap={bootstrap}",
            f"--batch={batch}",
            f"--events={events}",
            f"--checkpoint={work / 'ck'}",
            f"--master={master}",
            f"--topic={topic}",
            f"--parallelism={parallelism}",
        ]
        return run_progress_command(command, env)
    store = work / "store"
    if variant.startswith("routed-v2"):
        save(RoutingConfig.all_hash(parallelism, ("A", "B")), store)
        save(planned, store)
    settings = CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic=topic,
        checkpoint=work / "ck",
        output=work / "out",
        max_offsets_per_trigger=batch,
        stop_at_offset_total=events,
        routing_store=store,
        master=master,
        shuffle_partitions=parallelism,
        source="jvm" if variant.endswith("-connector") else "python",
        **routed_job_topics(work.name),
    )
    return run_job(settings, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=4_000, help="distinct keys in each field")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--spark-job", choices=("connector-read", "plain-spark"), help="internal")
    parser.add_argument("--bootstrap", help="internal: the --spark-job's broker")
    parser.add_argument("--checkpoint", type=Path, help="internal: the --spark-job's checkpoint")
    parser.add_argument("--master", default="local[2]", help="internal: the --spark-job's master")
    parser.add_argument("--topic", default=TOPIC, help="internal: the --spark-job's topic")
    parser.add_argument("--parallelism", type=int, default=PARALLELISM, help="internal")
    args = parser.parse_args()
    if args.spark_job:
        spark_job(
            args.spark_job,
            args.bootstrap,
            args.batch,
            args.events,
            args.checkpoint,
            master=args.master,
            topic=args.topic,
            parallelism=args.parallelism,
        )
        return

    spec = PairsWorkload(n_events=args.events, n_keys=args.keys, relabel_b=True, seed=3)
    planned = planned_version(spec, args.batch, ALPHA, PARALLELISM)
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    batches: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with private_broker("kafka") as (bootstrap, tmp):
        produce_workload(spec, bootstrap, TOPIC, partitions=PARTITIONS)
        for run in range(args.repeats):
            for v in VARIANTS:
                work = tmp / f"{v}-{run}"
                progress = run_variant(v, bootstrap, work, planned, args.batch, args.events)
                rates[v].append(steady_rate(progress))
                batches[v] += [p["duration_ms"] / 1000 for p in progress[1:]]
                print(f"run {run + 1}/{args.repeats} {v}: {rates[v][-1]:,.0f} rows/s", flush=True)

    plain = rates["plain-spark"]
    lines = [
        f"Apache Kafka (one KRaft node), {args.events:,} pairs events ({args.keys:,} keys a "
        f"field, L = 0.8) in {PARTITIONS} partitions, {args.batch:,} per micro-batch, "
        f"local[2], {PARALLELISM} shuffle partitions, {args.repeats} run(s) of each variant "
        "taking turns; median (min–max) over the runs",
        "",
        "| variant | steady rows/s | median batch s | vs plain Spark | vs connector-read |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {v} | {spread_cell(rates[v], ',.0f')} | {statistics.median(batches[v]):.2f} | "
            f"{spread_cell(ratios(rates[v], plain), '.2f')} | "
            f"{spread_cell(ratios(rates[v], rates['connector-read']), '.2f')} |"
            for v in VARIANTS
        ],
        "",
        runs_line(rates),
        "",
        "planned v2 (alpha "
        + f"{ALPHA}): "
        + ", ".join(
            f"stage {name} {len(op.table):,} keys in its table, {len(op.hot_keys)} hot keys"
            for name, op in planned.operators.items()
        ),
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
