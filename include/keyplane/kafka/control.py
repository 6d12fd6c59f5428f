"""The control topic: signed protocol messages between the controller and the job.

Paper 000 §3.4 needs the manager's commands to reach every instance in the
order they were sent (a PROPAGATE after its PREPARE, B's after A's MIGRATED),
and the replies to come back. keyplane carries both directions on one Kafka
topic with a single partition, since Kafka orders records only within a
partition. Every record is a message signed by :func:`keyplane.control.messages.encode`
with the key from ``KEYPLANE_CONTROL_KEY``, because whoever can write to the
topic could otherwise rewrite the job's routing.

:meth:`ControlChannel.read` returns exactly the records of an offset range, as
the job's driver needs at each micro-batch boundary: it reads from the offset
it checkpointed to the high watermark, so that after a restart it reads the
same records again and the protocol's idempotence does the rest. A record
that is not an authentic message is reported, never raised: a forged record
must not stop the job from reading the genuine ones after it. That holds even
if :func:`keyplane.control.messages.decode` has a bug: whatever else it raises on a
record is logged with the traceback and reported as ``undecodable``, since an
exception out of :meth:`ControlChannel.read` would fail the job's query, and
every restart would read the same record again from the checkpointed offset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError, OffsetOutOfRangeError

from keyplane.control.messages import ControlMessage, InvalidMessage, decode, encode
from keyplane.control.signing import control_key
from keyplane.kafka.admin import HighWatermarks, TopicError, ensure_topic
from keyplane.kafka.offsets import check_not_ahead
from keyplane.kafka.producer import DeliveryError, LongLivedProducer
from keyplane.kafka.security import client_config

log = logging.getLogger(__name__)

PARTITION = 0
"""The control topic's only partition: the one place where Kafka keeps order."""


@dataclass(frozen=True)
class ControlRead:
    """The records of one offset range of the control topic.

    ``messages`` are the authentic messages with their offsets; ``rejected``
    the records that are not, with the reason (``InvalidMessage.reason``).
    ``end`` is the offset after the range: where the next read starts.
    """

    messages: tuple[tuple[int, ControlMessage], ...]
    rejected: tuple[tuple[int, InvalidMessage], ...]
    end: int


