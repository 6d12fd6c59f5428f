"""Run the reference two-stage counting job and report its progress.

The job reads the events topic through :mod:`keyplane.spark.kafka_source`,
keeps the running counts of :mod:`keyplane.spark.running_counts`, and writes
each micro-batch's updated counts

* to ``<output>/batch-<id>.parquet`` (atomic rename: a replayed batch after a
  crash rewrites the same file, so the output is idempotent), and
* optionally to a results topic.

A restarted job resumes from its checkpoint: source offsets and both stages'
state come back together, so every event is counted exactly once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from keyplane.settings import Settings
from keyplane.spark.kafka_sink import write_to_kafka
from keyplane.spark.kafka_source import read_kafka
from keyplane.spark.running_counts import latest_counts, parse_events, running_counts
from keyplane.spark.session import build_session


class CountsJobSettings(BaseModel):
    """Everything the counting job needs; validated before Spark starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str
    events_topic: str = "keyplane.events"
    results_topic: str | None = None
    checkpoint: Path
    output: Path
    master: str = "local[2]"
    shuffle_partitions: int = Field(default=4, ge=1)
    max_offsets_per_trigger: int | None = Field(default=None, ge=1)
    trigger_interval: str = "1 second"
    stop_at_offset_total: int | None = Field(
        default=None, ge=0, description="Stop once this many events have been committed."
    )
    stop_when_idle_s: float | None = Field(
        default=None, gt=0, description="Stop after this long with no new input and no lag."
    )
    source: Literal["python", "jvm"] = "python"
    pipeline: Literal["two-stage", "count-by-first-key"] = Field(
        default="two-stage",
        description="'two-stage': the reference A → B running counts; "
        "'count-by-first-key': Spark's native streaming count by field 1 (a baseline).",
    )


@dataclass(frozen=True)
class BatchProgress:
    """One micro-batch, as shown to the operator."""

    batch_id: int
    rows: int
    rows_per_s: float
    duration_ms: int
    lag: int
    committed: int


def _offset_total(offsets: Any) -> int:
    """Sum of a progress report's per-partition offsets.

    Spark reports offsets as a JSON string, and reports ``null`` for the
    latest offset of the first batch after a restart.
    """
    if isinstance(offsets, str):
        offsets = json.loads(offsets)
    if not isinstance(offsets, dict):
        return 0
    return sum(int(o) for parts in offsets.values() for o in parts.values())


def progress_of(p: dict[str, Any]) -> BatchProgress:
    source = p["sources"][0] if p.get("sources") else {}
    end = _offset_total(source.get("endOffset"))
    latest = _offset_total(source.get("latestOffset")) or end
    return BatchProgress(
        batch_id=int(p["batchId"]),
        rows=int(p.get("numInputRows", 0)),
        rows_per_s=float(p.get("processedRowsPerSecond") or 0.0),
        duration_ms=int(p.get("durationMs", {}).get("triggerExecution", 0)),
        lag=max(0, latest - end),
        committed=end,
    )


def read_output(output: Path) -> pd.DataFrame:
    """Latest count per (stage, key) over every batch file written so far."""
    files = sorted(output.glob("batch-*.parquet"))
    if not files:
        return pd.DataFrame({"stage": [], "key": [], "count": []})
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    latest: pd.DataFrame = frame.groupby(["stage", "key"], as_index=False).agg(
        count=("count", "max")
    )
    return latest


def _batch_writer(settings: CountsJobSettings) -> Callable[[DataFrame, int], None]:
    settings.output.mkdir(parents=True, exist_ok=True)

    def write(batch: DataFrame, batch_id: int) -> None:
        updates = latest_counts(batch).cache()
        pdf = updates.toPandas()
        tmp = settings.output / f".batch-{batch_id:08d}.parquet.tmp"
        pdf.to_parquet(tmp, index=False)
        tmp.rename(settings.output / f"batch-{batch_id:08d}.parquet")
        if settings.results_topic:
            write_to_kafka(updates, settings.bootstrap_servers, settings.results_topic, "key")
        updates.unpersist()

    return write


def run_counts_job(
    settings: CountsJobSettings, on_progress: Callable[[BatchProgress], None] | None = None
) -> list[BatchProgress]:
    """Run until a stop condition holds (or forever when none is set)."""
    spark = build_session(
        "keyplane-running-counts", settings.master, shuffle_partitions=settings.shuffle_partitions
    )
    raw = read_kafka(
        spark,
        settings.bootstrap_servers,
        settings.events_topic,
        max_offsets_per_trigger=settings.max_offsets_per_trigger,
        implementation=settings.source,
    )
    events = parse_events(raw)
    if settings.pipeline == "two-stage":
        updates, mode = running_counts(events), "append"
    else:
        updates = (
            events.groupBy("a")
            .count()
            .select(F.lit("A").alias("stage"), F.col("a").alias("key"), "count")
        )
        mode = "update"
    query = (
        updates.writeStream.outputMode(mode)
        .foreachBatch(_batch_writer(settings))
        .option("checkpointLocation", str(settings.checkpoint))
        .trigger(processingTime=settings.trigger_interval)
        .queryName("keyplane_running_counts")
        .start()
    )
    seen: set[int] = set()
    history: list[BatchProgress] = []
    idle_since = time.monotonic()
    try:
        while query.isActive:
            time.sleep(0.5)
            for raw_progress in query.recentProgress:
                progress = progress_of(raw_progress)
                if progress.batch_id in seen or (progress.rows == 0 and progress.lag == 0):
                    if progress.batch_id not in seen:
                        seen.add(progress.batch_id)
                    continue
                seen.add(progress.batch_id)
                history.append(progress)
                idle_since = time.monotonic()
                if on_progress is not None:
                    on_progress(progress)
            committed = history[-1].committed if history else 0
            lag = history[-1].lag if history else 0
            if (
                settings.stop_at_offset_total is not None
                and committed >= settings.stop_at_offset_total
            ):
                break
            if (
                settings.stop_when_idle_s is not None
                and lag == 0
                and time.monotonic() - idle_since > settings.stop_when_idle_s
            ):
                break
        if query.exception() is not None:
            raise RuntimeError(f"streaming query failed: {query.exception()}")
    finally:
        query.stop()
        spark.stop()
    return history


PROGRESS_PREFIX = "progress "


def _print_progress(p: BatchProgress) -> None:
    sys.stdout.write(PROGRESS_PREFIX + json.dumps(dataclasses.asdict(p)) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="running_counts", description="Run keyplane's reference two-stage counting job."
    )
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--events-topic", default="keyplane.events")
    parser.add_argument("--results-topic")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--shuffle-partitions", type=int, default=4)
    parser.add_argument("--max-offsets-per-trigger", type=int)
    parser.add_argument("--trigger-interval", default="1 second")
    parser.add_argument("--stop-at-offset-total", type=int)
    parser.add_argument("--stop-when-idle-s", type=float)
    parser.add_argument(
        "--source",
        choices=["python", "jvm"],
        default=Settings().kafka_source,
        help="Kafka source implementation (default: KEYPLANE_KAFKA_SOURCE or python)",
    )
    parser.add_argument("--pipeline", choices=["two-stage", "count-by-first-key"])
    args = parser.parse_args(argv)
    settings = CountsJobSettings(**{k: v for k, v in vars(args).items() if v is not None})
    run_counts_job(settings, on_progress=_print_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
