"""A checkpoint keeps the time mode its stages started in; a new one starts without one.

The pure tests read fabricated copies of Spark's operator metadata files. The
integration tests run the routed job on the real broker and the real
SparkSession: a checkpoint written in either mode restarts in that mode
whatever a new checkpoint would start in, Spark's own record of it
unchanged, and the counts stay exact.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.spark.counts_job import (
    CountsJobSettings,
    job_command,
    read_output,
    start_counts_query,
)
from keyplane.spark.watermark import (
    NEW_CHECKPOINT_TIME_MODE,
    CheckpointRecordError,
    StageTimeMode,
    checkpoint_time_mode,
    stage_time_mode,
)
from keyplane.testing import routed_job_settings

OTHER: dict[StageTimeMode, StageTimeMode] = {"None": "EventTime", "EventTime": "None"}


def _operator_record(checkpoint: Path, operator: int, batch: int, time_mode: str) -> None:
    """Spark's metadata of a ``transformWithState`` operator, as PySpark 4.3 writes it."""
    records = checkpoint / "state" / str(operator) / "_metadata" / "v2"
    records.mkdir(parents=True, exist_ok=True)
    properties = {"timeMode": time_mode, "outputMode": "Append", "stateVariables": []}
    record = {
        "operatorInfo": {"operatorId": operator, "operatorName": "transformWithStateExec"},
        "stateStoreInfo": [],
        "operatorPropertiesJson": json.dumps(properties),
    }
    (records / str(batch)).write_text(f"v2\n{json.dumps(record)}")


def test_a_checkpoint_s_time_mode_is_spark_s_record_of_it_pure(tmp_path: Path) -> None:
    """No record leaves the mode free; an operator in event time makes the checkpoint so
    (its newest record counts, "10" after "9"); an unreadable record is one clear error."""
    checkpoint = tmp_path / "checkpoint"
    assert checkpoint_time_mode(None) is None
    assert checkpoint_time_mode(checkpoint) is None
    (checkpoint / "state" / "0" / "0").mkdir(parents=True)  # a state partition, no record yet
    assert checkpoint_time_mode(checkpoint) is None
    assert stage_time_mode(checkpoint) == NEW_CHECKPOINT_TIME_MODE == "None"
    assert stage_time_mode(checkpoint, "EventTime") == "EventTime"

    _operator_record(checkpoint, 0, 0, "NoTime")
    _operator_record(checkpoint, 1, 0, "NoTime")
    assert checkpoint_time_mode(checkpoint) == "None"
    assert stage_time_mode(checkpoint, "EventTime") == "None"

    _operator_record(checkpoint, 1, 9, "NoTime")
    _operator_record(checkpoint, 1, 10, "EventTime")
    assert checkpoint_time_mode(checkpoint) == "EventTime"
    assert stage_time_mode(checkpoint, "None") == "EventTime"

    _operator_record(checkpoint, 0, 11, "ProcessingTime")
    with pytest.raises(CheckpointRecordError, match=r"state/0/_metadata/v2/11: no time mode"):
        checkpoint_time_mode(checkpoint)
    (checkpoint / "state" / "0" / "_metadata" / "v2" / "11").write_text("v2\n{}")
    with pytest.raises(CheckpointRecordError, match="operatorPropertiesJson"):
        checkpoint_time_mode(checkpoint)


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["jvm", "python"])
@pytest.mark.parametrize("first", ["None", "EventTime"])
def test_a_checkpoint_restarts_in_the_time_mode_it_was_written_in(
    spark, broker: str, topic_name: str, tmp_path: Path, engine: str, first: StageTimeMode
) -> None:
    """Written in ``first``, restarted with new checkpoints starting in the other mode: both
    stages run as Spark recorded them (a mode changed on restart fails the query with
    ``STATE_STORE_INVALID_CONFIG_AFTER_RESTART``), stage A keeps a watermark only in event
    time, and the counts of both runs are exact. The job stores its all-hash v1 itself."""

    def run(new: StageTimeMode) -> tuple[str, list[dict]]:
        settings = routed_job_settings(
            broker, topic_name, tmp_path, parallelism=4, batch=2_000, trigger="0 seconds",
            stage_engine=engine, new_checkpoint_time_mode=new,
        )  # fmt: skip
        query = start_counts_query(spark, settings)
        try:
            query.processAllAvailable()
            return query._jsq.explainInternal(False), list(query.recentProgress)
        finally:
            query.stop()

    first_events = ZipfEvolvingWorkload(n_keys=200, n_categories=10, n_events=3_000, seed=8)
    second_events = ZipfEvolvingWorkload(n_keys=200, n_categories=10, n_events=2_000, seed=9)
    produce_workload(first_events, broker, topic_name, partitions=2)
    plan, _ = run(first)
    assert checkpoint_time_mode(tmp_path / "checkpoint") == first
    produce_workload(second_events, broker, topic_name, partitions=2)
    plan, reports = run(OTHER[first])

    assert checkpoint_time_mode(tmp_path / "checkpoint") == first
    assert ("EventTime" in plan) == (first == "EventTime")  # stage B is always "NoTime"
    watermarks = {report.get("eventTime", {}).get("watermark") for report in reports}
    assert (watermarks != {None}) == (first == "EventTime"), watermarks
    truth = expected_counts_of((first_events, second_events))
    report = compare_counts(truth, read_output(tmp_path / "output"))
    assert report.expected_events == first_events.n_events + second_events.n_events
    assert report.exact, report


@pytest.mark.integration
def test_an_unreadable_operator_record_stops_the_job_with_one_line_before_it_reads(
    tmp_path: Path,
) -> None:
    """The job's own process, no broker behind its address: the record is read before
    anything else, and the job exits 2 with the file's name, no traceback."""
    checkpoint = tmp_path / "checkpoint"
    _operator_record(checkpoint, 0, 0, "NoTime")
    broken = checkpoint / "state" / "1" / "_metadata" / "v2"
    broken.mkdir(parents=True)
    (broken / "0").write_text("v2\n{")  # cut short, as a full disk leaves a file
    settings = CountsJobSettings(
        bootstrap_servers="127.0.0.1:9", checkpoint=checkpoint, output=tmp_path / "output"
    )

    done = subprocess.run(job_command(settings), capture_output=True, text=True, timeout=300)

    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("running_counts: error: "), last
    assert f"{broken / '0'}: no time mode" in last
