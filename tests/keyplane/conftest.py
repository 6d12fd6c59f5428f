"""Fixtures for the tests of the controller (a configuration store and a stand-in job),
and a fake Kafka producer for the senders' pure-logic tests.

The job side is :class:`keyplane.testing.ProtocolOnlyJob`: the real job
protocol of paper 000 §3.4 on the real control topic, without Spark.

:class:`FakeProducer` returns kafka-python's own record futures and settles
them only in ``flush``, as the real producer does: a record it does not
deliver fails its future, and ``flush`` itself raises nothing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kafka.errors import KafkaError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
from kafka.structs import TopicPartition

from keyplane.control.operators import OPERATORS
from keyplane.kafka.control import ControlChannel
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.testing import ProtocolOnlyJob

CONTROL_KEY = "controller-tests-key-0123456789abcdef"


def routing_config(version: int, parent: int | None) -> RoutingConfig:
    """A small two-operator configuration whose tables change from version to version."""
    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_at=datetime(2026, 11, 3, 12, version, tzinfo=UTC),
        created_by="initial" if parent is None else "schedule",
        operators={
            "A": OperatorRouting(parallelism=2, table={"eu": version % 2, "us": 1 - version % 2}),
            "B": OperatorRouting(parallelism=3, table={"#spark": version % 3}),
        },
    )


@pytest.fixture
def control_key() -> str:
    """The signing key shared by the controller and the stand-in job."""
    return CONTROL_KEY


@pytest.fixture
def routing_store(tmp_path: Path) -> Path:
    """A store holding v1 (initial), v2 (child of v1) and v3 (child of v2)."""
    store = tmp_path / "configs"
    for version, parent in ((1, None), (2, 1), (3, 2)):
        config_store.save(routing_config(version, parent), store)
    return store


@pytest.fixture
def protocol_only_job(
    broker: str, topic_name: str, routing_store: Path
) -> Iterator[Callable[[], ProtocolOnlyJob]]:
    """Start a :class:`ProtocolOnlyJob` running v1 of ``routing_store`` on ``topic_name``."""
    started: list[ProtocolOnlyJob] = []

    def start() -> ProtocolOnlyJob:
        channel = ControlChannel(broker, topic_name, key=CONTROL_KEY)
        channel.ensure()
        job = ProtocolOnlyJob(channel, routing_store, OPERATORS, 1).__enter__()
        started.append(job)
        return job

    yield start
    for job in started:
        job.__exit__(None, None, None)


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process that leads a process group, as a detached broker would."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@dataclass
class FakeProducer:
    """Delivers its first ``delivers`` records (None: all), then fails every send."""

    delivers: int | None
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    partitions: list[int | None] = field(default_factory=list)
    closed: bool = False
    pending: list[tuple[FutureProduceResult, KafkaError | None]] = field(default_factory=list)

    def send(
        self, topic: str, key: bytes | None, value: bytes, partition: int | None = None
    ) -> FutureRecordMetadata:
        error = None
        if self.delivers is not None and len(self.sent) >= self.delivers:
            error = KafkaError("unknown producer id")
        else:
            self.sent.append((topic, value))
            self.partitions.append(partition)
        result = FutureProduceResult(TopicPartition(topic, 0))
        self.pending.append((result, error))
        return FutureRecordMetadata(result, 0, -1, None, len(key or b""), len(value), -1)

    def flush(self, timeout: float | None = None) -> None:
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
