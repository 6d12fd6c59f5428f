"""The routed job as a managed background process: start, stop, status.

One test runs the real job under Spark, started twice (a minute or two on 2
cores), with a user's keyed aggregate in stage B, and one a job that fails as
Spark starts. The others need no Spark:
they put a stand-in process (``sleep``) behind a pid file, or write the
checkpoint's logs or the controller's state file by hand, and say so in their
names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from keyplane.aggregates import (
    DEFAULT_AGGREGATE_SPEC,
    AggregateSpecError,
    RunningCount,
    ValueCounts,
)
from keyplane.cli import main as cli_main
from keyplane.cli.job import render_job_status
from keyplane.control.operators import OPERATORS
from keyplane.control.signing import MissingKeyError
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import produce_workload
from keyplane.reference.events import key_name
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save, version_path
from keyplane.settings import Settings
from keyplane.spark.counts_job import PROGRESS_PREFIX, job_command, parse_settings, read_results
from keyplane.spark.job_checks import stored_partitions
from keyplane.spark.job_record import JobError, JobExited, JobRecord
from keyplane.spark.jobprocess import JobProcess
from keyplane.testing import free_port
from keyplane.util.processes import alive, start_detached

JOB_COMMAND = (sys.executable, "-m", "keyplane.spark.counts_job", "--checkpoint", "x")
VALUE_COUNTS = "keyplane.aggregates:ValueCounts"


def _env(home: Path, broker: str, topic: str) -> dict[str, str]:
    """Settings of a job of its own: home, topics, and the test broker."""
    return {
        "KEYPLANE_HOME": str(home),
        "KEYPLANE_BOOTSTRAP_SERVERS": broker,
        "KEYPLANE_EVENTS_TOPIC": topic,
        "KEYPLANE_CONTROL_TOPIC": f"{topic}.control",
        "KEYPLANE_MIGRATION_TOPIC": f"{topic}.migration",
        "KEYPLANE_METRICS_TOPIC": f"{topic}.metrics",
    }


@pytest.fixture
def settings(
    tmp_path: Path, broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """Settings from the environment, as the CLI reads them, for this test's topics."""
    for name, value in _env(tmp_path / "home", broker, topic_name).items():
        monkeypatch.setenv(name, value)
    return Settings()


def _record(pid: int, command: tuple[str, ...] = JOB_COMMAND, log_offset: int = 0) -> JobRecord:
    return JobRecord(
        pid=pid,
        command=command,
        started_at=datetime.now(UTC),
        checkpoint=Path("/nonexistent/checkpoint"),
        output=Path("/nonexistent/output"),
        log_offset=log_offset,
    )


def _write_pid_file(job: JobProcess, record: JobRecord) -> None:
    job.pid_file.parent.mkdir(parents=True, exist_ok=True)
    job.pid_file.write_text(record.model_dump_json())


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A detached ``sleep`` standing in for the job's process."""
    proc = start_detached(["sleep", "300"], tmp_path / "stand-in.log")
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# --- the real job ----------------------------------------------------------------------------


def _answers(spec: ZipfEvolvingWorkload) -> dict[tuple[str, str], object]:
    """Ground truth of the job below: stage A's count per key (the running count), stage
    B's count of each field-1 value per key (:class:`~keyplane.aggregates.ValueCounts`)."""
    counts: Counter[str] = Counter()
    values: dict[str, Counter[str]] = {}
    for batch in spec.batches(100_000):
        for a, b in zip(batch.a.tolist(), batch.b.tolist(), strict=True):
            counts[key_name(a)] += 1
            values.setdefault(key_name(b), Counter())[key_name(a)] += 1
    return {("A", key): n for key, n in counts.items()} | {
        ("B", key): dict(sorted(met.items())) for key, met in values.items()
    }


