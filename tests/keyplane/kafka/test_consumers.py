"""The process's lent consumers, on the embedded broker: reused, exact, bounded, per process."""

from __future__ import annotations

import multiprocessing
from contextlib import ExitStack
from typing import Any

import pytest
from kafka import KafkaConsumer

from keyplane.kafka import consumers
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer
from keyplane.kafka.ranges import OffsetRange, read_range


def _produce(broker: str, topic: str, count: int) -> None:
    ensure_topic(broker, topic, 1)
    producer = make_producer(broker)
    try:
        for i in range(count):
            producer.send(topic, value=b"%s-%d" % (topic.encode(), i), partition=0)
        producer.flush()
    finally:
        producer.close(timeout=10)


def _values(broker: str, topic: str, start: int, end: int) -> list[bytes]:
    batches = read_range(OffsetRange(broker, topic, 0, start, end))
    return [value for batch in batches for value in batch.column("value").to_pylist()]


@pytest.mark.integration
def test_reads_of_a_topic_share_one_consumer_and_each_gets_exactly_its_range(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[KafkaConsumer] = []

    def counted(*args: Any, **kwargs: Any) -> KafkaConsumer:
        made.append(KafkaConsumer(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(consumers, "KafkaConsumer", counted)
    _produce(broker, topic_name, 30)
    name = topic_name.encode()

    assert _values(broker, topic_name, 0, 20) == [b"%s-%d" % (name, i) for i in range(20)]
    assert _values(broker, topic_name, 5, 8) == [b"%s-%d" % (name, i) for i in (5, 6, 7)]
    assert _values(broker, topic_name, 25, 30) == [b"%s-%d" % (name, i) for i in range(25, 30)]
    assert len(made) == 1
    assert consumers.idle_count() == 1


@pytest.mark.integration
def test_reads_that_alternate_topics_never_see_the_other_topics_records(
    broker: str, topic_name: str
) -> None:
    other = f"{topic_name}-other"
    _produce(broker, topic_name, 10)
    _produce(broker, other, 10)
    for start in (0, 4, 8, 2):
        assert _values(broker, topic_name, start, start + 2) == [
            b"%s-%d" % (topic_name.encode(), i) for i in (start, start + 1)
        ]
        assert _values(broker, other, start, start + 2) == [
            b"%s-%d" % (other.encode(), i) for i in (start, start + 1)
        ]
    assert consumers.idle_count() == 2


@pytest.mark.integration
def test_a_read_that_fails_closes_its_consumer_instead_of_returning_it(
    broker: str, topic_name: str
) -> None:
    _produce(broker, topic_name, 3)
    with pytest.raises(TimeoutError, match="no records past offset 3"):
        list(read_range(OffsetRange(broker, topic_name, 0, 0, 5), idle_timeout_s=0.3))
    assert consumers.idle_count() == 0


@pytest.mark.integration
def test_the_pool_keeps_at_most_max_idle_consumers(broker: str, topic_name: str) -> None:
    _produce(broker, topic_name, 1)
    with ExitStack() as stack:
        lent = [
            stack.enter_context(consumers.lent_consumer(broker, topic_name))
            for _ in range(consumers.MAX_IDLE + 2)
        ]
        assert len({id(c) for c in lent}) == consumers.MAX_IDLE + 2
    assert consumers.idle_count() == consumers.MAX_IDLE


def _idle_in_child(queue: multiprocessing.Queue[int]) -> None:
    queue.put(consumers.idle_count())


@pytest.mark.integration
def test_a_forked_process_does_not_inherit_its_parents_consumers(
    broker: str, topic_name: str
) -> None:
    _produce(broker, topic_name, 1)
    assert _values(broker, topic_name, 0, 1)
    assert consumers.idle_count() == 1
    fork = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[int] = fork.Queue()
    child = fork.Process(target=_idle_in_child, args=(queue,))
    child.start()
    child.join(timeout=30)
    assert queue.get(timeout=5) == 0
    assert consumers.idle_count() == 1


@pytest.mark.integration
def test_with_no_idle_consumers_allowed_every_read_opens_and_closes_its_own(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumers, "MAX_IDLE", 0)
    _produce(broker, topic_name, 4)
    assert _values(broker, topic_name, 0, 4)
    assert _values(broker, topic_name, 1, 3)
    assert consumers.idle_count() == 0
