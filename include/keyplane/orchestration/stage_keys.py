"""Each stage's key of every event in a window of the pipeline's topics, with Spark.

The statistics job (``spark_jobs/key_statistics.py``) and the scale DAG need,
for a window of the topics a pipeline reads, how many events carried each
key of each stage and each pair of keys of consecutive stages: the key-pair
statistics of paper 000 §3.2 over a chain. A stage's key is a Spark SQL
expression over the parsed value, so the keys are evaluated by Spark: one
task per Kafka partition reads its exact offset range
(:func:`keyplane.kafka.ranges.read_range`, so a rerun reads the same
records) and hands the raw values to the JVM, which parses them with
``from_json`` against the pipeline's schema, evaluates every stage's key and
counts. Only counts come back to the driver.

The events are keyed as the job keys them
(:func:`keyplane.spark.pipeline_frames.keyed_events`), so an event the job
sends to the dead-letter topic (it does not parse against the schema, or
has a null key or value in some stage) or refuses as larger than its bound
on one event is not counted here either. Such events are counted apart
(``stage`` null), so that a window of bad records is reported, not fatal.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from keyplane.algorithms.statistics import CHAIN_ROW_COLUMNS, TopicWindow, holdout_starts
from keyplane.kafka.ranges import OffsetRange, offset_ranges, read_range

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from keyplane.pipeline import Pipeline

RAW_DDL = "topic STRING, partition INT, offset BIGINT, value BINARY, holdout BOOLEAN"
"""What the reading tasks hand to the JVM: each record's identity and value, and its side
of the hold-out line."""

_SIZE = "__keyplane_size"
_RAW_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("value", pa.binary()),
        ("holdout", pa.bool_()),
    ]
)


def _raw_values(
    ranges: Sequence[tuple[OffsetRange, int]], ids: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: read the offset ranges ``ids`` number, yield their values and
    whether each lies in the hold-out (offset at or after the range's hold-out start)."""
    for batch in ids:
        for i in batch.column("id").to_pylist():
            partition, holdout_start = ranges[i]
            for records in read_range(partition):
                yield pa.RecordBatch.from_arrays(
                    [
                        records.column("topic"),
                        records.column("partition"),
                        records.column("offset"),
                        records.column("value"),
                        pc.greater_equal(records.column("offset"), holdout_start),
                    ],
                    schema=_RAW_SCHEMA,
                )


def raw_window(
    spark: SparkSession,
    bootstrap_servers: str,
    windows: Sequence[TopicWindow],
    holdout_fraction: float,
) -> DataFrame:
    """Rows :data:`RAW_DDL` of the records of ``windows``, one task per partition range.

    ``spark.range`` with one number per task, each naming its offset range,
    spreads the read over every executor core as Spark's own Kafka source
    would, without its planning.
    """
    ranges = []
    for window in windows:
        starts = holdout_starts(window, holdout_fraction)
        ranges += [
            (partition, starts[partition.partition])
            for partition in offset_ranges(
                bootstrap_servers, window.topic, window.start, window.end
            )
        ]
    return spark.range(len(ranges), numPartitions=max(1, len(ranges))).mapInArrow(
        partial(_raw_values, ranges), RAW_DDL
    )


def key_counts(raw: DataFrame, pipeline: Pipeline, max_event_bytes: int) -> DataFrame:
    """Rows :data:`keyplane.algorithms.statistics.CHAIN_ROW_COLUMNS` of ``raw`` events.

    One row per stage, key, next stage's key (null in the last stage) and
    side of the hold-out line, with the number of events ``n``; events that
    are not counted (module docstring) make rows whose ``stage`` is null.
    """
    from pyspark.sql import functions as F

    from keyplane.spark.pipeline_frames import key_column, keyed_events

    sized = raw.withColumn(_SIZE, F.length("value"))
    events = keyed_events(sized, pipeline, keep=("holdout", _SIZE))
    good = F.col("invalid").isNull() & (F.col(_SIZE) <= max_event_bytes)
    keys = [F.col(key_column(index)) for index in range(len(pipeline.stages))]
    no_key = F.lit(None).cast("string")
    rows = F.array(
        *[
            F.struct(
                F.lit(stage.name).alias("stage"),
                keys[index].alias("a"),
                (keys[index + 1] if index + 1 < len(keys) else no_key).alias("b"),
            )
            for index, stage in enumerate(pipeline.stages)
        ]
    )
    uncounted = F.array(F.struct(no_key.alias("stage"), no_key.alias("a"), no_key.alias("b")))
    exploded = events.select(
        F.explode(F.when(good, rows).otherwise(uncounted)).alias("row"), "holdout"
    )
    counted = exploded.groupBy("row.stage", "row.a", "row.b", "holdout").agg(
        F.count(F.lit(1)).alias("n")
    )
    return counted.select(*CHAIN_ROW_COLUMNS)


def window_key_counts(
    spark: SparkSession,
    bootstrap_servers: str,
    windows: Sequence[TopicWindow],
    pipeline: Pipeline,
    holdout_fraction: float,
    max_event_bytes: int,
) -> DataFrame:
    """:func:`key_counts` of the records of ``windows`` (:func:`raw_window`)."""
    raw = raw_window(spark, bootstrap_servers, windows, holdout_fraction)
    return key_counts(raw, pipeline, max_event_bytes)
