"""Exact offset ranges of a topic, read as Arrow batches.

Every reader of a bounded stretch of a topic in keyplane goes through
:func:`read_range`: the Spark source's tasks, the statistics job, the scale
DAG's key loads and every reader of the metrics topic
(:mod:`keyplane.kafka.metrics_topic`). So all of them stop at the same
offset, and all of them fail the same way on a partition that stops short,
instead of each deciding on its own when it has read "enough". The bounds
come from :func:`keyplane.kafka.admin.high_watermarks`, since the embedded
broker under-reports a partition's end to ListOffsets.

The module needs kafka-python and pyarrow only, not Spark: the command line
and the dashboard read through it too.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keyplane.kafka.consumers import lent_consumer

RECORD_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
    ]
)
"""The columns of a read, those of Spark's own Kafka connector."""

IDLE_TIMEOUT_S = 60.0
"""How long a read waits for the next record of a range before it gives up."""


class RecordsLost(RuntimeError):
    """A range's records are no longer on the broker: retention deleted them, or the topic
    was deleted and made again, before they were read."""


@dataclass(frozen=True)
class OffsetRange:
    """Records ``start <= offset < end`` of one topic partition."""

    bootstrap_servers: str
    topic: str
    partition: int
    start: int
    end: int


def offset_ranges(
    bootstrap_servers: str,
    topic: str,
    start: Mapping[Any, int],
    end: Mapping[Any, int],
) -> list[OffsetRange]:
    """The non-empty ranges ``[start, end)`` of ``topic``'s partitions, by partition number.

    ``start`` and ``end`` map a partition (its number, or the number as a
    string, as in Spark's offset JSON; the two may differ) to an offset; a
    partition missing from ``start`` starts at 0.
    """
    first_of = {int(part): int(offset) for part, offset in start.items()}
    ranges = []
    for part, last in sorted((int(p), int(o)) for p, o in end.items()):
        first = first_of.get(part, 0)
        if last > first:
            ranges.append(OffsetRange(bootstrap_servers, topic, part, first, last))
    return ranges


def balanced_groups(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """The indices of ``sizes`` dealt into at most ``groups`` non-empty groups of near-equal
    total size (largest first, each to the lightest group so far); each group lists its
    indices in order.

    This reads several ranges in one Spark task: a task of a Python source
    has a fixed cost whatever it reads (launch, worker hand-off, shuffle
    files), so a micro-batch of many small ranges on few cores would spend
    most of its read starting tasks.
    """
    if groups < 1:
        raise ValueError(f"ranges are dealt into 1 group or more, not {groups}")
    dealt: list[list[int]] = [[] for _ in range(min(groups, len(sizes)))]
    loads = [0] * len(dealt)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(len(dealt)), key=lambda g: (loads[g], len(dealt[g]), g))
        dealt[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(group) for group in dealt]


