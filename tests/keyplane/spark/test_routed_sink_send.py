"""The sinks check every record's delivery (fake producers: pure logic, no broker).

A record the producer gives up on (the broker down longer than its delivery
timeout) fails only its future; ``flush`` returns normally. A sink that did
not check the futures let the micro-batch commit with those records lost.
Now the batch fails with :class:`DeliveryError`, and Spark replays it. The
routed sink sends every batch through one kept producer; a send that fails
goes out once more through a new producer before the batch fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from pyspark.sql import Row

import keyplane.kafka.producer
from keyplane.algorithms.batchmetrics import BatchMetrics, traffic_metrics
from keyplane.kafka.migration_topic import moves_of
from keyplane.kafka.producer import SAFE_DELIVERY, DeliveryError, LongLivedProducer
from keyplane.spark import routed_sink
from keyplane.spark.kafka_sink import _send_partition
from keyplane.spark.routed_counts import OUTPUT_FIELDS
from keyplane.spark.routed_sink import unpacked_partials
from keyplane.util.parquet_files import read_frame

RECORDS = [("k1", {"n": 1}), ("k2", {"n": 2}), ("k3", {"n": 3})]


def test_sends_with_fake_producers_share_one_producer_and_return_their_counts(
    fake_producers: Any,
) -> None:
    made = fake_producers(keyplane.kafka.producer, None)
    sends = LongLivedProducer("broker:9092")
    assert sends.send("job.results", routed_sink._json(iter(RECORDS))) == 3
    assert sends.send("job.migration", routed_sink._json(iter(RECORDS[:1]))) == 1
    [producer] = made
    assert [(topic, json.loads(value)) for topic, value in producer.sent] == [
        *(("job.results", v) for _, v in RECORDS),
        ("job.migration", RECORDS[0][1]),
    ]
    assert not producer.closed
    sends.close()
    assert producer.closed


def test_a_failed_send_with_fake_producers_goes_out_again_through_a_new_producer(
    fake_producers: Any,
) -> None:
    made = fake_producers(keyplane.kafka.producer, 2, None)
    sends = LongLivedProducer("broker:9092")
    assert sends.send("job.migration", routed_sink._json(iter(RECORDS))) == 3
    broken, replacement = made
    assert broken.closed and len(broken.sent) == 2
    assert [json.loads(value) for _, value in replacement.sent] == [v for _, v in RECORDS]
    assert not replacement.closed
    assert sends.send("job.migration", routed_sink._json(iter(RECORDS[:1]))) == 1
    assert len(made) == 2, "the replacement is kept for the next send"


def test_a_send_that_two_fake_producers_cannot_deliver_raises_and_closes_both(
    fake_producers: Any,
) -> None:
    made = fake_producers(keyplane.kafka.producer, 2, 0)
    sends = LongLivedProducer("broker:9092")
    with pytest.raises(DeliveryError, match=r"3 of 3 records to topic 'job.migration'") as raised:
        sends.send("job.migration", routed_sink._json(iter(RECORDS)))
    assert "unknown producer id" in str(raised.value)
    assert isinstance(raised.value, RuntimeError)
    assert len(made) == 2 and all(producer.closed for producer in made)


def test_kafka_sink_partitions_with_fake_producer_send_every_row_through_one_kept_producer(
    fake_producers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's tasks share its producer: the next partition pays no connection."""
    monkeypatch.setattr(keyplane.kafka.producer, "_EXECUTOR_PRODUCERS", {})
    made = fake_producers(keyplane.kafka.producer, None)
    rows = [Row(stage="A", key=f"k{i}", count=i) for i in range(3)]
    _send_partition(iter(rows[:2]), "broker:9092", "job.results", "key", SAFE_DELIVERY)
    _send_partition(iter(rows[2:]), "broker:9092", "job.results", "key", SAFE_DELIVERY)
    [producer] = made
    assert [json.loads(value)["key"] for _, value in producer.sent] == ["k0", "k1", "k2"]
    assert not producer.closed


