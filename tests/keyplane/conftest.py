"""Fixtures for the tests of the controller: a configuration store and a stand-in job.

The job side is :class:`keyplane.testing.ProtocolOnlyJob`: the real job
protocol of paper 000 §3.4 on the real control topic, without Spark.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

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
