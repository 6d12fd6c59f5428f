"""Airflow gets a throwaway home in these tests.

Some of them run the DAGs' operators in this process, without a database.
Importing Airflow creates ``$AIRFLOW_HOME`` (``~/airflow`` unless set) with
its log folder, and reads it once per process: the home is set here, when
pytest collects this folder, before a test module imports Airflow.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fake_control import FakeControlTopic

if "AIRFLOW_HOME" not in os.environ:
    home = tempfile.mkdtemp(prefix="keyplane-airflow-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ["AIRFLOW_HOME"] = home


@pytest.fixture
def topic(monkeypatch: pytest.MonkeyPatch) -> FakeControlTopic:
    """The control topic as a list (:class:`FakeControlTopic`) for every channel opened.

    Imported here, not at the top: Airflow must find its home set first.
    """
    from fake_control import FakeControlTopic

    from keyplane.kafka import control

    log = FakeControlTopic()
    monkeypatch.setattr(control, "ControlChannel", log.channel)
    return log