def split_range(r: OffsetRange, pieces: int) -> list[OffsetRange]:
    """``r`` cut into at most ``pieces`` contiguous, non-empty ranges of near-equal length,
    in offset order; together they hold exactly ``r``'s offsets."""
    if pieces < 1:
        raise ValueError(f"a range is cut into 1 piece or more, not {pieces}")
    length = r.end - r.start
    count = max(1, min(pieces, length))
    bounds = [r.start + length * i // count for i in range(count + 1)]
    return [
        dataclasses.replace(r, start=low, end=high)
        for low, high in itertools.pairwise(bounds)
        if high > low
    ]


def read_range(
    r: OffsetRange, batch_rows: int = 20_000, *, idle_timeout_s: float = IDLE_TIMEOUT_S
) -> Iterator[pa.RecordBatch]:
    """Read exactly the records of ``r`` as Arrow batches of :data:`RECORD_SCHEMA`.

    Raises TimeoutError when no record arrives for ``idle_timeout_s``
    before the range's end: a partition that stops short (truncated, or a
    broker that lost records) is an error, never a silently shorter read.
    Raises :class:`RecordsLost` when the broker answers that the range's
    offsets are out of its bounds. kafka-python's default answer to that is
    to jump to the partition's end, which read an empty range as done and,
    on a live topic, spun past it for ever; Spark's own Kafka source fails
    the query too (``failOnDataLoss``). The consumer is the process's
    (:mod:`keyplane.kafka.consumers`), so a worker that reads many ranges
    connects once.
    """
    from kafka import TopicPartition
    from kafka.errors import OffsetOutOfRangeError

    tp = TopicPartition(r.topic, r.partition)
    poll_ms = max(50, min(1000, int(idle_timeout_s * 1000)))
    with lent_consumer(
        r.bootstrap_servers,
        r.topic,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
        auto_offset_reset="none",
    ) as consumer:
        consumer.assign([tp])
        consumer.seek(tp, r.start)
        cols: dict[str, list[Any]] = {name: [] for name in RECORD_SCHEMA.names}
        position = r.start
        idle_ms = 0
        while position < r.end:
            # The fetcher decodes records lazily, as poll takes them: asking for no
            # more than the range still holds decodes nothing past its end (a
            # fetch returns up to max_partition_fetch_bytes of the partition).
            wanted = min(batch_rows - len(cols["offset"]), r.end - position)
            try:
                records = consumer.poll(timeout_ms=poll_ms, max_records=wanted).get(tp, [])
            except OffsetOutOfRangeError:
                raise RecordsLost(_lost(r, position, consumer, tp)) from None
            if not records:
                idle_ms += poll_ms
                if idle_ms >= idle_timeout_s * 1000:
                    raise TimeoutError(
                        f"{r.topic}[{r.partition}]: no records past offset {position} "
                        f"(wanted up to {r.end}) after {idle_timeout_s:g} s"
                    )
                continue
            idle_ms = 0
            for record in records:
                if record.offset >= r.end:
                    # A partition's records come in offset order, so no record is
                    # left in the range: its last offsets hold none (a transaction's
                    # commit marker, a compacted-away record).
                    position = r.end
                    break
                cols["key"].append(record.key)
                cols["value"].append(record.value)
                cols["offset"].append(record.offset)
                cols["timestamp"].append(record.timestamp)
                position = record.offset + 1
            if len(cols["offset"]) >= batch_rows or position >= r.end:
                yield _to_batch(cols, r)
                cols = {name: [] for name in RECORD_SCHEMA.names}


def _lost(r: OffsetRange, position: int, consumer: Any, tp: Any) -> str:
    """What a read out of the broker's bounds lost, in one line that says what to do."""
    try:
        first = consumer.beginning_offsets([tp])[tp]
        end = consumer.end_offsets([tp])[tp]
        kept = f"; the broker keeps offsets {first}..{end - 1} only" if end > first else ""
    except Exception:  # the broker's bounds only enrich the message
        kept = ""
    return (
        f"{r.topic}[{r.partition}]: records from offset {position} (of the range "
        f"{r.start}..{r.end - 1}) are gone{kept}: retention deleted them, or the topic was "
        "made again, before they were read. Counts from here would be short, so the read "
        "stops; keep the records longer (retention.ms) or start the job on a new checkpoint"
    )


def _to_batch(cols: dict[str, list[Any]], r: OffsetRange) -> pa.RecordBatch:
    n = len(cols["offset"])
    return pa.RecordBatch.from_arrays(
        [
            pa.array(cols["key"], pa.binary()),
            pa.array(cols["value"], pa.binary()),
            pa.array([r.topic] * n, pa.string()),
            pa.array([r.partition] * n, pa.int32()),
            pa.array(cols["offset"], pa.int64()),
            pa.array([ms * 1000 for ms in cols["timestamp"]], pa.int64()).cast(
                pa.timestamp("us", tz="UTC")
            ),
        ],
        schema=RECORD_SCHEMA,
    )