def test_kafka_sink_partition_with_fake_producers_raises_when_a_delivery_fails_twice(
    fake_producers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed send goes out once more through a new producer, then fails the task."""
    monkeypatch.setattr(keyplane.kafka.producer, "_EXECUTOR_PRODUCERS", {})
    made = fake_producers(keyplane.kafka.producer, 1, 1)
    rows = [Row(stage="A", key=f"k{i}", count=i) for i in range(3)]
    with pytest.raises(DeliveryError, match=r"2 of 3 records to topic 'job.results'"):
        _send_partition(iter(rows), "broker:9092", "job.results", "key", SAFE_DELIVERY)
    assert len(made) == 2 and all(producer.closed for producer in made)


def _task_output() -> pd.DataFrame:
    """One task's output rows: two partials of a key (the later wins), a tombstone, a moved
    state, a malformed event and a hop."""
    rows: list[dict[str, Any]] = [
        {"kind": "count", "stage": "A", "key": "a1", "routed_key": "a1", "instance": 0,
         "count": 2, "state": "2"},
        {"kind": "count", "stage": "A", "key": "a1", "routed_key": "a1", "instance": 0,
         "count": 3, "state": "3"},
        {"kind": "count", "stage": "B", "key": "b1", "routed_key": "b1", "instance": None,
         "count": 0, "state": "0"},
        {"kind": "moved", "stage": "B", "key": "b1", "routed_key": "b1", "target": "b1#1",
         "count": 4, "state": "4", "marker": 7},
        {"kind": "invalid", "detail": json.dumps({"reason": "not JSON", "value": "{"})},
        {"kind": "hop", "upstream": 0, "upstream_executor": "e1", "instance": 1,
         "executor": "e1", "n": 3},
    ]  # fmt: skip
    return pd.DataFrame([{**dict.fromkeys(OUTPUT_FIELDS), **row} for row in rows])


def _part_writer(parts: Path, *, with_partials: bool) -> routed_sink.BatchPartWriter:
    return routed_sink.BatchPartWriter(
        batch_id=5,
        parts=parts,
        bootstrap_servers="broker:9092",
        migration_topic="job.migration",
        dead_letter_topic="job.dead",
        results_topic="job.results",
        delivery=SAFE_DELIVERY,
        parallelism={"A": 2, "B": 2},
        with_partials=with_partials,
    )


def test_a_task_with_a_fake_producer_writes_its_part_sends_its_records_and_reports_a_summary(
    fake_producers: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Outside Spark (no task context) the task is partition 0. Its part holds the latest
    partial per routed key; the moved state, dead letter and results reach their topics;
    the driver gets one metrics row, and the partials too only when a pipeline sink needs
    them."""
    monkeypatch.setattr(keyplane.kafka.producer, "_EXECUTOR_PRODUCERS", {})
    made = fake_producers(keyplane.kafka.producer, None)
    output = _task_output()

    [report] = list(_part_writer(tmp_path, with_partials=False)(iter([output[:3], output[3:]])))

    part = read_frame(tmp_path / "part-00000.parquet")
    assert list(zip(part["key"], part["count"], strict=True)) == [("a1", 3), ("b1", 0)]
    [producer] = made
    topics = [topic for topic, _ in producer.sent]
    assert topics == ["job.migration", "job.dead", "job.results", "job.results"]
    assert [move["target"] for move in moves_of(producer.sent[0][1])] == ["b1#1"]
    assert list(report["kind"]) == ["metrics"]
    assert report["count"].tolist() == [len(output)], "the output rows the task wrote"
    metrics = BatchMetrics.model_validate_json(report["detail"][0])
    expected = traffic_metrics(5, unpacked_partials(output), {"A": 2, "B": 2})
    assert metrics == expected and (metrics.moved_states, metrics.invalid_events) == (1, 1)

    [with_partials] = list(_part_writer(tmp_path, with_partials=True)(iter([output])))
    assert list(with_partials["kind"]) == ["metrics", "count", "count"]
    assert with_partials["instance"].tolist()[1:] == [0, None]
    assert len(made) == 1, "the worker's producer is kept for its next task"


def test_a_task_whose_records_fake_producers_cannot_deliver_fails_and_leaves_no_part(
    fake_producers: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The batch must not commit without the task's records: the task raises, and its part
    is not renamed into the batch, so the retried task or the replayed batch writes it."""
    monkeypatch.setattr(keyplane.kafka.producer, "_EXECUTOR_PRODUCERS", {})
    fake_producers(keyplane.kafka.producer, 0, 0)
    with pytest.raises(DeliveryError, match=r"topic .job\.migration."):
        list(_part_writer(tmp_path, with_partials=False)(iter([_task_output()])))
    assert not list(tmp_path.glob("part-*.parquet"))
