"""Shared fixtures: a real embedded broker and a real local SparkSession.

Integration tests use these real components; fakes appear only in unit tests
of pure logic, and such tests say so in their names.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyplane.testing import free_port

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# Control messages are signed (keyplane.signing); tests sign with a throwaway key.
os.environ.setdefault("KEYPLANE_CONTROL_KEY", "keyplane-tests-only")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a real embedded broker, shared by the session."""
    from keyplane.kafka.broker import EmbeddedBroker

    home = tmp_path_factory.mktemp("broker")
    embedded = EmbeddedBroker(home, free_port())
    state = embedded.start()
    yield state.bootstrap_servers
    embedded.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    from keyplane.spark.session import build_session

    session = build_session("keyplane-tests", "local[2]", shuffle_partitions=4)
    yield session
    session.stop()


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    return "t-" + request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:80]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
