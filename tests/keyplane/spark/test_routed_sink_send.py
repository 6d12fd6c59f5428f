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
from typing import Any

import pytest
from pyspark.sql import Row

import keyplane.kafka.producer
from keyplane.kafka.producer import SAFE_DELIVERY, DeliveryError, LongLivedProducer
from keyplane.spark import routed_sink
from keyplane.spark.kafka_sink import _send_partition

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


def test_kafka_sink_partition_with_fake_producer_sends_every_row(fake_producers: Any) -> None:
    made = fake_producers(keyplane.kafka.producer, None)
    rows = [Row(stage="A", key=f"k{i}", count=i) for i in range(3)]
    _send_partition(iter(rows), "broker:9092", "job.results", "key", SAFE_DELIVERY)
    [producer] = made
    assert [json.loads(value)["key"] for _, value in producer.sent] == ["k0", "k1", "k2"]
    assert producer.closed


def test_kafka_sink_partition_with_fake_producer_raises_when_a_delivery_fails(
    fake_producers: Any,
) -> None:
    made = fake_producers(keyplane.kafka.producer, 1)
    rows = [Row(stage="A", key=f"k{i}", count=i) for i in range(3)]
    with pytest.raises(DeliveryError, match=r"2 of 3 records to topic 'job.results'"):
        _send_partition(iter(rows), "broker:9092", "job.results", "key", SAFE_DELIVERY)
    [producer] = made
    assert producer.closed
