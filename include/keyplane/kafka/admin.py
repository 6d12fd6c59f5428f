"""Topic administration and offset queries that work on Kafka and on tansu.

tansu's ListOffsets(latest) answers with the start of the last record batch
plus one, not the high watermark. A Fetch response, however, carries the true
high watermark, so :func:`high_watermarks` seeks near the reported end and
reads the watermark from one fetch. On Apache Kafka both agree, and the same
code is correct.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from keyplane.kafka.security import client_config


class TopicError(RuntimeError):
    """A topic is missing, misnamed or does not have the partitions the caller needs."""


_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def check_topic_name(name: str) -> str:
    """``name`` if Apache Kafka accepts it as a topic name, else a one-line TopicError.

    Kafka's rule: 1 to 249 ASCII letters, digits, '.', '_' and '-', but not
    '.' or '..'. Checked here because tansu creates topics Kafka would refuse
    (``bad name!``, 300 characters), which would then work on a laptop and
    fail once the same commands point at Kafka.
    """
    if _TOPIC_NAME.fullmatch(name) is None or name in {".", ".."}:
        raise TopicError(
            f"{name!r} is not a Kafka topic name: 1 to 249 letters, digits, '.', '_' or '-' "
            "(and not '.' or '..')"
        )
    return name


def ensure_topic(bootstrap_servers: str, name: str, partitions: int) -> int:
    """Create ``name`` with ``partitions`` partitions unless it exists.

    Returns the topic's partition count. An existing topic with a different
    count is kept as it is (tansu cannot add partitions), and the caller gets
    the real count back. A name Kafka would refuse is refused
    (:func:`check_topic_name`) before connecting.
    """
    check_topic_name(name)
    admin = KafkaAdminClient(**client_config(bootstrap_servers))
    try:
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()
    return len(partitions_of(bootstrap_servers, name))


def partitions_of(bootstrap_servers: str, topic: str, timeout_s: float = 10.0) -> list[int]:
    """The topic's partition ids; TopicError when it does not exist."""
    consumer = KafkaConsumer(**client_config(bootstrap_servers), enable_auto_commit=False)
    try:
        return _partitions(consumer, bootstrap_servers, topic, timeout_s)
    finally:
        consumer.close()


def _partitions(
    consumer: KafkaConsumer, bootstrap_servers: str, topic: str, timeout_s: float = 10.0
) -> list[int]:
    """``topic``'s partition ids as ``consumer`` learns them; TopicError when it does not exist."""
    deadline = time.monotonic() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        if time.monotonic() > deadline:
            raise TopicError(
                f"topic {topic!r} does not exist on {bootstrap_servers}; "
                "create it with `keyplane topic create`"
            )
        time.sleep(0.2)


def high_watermarks(
    bootstrap_servers: str, topic: str, partitions: list[int] | None = None
) -> dict[int, int]:
    """The next offset to be written in each partition (the high watermark).

    One query; a caller that asks at every micro-batch boundary keeps a
    :class:`HighWatermarks` instead.
    """
    with HighWatermarks(bootstrap_servers) as marks:
        return marks.of(topic, partitions)


LOST_CONNECTION_RETRIES = 2
"""How many times :meth:`HighWatermarks.of` asks again after its connection broke."""