@pytest.mark.integration
def test_start_status_stop_restart_of_the_routed_job(
    settings: Settings,
    broker: str,
    topic_name: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole life of the job under Spark, once, with the CLI's views of it.

    Stage B runs :class:`~keyplane.aggregates.ValueCounts`, a user's aggregate
    as ``keyplane job start --stage-b-aggregate`` names it; the CLI's second
    start finds the job only if it passes the same one. The restart has no
    events left to read, so it runs no batch: it must still be recognised as
    up rather than stopped at the timeout.
    """
    spec = ZipfEvolvingWorkload(n_events=3000, n_keys=500, seed=7)
    assert produce_workload(spec, broker, topic_name, partitions=2) == 3000
    job = JobProcess(settings, shuffle_partitions=2, stage_b_aggregate=VALUE_COUNTS)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the working directory

    try:
        started = job.start(timeout_s=300)
        again = job.start()
        assert cli_main(["job", "start", "--stage-b-aggregate", VALUE_COUNTS]) == 0
        status = job.status()
        deadline = time.monotonic() + 60
        while (
            status.metrics is None or status.metrics.last_busy is None
        ) and time.monotonic() < deadline:
            time.sleep(1)
            status = job.status()
        assert cli_main(["job", "status"]) == 0
        assert cli_main(["status"]) == 0
        stopped = job.stop()
        stopped_again = job.stop()
        restarted = job.start(timeout_s=300)
    finally:
        last_stop = job.stop()
    more = ZipfEvolvingWorkload(n_events=500, n_keys=500, seed=8)
    assert produce_workload(more, broker, topic_name, partitions=2) == 500
    while_down = job.status()

    assert not started.already_running and started.stale is None
    assert started.events_waiting == 3000
    assert started.first_progress is not None and started.first_progress.rows > 0
    assert again.already_running and again.record == started.record
    assert status.running == started.record
    assert status.last_progress is not None and status.last_progress.committed == 3000
    assert status.metrics is not None and status.metrics.last_busy is not None
    assert status.metrics.latest.versions == {"A": 1, "B": 1}
    assert status.metrics.latest.input_lag == 0
    assert sum(status.metrics.last_busy.load["A"].values()) > 0
    assert status.rollout is None and status.metrics_problem is None
    assert status.events_waiting == 0

    out = capsys.readouterr().out.splitlines()
    assert f"job already running (pid {started.record.pid}, up " in out[0]
    # Both `job status` and `status` name the aggregates.
    assert out.count(f"aggregates   A the running count, B {VALUE_COUNTS}") == 2
    assert "versions     A v1, B v1" in out
    assert "input lag    0 events at that batch" in out
    assert "unread       0 events past the checkpoint" in out
    assert "committed    3,000 events (batch " in "\n".join(out)
    assert f"broker       up at {broker}" in out
    assert f"job          running (pid {started.record.pid}, up " in "\n".join(out)
    assert "version      A v1, B v1" in out
    assert "lag          0 events (last batch " in "\n".join(out)

    assert stopped.outcome == "stopped" and stopped.record == started.record
    # Each stop waited for the running batch: none was cancelled under it. And the
    # workers' pandas warning about PySpark's own code is filtered out.
    log_text = job.log.read_text()
    assert "SPARK_JOB_CANCELLED" not in log_text and "FutureWarning" not in log_text
    # keyplane's own INFO lines reach the log: which engine runs the stages.
    assert re.search(
        r" INFO keyplane\.spark\.counts_job: pipeline '\w+': stages A, B run in ", log_text
    )
    assert " INFO kafka." not in log_text
    assert stopped_again.outcome == "not running"
    assert not alive(started.record.pid, started.record.command)
    results = read_results(job.output, {"A": RunningCount(), "B": ValueCounts()})
    answers = {(stage, key): result for stage, key, result in results.itertuples(index=False)}
    assert answers == _answers(spec)

    assert not restarted.already_running and restarted.record.pid != started.record.pid
    assert (restarted.events_waiting, restarted.first_progress) == (0, None)
    assert restarted.record.log_offset > 0
    assert last_stop.outcome == "stopped" and last_stop.record == restarted.record
    assert not job.pid_file.exists()
    assert while_down.running is None and while_down.events_waiting == 500
    assert while_down.committed is not None and while_down.committed.events == 3000
    # Each run's log ends with what the checkpoint committed, read from its logs.
    assert log_text.rstrip().endswith(
        f"stopped; the checkpoint has committed 3,000 events (batch "
        f"{while_down.committed.batch_id}; partitions 0: 1,500, 1: 1,500)"
    )
    # Spark's offset log names the checkpoint's partitions; a restart takes them.
    assert JobProcess(settings).shuffle_partitions() == 2
    with pytest.raises(JobError, match="runs 2 state partitions per operator, not 4"):
        JobProcess(settings, shuffle_partitions=4).shuffle_partitions()


@pytest.mark.integration
def test_a_job_that_exits_as_it_starts_fails_the_start_with_its_log(
    settings: Settings, broker: str, topic_name: str
) -> None:
    ensure_topic(broker, topic_name, 1)
    job = JobProcess(settings, master="no-such-master")

    with pytest.raises(JobExited) as failure:
        job.start(timeout_s=120)

    assert "the job exited with code 1 as it started: " in str(failure.value)
    assert "\n" not in str(failure.value)
    assert str(job.log) in str(failure.value)
    log = job.log.read_text()
    assert "Master must either be yarn or start with spark, k8s, or local" in log
    assert failure.value.log_tail and failure.value.log_tail[-1] in log
    assert "Error" in str(failure.value)
    assert not job.pid_file.exists()


# --- start refuses early, before Spark -------------------------------------------------------


def test_start_without_kafka_names_the_fix(tmp_path: Path) -> None:
    bootstrap = f"127.0.0.1:{free_port()}"
    job = JobProcess(Settings(home=tmp_path, bootstrap_servers=bootstrap))

    with pytest.raises(JobError, match=f"Kafka at {bootstrap} does not answer.*broker start"):
        job.start()

    assert not job.pid_file.exists() and not job.log.exists()


@pytest.mark.integration
def test_start_without_the_events_topic_names_the_fix(settings: Settings) -> None:
    job = JobProcess(settings)

    with pytest.raises(JobError, match=r"events topic .* does not exist.*keyplane generate"):
        job.start()

    assert not job.pid_file.exists() and not job.log.exists()


def test_start_without_a_control_key_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keyplane.control.signing import MissingKeyError

    monkeypatch.delenv("KEYPLANE_CONTROL_KEY", raising=False)
    job = JobProcess(Settings(home=tmp_path))

    with pytest.raises(MissingKeyError):
        job.start()

    assert not job.pid_file.exists()


def test_job_command_takes_topics_store_and_options_from_settings(tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path, bootstrap_servers="kafka:9092", events_topic="ev", metrics_topic="m"
    )
    job_settings = JobProcess(
        settings, shuffle_partitions=3, max_offsets_per_trigger=500, master="local[1]"
    ).job_settings()

    assert job_settings.bootstrap_servers == "kafka:9092"
    assert job_settings.events_topic == "ev" and job_settings.metrics_topic == "m"
    assert job_settings.routing_store == (tmp_path / "configs").resolve()
    assert job_settings.checkpoint == (tmp_path / "job" / "checkpoint").resolve()
    assert job_settings.output == (tmp_path / "job" / "output").resolve()
    assert (job_settings.shuffle_partitions, job_settings.max_offsets_per_trigger) == (3, 500)
    assert (job_settings.master, job_settings.source) == ("local[1]", "python")
    unlimited = JobProcess(settings).job_settings()
    assert "max_offsets_per_trigger" not in unlimited.model_fields_set


def test_the_job_reads_through_sparks_connector_when_asked_and_never_the_embedded_broker(
    tmp_path: Path,
) -> None:
    """``KEYPLANE_KAFKA_SOURCE=jvm`` reaches the job's command line; on the embedded broker
    that ``keyplane broker start`` runs here it is refused before anything starts, as the
    connector would stop short of the topic's end there."""
    on_kafka = Settings(home=tmp_path, bootstrap_servers="kafka:9092", kafka_source="jvm")
    assert JobProcess(on_kafka).job_settings().source == "jvm"
    assert JobProcess(Settings(home=tmp_path)).job_settings().source == "python"
    started_here = Settings(home=tmp_path, broker_engine="kafka", kafka_source="jvm")
    assert JobProcess(started_here).job_settings().source == "jvm"
    with pytest.raises(JobError, match="does not read the embedded broker"):
        JobProcess(Settings(home=tmp_path, kafka_source="jvm"))


def _fake_checkpoint(checkpoint: Path, partitions: int) -> None:
    """A committed batch 0 whose offset log entry records ``partitions``, in the layout
    Spark writes (the integration test above reads a real one)."""
    (checkpoint / "commits").mkdir(parents=True)
    (checkpoint / "offsets").mkdir()
    (checkpoint / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    metadata = {"batchWatermarkMs": 0, "conf": {"spark.sql.shuffle.partitions": str(partitions)}}
    (checkpoint / "offsets" / "0").write_text(f"v1\n{json.dumps(metadata)}\n{{}}\n")


def test_partitions_come_from_the_checkpoint_else_the_store_and_a_mismatch_is_refused_fake(
    tmp_path: Path,
) -> None:
    settings = Settings(home=tmp_path)
    assert JobProcess(settings).shuffle_partitions() == 4
    assert JobProcess(settings, shuffle_partitions=3).shuffle_partitions() == 3

    save(RoutingConfig.all_hash(2, OPERATORS), settings.config_store)
    assert JobProcess(settings).shuffle_partitions() == 2
    with pytest.raises(JobError) as by_store:
        JobProcess(settings, shuffle_partitions=4).job_settings()
    assert str(by_store.value) == (
        f"v1 in {settings.config_store} routes over 2 state partitions per operator, not 4; "
        "start with --shuffle-partitions 2, or publish a configuration for that many first"
    )

    job = JobProcess(settings)
    _fake_checkpoint(job.checkpoint, 8)
    assert JobProcess(settings).shuffle_partitions() == 8
    with pytest.raises(
        JobError, match=r"checkpoint .* runs 8 state partitions per operator, not 2"
    ):
        JobProcess(settings, shuffle_partitions=2).shuffle_partitions()


def test_a_store_that_binds_no_partition_count_records_none_and_leaves_the_count_free(
    tmp_path: Path,
) -> None:
    """No configuration, operators over different counts, or a store that cannot be read:
    nothing is on record, so the count asked for (4 by default) goes through."""
    settings = Settings(home=tmp_path)
    hashed = RoutingConfig.all_hash(2, OPERATORS)
    mixed = RoutingConfig.model_validate(
        {**hashed.model_dump(), "operators": {"A": {"parallelism": 2}, "B": {"parallelism": 3}}}
    )
    seen = [stored_partitions(settings.config_store)]
    save(mixed, settings.config_store)
    seen.append(stored_partitions(settings.config_store))
    free = (
        JobProcess(settings).shuffle_partitions(),
        JobProcess(settings, shuffle_partitions=3).shuffle_partitions(),
    )
    damaged = Settings(home=tmp_path / "damaged")
    save(hashed, damaged.config_store)
    with (version_path(damaged.config_store, 1) / "operator-000.table.parquet").open("ab") as table:
        table.write(b"x")
    seen.append(stored_partitions(damaged.config_store))

    assert seen == [None, None, None]
    assert free == (4, 3)
    assert JobProcess(damaged, shuffle_partitions=5).shuffle_partitions() == 5


def test_stage_aggregates_reach_the_job_command_line_and_its_record(tmp_path: Path) -> None:
    """What ``--stage-b-aggregate`` gives the job: its flag, parsed back into the job's
    settings, and the stage's aggregate that ``status`` reads from the pid file."""
    job = JobProcess(Settings(home=tmp_path), stage_b_aggregate=VALUE_COUNTS)
    command = job_command(job.job_settings())
    record = _record(1, tuple(command))

    parsed = parse_settings(command[3:])

    assert f"--stage-b-aggregate={VALUE_COUNTS}" in command
    assert not any(arg.startswith("--stage-a-aggregate") for arg in command)
    assert (parsed.stage_a_aggregate, parsed.stage_b_aggregate) == (None, VALUE_COUNTS)
    assert type(parsed.aggregates()["B"]).__name__ == "ValueCounts"
    assert record.aggregates() == {"A": None, "B": VALUE_COUNTS}
    assert _record(1).aggregates() == {"A": None, "B": None}


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("keyplane.aggregates", "expected 'module:attr'"),
        ("no_such_module:Agg", "cannot import 'no_such_module'"),
        ("keyplane.aggregates:Nope", "keyplane.aggregates has no 'Nope'"),
        ("keyplane.settings:Settings", "is not a KeyedAggregate: missing zero, add"),
    ],
)
def test_an_unloadable_aggregate_is_refused_before_anything_starts(
    tmp_path: Path, spec: str, problem: str
) -> None:
    with pytest.raises(AggregateSpecError) as failure:
        JobProcess(Settings(home=tmp_path), stage_a_aggregate=spec)

    assert str(failure.value).startswith(f"aggregate {spec!r}")
    assert problem in str(failure.value)
    assert not (tmp_path / "job").exists()


