"""Progress, stopping and session settings of the counting job (pure: progress JSON, fakes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from pydantic import ValidationError
from pyspark.sql import SparkSession

from keyplane.reference.events import MAX_EVENT_BYTES
from keyplane.spark.counts_job import (
    CountsJobSettings,
    job_command,
    parse_settings,
    read_tasks,
    stop_between_batches,
)
from keyplane.spark.progress import phases_ms, progress_of


def _progress(end: object, latest: object) -> dict[str, object]:
    return {
        "batchId": 7,
        "numInputRows": 300,
        "processedRowsPerSecond": 150.0,
        "durationMs": {"triggerExecution": 2000},
        "sources": [{"endOffset": end, "latestOffset": latest}],
    }


def test_lag_is_latest_minus_committed() -> None:
    end = json.dumps({"t": {"0": 100, "1": 200}})
    latest = json.dumps({"t": {"0": 150, "1": 260}})
    p = progress_of(_progress(end, latest))
    assert (p.batch_id, p.rows, p.committed, p.lag, p.duration_ms) == (7, 300, 300, 110, 2000)


def test_a_routed_batch_counts_the_records_its_offset_says_it_read_not_its_rows() -> None:
    """In pairs mode one source row stands for many events; a trigger that ran no
    batch is reported under the last batch's end offset and must count nothing."""
    end = {"plan": 3, "events": {"t": {"0": 400}}, "read": 500}
    report = _progress(json.dumps(end), None)
    report["sources"][0]["numInputRows"] = 300  # type: ignore[index]
    p = progress_of(report)
    assert (p.rows, p.rows_per_s, p.committed) == (500, 250.0, 400)
    report["sources"][0]["numInputRows"] = 0  # type: ignore[index]
    assert progress_of(report).rows == 0


def test_a_batchs_phases_are_its_durations_without_the_whole() -> None:
    report = _progress(json.dumps({"t": {"0": 5}}), None)
    report["durationMs"] = {
        "triggerExecution": 2000,
        "latestOffset": 40,
        "queryPlanning": 60,
        "addBatch": 1800,
        "walCommit": 30,
        "commitOffsets": 25,
    }
    assert phases_ms(report) == {
        "latestOffset": 40,
        "queryPlanning": 60,
        "addBatch": 1800,
        "walCommit": 30,
        "commitOffsets": 25,
    }
    assert phases_ms({"batchId": 0}) == {}


def test_null_latest_offset_after_restart_counts_as_no_lag() -> None:
    p = progress_of(_progress(json.dumps({"t": {"0": 5}}), None))
    assert (p.committed, p.lag) == (5, 0)
    p = progress_of(_progress(json.dumps({"t": {"0": 5}}), "null"))
    assert (p.committed, p.lag) == (5, 0)


def test_job_command_round_trips_through_the_job_parser() -> None:
    settings = CountsJobSettings(
        bootstrap_servers="127.0.0.1:1",
        events_topic="ev",
        checkpoint=Path("/ck"),
        output=Path("/out"),
        variant="count-by-first-key",
        max_offsets_per_trigger=100,
        trigger_interval="0 seconds",
        stop_at_offset_total=5,
    )
    cmd = job_command(settings)
    assert cmd[1:3] == ["-m", "keyplane.spark.counts_job"]
    # ``source`` is left to the child's environment (KEYPLANE_KAFKA_SOURCE).
    assert parse_settings(cmd[3:]).model_dump(exclude={"source"}) == settings.model_dump(
        exclude={"source"}
    )
    assert not any(arg.startswith("--master") for arg in cmd)  # unset: the child's default


def test_every_setting_round_trips_through_the_job_command_line_even_a_dash_leading_one() -> None:
    """Each flag is one ``--flag=value`` argument: the child's parser took a separate value
    that starts with ``-`` (a topic ``-events``) for a flag and failed after the launch."""
    settings = CountsJobSettings(
        bootstrap_servers="127.0.0.1:1,[::1]:2",
        events_topic="-events",
        results_topic="--results",
        checkpoint=Path("-ck"),
        output=Path("/out"),
        master="-x",
        shuffle_partitions=3,
        max_offsets_per_trigger=100,
        trigger_interval="0 seconds",
        producer_acks="1",
        producer_idempotent=False,
        stop_at_offset_total=5,
        stop_when_idle_s=2.5,
        source="python",
        variant="two-stage",
        pipeline="keyplane.reference.pipeline:counts",
        routing_store=Path("/store"),
        routing_version=2,
        control_topic="-control",
        migration_topic="-migration",
        metrics_topic="-metrics",
        dead_letter_topic="-dead=letter",
        stage_a_aggregate="keyplane.aggregates:ValueCounts",
        stage_b_aggregate="keyplane.aggregates:RunningCount",
        forward="tuples",
        max_event_bytes=4096,
        read_tasks=3,
        stage_engine="python",
        sink_writer="driver",
        log_level="WARNING",
        restarts=2,
        restart_delay_s=0.0,
        executors_initial=2,
    )
    assert settings.model_fields_set == set(CountsJobSettings.model_fields)  # every one

    parsed = parse_settings(job_command(settings)[3:])

    assert parsed.model_dump() == settings.model_dump()


