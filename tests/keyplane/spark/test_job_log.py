"""The routed job's log read backwards for the last progress line of this run (no Spark)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from keyplane.spark.job_log import last_progress
from keyplane.spark.progress import PROGRESS_PREFIX, BatchProgress


def _line(batch_id: int, committed: int) -> str:
    """A progress line as the job prints it, for a batch of 10 rows."""
    progress = BatchProgress(batch_id, 10, 5.0, 2000, 0, committed)
    return PROGRESS_PREFIX + json.dumps(asdict(progress)) + "\n"


def test_last_progress_is_the_last_complete_line_of_this_run(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    earlier_run = _line(41, 410) + "x" * 5000 + "\n"
    this_run = _line(0, 10) + ("spark noise\n" * 300) + _line(1, 20) + "more noise\n"
    log.write_text(earlier_run + this_run + PROGRESS_PREFIX + '{"batch_id": 2')

    found = last_progress(log, len(earlier_run), block=97)
    only_earlier = last_progress(log, 0, block=97)
    none_yet = last_progress(log, len(earlier_run) + len(this_run))

    assert found is not None and (found.batch_id, found.committed) == (1, 20)
    assert only_earlier == found
    assert none_yet is None
    assert last_progress(tmp_path / "missing.log", 0) is None


_LOGS = """
import logging
from keyplane.spark.job_log import configure_job_logging
configure_job_logging({level!r})
logging.getLogger("keyplane.spark.counts_job").debug("a keyplane debug line")
logging.getLogger("keyplane.spark.counts_job").info("a keyplane info line")
logging.getLogger("keyplane.kafka.producer").warning("a keyplane warning")
logging.getLogger("kafka.conn").info("a kafka-python info line")
logging.getLogger("py4j.clientserver").warning("a py4j warning")
"""


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        (
            "INFO",
            [
                "INFO keyplane.spark.counts_job: a keyplane info line",
                "WARNING keyplane.kafka.producer: a keyplane warning",
                "WARNING py4j.clientserver: a py4j warning",
            ],
        ),
        (
            "WARNING",
            [
                "WARNING keyplane.kafka.producer: a keyplane warning",
                "WARNING py4j.clientserver: a py4j warning",
            ],
        ),
    ],
)
def test_the_job_logs_its_own_lines_from_the_level_and_other_libraries_warnings(
    level: str, expected: list[str]
) -> None:
    # A process of its own, as the job is: pytest's own handlers on the root logger would
    # make logging.basicConfig a no-op here.
    done = subprocess.run(
        [sys.executable, "-c", _LOGS.format(level=level)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip

    lines = done.stderr.splitlines()
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
    assert all(stamp.match(line) for line in lines), lines
    assert [stamp.sub("", line) for line in lines] == expected
    assert done.stdout == ""
