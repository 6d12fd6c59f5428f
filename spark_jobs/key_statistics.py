"""The statistics job: one window of the pipeline's topics and the metrics topic into a
snapshot folder.

    spark-submit spark_jobs/key_statistics.py --bootstrap-servers HOST:PORT \\
        --metrics-topic M --snapshots DIR --run-id ID [--pipeline module:attribute] \\
        [--events-topic T] [--routing-store DIR] [--decay 0.5] [--holdout-fraction 0.2]

Submitted by the ``collect_statistics`` task of the ``keyplane_reconfigure``
DAG (``SparkSubmitOperator``). The pipeline (default ``KEYPLANE_PIPELINE``)
says which topics to read, how to parse their values and each stage's key.
Spark stays at the edge: one task per Kafka partition reads its exact offset
range of the window (so a rerun reads the same records), the JVM parses the
values against the pipeline's schema and counts the events by stage, key,
next stage's key and side of the hold-out line
(:mod:`keyplane.orchestration.stage_keys`); events that do not parse are
counted and reported, not fatal. The metrics window, one record per
micro-batch, is read on the driver; :mod:`keyplane.algorithms.statistics`
does the rest in pandas. The window starts where the previous snapshot ended
(first run: the earliest offsets), so a run with a snapshot already written
exits at once: retries and repeated runs change nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pyspark.sql import SparkSession

from keyplane.algorithms import statistics as stats
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.kafka.admin import earliest_offsets, ensure_topic, high_watermarks
from keyplane.kafka.metrics_topic import read_metrics
from keyplane.orchestration.stage_keys import window_key_counts
from keyplane.pipeline import Pipeline, load_pipeline
from keyplane.routing import config as config_store
from keyplane.settings import Settings
from keyplane.spark.session import build_session


def _window(bootstrap: str, topic: str, previous: stats.TopicWindow | None) -> stats.TopicWindow:
    ensure_topic(bootstrap, topic, 1)
    return stats.next_window(
        topic, previous, earliest_offsets(bootstrap, topic), high_watermarks(bootstrap, topic)
    )


def metrics_records(bootstrap: str, window: stats.TopicWindow) -> list[BatchMetrics]:
    """The window's metrics records, oldest first; records that do not parse are skipped.

    The job writes one record per micro-batch, a few hundred per window: the
    driver reads them itself, since a second Spark job would cost more to
    start than the read.
    """
    records = read_metrics(bootstrap, window.topic, window.start, window.end)
    return [record.metrics for record in records]


def collect(spark: SparkSession, args: argparse.Namespace) -> Path:
    """Write the snapshot of run ``args.run_id`` (or find it written) and return its folder."""
    folder = stats.snapshot_folder(args.snapshots, args.run_id)
    if (folder / stats.MANIFEST_NAME).is_file():
        return folder
    settings = stats.StatisticsSettings(
        decay=args.decay, holdout_fraction=args.holdout_fraction, max_entries=args.max_entries
    )
    last = stats.latest_snapshot(args.snapshots, before=args.run_id)
    previous = None if last is None else stats.read_snapshot(args.snapshots, last.run_id)
    bootstrap = args.bootstrap_servers
    pipeline: Pipeline = load_pipeline(args.pipeline or Settings().pipeline)
    topics = (args.events_topic,) if args.events_topic else pipeline.source.topics
    before = {} if last is None else {w.topic: w for w in last.events}
    events = [_window(bootstrap, topic, before.get(topic)) for topic in topics]
    metrics_window = _window(bootstrap, args.metrics_topic, None if last is None else last.metrics)
    started = time.monotonic()
    rows = window_key_counts(
        spark, bootstrap, events, pipeline, settings.holdout_fraction, args.max_event_bytes
    ).toPandas()
    unparsed = rows["stage"].isna()
    grouped = rows[~unparsed].reset_index(drop=True)
    unparsed_events = int(rows.loc[unparsed, "n"].sum())
    records = metrics_records(bootstrap, metrics_window)
    read_s = time.monotonic() - started
    version = stats.job_version(records)
    config = None
    if args.routing_store is not None:
        stored = config_store.stored_versions(args.routing_store)
        chosen = version if version in stored else (stored[0] if stored else None)
        config = None if chosen is None else config_store.load(args.routing_store, chosen)
    manifest, frames = stats.build_snapshot(
        run_id=args.run_id,
        grouped=grouped,
        stages=pipeline.stage_names,
        metrics=records,
        events=events,
        metrics_window=metrics_window,
        previous=previous,
        config=config,
        settings=settings,
        unparsed_events=unparsed_events,
    )
    folder = stats.write_snapshot(args.snapshots, manifest, **frames)
    read = sum(window.records for window in events)
    if unparsed_events:
        sys.stdout.write(
            f"statistics: {unparsed_events:,} of {read:,} events did not parse against pipeline "
            f"{pipeline.name!r}'s schema, were too large or had a null key; not counted\n"
        )
    sys.stdout.write(
        f"statistics: read {read:,} events and {len(records):,} metrics records "
        f"in {read_s:.1f} s; snapshot of {len(frames['pairs']):,} key pairs written in "
        f"{time.monotonic() - started - read_s:.1f} s\n"
    )
    return folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="statistics", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument(
        "--pipeline",
        default=None,
        help="the pipeline as module:attribute (default: KEYPLANE_PIPELINE)",
    )
    parser.add_argument(
        "--events-topic", default=None, help="read this topic instead of the pipeline's topics"
    )
    parser.add_argument("--metrics-topic", required=True)
    parser.add_argument("--snapshots", type=Path, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--routing-store", type=Path)
    defaults = stats.StatisticsSettings()
    parser.add_argument("--decay", type=float, default=defaults.decay)
    parser.add_argument("--holdout-fraction", type=float, default=defaults.holdout_fraction)
    parser.add_argument("--max-entries", type=int, default=defaults.max_entries)
    parser.add_argument(
        "--max-event-bytes",
        type=int,
        default=Settings().max_event_bytes,
        help="events over this many bytes are not counted, as the routed job dead-letters "
        "them (default: KEYPLANE_MAX_EVENT_BYTES)",
    )
    parser.add_argument(
        "--master", default=None, help="default KEYPLANE_SPARK_MASTER (spark-submit: the same)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    master = args.master or Settings().spark_master
    # A batch job that ends in seconds: the web UI would only add to its start.
    spark = build_session(
        "keyplane-statistics", master, shuffle_partitions=4, extra={"spark.ui.enabled": "false"}
    )
    try:
        folder = collect(spark, args)
    finally:
        spark.stop()
    sys.stdout.write(f"statistics snapshot: {folder}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
