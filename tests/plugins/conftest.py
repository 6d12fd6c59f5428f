"""Fixtures of the dashboard's tests: a KEYPLANE_HOME filled by the real components."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dashboard_home import PreparedHome, prepare_home


@pytest.fixture(scope="session")
def prepared_home(broker: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreparedHome]:
    """A KEYPLANE_HOME with v1 → v2 planned, validated, rolled out and measured."""
    yield prepare_home(tmp_path_factory.mktemp("keyplane_home"), broker)
