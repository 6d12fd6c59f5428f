"""Exact offset ranges read from the embedded broker, and a range that stops short."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import OffsetOutOfRangeError

from keyplane.kafka.admin import ensure_topic, high_watermarks, tail_offsets
from keyplane.kafka.producer import make_producer
from keyplane.kafka.ranges import (
    RECORD_SCHEMA,
    OffsetRange,
    RecordsLost,
    balanced_groups,
    offset_ranges,
    read_range,
    split_range,
)


def _produce(broker: str, topic: str, per_partition: int) -> None:
    ensure_topic(broker, topic, 2)
    producer = make_producer(broker)
    try:
        for i in range(per_partition):
            for partition in (0, 1):
                producer.send(topic, key=b"k", value=b"%d-%d" % (partition, i), partition=partition)
        producer.flush()
    finally:
        producer.close(timeout=10)


@pytest.mark.integration
def test_ranges_cover_exactly_the_bounds_in_batches_of_the_connector_schema(
    broker: str, topic_name: str
) -> None:
    _produce(broker, topic_name, 25)
    ends = high_watermarks(broker, topic_name)
    ranges = offset_ranges(broker, topic_name, {0: 5, 1: 25}, ends)
    assert ranges == [OffsetRange(broker, topic_name, 0, 5, 25)]

    batches = list(read_range(ranges[0], batch_rows=8))
    table = pa.Table.from_batches(batches)
    assert table.schema == RECORD_SCHEMA
    assert [b.num_rows for b in batches] == [8, 8, 4]
    assert table.column("offset").to_pylist() == list(range(5, 25))
    assert table.column("value").to_pylist() == [b"0-%d" % i for i in range(5, 25)]
    assert set(table.column("partition").to_pylist()) == {0}


@pytest.mark.integration
def test_a_range_takes_no_record_past_its_end_from_the_consumer(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch returns the partition well past a range's end; the records taken from it
    are decoded one by one, so a range that takes more than it keeps pays for records
    it throws away (every events task of the routed job read its partition's rest)."""
    _produce(broker, topic_name, 40)
    taken: list[int] = []
    real_poll = KafkaConsumer.poll

    def spy(self: KafkaConsumer, *args: Any, **kwargs: Any) -> Any:
        polled = real_poll(self, *args, **kwargs)
        taken.extend(record.offset for records in polled.values() for record in records)
        return polled

    monkeypatch.setattr(KafkaConsumer, "poll", spy)
    table = pa.Table.from_batches(read_range(OffsetRange(broker, topic_name, 0, 5, 15)))
    assert table.column("offset").to_pylist() == list(range(5, 15))
    assert taken == list(range(5, 15))


