"""No event is dropped as late, however far behind the others its time is.

The integration tests run the counting jobs on the real broker and the real
SparkSession: an event whose time is an hour behind the newest one of two
earlier batches (a producer whose clock is behind, a backfill) is counted
exactly, in the routed job on both stage engines and in the plain two-stage
job, on a new checkpoint (no time mode) and on one in event time, as earlier
versions wrote them. The pure tests pin where an event-time checkpoint's
watermark starts (:mod:`keyplane.spark.watermark`).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer
from keyplane.reference.verification import compare_counts, counts_from_mapping
from keyplane.spark.counts_job import read_output, start_counts_query, stop_between_batches
from keyplane.spark.watermark import (
    BASE_MS,
    StageTimeMode,
    checkpoint_time_mode,
    checkpoint_watermark_ms,
    watermark_ms,
)
from keyplane.testing import routed_job_settings, wait_for_records

NEWEST = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
CHUNK = 40


def _send(broker: str, topic: str, first_seq: int, when: datetime) -> list[tuple[str, str]]:
    """``CHUNK`` events at ``when`` over the topic's two partitions; their (a, b) pairs."""
    ts = (when - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    producer = make_producer(broker)
    pairs = []
    for seq in range(first_seq, first_seq + CHUNK):
        a, b = f"a{seq % 7}", f"b{seq % 5}"
        event = {"seq": seq, "a": a, "b": b, "ts": ts}
        producer.send(topic, value=json.dumps(event).encode(), partition=seq % 2)
        pairs.append((a, b))
    producer.flush()
    producer.close()
    return pairs


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["None", "EventTime"])
@pytest.mark.parametrize("job", ["jvm", "python", "plain"])
def test_an_event_an_hour_behind_earlier_batches_is_counted(
    spark, broker: str, topic_name: str, tmp_path: Path, job: str, mode: StageTimeMode
) -> None:
    """Batches 1 and 2 hold events at ``NEWEST``; a later one, events an hour older.

    Spark drops an event-time stage's input rows at or below the previous
    batch's watermark; on the events' own times (``NEWEST`` minus the delay),
    the third chunk was dropped whole, although the batch read it.
    """
    routed = {"stage_engine": job} if job != "plain" else {"routing_store": None}
    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=4, batch=10_000, trigger="0 seconds",
        new_checkpoint_time_mode=mode, **routed,
    )  # fmt: skip
    ensure_topic(broker, topic_name, 2)
    sent = _send(broker, topic_name, 0, NEWEST)
    query = start_counts_query(spark, settings)
    try:
        wait_for_records(query, CHUNK)
        sent += _send(broker, topic_name, CHUNK, NEWEST)
        wait_for_records(query, 2 * CHUNK)
        sent += _send(broker, topic_name, 2 * CHUNK, NEWEST - timedelta(hours=1))
        wait_for_records(query, 3 * CHUNK)
        reports = list(query.recentProgress)
    finally:
        stop_between_batches(query)

    assert len({report["batchId"] for report in reports}) >= 3
    assert checkpoint_time_mode(settings.checkpoint) == mode
    dropped = [
        operator.get("numRowsDroppedByWatermark", 0)
        for report in reports
        for operator in report["stateOperators"]
    ]
    assert sum(dropped) == 0
    truth = Counter({("A", a): 0 for a, _ in sent} | {("B", b): 0 for _, b in sent})
    for a, b in sent:
        truth["A", a] += 1
        truth["B", b] += 1
    report = compare_counts(counts_from_mapping(truth), read_output(settings.output))
    assert report.expected_events == 3 * CHUNK
    assert report.exact, report


def _offset_log_entry(checkpoint: Path, batch: int, watermark: int) -> None:
    """An entry of Spark's offset log, as Spark 4 writes it."""
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True, exist_ok=True)
    metadata = {"batchWatermarkMs": watermark, "batchTimestampMs": 1, "conf": {}}
    (offsets / str(batch)).write_text(f"v1\n{json.dumps(metadata)}\n{{}}")


def test_the_stages_watermark_time_is_fixed_and_above_any_watermark_a_checkpoint_holds_pure(
    tmp_path: Path,
) -> None:
    """A new checkpoint, and one whose watermark already follows the column, take the
    same time on every run; one whose watermark followed the events' times (here a
    future-dated event's) starts just above it, or its events would all be late."""
    checkpoint = tmp_path / "checkpoint"
    assert watermark_ms(None) == watermark_ms(checkpoint) == BASE_MS
    _offset_log_entry(checkpoint, 0, 0)
    _offset_log_entry(checkpoint, 1, BASE_MS - 60_000)
    assert checkpoint_watermark_ms(checkpoint) == BASE_MS - 60_000
    assert watermark_ms(checkpoint) == BASE_MS

    future = (datetime(2030, 1, 1, tzinfo=UTC) - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(
        milliseconds=1
    )
    _offset_log_entry(checkpoint, 10, future)  # the newest entry, though "10" < "2" as text
    _offset_log_entry(checkpoint, 2, BASE_MS)
    (checkpoint / "offsets" / ".11.tmp").write_text("partial")
    assert watermark_ms(checkpoint) == future + 1

    (checkpoint / "offsets" / "12").write_text("v1\n{}\n{}")
    with pytest.raises(ValueError, match="batchWatermarkMs"):
        watermark_ms(checkpoint)