class ControlChannel:
    """Send and read signed control messages on a one-partition topic (000 §3.4).

    The producer and the consumer are created on first use and reused, so
    the driver's read at every batch boundary costs one high-watermark query
    and one fetch, not a new connection. ``key`` defaults to
    ``KEYPLANE_CONTROL_KEY``; it is resolved here, so a missing key fails
    when the channel is built rather than at the first message.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        key: bytes | str | None = None,
        read_timeout_s: float = 30.0,
        send_timeout_s: float = 30.0,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self._key = control_key(key)
        self._read_timeout_s = read_timeout_s
        self._send_timeout_s = send_timeout_s
        self._partition = TopicPartition(topic, PARTITION)
        self._sends = LongLivedProducer(bootstrap_servers)
        self._consumer: KafkaConsumer | None = None
        self._marks = HighWatermarks(bootstrap_servers)

    def __repr__(self) -> str:
        return f"ControlChannel({self.bootstrap_servers!r}, {self.topic!r})"

    def ensure(self) -> None:
        """Create the topic with one partition unless it exists.

        An existing topic with more partitions is refused: records written to
        the others by another producer would never be read, and their order
        relative to partition 0 is undefined.
        """
        partitions = ensure_topic(self.bootstrap_servers, self.topic, 1)
        if partitions != 1:
            raise TopicError(
                f"control topic {self.topic!r} has {partitions} partitions, but the "
                "reconfiguration protocol needs exactly one to keep its messages in order; "
                "set KEYPLANE_CONTROL_TOPIC to a new topic name"
            )

    def send(self, messages: Sequence[ControlMessage]) -> None:
        """Sign and publish ``messages`` in order; return once the broker has them all.

        Every message is encoded before any is sent, so a message that cannot
        be signed sends nothing. The producer is idempotent with
        ``acks=all``, so its own retries never duplicate a record. A producer
        the broker refuses (after a restart: an unknown producer id, a
        sequence out of order) is replaced and the messages sent once more
        (:class:`~keyplane.kafka.producer.LongLivedProducer`); a message
        that arrives twice changes nothing, as every protocol step is
        idempotent (000 §3.4).
        """
        payloads = [encode(message, self._key) for message in messages]
        if not payloads:
            return
        try:
            self._sends.send(
                self.topic,
                [(None, payload) for payload in payloads],
                partition=PARTITION,
                timeout_s=self._send_timeout_s,
            )
        except (KafkaError, DeliveryError) as exc:
            described = ", ".join(message.describe() for message in messages)
            raise TopicError(
                f"could not publish {described} to control topic {self.topic!r} on "
                f"{self.bootstrap_servers}: {exc}"
            ) from exc

    def end_offset(self) -> int:
        """The high watermark of the control partition: the offset of the next record.

        Asked through :class:`keyplane.kafka.admin.HighWatermarks`, since the
        embedded broker's ListOffsets does not report it (see that module). The
        job's driver asks at every micro-batch boundary, so the channel keeps
        that consumer open: a consumer of its own for each query costs a
        connection and a metadata round trip each time.
        """
        return self._marks.of(self.topic, [PARTITION])[PARTITION]

    def read(self, start: int, end: int | None = None) -> ControlRead:
        """Every record at offsets ``[start, end)``; ``end`` defaults to the high watermark.

        A ``start`` past the high watermark raises
        :class:`~keyplane.kafka.offsets.CheckpointAheadError`: the broker lost
        records a reader had already read.

        Raises :class:`TopicError` when the range cannot be read: it starts
        outside the records the broker keeps, or no record arrives for
        ``read_timeout_s`` while the range is not complete.
        """
        if start < 0:
            raise ValueError(f"offsets are non-negative, got start {start}")
        if end is None:
            stop = self.end_offset()
            # The topic ends before a position once read: it lost records.
            check_not_ahead(self.topic, {str(PARTITION): start}, {PARTITION: stop})
        else:
            stop = end
        if stop < start:
            raise ValueError(f"end {stop} is before start {start}")
        if stop == start:
            return ControlRead(messages=(), rejected=(), end=start)
        consumer = self._consumer_for_reading()
        consumer.seek(self._partition, start)
        messages: list[tuple[int, ControlMessage]] = []
        rejected: list[tuple[int, InvalidMessage]] = []
        position = start
        progressed_at = time.monotonic()
        while position < stop:
            try:
                fetched = consumer.poll(timeout_ms=200, max_records=stop - position)
            except OffsetOutOfRangeError as exc:
                raise TopicError(
                    f"offset {start} is out of range of control topic {self.topic!r} "
                    "(deleted by retention, or past the end)"
                ) from exc
            for record in fetched.get(self._partition, []):
                if not start <= record.offset < stop:
                    continue
                try:
                    messages.append((record.offset, self._decode(record.offset, record.value)))
                except InvalidMessage as invalid:
                    rejected.append((record.offset, invalid))
            reached = min(int(consumer.position(self._partition)), stop)
            if reached > position:
                position, progressed_at = reached, time.monotonic()
            elif time.monotonic() - progressed_at >= self._read_timeout_s:
                raise TopicError(
                    f"control topic {self.topic!r} on {self.bootstrap_servers}: no record past "
                    f"offset {position} (reading offsets {start}..{stop - 1}) after "
                    f"{self._read_timeout_s:.0f} s"
                )
        return ControlRead(messages=tuple(messages), rejected=tuple(rejected), end=stop)

    def _decode(self, offset: int, value: bytes | None) -> ControlMessage:
        """The message at ``offset``, or :class:`InvalidMessage` for any record that is not one.

        :func:`decode` raises only :class:`InvalidMessage` for a record it
        refuses; anything else it raises is a bug in it, turned into an
        ``undecodable`` rejection here so that the record cannot stop the job
        (see the module docstring).
        """
        try:
            return decode(value or b"", self._key)
        except InvalidMessage:
            raise
        except Exception as error:
            log.warning(
                "control topic %s, offset %d: decoding the record raised %s",
                self.topic,
                offset,
                type(error).__name__,
                exc_info=True,
            )
            # One short line: the error's text may quote the record, which anyone may write.
            detail = " ".join(f"{type(error).__name__}: {error}".split())[:200]
            raise InvalidMessage("undecodable", detail) from None

    def _consumer_for_reading(self) -> KafkaConsumer:
        if self._consumer is None:
            consumer = KafkaConsumer(
                **client_config(self.bootstrap_servers),
                enable_auto_commit=False,
                auto_offset_reset="none",
                fetch_max_wait_ms=50,
            )
            consumer.assign([self._partition])
            self._consumer = consumer
        return self._consumer

    def close(self) -> None:
        """Close the producer (after sending what it holds) and the consumers."""
        consumer, self._consumer = self._consumer, None
        try:
            self._sends.close(timeout_s=10)
        finally:
            self._marks.close()
            if consumer is not None:
                consumer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
