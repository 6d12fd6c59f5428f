"""The metrics listener's delivery when its producer breaks (fake producers: pure logic).

A broker restart can leave the listener's long-lived idempotent producer
unable to deliver anything again (the broker no longer knows its producer id);
the broker restart fault test on the real broker showed every later record
lost. The listener must replace such a producer, not keep using it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from kafka.errors import KafkaError

from keyplane.batchmetrics import BatchMetrics
from keyplane.kafka.producer import SAFE_DELIVERY
from keyplane.spark import routed_sink
from keyplane.spark.routed_sink import MetricsListener


@dataclass
class FakeFuture:
    error: KafkaError | None

    def get(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error


@dataclass
class FakeProducer:
    """Delivers its first ``delivers`` records (None: all), then fails every send."""

    delivers: int | None
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    closed: bool = False

    def send(self, topic: str, key: bytes, value: bytes) -> FakeFuture:
        if self.delivers is not None and len(self.sent) >= self.delivers:
            return FakeFuture(KafkaError("unknown producer id"))
        self.sent.append((topic, value))
        return FakeFuture(None)

    def flush(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


@dataclass
class Writer:
    bootstrap_servers: str = "broker:9092"
    delivery: Any = SAFE_DELIVERY


def listener_with_fake_producers(
    monkeypatch: pytest.MonkeyPatch, *delivers: int | None
) -> tuple[MetricsListener, list[FakeProducer]]:
    made: list[FakeProducer] = []

    def make(bootstrap_servers: str, delivery: Any) -> FakeProducer:
        producer = FakeProducer(delivers=delivers[len(made)])
        made.append(producer)
        return producer

    monkeypatch.setattr(routed_sink, "make_producer", make)
    return MetricsListener(Writer(), "job.metrics"), made  # type: ignore[arg-type]


def test_a_producer_that_stops_delivering_is_replaced_and_the_record_sent_again_fake_producers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener, made = listener_with_fake_producers(monkeypatch, 1, None)
    assert listener.publish(BatchMetrics(batch_id=1))
    assert listener.publish(BatchMetrics(batch_id=2))
    assert listener.publish(BatchMetrics(batch_id=3))

    broken, replacement = made
    assert [BatchMetrics.model_validate_json(v).batch_id for _, v in broken.sent] == [1]
    assert broken.closed and not replacement.closed
    assert [BatchMetrics.model_validate_json(v).batch_id for _, v in replacement.sent] == [2, 3]


def test_a_record_that_two_producers_cannot_deliver_is_reported_lost_fake_producers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener, made = listener_with_fake_producers(monkeypatch, 0, 0)
    assert listener.publish(BatchMetrics(batch_id=7)) is False
    assert len(made) == 2 and all(p.closed for p in made)
