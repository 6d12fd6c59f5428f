"""A fake Kafka producer for the sinks' pure-logic tests (no broker).

:class:`FakeProducer` returns kafka-python's own record futures and settles
them only in ``flush``, as the real producer does: a record it does not
deliver fails its future, and ``flush`` itself raises nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from kafka.errors import KafkaError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
from kafka.structs import TopicPartition


@dataclass
class FakeProducer:
    """Delivers its first ``delivers`` records (None: all), then fails every send."""

    delivers: int | None
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    closed: bool = False
    pending: list[tuple[FutureProduceResult, KafkaError | None]] = field(default_factory=list)

    def send(self, topic: str, key: bytes, value: bytes) -> FutureRecordMetadata:
        error = None
        if self.delivers is not None and len(self.sent) >= self.delivers:
            error = KafkaError("unknown producer id")
        else:
            self.sent.append((topic, value))
        result = FutureProduceResult(TopicPartition(topic, 0))
        self.pending.append((result, error))
        return FutureRecordMetadata(result, 0, -1, None, len(key), len(value), -1)

    def flush(self) -> None:
        for result, error in self.pending:
            if error is None:
                result.success((len(self.sent), -1, None))
            else:
                result.failure(error)
        self.pending.clear()

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


FakeProducers = Callable[..., list[FakeProducer]]


@pytest.fixture
def fake_producers(monkeypatch: pytest.MonkeyPatch) -> FakeProducers:
    """``fake_producers(module, *delivers)``: ``module.make_producer`` makes fake producers.

    The i-th producer made delivers ``delivers[i]`` records; the returned
    list fills with the producers as they are made.
    """

    def install(module: ModuleType, *delivers: int | None) -> list[FakeProducer]:
        made: list[FakeProducer] = []

        def make(bootstrap_servers: str, delivery: Any = None) -> FakeProducer:
            producer = FakeProducer(delivers=delivers[len(made)])
            made.append(producer)
            return producer

        monkeypatch.setattr(module, "make_producer", make)
        return made

    return install