@pytest.mark.integration
def test_a_range_whose_last_offsets_hold_no_record_ends_at_the_next_record_simulated_gap(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offsets 12-14 hold no record (as a transaction's commit marker or compaction
    leaves them): the first record past the range ends it. Before, the read waited for
    a record below 15 that never came: on a live topic for ever, else until it timed out.
    The broker's records are real; the poll hides 12-14 as such a partition would."""
    _produce(broker, topic_name, 40)
    real_poll = KafkaConsumer.poll

    def without_12_to_14(self: KafkaConsumer, *args: Any, **kwargs: Any) -> Any:
        polled = real_poll(self, *args, **kwargs)
        return {
            tp: [record for record in records if not 12 <= record.offset <= 14]
            for tp, records in polled.items()
        }

    monkeypatch.setattr(KafkaConsumer, "poll", without_12_to_14)
    table = pa.Table.from_batches(
        read_range(OffsetRange(broker, topic_name, 0, 5, 15), idle_timeout_s=2.0)
    )
    assert table.column("offset").to_pylist() == list(range(5, 12))


@pytest.mark.integration
def test_a_range_the_broker_no_longer_keeps_raises_naming_it_simulated_retention(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker answers OFFSET_OUT_OF_RANGE (retention deleted the offsets, or the
    topic was made again). kafka-python's default reset jumped to the partition's end
    and the read went on as if nothing was lost; now it stops and says what is gone.
    The embedded broker never answers so, so the poll raises as kafka-python does."""
    _produce(broker, topic_name, 40)

    def out_of_range(self: KafkaConsumer, *args: Any, **kwargs: Any) -> Any:
        assert self.config["auto_offset_reset"] == "none"  # no silent jump
        raise OffsetOutOfRangeError({TopicPartition(topic_name, 0): 5})

    monkeypatch.setattr(KafkaConsumer, "poll", out_of_range)
    with pytest.raises(RecordsLost) as lost:
        list(read_range(OffsetRange(broker, topic_name, 0, 5, 15), idle_timeout_s=2.0))
    assert str(lost.value).startswith(
        f"{topic_name}[0]: records from offset 5 (of the range 5..14) are gone"
    )
    assert "retention deleted them, or the topic was made again" in str(lost.value)
    assert str(lost.value).endswith("or start the job on a new checkpoint")


@pytest.mark.integration
def test_a_range_past_the_partitions_end_raises_instead_of_reading_less(
    broker: str, topic_name: str
) -> None:
    _produce(broker, topic_name, 3)
    with pytest.raises(TimeoutError, match=r"no records past offset 3 \(wanted up to 10\)"):
        list(read_range(OffsetRange(broker, topic_name, 1, 0, 10), idle_timeout_s=1.0))


def test_ranges_match_partitions_given_as_numbers_and_as_strings() -> None:
    """Spark's offset JSON keys partitions by string; a caller may mix it with numbers."""
    ranges = offset_ranges("b:9092", "t", {"0": 5, 1: 7}, {0: 9, "1": 7, 2: 3})
    assert [(r.partition, r.start, r.end) for r in ranges] == [(0, 5, 9), (2, 0, 3)]


@pytest.mark.integration
def test_tail_offsets_end_at_the_high_watermark_and_never_start_below_zero(
    broker: str, topic_name: str
) -> None:
    _produce(broker, topic_name, 10)
    assert tail_offsets(broker, topic_name, 3) == ({0: 7, 1: 7}, {0: 10, 1: 10})
    assert tail_offsets(broker, topic_name, 50, [1]) == ({1: 0}, {1: 10})


@pytest.mark.parametrize(("length", "pieces"), [(20, 8), (3, 8), (8, 8), (1, 1), (17, 4)])
def test_a_range_splits_into_contiguous_non_empty_pieces_that_hold_it_exactly(
    length: int, pieces: int
) -> None:
    whole = OffsetRange("127.0.0.1:1", "migration", 0, 100, 100 + length)
    parts = split_range(whole, pieces)
    assert len(parts) == min(length, pieces)
    assert [o for p in parts for o in range(p.start, p.end)] == list(range(100, 100 + length))
    assert max(p.end - p.start for p in parts) - min(p.end - p.start for p in parts) <= 1
    assert {(p.topic, p.partition) for p in parts} == {("migration", 0)}
    with pytest.raises(ValueError, match="1 piece or more"):
        split_range(whole, 0)


@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 12))
def test_balanced_groups_deal_every_range_once_evenly_pure(sizes: list[int], groups: int) -> None:
    dealt = balanced_groups(sizes, groups)
    assert sorted(i for group in dealt for i in group) == list(range(len(sizes)))
    assert len(dealt) == min(groups, len(sizes))
    assert all(group and group == sorted(group) for group in dealt)
    loads = [sum(sizes[i] for i in group) for group in dealt]
    # Largest first, each to the lightest group: no group exceeds another by more
    # than one range.
    if loads:
        assert max(loads) - min(loads) <= max(sizes)


def test_balanced_groups_pair_a_large_range_with_small_ones_pure() -> None:
    assert balanced_groups([10, 1, 1, 1, 9, 2], 2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="1 group or more"):
        balanced_groups([1], 0)
