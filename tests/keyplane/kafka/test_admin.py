"""Offset queries on the embedded broker, whose ListOffsets does not report the end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kafka.errors import KafkaTimeoutError

from keyplane.kafka.admin import (
    HighWatermarks,
    TopicError,
    check_topic_name,
    ensure_topic,
    high_watermarks,
)
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import make_producer
from keyplane.testing import crash_broker, free_port


@pytest.mark.parametrize("name", ["bad name!", "", "a" * 250, ".", "..", "tópico", "a/b"])
def test_a_name_kafka_refuses_is_refused_before_connecting(name: str) -> None:
    with pytest.raises(TopicError, match="is not a Kafka topic name: 1 to 249 letters"):
        ensure_topic(f"127.0.0.1:{free_port()}", name, 1)


@pytest.mark.parametrize("name", ["a" * 249, "keyplane.events", "A-b_c.9", "..."])
def test_check_topic_name_accepts_every_name_kafka_accepts(name: str) -> None:
    assert check_topic_name(name) == name


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


@pytest.mark.integration
def test_one_long_lived_high_watermarks_is_never_behind_the_records_sent(
    broker: str, topic_name: str
) -> None:
    """The same rounds through one :class:`HighWatermarks`, as the job's driver keeps it:
    its consumer remembers the watermark of its last fetch, which must never be taken for
    the end once more records are in (rounds that send) nor lost when none are (rounds
    that do not). A second topic on the same instance keeps its own answers."""
    other = f"{topic_name}-other"
    ensure_topic(broker, topic_name, 2)
    ensure_topic(broker, other, 1)
    producer = make_producer(broker)
    sent = {0: 0, 1: 0}
    try:
        with HighWatermarks(broker) as marks:
            for round_ in range(10):
                for partition, n in ((0, round_ % 3 * 4), (1, 5 if round_ % 2 else 0)):
                    for i in range(n):
                        producer.send(topic_name, value=b"%d" % i, partition=partition)
                    sent[partition] += n
                producer.send(other, value=b"x", partition=0)
                producer.flush()
                assert marks.of(topic_name) == sent, f"round {round_}"
                assert marks.of(other) == {0: round_ + 1}, f"round {round_}"
                assert marks.of(topic_name, [1]) == {1: sent[1]}, f"round {round_}"
    finally:
        producer.close(timeout=10)


def _produce(broker: str, topic: str, n: int) -> None:
    producer = make_producer(broker)
    try:
        for i in range(n):
            producer.send(topic, value=b"%d" % i, partition=0)
        producer.flush()
    finally:
        producer.close(timeout=10)


@pytest.mark.integration
def test_a_query_that_fails_while_the_broker_is_down_leaves_the_next_one_exact(
    tmp_path: Path,
) -> None:
    """A broker down for longer than a request's timeout: the driver's query fails with
    Kafka's timeout error, in about that time, rather than hanging its batch boundary,
    and once the broker is back (same port, records kept) the next query on the same
    :class:`HighWatermarks` counts the records sent before the crash and after it."""
    embedded = EmbeddedBroker(tmp_path / "broker", free_port(), storage="s3")
    broker = embedded.start().bootstrap_servers
    topic = "offsets"
    try:
        ensure_topic(broker, topic, 1)
        _produce(broker, topic, 4)
        with HighWatermarks(broker) as marks:
            assert marks.of(topic) == {0: 4}
            crash_broker(embedded)
            started = time.monotonic()
            with pytest.raises(KafkaTimeoutError):
                marks.of(topic)
            assert time.monotonic() - started < 60
            embedded.start()
            _produce(broker, topic, 3)
            assert marks.of(topic) == {0: 7}
            assert marks.of(topic, [0]) == {0: 7}
    finally:
        embedded.stop()
