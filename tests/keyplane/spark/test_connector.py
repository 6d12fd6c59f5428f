"""Spark's own Kafka connector, as installed, reads a real Apache Kafka topic with the
installed Spark: in a batch query and in a streaming one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyspark
import pytest

from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer, send_confirmed
from keyplane.spark.connector import (
    CONNECTOR_HOME_ENV,
    ConnectorUnavailable,
    connector_jars,
)

N = 3_000

# Its own process: a session's classpath is fixed when its JVM starts, and the
# tests' shared session was started without the connector.
_READ = """
import json, sys
from keyplane.spark.connector import connector_jars_setting
from keyplane.spark.session import build_session

bootstrap, topic, checkpoint = sys.argv[1:4]
spark = build_session("connector-test", "local[2]", extra={"spark.jars": connector_jars_setting()})
options = {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, "startingOffsets": "earliest"}
rows = (
    spark.read.format("kafka").options(**options).load()
    .selectExpr("CAST(value AS STRING) AS value", "partition").collect()
)
query = (
    spark.readStream.format("kafka").options(**options).option("maxOffsetsPerTrigger", 1000)
    .load().groupBy().count()
    .writeStream.outputMode("complete").format("memory").queryName("counted")
    .option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
)
query.awaitTermination()
print(json.dumps({
    "spark": spark.version,
    "values": sorted(row.value for row in rows),
    "partitions": sorted({row.partition for row in rows}),
    "streamed": spark.sql("SELECT * FROM counted").collect()[0][0],
    "batches": len(query.recentProgress),
}))
spark.stop()
"""


def test_missing_connector_is_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONNECTOR_HOME_ENV, str(tmp_path))
    with pytest.raises(ConnectorUnavailable, match=r"^Spark's Kafka connector is not installed"):
        connector_jars()


@pytest.mark.integration
@pytest.mark.apache_kafka
def test_the_installed_spark_reads_an_apache_kafka_topic_through_the_connector(
    apache_kafka_broker: str, topic_name: str, tmp_path: Path
) -> None:
    assert ensure_topic(apache_kafka_broker, topic_name, 3) == 3
    producer = make_producer(apache_kafka_broker)
    try:
        records = [(b"key-%d" % i, b"event-%05d" % i) for i in range(N)]
        assert send_confirmed(producer, topic_name, records) == N
    finally:
        producer.close()
    done = subprocess.run(
        [sys.executable, "-c", _READ, apache_kafka_broker, topic_name, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["spark"] == pyspark.__version__
    assert result["values"] == [f"event-{i:05d}" for i in range(N)]
    assert result["partitions"] == [0, 1, 2]
    assert result["streamed"] == N
    assert result["batches"] >= N // 1000
