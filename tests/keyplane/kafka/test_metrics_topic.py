"""The metrics topic read back over an exact range, on the embedded broker."""

from __future__ import annotations

import time

import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.metrics_topic import read_metrics
from keyplane.kafka.producer import make_producer

pytestmark = pytest.mark.integration


def _record(batch_id: int) -> bytes:
    return BatchMetrics(batch_id=batch_id, rows=10 * batch_id).model_dump_json().encode()


def test_records_that_are_not_metrics_are_skipped_and_the_range_is_exact(
    broker: str, topic_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    ensure_topic(broker, topic_name, 1)
    before = time.time()
    producer = make_producer(broker)
    try:
        for value in (_record(0), b"not json", _record(1), b'{"batch_id": "x"}', _record(2)):
            producer.send(topic_name, value=value, partition=0)
        producer.flush()
    finally:
        producer.close(timeout=10)
    assert high_watermarks(broker, topic_name) == {0: 5}

    records = read_metrics(broker, topic_name, {0: 0}, {0: 5})
    assert [(r.metrics.batch_id, r.offset, r.partition) for r in records] == [
        (0, 0, 0),
        (1, 2, 0),
        (2, 4, 0),
    ]
    assert all(before - 5 <= r.published_s <= time.time() + 5 for r in records)
    assert f"metrics topic {topic_name}: skipped 2 record(s)" in caplog.text
    assert "first partition 0 offset 1: Invalid JSON" in caplog.text
    assert [r.metrics.batch_id for r in read_metrics(broker, topic_name, {0: 1}, {0: 4})] == [1]