def test_a_checkpoint_keeps_the_aggregates_it_was_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start records the aggregates; once the checkpoint has a commit, a
    start with others is refused before Spark. Without a signing key every start
    that passes that check stops at the next one, so none reaches Kafka or Spark."""
    monkeypatch.delenv("KEYPLANE_CONTROL_KEY", raising=False)
    settings = Settings(home=tmp_path)
    first = JobProcess(settings, stage_b_aggregate=VALUE_COUNTS)
    with pytest.raises(MissingKeyError):
        first.start()
    (first.checkpoint / "commits").mkdir(parents=True)
    (first.checkpoint / "commits" / "0").write_text("v1\n{}\n")

    with pytest.raises(JobError) as refused:
        JobProcess(settings).start()
    with pytest.raises(MissingKeyError):
        JobProcess(settings, stage_b_aggregate=VALUE_COUNTS).start()
    # The running count named is the running count left out.
    with pytest.raises(MissingKeyError):
        JobProcess(
            settings, stage_a_aggregate=DEFAULT_AGGREGATE_SPEC, stage_b_aggregate=VALUE_COUNTS
        ).start()

    assert str(refused.value) == (
        f"the checkpoint {first.checkpoint} holds the states of A the running count, "
        f"B {VALUE_COUNTS}, not A the running count, B the running count; start with the "
        f"same aggregates, or move {first.directory} aside to start afresh"
    )
    assert not first.pid_file.exists() and not first.log.exists()


def test_a_checkpoint_with_commits_and_no_aggregates_record_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its states were written by aggregates nobody recorded: the start says which file is
    missing rather than guess them."""
    monkeypatch.delenv("KEYPLANE_CONTROL_KEY", raising=False)
    job = JobProcess(Settings(home=tmp_path), stage_a_aggregate=VALUE_COUNTS)
    (job.checkpoint / "commits").mkdir(parents=True)
    (job.checkpoint / "commits" / "3").write_text("v1\n{}\n")

    with pytest.raises(JobError, match=r"cannot read .*aggregates.json .*names the aggregates"):
        job.start()