def test_forward_mode_round_trips_and_is_checked_at_the_boundary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = {"bootstrap_servers": "127.0.0.1:1", "checkpoint": Path("/ck"), "output": Path("/o")}
    settings = CountsJobSettings(**common, routing_store=Path("/store"), forward="tuples")
    cmd = job_command(settings)
    assert "--forward=tuples" in cmd
    assert parse_settings(cmd[3:]).forward == "tuples"
    assert CountsJobSettings(**common).forward == "pairs"
    with pytest.raises(ValidationError, match="'pairs' or 'tuples'"):
        CountsJobSettings(**common, routing_store=Path("/store"), forward="tuple")
    with pytest.raises(ValidationError, match="forward='tuples' needs the routed job"):
        CountsJobSettings(**common, forward="tuples")
    with pytest.raises(SystemExit):
        parse_settings([*cmd[3:], "--forward=tuple"])
    assert "argument --forward: invalid choice: 'tuple'" in capsys.readouterr().err


def test_event_size_bound_round_trips_and_is_checked_at_the_boundary() -> None:
    common = {"bootstrap_servers": "127.0.0.1:1", "checkpoint": Path("/ck"), "output": Path("/o")}
    routed = {**common, "routing_store": Path("/store")}
    settings = CountsJobSettings(**routed, max_event_bytes=4096)
    assert parse_settings(job_command(settings)[3:]).max_event_bytes == 4096
    assert CountsJobSettings(**routed).max_event_bytes == MAX_EVENT_BYTES
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        CountsJobSettings(**routed, max_event_bytes=0)
    with pytest.raises(ValidationError, match="max_event_bytes needs the routed job"):
        CountsJobSettings(**common, max_event_bytes=4096)


def test_read_tasks_round_trip_and_default_to_the_sessions_cores_pure() -> None:
    common = {"bootstrap_servers": "127.0.0.1:1", "checkpoint": Path("/ck"), "output": Path("/o")}
    settings = CountsJobSettings(**common, read_tasks=3)
    assert parse_settings(job_command(settings)[3:]).read_tasks == 3
    assert CountsJobSettings(**common).read_tasks is None
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        CountsJobSettings(**common, read_tasks=0)

    def session(cores_max: str | None) -> SparkSession:
        """Stands in for a session with 6 cores registered and ``spark.cores.max``: read_tasks
        asks nothing else."""
        conf = {"spark.cores.max": cores_max} if cores_max else {}
        return cast(
            SparkSession,
            SimpleNamespace(
                conf=SimpleNamespace(get=lambda key, default=None: conf.get(key, default)),
                sparkContext=SimpleNamespace(defaultParallelism=6),
            ),
        )

    assert read_tasks(session(None), CountsJobSettings(**common)) == 6
    assert read_tasks(session("4"), CountsJobSettings(**common)) == 4
    assert read_tasks(session("4"), settings) == 3


class FakeQuery:
    """Stands in for a StreamingQuery: batch ``last_batch`` + 1 runs for ``busy_reads``
    status reads, and the next starts at once when ``backlog``."""

    def __init__(self, busy_reads: float, *, last_batch: int | None = 4, backlog: bool) -> None:
        self.busy_reads = busy_reads
        self.backlog = backlog
        self.batch = last_batch
        self.reads = 0
        self.isActive = True
        self.stopped_after: int | None = None

    @property
    def status(self) -> dict[str, bool]:
        self.reads += 1
        if self.reads == self.busy_reads + 1:
            self.batch = 0 if self.batch is None else self.batch + 1
        return {"isTriggerActive": self.backlog or self.reads <= self.busy_reads}

    @property
    def lastProgress(self) -> dict[str, int] | None:
        return None if self.batch is None else {"batchId": self.batch}

    def stop(self) -> None:
        self.stopped_after = self.reads
        self.isActive = False


@pytest.mark.parametrize("backlog", [False, True])
@pytest.mark.parametrize("last_batch", [None, 4])
def test_stop_waits_for_the_running_batch_only_with_a_fake_query(
    backlog: bool, last_batch: int | None
) -> None:
    query = FakeQuery(busy_reads=3, last_batch=last_batch, backlog=backlog)
    stop_between_batches(query, grace_s=60, poll_s=0)
    assert query.stopped_after == 4


def test_stop_gives_up_waiting_after_the_grace_with_a_fake_query() -> None:
    query = FakeQuery(busy_reads=float("inf"), backlog=True)
    started = time.monotonic()
    stop_between_batches(query, grace_s=0.2, poll_s=0.01)
    assert query.stopped_after is not None and query.stopped_after > 1
    assert time.monotonic() - started >= 0.2
