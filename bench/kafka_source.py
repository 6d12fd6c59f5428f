"""keyplane's Kafka source vs a plain Kafka consumer, side by side in one run.

The plain consumer (kafka-python, one process, all partitions) is the physical
limit of this machine for reading the topic from Python; the ratio says how
much of it the Structured Streaming source keeps once Spark plans, reads and
counts the same records.

    python bench/kafka_source.py [--events 500000] [--partitions 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kafka import KafkaConsumer, TopicPartition
from pyspark.sql import SparkSession

from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import PairsWorkload
from keyplane.spark.kafka_source import read_kafka
from keyplane.spark.session import build_session
from keyplane.testing import free_port


def plain_consumer(bootstrap: str, topic: str, partitions: int, total: int) -> float:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    seen = 0
    started = time.perf_counter()
    while seen < total:
        for records in consumer.poll(timeout_ms=1000, max_records=50_000).values():
            seen += len(records)
    elapsed = time.perf_counter() - started
    consumer.close()
    return elapsed


def spark_source(
    spark: SparkSession, bootstrap: str, topic: str, checkpoint: Path, max_rows: int | None
) -> tuple[float, int]:
    counted: list[int] = []
    query = (
        read_kafka(spark, bootstrap, topic, max_offsets_per_trigger=max_rows)
        .writeStream.foreachBatch(lambda df, _id: counted.append(df.count()))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="0 seconds")
        .start()
    )
    started = time.perf_counter()
    query.processAllAvailable()
    elapsed = time.perf_counter() - started
    query.stop()
    return elapsed, sum(counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=500_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--max-offsets-per-trigger", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="100k events")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    events = 100_000 if args.quick else args.events

    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp), free_port())
        bootstrap = broker.start().bootstrap_servers
        try:
            spec = PairsWorkload(n_keys=10_000, locality=0.8, n_events=events, seed=1)
            t0 = time.perf_counter()
            produce_workload(spec, bootstrap, "bench", partitions=args.partitions)
            produce_s = time.perf_counter() - t0
            warm = PairsWorkload(n_keys=100, locality=0.8, n_events=20_000, seed=2)
            produce_workload(warm, bootstrap, "warm-up", partitions=args.partitions)
            spark = build_session("bench-kafka-source", "local[2]")
            # Warm-up on its own topic: JVM, Python workers and the source's imports.
            spark_source(spark, bootstrap, "warm-up", Path(tmp) / "warm", None)
            source_s, counted = spark_source(
                spark, bootstrap, "bench", Path(tmp) / "ck", args.max_offsets_per_trigger
            )
            assert counted == events, f"source counted {counted}, expected {events}"
            consumer_s = plain_consumer(bootstrap, "bench", args.partitions, events)
            spark.stop()
        finally:
            broker.stop()

    rows = [
        ("producer (kafka-python, idempotent, acks=all)", produce_s),
        ("plain consumer (kafka-python, 1 process)", consumer_s),
        ("keyplane Kafka source (Spark local[2], count per batch)", source_s),
    ]
    lines = [
        f"events: {events:,} in {args.partitions} partitions",
        "",
        "| path | seconds | rows/s |",
        "|---|---:|---:|",
        *[f"| {name} | {s:.2f} | {events / s:,.0f} |" for name, s in rows],
        "",
        f"source / plain consumer throughput ratio: **{consumer_s / source_s:.2f}**",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