# --- the pid file, with a stand-in process ---------------------------------------------------


def test_start_with_a_stand_in_job_running_does_nothing(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    job = JobProcess(Settings(home=tmp_path))
    record = _record(stand_in.pid, ("sleep", "300"))
    _write_pid_file(job, record)

    result = job.start()

    assert result.already_running and result.record == record
    assert stand_in.poll() is None and not job.log.exists()
    assert JobRecord.model_validate_json(job.pid_file.read_text()) == record


def test_a_stand_in_job_running_an_aggregate_is_shown_and_not_taken_for_another(
    tmp_path: Path,
) -> None:
    """A start that names other aggregates than the running job's is an error, not
    "already running"; the same ones find the job, and ``job status`` names them."""
    command = (
        sys.executable,
        "-c",
        "import time; time.sleep(300)",
        f"--stage-b-aggregate={VALUE_COUNTS}",
    )
    proc = start_detached(command, tmp_path / "stand-in.log")
    try:
        job = JobProcess(Settings(home=tmp_path), stage_b_aggregate=VALUE_COUNTS)
        record = _record(proc.pid, command)
        _write_pid_file(job, record)

        same = job.start()
        named_default = JobProcess(
            Settings(home=tmp_path),
            stage_a_aggregate=DEFAULT_AGGREGATE_SPEC,
            stage_b_aggregate=VALUE_COUNTS,
        ).start()
        with pytest.raises(JobError) as other:
            JobProcess(Settings(home=tmp_path)).start()
        lines = render_job_status(job.status(read_metrics=False), "metrics")
    finally:
        proc.kill()
        proc.wait()

    assert same.already_running and same.record == record
    assert named_default.already_running and named_default.record == record
    assert str(other.value) == (
        f"the job already runs (pid {proc.pid}) with A the running count, B {VALUE_COUNTS}, "
        "not A the running count, B the running count; a checkpoint keeps its aggregates "
        "for life"
    )
    assert f"aggregates   A the running count, B {VALUE_COUNTS}" in lines
    assert not job.log.exists()


def test_stop_of_a_stand_in_job_then_stop_again(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    job = JobProcess(Settings(home=tmp_path))
    _write_pid_file(job, _record(stand_in.pid, ("sleep", "300")))

    first = job.stop(timeout_s=10)
    second = job.stop()

    assert first.outcome == "stopped" and first.record is not None
    assert first.record.pid == stand_in.pid
    assert stand_in.wait(timeout=5) == -15
    assert not job.pid_file.exists()
    assert second.outcome == "not running" and second.record is None


def test_stop_kills_a_stand_in_job_that_ignores_sigterm(tmp_path: Path) -> None:
    command = (
        sys.executable,
        "-c",
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(300)",
    )
    log = tmp_path / "ignores.log"
    proc = start_detached(command, log)
    deadline = time.monotonic() + 30
    while "ready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    job = JobProcess(Settings(home=tmp_path))
    _write_pid_file(job, _record(proc.pid, command))

    result = job.stop(timeout_s=0.5)

    assert result.outcome == "killed"
    assert proc.wait(timeout=10) == -9
    assert not job.pid_file.exists()


def test_status_of_a_stale_pid_file_reports_it_and_removes_it(tmp_path: Path) -> None:
    job = JobProcess(Settings(home=tmp_path))
    record = _record(_dead_pid())
    _write_pid_file(job, record)

    status = job.status(read_metrics=False)

    assert status.running is None and status.stale == record
    assert not job.pid_file.exists()
    assert job.status(read_metrics=False).stale is None


def test_stop_of_a_stale_pid_file_removes_it(tmp_path: Path) -> None:
    job = JobProcess(Settings(home=tmp_path))
    record = _record(_dead_pid())
    _write_pid_file(job, record)

    result = job.stop()

    assert result.outcome == "stale" and result.record == record
    assert not job.pid_file.exists()


def test_a_reused_pid_is_not_taken_for_the_job_nor_signalled(tmp_path: Path) -> None:
    """The pid file names this test's own process, which runs another command line."""
    job = JobProcess(Settings(home=tmp_path))
    _write_pid_file(job, _record(os.getpid()))

    status = job.status(read_metrics=False)
    _write_pid_file(job, _record(os.getpid()))
    stopped = job.stop(timeout_s=1)

    assert status.running is None and status.stale is not None
    assert stopped.outcome == "stale"
    assert alive(os.getpid())


def test_an_unreadable_pid_file_names_the_fix(tmp_path: Path) -> None:
    job = JobProcess(Settings(home=tmp_path))
    job.pid_file.parent.mkdir(parents=True)
    job.pid_file.write_text('{"pid": "not a number"}')

    with pytest.raises(JobError, match=r"is not a job pid file .*if no job is running, remove it"):
        job.status(read_metrics=False)


# --- progress lines in the log ---------------------------------------------------------------


def _progress(batch_id: int, committed: int) -> str:
    return (
        f'{PROGRESS_PREFIX}{{"batch_id": {batch_id}, "rows": 10, "rows_per_s": 5.0, '
        f'"duration_ms": 2000, "lag": 0, "committed": {committed}}}\n'
    )


def test_status_shows_the_progress_of_the_running_run_only(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    job = JobProcess(Settings(home=tmp_path))
    job.log.parent.mkdir(parents=True)
    earlier = _progress(9, 90)
    job.log.write_text(earlier)
    _write_pid_file(job, _record(stand_in.pid, ("sleep", "300"), log_offset=len(earlier)))

    before = job.status(read_metrics=False)
    with job.log.open("a") as log:
        log.write(_progress(0, 15))
    after = job.status(read_metrics=False)

    assert before.running is not None and before.last_progress is None
    assert after.last_progress is not None and after.last_progress.committed == 15


def _committed_batch(checkpoint: Path, batch_id: int, events: dict[str, dict[str, int]]) -> None:
    """Batch ``batch_id`` planned and committed in the layout Spark writes (the real job's
    test above reads a real one): the offset log entry with the routed source's offset,
    then the commit log entry."""
    (checkpoint / "commits").mkdir(parents=True, exist_ok=True)
    (checkpoint / "offsets").mkdir(exist_ok=True)
    metadata = {"batchWatermarkMs": 0, "conf": {"spark.sql.shuffle.partitions": "2"}}
    source = {"plan": batch_id, "events": events, "control": 0, "migration": {}}
    (checkpoint / "offsets" / str(batch_id)).write_text(
        f"v1\n{json.dumps(metadata)}\n{json.dumps(source)}\n"
    )
    (checkpoint / "commits" / str(batch_id)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def test_status_counts_what_the_checkpoint_committed_not_the_last_progress_line_fake(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    """With hand-written checkpoint logs: the job's log printed batch 1 at 30,023 events,
    then the job went idle and committed batches 2 and 3 without a progress line; status
    and its rendering report the checkpoint's 51,004 events of batch 3, per partition. A
    batch planned but not committed (4) does not count."""
    settings = Settings(home=tmp_path, events_topic="ev")
    job = JobProcess(settings)
    job.log.parent.mkdir(parents=True)
    job.log.write_text(_progress(1, 30_023))
    _write_pid_file(job, _record(stand_in.pid, ("sleep", "300")))
    for batch_id, (p0, p1) in enumerate(((10_000, 10_000), (15_012, 15_011), (25_502, 25_502))):
        _committed_batch(job.checkpoint, batch_id + 1, {"ev": {"0": p0, "1": p1}})
    _committed_batch(job.checkpoint, 4, {"ev": {"0": 26_000, "1": 26_000}})
    (job.checkpoint / "commits" / "4").unlink()

    status = job.status(read_metrics=False)
    lines = render_job_status(status, settings.metrics_topic)

    assert status.committed is not None
    assert (status.committed.batch_id, status.committed.events) == (3, 51_004)
    assert status.committed.offsets == {0: 25_502, 1: 25_502}
    [committed] = [line for line in lines if line.startswith("committed")]
    assert committed.startswith(
        "committed    51,004 events (batch 3; partitions 0: 25,502, 1: 25,502), "
    )


# --- the metrics topic and the controller's state file ---------------------------------------


@pytest.mark.parametrize(
    ("write", "problem"),
    [
        (lambda path: path.write_text("{}"), "is not a controller state file"),
        (lambda path: path.write_bytes(b"\xff\xfe"), "cannot read the controller state file"),
        (lambda path: path.mkdir(), "cannot read the controller state file"),
    ],
    ids=["not-the-model", "not-utf-8", "a-directory"],
)
def test_an_unreadable_controller_file_is_a_status_problem_not_a_failure(
    tmp_path: Path, write: Callable[[Path], object], problem: str
) -> None:
    write(tmp_path / "controller.json")

    status = JobProcess(Settings(home=tmp_path)).status(read_metrics=False)

    assert status.rollout is None
    assert status.rollout_problem is not None
    assert problem in status.rollout_problem
    assert "move it aside" in status.rollout_problem


def test_start_of_a_running_job_refuses_options_it_does_not_run_with_fake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in process (``sh``) whose command line carries the job's flags: starting
    with the same options finds it running; with others, the start is refused in one line
    that names what differs, instead of "already running" and the options dropped."""
    command = (
        "sh",
        "-c",
        "sleep 300; :",
        "job",
        "--master=local[2]",
        "--shuffle-partitions=2",
        "--restart-delay-s=10.0",
    )
    proc = start_detached(list(command), tmp_path / "stand-in.log")
    try:
        monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
        job = JobProcess(Settings(home=tmp_path))
        _write_pid_file(job, _record(proc.pid, command))
        same = cli_main(["job", "start", "--shuffle-partitions", "2", "--restart-delay", "10"])
        same_out = capsys.readouterr().out
        other = cli_main(["job", "start", "--restarts", "2", "--forward", "pairs"])
        other_err = capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait()

    assert same == 0 and same_out.startswith(f"job already running (pid {proc.pid}, up ")
    assert other == 2
    assert other_err == (
        f"keyplane: the job already runs (pid {proc.pid}) with --restarts 0; options apply "
        "when it starts: stop it (`keyplane job stop`), then `keyplane job start --restarts 2`\n"
    )
