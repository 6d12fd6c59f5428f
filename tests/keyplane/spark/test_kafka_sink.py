"""The foreachBatch Kafka sink writes every row once, keyed, as JSON."""

from __future__ import annotations

import json

import pytest
from kafka import KafkaConsumer, TopicPartition

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.spark.kafka_sink import write_to_kafka

pytestmark = pytest.mark.integration


def test_rows_arrive_keyed_and_complete(spark, broker: str, topic_name: str) -> None:
    ensure_topic(broker, topic_name, 2)
    df = spark.createDataFrame(
        [("A", f"k{i}", i) for i in range(500)], "stage STRING, key STRING, count LONG"
    ).repartition(3)
    write_to_kafka(df, broker, topic_name, "key")
    marks = high_watermarks(broker, topic_name)
    assert sum(marks.values()) == 500
    consumer = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
    tps = [TopicPartition(topic_name, p) for p in marks]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    got: dict[str, int] = {}
    while len(got) < 500:
        for records in consumer.poll(timeout_ms=2000).values():
            for r in records:
                value = json.loads(r.value)
                assert r.key.decode() == value["key"]
                got[value["key"]] = value["count"]
    consumer.close()
    assert got == {f"k{i}": i for i in range(500)}
