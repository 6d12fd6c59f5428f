"""The plain two-stage job's parsing: event times exact to the millisecond (real SparkSession)."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import functions as F

from keyplane.spark.running_counts import parse_events


@pytest.mark.integration
def test_parsed_event_times_are_exact_to_the_millisecond(spark) -> None:
    """The last millisecond of the year 9999 and one before 1970 come out exact; as a
    double of seconds, Spark's cast put 9999-12-31T23:59:59.999 at …59.999008."""
    times = [253402300799999, -1, 1_767_225_600_123]
    values = [
        (json.dumps({"seq": i, "a": "x", "b": "y", "ts": ts}).encode(),)
        for i, ts in enumerate(times)
    ]
    raw = spark.createDataFrame(values, "value BINARY")

    events = parse_events(raw)
    got = events.orderBy("seq").select(F.unix_micros("ts").alias("us")).collect()

    assert [row.us for row in got] == [ts * 1000 for ts in times]
    assert "watermark_ts" not in events.columns