class HighWatermarks:
    """High watermarks asked again and again, over one long-lived consumer per topic.

    A job's driver asks for the events' and the migration topic's marks at
    every micro-batch boundary. A consumer of its own for each query costs a
    connection and a metadata round trip first, for every topic at every
    batch. Kept open, a query is a ListOffsets and one small fetch.

    The broker answers a fetch at the end of an empty partition only after
    ``fetch_max_wait_ms``; waiting 50 ms instead of the default 500, and
    polling as often, keeps a query cheap. A consumer remembers the
    watermark of its last fetch, so a watermark counts only when it is at
    least the reported end: an older one is lower whenever records arrived
    since (on tansu, the new last batch starts at or after it).
    """

    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self._consumers: dict[str, KafkaConsumer] = {}

    def _consumer(self, topic: str) -> KafkaConsumer:
        consumer = self._consumers.get(topic)
        if consumer is None:
            consumer = KafkaConsumer(
                **client_config(self.bootstrap_servers),
                enable_auto_commit=False,
                fetch_max_bytes=1024,
                max_partition_fetch_bytes=1024,
                fetch_max_wait_ms=50,
                # New partitions of a topic show within 10 s.
                metadata_max_age_ms=10_000,
            )
            self._consumers[topic] = consumer
        return consumer

    def of(self, topic: str, partitions: list[int] | None = None) -> dict[int, int]:
        """``topic``'s high watermark in each partition (of ``partitions``, else all).

        A query that fails closes its consumer, so the next one starts afresh
        rather than from a consumer left in an unknown state. A query whose
        connection broke under it (the broker crashed or restarted while it
        asked: ``KafkaConnectionError``) is asked again on a fresh consumer, up
        to :data:`LOST_CONNECTION_RETRIES` times, whose bootstrap waits for the
        broker to return; otherwise a job's micro-batch would fail on the one
        request that was in flight. Every other failure, and a broker that does
        not return within a bootstrap timeout, is raised.
        """
        for attempt in range(LOST_CONNECTION_RETRIES + 1):
            try:
                return self._of(topic, partitions)
            except BaseException as error:
                consumer = self._consumers.pop(topic, None)
                if consumer is not None:
                    consumer.close()
                if (
                    not isinstance(error, KafkaConnectionError)
                    or attempt == LOST_CONNECTION_RETRIES
                ):
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _of(self, topic: str, partitions: list[int] | None) -> dict[int, int]:
        consumer = self._consumer(topic)
        parts = (
            partitions
            if partitions is not None
            else _partitions(consumer, self.bootstrap_servers, topic)
        )
        all_tps = [TopicPartition(topic, p) for p in parts]
        reported: Mapping[TopicPartition, int] = consumer.end_offsets(all_tps)
        # A partition whose reported end is 0 has never held a batch (any broker
        # reports at least the last batch's start + 1 otherwise): its mark is 0,
        # with no fetch, which on an empty partition waits fetch_max_wait_ms.
        marks: dict[int, int] = {tp.partition: 0 for tp in all_tps if reported[tp] == 0}
        tps = [tp for tp in all_tps if reported[tp] > 0]
        if not tps:
            return marks
        if set(consumer.assignment()) != set(tps):
            consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, reported[tp] - 1)
        deadline = time.monotonic() + 10.0
        while len(marks) < len(all_tps):
            consumer.poll(timeout_ms=50, max_records=1)
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is not None and hw >= reported[tp]:
                    marks[tp.partition] = hw
            if time.monotonic() > deadline:
                missing = [tp.partition for tp in tps if tp.partition not in marks]
                raise TopicError(f"no high watermark for {topic} partitions {missing}")
        return marks

    def close(self) -> None:
        for consumer in self._consumers.values():
            consumer.close()
        self._consumers.clear()

    def __enter__(self) -> HighWatermarks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def earliest_offsets(
    bootstrap_servers: str, topic: str, partitions: list[int] | None = None
) -> dict[int, int]:
    """The first retained offset of each partition (of ``partitions``, else all)."""
    parts = partitions if partitions is not None else partitions_of(bootstrap_servers, topic)
    consumer = KafkaConsumer(**client_config(bootstrap_servers), enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in parts]
        return {tp.partition: off for tp, off in consumer.beginning_offsets(tps).items()}
    finally:
        consumer.close()


def tail_offsets(
    bootstrap_servers: str, topic: str, last: int, partitions: list[int] | None = None
) -> tuple[dict[int, int], dict[int, int]]:
    """Start and end offsets of the newest ``last`` records of each partition.

    A start is never before the partition's first retained record: a range
    reaching past it would wait for records retention has deleted, and time
    out. Ends are high watermarks (:func:`high_watermarks`).
    """
    ends = high_watermarks(bootstrap_servers, topic, partitions)
    earliest = earliest_offsets(bootstrap_servers, topic, list(ends))
    return {p: max(earliest.get(p, 0), end - last) for p, end in ends.items()}, ends
