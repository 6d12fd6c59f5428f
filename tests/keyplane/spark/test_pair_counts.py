"""Key-pair counts of an events window: Arrow counting (pure), Spark tasks on the real broker."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from keyplane.algorithms.statistics import TopicWindow
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer
from keyplane.spark.pair_counts import count_pairs, window_pair_counts


def event(a: str, b: str) -> bytes:
    return f'{{"seq":0,"a":"{a}","b":"{b}","ts":0}}'.encode()


def test_count_pairs_splits_each_pair_at_the_holdout_offset_and_skips_non_events() -> None:
    values = [event("1", "2"), event("1", "2"), b"junk", event("1", "2"), event("3", "2")]
    records = pa.RecordBatch.from_pydict(
        {"value": pa.array(values, pa.binary()), "offset": pa.array([10, 11, 12, 13, 14])}
    )
    counted = count_pairs(records, holdout_start=13).to_pylist()
    assert sorted((r["a"], r["b"], r["holdout"], r["n"]) for r in counted) == [
        ("1", "2", False, 2),
        ("1", "2", True, 1),
        ("3", "2", True, 1),
    ]


def test_count_pairs_skips_the_events_the_job_would_dead_letter_as_oversized() -> None:
    """The statistics count an event exactly when the routed job, under the same
    bound, would: one over it is not counted, however valid."""
    padded = f'{{"seq":0,"a":"5","b":"6","ts":0,"pad":"{"p" * 200}"}}'.encode()
    records = pa.RecordBatch.from_pydict(
        {"value": pa.array([event("1", "2"), padded], pa.binary()), "offset": pa.array([0, 1])}
    )

    def pairs(**bound: int) -> list[tuple[str, str]]:
        return sorted((r["a"], r["b"]) for r in count_pairs(records, 5, **bound).to_pylist())

    assert pairs() == [("1", "2"), ("5", "6")]
    assert pairs(max_event_bytes=len(padded)) == [("1", "2"), ("5", "6")]
    assert pairs(max_event_bytes=len(padded) - 1) == [("1", "2")]


@pytest.mark.integration
def test_window_pair_counts_reads_exactly_the_window_of_every_partition(
    broker: str, spark: SparkSession, topic_name: str
) -> None:
    ensure_topic(broker, topic_name, 3)
    # Partition p holds events a = p, b = offset % 4; partition 2 stays empty.
    sizes = {0: 50, 1: 30}
    producer = make_producer(broker)
    try:
        for partition, size in sizes.items():
            for offset in range(size):
                producer.send(
                    topic_name, value=event(str(partition), str(offset % 4)), partition=partition
                )
        producer.flush()
    finally:
        producer.close(timeout=10)
    window = TopicWindow(topic=topic_name, start={0: 10, 1: 0, 2: 0}, end={0: 50, 1: 20, 2: 0})

    rows = window_pair_counts(spark, broker, window, holdout_fraction=0.25).collect()

    # Hold-out: the newest quarter of each partition's window: offsets >= 40 and >= 15.
    truth: Counter[tuple[str, str, bool]] = Counter()
    for partition, first_holdout in ((0, 40), (1, 15)):
        for offset in range(window.start[partition], window.end[partition]):
            truth[str(partition), str(offset % 4), offset >= first_holdout] += 1
    assert {(r.a, r.b, r.holdout): r.n for r in rows} == dict(truth)


@pytest.mark.integration
def test_an_empty_window_has_no_pair_counts(
    broker: str, spark: SparkSession, topic_name: str
) -> None:
    ensure_topic(broker, topic_name, 2)
    window = TopicWindow(topic=topic_name, start={0: 0, 1: 0}, end={0: 0, 1: 0})
    assert window_pair_counts(spark, broker, window, holdout_fraction=0.2).collect() == []
