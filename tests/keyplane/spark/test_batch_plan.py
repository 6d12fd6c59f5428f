"""A task finds its micro-batch's plan in Spark's offset log (the log's files are real;
no Spark runs here: the job's connector tests run it, in test_routed_counts.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keyplane.spark.batch_plan import (
    BatchPlanUnavailable,
    offset_log_file,
    planned_offset,
    running_batch_id,
)

METADATA = '{"batchWatermarkMs":0,"batchTimestampMs":1796636762858,"conf":{}}'
PLAN = {"plan": 4, "protocol": {"format": 1}, "routing": {"A": 2, "B": 1}, "prepared": None}
CONNECTOR = {"events": {"0": 1000, "1": 980}}


def _log(checkpoint: Path, batch_id: int, *sources: str) -> None:
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True, exist_ok=True)
    (offsets / str(batch_id)).write_text("\n".join(["v1", METADATA, *sources]))


@pytest.mark.parametrize("order", ["plan-first", "connector-first"])
def test_the_plan_is_keyplanes_line_of_the_batchs_offsets_wherever_spark_puts_it(
    tmp_path: Path, order: str
) -> None:
    lines = [json.dumps(PLAN), json.dumps(CONNECTOR)]
    _log(tmp_path, 7, *(lines if order == "plan-first" else lines[::-1]))
    assert planned_offset(str(tmp_path), 7) == PLAN
    assert planned_offset(f"file:{tmp_path}", 7) == PLAN
    assert planned_offset(f"file://{tmp_path}", 7) == PLAN


def test_a_batch_without_a_logged_plan_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(BatchPlanUnavailable, match="cannot be read"):
        planned_offset(str(tmp_path), 3)
    _log(tmp_path, 3, json.dumps(CONNECTOR), "-")
    with pytest.raises(BatchPlanUnavailable, match="no offset of keyplane's routed source"):
        planned_offset(str(tmp_path), 3)


def test_a_checkpoint_the_tasks_cannot_open_as_a_file_is_refused() -> None:
    with pytest.raises(BatchPlanUnavailable, match="file system every executor mounts"):
        offset_log_file("s3a://bucket/checkpoint", 1)
    assert offset_log_file("/data/checkpoint", 12) == Path("/data/checkpoint/offsets/12")


def test_outside_a_spark_task_there_is_no_running_batch() -> None:
    with pytest.raises(BatchPlanUnavailable, match=r"streaming\.sql\.batchId"):
        running_batch_id()
