"""The routed job's log read backwards for the last progress line of this run (no Spark)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

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
