"""Key-pair counts of a window of the events topic, one Spark task per Kafka partition.

The statistics job needs, per key pair ``(a, b)``, how many events of the
window carried it, on each side of the hold-out line (000 §3.2's pair counts;
the hold-out feeds the backtest). Each task reads its partition's offset range
with :func:`keyplane.kafka.ranges.read_range`, as the Kafka source's tasks do,
parses the values with Arrow (:func:`keyplane.reference.events.decode_keys`) and counts
the pairs with Arrow's group-by, so only counts leave the Python worker; Spark
then sums the partitions' counts. Reading the window through the data source
and parsing in the JVM instead would move every event across the Python-JVM
boundary and pay the data source's planning workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from keyplane.algorithms.statistics import TopicWindow, holdout_starts
from keyplane.kafka.ranges import OffsetRange, offset_ranges, read_range
from keyplane.reference.events import MAX_EVENT_BYTES, decode_keys

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PAIR_COUNTS_DDL = "a STRING, b STRING, holdout BOOLEAN, n LONG"

_PAIR_COUNTS_SCHEMA = pa.schema(
    [("a", pa.string()), ("b", pa.string()), ("holdout", pa.bool_()), ("n", pa.int64())]
)


def count_pairs(
    records: pa.RecordBatch, holdout_start: int, max_event_bytes: int = MAX_EVENT_BYTES
) -> pa.Table:
    """Rows ``a, b, holdout, n`` of one batch of Kafka records (``value``, ``offset``).

    A record lies in the hold-out when its offset is ``>= holdout_start``.
    Records whose value :func:`keyplane.reference.events.parse_event` refuses are not
    counted, those over ``max_event_bytes`` among them: the routed job's
    bound, so that the statistics count exactly the events the job counts.
    """
    keys = decode_keys(records.column("value").to_pylist(), max_event_bytes)
    events = pa.table(
        {
            "a": keys.column("a"),
            "b": keys.column("b"),
            "holdout": pc.greater_equal(records.column("offset"), holdout_start),
        }
    ).filter(pc.and_(pc.is_valid(keys.column("a")), pc.is_valid(keys.column("b"))))
    counted = events.group_by(["a", "b", "holdout"]).aggregate([([], "count_all")])
    return counted.rename_columns(_PAIR_COUNTS_SCHEMA.names).cast(_PAIR_COUNTS_SCHEMA)


def _count_ranges(
    ranges: Sequence[tuple[OffsetRange, int]],
    max_event_bytes: int,
    ids: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: read the offset ranges ``ids`` number and yield their pair counts.

    Each range comes with the first offset of its hold-out.
    """
    for batch in ids:
        for i in batch.column("id").to_pylist():
            partition, holdout_start = ranges[i]
            for records in read_range(partition):
                yield from count_pairs(records, holdout_start, max_event_bytes).to_batches()


def window_pair_counts(
    spark: SparkSession,
    bootstrap_servers: str,
    window: TopicWindow,
    holdout_fraction: float,
    max_event_bytes: int = MAX_EVENT_BYTES,
) -> DataFrame:
    """Rows ``a, b, holdout, n``: the window's events per key pair and side of the hold-out.

    One task per partition with records in the window, so the read spreads
    over every executor core, as Spark's own Kafka source would spread it:
    ``spark.range`` with one number per task, each naming its offset range.
    """
    from pyspark.sql import functions as F

    starts = holdout_starts(window, holdout_fraction)
    ranges = [
        (partition, starts[partition.partition])
        for partition in offset_ranges(bootstrap_servers, window.topic, window.start, window.end)
    ]
    return (
        spark.range(len(ranges), numPartitions=max(1, len(ranges)))
        .mapInArrow(partial(_count_ranges, ranges, max_event_bytes), PAIR_COUNTS_DDL)
        .groupBy("a", "b", "holdout")
        .agg(F.sum("n").alias("n"))
    )
