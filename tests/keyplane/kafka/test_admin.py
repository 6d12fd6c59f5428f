"""Offset queries on the embedded broker, whose ListOffsets does not report the end."""

from __future__ import annotations

import pytest

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.producer import make_producer


@pytest.mark.integration
def test_high_watermarks_asked_again_and_again_are_each_partitions_end(
    broker: str, topic_name: str
) -> None:
    """As the job's driver asks at every batch boundary: each answer is every partition's
    end after the records sent before it. Records go in batches of several, so the
    broker's ListOffsets is short of the end; an empty partition's end is 0."""
    ensure_topic(broker, topic_name, 2)
    producer = make_producer(broker)
    sent = {0: 0, 1: 0}
    try:
        for round_ in range(8):
            for partition, n in ((0, round_ % 3 * 4), (1, 5 if round_ % 2 else 0)):
                for i in range(n):
                    producer.send(topic_name, value=b"%d" % i, partition=partition)
                sent[partition] += n
            producer.flush()
            assert high_watermarks(broker, topic_name) == sent, f"round {round_}"
    finally:
        producer.close(timeout=10)
    assert sent[0] > 0 and sent[1] > 0
