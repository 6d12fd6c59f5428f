"""The Python Data Source Kafka reader, on the real broker and a real SparkSession."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kafka import KafkaProducer

from keyplane.kafka.admin import ensure_topic
from keyplane.spark.kafka_source import KafkaSourceOptionError, read_kafka

pytestmark = pytest.mark.integration


def _fill(broker: str, topic: str, partitions: int, n: int) -> None:
    ensure_topic(broker, topic, partitions)
    producer = KafkaProducer(bootstrap_servers=broker, linger_ms=5)
    for i in range(n):
        producer.send(
            topic,
            key=str(i).encode(),
            value=json.dumps({"i": i}).encode(),
            partition=i % partitions,
        )
    producer.flush()
    producer.close()


@pytest.mark.parametrize(
    "max_partitions", [None, 3, 1], ids=["task-per-partition", "3-tasks", "1-task"]
)
def test_reads_every_record_once_with_kafka_schema_and_batch_cap(
    spark, broker: str, topic_name: str, tmp_path: Path, max_partitions: int | None
) -> None:
    """Whether each of the 4 partitions has a task or they share fewer (maxPartitions)."""
    _fill(broker, topic_name, 4, 10_000)
    df = read_kafka(
        spark, broker, topic_name, max_offsets_per_trigger=3_000, max_partitions=max_partitions
    )
    assert [f.name for f in df.schema.fields] == [
        "key",
        "value",
        "topic",
        "partition",
        "offset",
        "timestamp",
    ]
    batch_sizes: list[int] = []
    query = (
        df.selectExpr("CAST(value AS STRING) AS v", "partition", "offset", "topic")
        .writeStream.format("memory")
        .queryName(f"src_once_{max_partitions}")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    query.processAllAvailable()
    batch_sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    query.stop()
    rows = spark.sql(f"SELECT v, partition, offset, topic FROM src_once_{max_partitions}").collect()
    values = sorted(json.loads(r.v)["i"] for r in rows)
    assert values == list(range(10_000))
    assert {r.topic for r in rows} == {topic_name}
    assert all(json.loads(r.v)["i"] % 4 == r.partition for r in rows)
    assert max(batch_sizes) <= 3_000 and sum(batch_sizes) == 10_000


def test_restart_resumes_from_checkpoint_and_latest_skips_history(
    spark, broker: str, topic_name: str, tmp_path: Path
) -> None:
    _fill(broker, topic_name, 2, 1_000)
    ck = tmp_path / "ck"

    def run(name: str, starting: str = "earliest") -> list[int]:
        """Run to the end of the topic; return the values this run processed."""
        seen: list[int] = []

        def collect(batch, _batch_id: int) -> None:
            seen.extend(json.loads(r.v)["i"] for r in batch.collect())

        q = (
            read_kafka(spark, broker, topic_name, starting_offsets=starting)
            .selectExpr("CAST(value AS STRING) AS v")
            .writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(ck if starting == "earliest" else tmp_path / name))
            .start()
        )
        q.processAllAvailable()
        q.stop()
        return sorted(seen)

    assert run("first") == list(range(1_000))
    producer = KafkaProducer(bootstrap_servers=broker)
    for i in range(1_000, 1_500):
        producer.send(topic_name, value=json.dumps({"i": i}).encode(), partition=i % 2)
    producer.flush()
    # Same checkpoint: only the new records.
    assert run("second") == list(range(1_000, 1_500))
    # Fresh checkpoint from "latest": nothing of the history.
    assert run("latest_only", "latest") == []


def test_missing_option_is_a_clear_error(spark) -> None:
    with pytest.raises(KafkaSourceOptionError, match="implementation"):
        read_kafka(spark, "x:1", "t", implementation="rust")


def test_batch_read_takes_exactly_the_offset_range_and_defaults_the_rest(
    spark, broker: str, topic_name: str
) -> None:
    """``spark.read`` over ``[startingOffsets, endingOffsets)``: a partition missing
    from a JSON bound takes the default (earliest start, latest end)."""
    from keyplane.spark.kafka_source import SOURCE_NAME, KafkaDataSource

    _fill(broker, topic_name, 2, 100)  # i lands on partition i % 2, at offset i // 2
    spark.dataSource.register(KafkaDataSource)
    rows = (
        spark.read.format(SOURCE_NAME)
        .option("kafka.bootstrap.servers", broker)
        .option("subscribe", topic_name)
        .option("startingOffsets", json.dumps({topic_name: {"0": 10}}))
        .option("endingOffsets", json.dumps({topic_name: {"1": 5}}))
        .load()
        .selectExpr("CAST(value AS STRING) AS v", "partition", "offset")
        .collect()
    )
    read = sorted((r.partition, r.offset, json.loads(r.v)["i"]) for r in rows)
    assert read == [(0, o, 2 * o) for o in range(10, 50)] + [(1, o, 2 * o + 1) for o in range(5)]
    with pytest.raises(Exception, match="endingOffsets must be 'latest' or JSON"):
        spark.read.format(SOURCE_NAME).option("kafka.bootstrap.servers", broker).option(
            "subscribe", topic_name
        ).option("endingOffsets", "earliest").load().collect()
