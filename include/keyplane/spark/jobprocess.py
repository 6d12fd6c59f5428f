"""The routed streaming job as a managed background process (``keyplane job start|stop|status``).

The job runs for days, long after the shell that started it is gone, and the
controller, Airflow and the operator all need to know whether it runs and
what it does. So, like :class:`~keyplane.kafka.broker.EmbeddedBroker`, it runs
detached, and ``<home>/job/job.pid`` records its pid, command line, start
time, checkpoint and output, so that ``stop`` and ``status`` in another shell
find it. Its stdout and stderr go to ``<home>/job/job.log``, and
``<home>/job/aggregates.json`` names the stages' keyed aggregates
(:mod:`keyplane.aggregates`) whose states the checkpoint holds.

Start returns once the job is demonstrably up, because Spark takes seconds to
start and most failures (Kafka, the configuration store, the signing key)
show up only when the query plans its first batch. Up means a ``progress``
line in the log (a batch that read events) or a new commit in the
checkpoint's commit log. A job with no events to read, though, runs no batch
at all (the routed source plans one only when there is work), so then the
query running is enough: the sign of that is PySpark's runner of the Python
streaming source in the job's session, alive for a few seconds. A job that
exits first fails the start with the end of its log; one that is not up in
time is stopped.

Stop sends SIGTERM to the job's Python process only. Its handler stops the
query between two batches (it waits up to ``STOP_GRACE_S`` for the running
one), then Spark; a SIGTERM to the whole process group
would also reach the JVM, whose shutdown hooks would tear Spark down under a
running batch. Either way the checkpoint makes the restart exact.

``keyplane.spark.counts_job`` (the job's settings and its progress lines)
imports PySpark, which takes seconds; it is imported where it is used, so
that every other ``keyplane`` command, which imports this module, stays quick.

Status reads three sources, each on its own so that one being unavailable
(broker down, no rollout yet) does not hide the others: the pid file and the
log (is the job running, with which aggregates, what was its last batch with
events), the last records of the metrics topic (routing versions, lag,
throughput, locality, imbalance), and the controller's state file (a rollout
in flight or the last one finished). Nothing is sent anywhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kafka.errors import KafkaError, KafkaTimeoutError
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from keyplane.aggregates import canonical_spec, load_aggregate
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.controller import ControllerError, read_controller_file
from keyplane.control.controller_protocol import Reconfiguration
from keyplane.control.signing import control_key
from keyplane.kafka.admin import TopicError, high_watermarks, partitions_of, tail_offsets
from keyplane.kafka.broker import answers_kafka
from keyplane.kafka.metrics_topic import read_metrics
from keyplane.kafka.offsets import CheckpointAheadError, check_not_ahead
from keyplane.pipeline import load_pipeline
from keyplane.reference.events import Forward
from keyplane.reference.pipeline import FIRST_STAGE, REFERENCE_PIPELINE, SECOND_STAGE
from keyplane.routing import config as config_store
from keyplane.settings import Settings, StageEngine
from keyplane.util.processes import (
    live_or_removed,
    session_commands,
    start_detached,
    stop_detached,
    write_atomically,
)
from keyplane.util.statefiles import read_model_file

if TYPE_CHECKING:
    from keyplane.spark.counts_job import BatchProgress, CountsJobSettings

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
WAIT_TIMEOUT_S = 600.0
METRICS_WINDOW = 600
"""Metrics records searched back from the end for the last batch that read events."""
LOG_TAIL_LINES = 20
POLL_S = 0.25
PROGRESS_GRACE_S = 2.0
QUERY_GRACE_S = 3.0
"""How long a started query with no events must keep running to count as up: the
routed source fails on a bad store or key at its first planning, a trigger later."""
CLI_FLAGS = {"--restart-delay-s": "--restart-delay"}
"""The job's flags that ``keyplane job start`` spells otherwise."""
AGGREGATE_FLAGS = {FIRST_STAGE: "--stage-a-aggregate", SECOND_STAGE: "--stage-b-aggregate"}
"""The job's command-line flag of each stage's keyed aggregate (``keyplane.spark.counts_job``)."""


class JobError(RuntimeError):
    """A job operation failed; the message (one line) says what to do about it."""


class JobExited(JobError):
    """The job exited before it was up; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: tuple[str, ...]) -> None:
        super().__init__(message)
        self.log_tail = log_tail


class JobRecord(BaseModel):
    """The pid file: which process runs the job, and where this run's log begins.

    ``log_offset`` is the size of the log when the run started, so that
    ``status`` never shows a progress line of an earlier run as this one's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int = Field(ge=1)
    command: tuple[str, ...]
    started_at: AwareDatetime
    checkpoint: Path
    output: Path
    log_offset: int = Field(default=0, ge=0)

    def flags(self) -> dict[str, str]:
        """The job's ``--flag=value`` options as its command line has them."""
        flags = {}
        for arg in self.command:
            flag, equals, value = arg.partition("=")
            if flag.startswith("--") and equals:
                flags[flag] = value
        return flags

    def aggregates(self) -> dict[str, str | None]:
        """Each stage's ``module:attr`` as the job's command line names it; None: the default.

        Read from the recorded command, the job's own settings, so that
        ``status`` needs neither PySpark nor the user's module to say it.
        """
        flags = self.flags()
        return {stage: canonical_spec(flags.get(flag)) for stage, flag in AGGREGATE_FLAGS.items()}

    def pipeline(self) -> str | None:
        """The ``module:attr`` of the pipeline the job runs; None: the reference one."""
        return self.flags().get("--pipeline")

    def events_topic(self) -> str | None:
        """The topic the job reads, as its command line names it."""
        return self.flags().get("--events-topic")


@dataclass(frozen=True)
class StartResult:
    """What ``start`` did: launched a job (``already_running`` False) or found one.

    ``first_progress`` is the first batch that read events, None when the job
    came up without one. ``events_waiting`` is how many events the checkpoint
    had not read when the job was launched (None: unknown). ``stale`` is a
    dead job's pid file that was removed before starting.
    """

    record: JobRecord
    already_running: bool
    first_progress: BatchProgress | None = None
    ready_after_s: float = 0.0
    stale: JobRecord | None = None
    events_waiting: int | None = None


@dataclass(frozen=True)
class StopResult:
    """What ``stop`` found and did; ``record`` is None when there was no pid file."""

    outcome: Literal["stopped", "killed", "not running", "stale"]
    record: JobRecord | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class MetricsSnapshot:
    """The end of the metrics topic: the newest batch, and the newest one that read events.

    The newest batch may have read none (it carried only control messages or state
    moves), so throughput, locality and imbalance come
    from ``last_busy``; versions and lag from ``latest``.
    """

    latest: BatchMetrics
    latest_at: datetime
    last_busy: BatchMetrics | None
    records: int


@dataclass(frozen=True)
class RolloutState:
    """The controller's state file, summarised: a rollout in flight or the last finished one.

    ``step`` says where the rollout in flight stands ("waiting for ACK",
    "waiting for MIGRATED B", "next: DONE", ...).
    """

    active_version: int
    in_flight: int | None
    step: str | None
    last_version: int | None
    last_outcome: Literal["DONE", "ABORT"] | None


@dataclass(frozen=True)
class JobStatus:
    """Everything ``keyplane job status`` shows.

    ``running`` is the live job's record; ``stale`` a pid file whose process
    had died, removed while reading. ``events_waiting`` counts the events of
    the events topic past the checkpoint's last committed batch: the lag now,
    which unlike the last batch's ``input_lag`` keeps growing while the job
    is down (None: unknown). ``committed`` is the checkpoint's last committed
    batch (:func:`last_committed_batch`). ``metrics`` and ``rollout`` are None when there
    is nothing yet, or when their source could not be read: then
    ``metrics_problem`` or ``rollout_problem`` says why, in one line.
    """

    log: Path
    running: JobRecord | None
    stale: JobRecord | None
    last_progress: BatchProgress | None
    metrics: MetricsSnapshot | None
    rollout: RolloutState | None
    events_waiting: int | None = None
    metrics_problem: str | None = None
    rollout_problem: str | None = None
    committed: CommittedBatch | None = None


@dataclass(frozen=True)
class _PartitionsOnRecord:
    """A partition count the job must run with, kept with what the refusal of another
    count says: ``source`` where the count is recorded, ``fix`` how to start afresh."""

    count: int
    source: str
    fix: str


class JobProcess:
    """Start, stop and inspect the routed job recorded under ``<settings.home>/job``.

    Every topic, the bootstrap servers and the configuration store come from
    ``settings``; ``master`` defaults to ``settings.spark_master``.
    ``stage_a_aggregate`` and ``stage_b_aggregate`` name the stages' keyed
    aggregates as ``module:attr`` (None: the running count). They are
    loaded here, so that a bad one raises
    :class:`~keyplane.aggregates.AggregateSpecError` before anything starts
    rather than inside a Spark task of a detached process. ``forward`` is
    what stage A sends stage B and ``max_event_bytes`` the bound on one event's
    record (None: the source's default), as in
    :class:`~keyplane.spark.counts_job.CountsJobSettings`. ``stage_engine``
    says where the stages run (:data:`~keyplane.spark.routed_counts.StageEngine`);
    a checkpoint keeps the engine it was started on, and another one is
    refused before anything starts.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        shuffle_partitions: int | None = None,
        max_offsets_per_trigger: int | None = None,
        master: str | None = None,
        stage_a_aggregate: str | None = None,
        stage_b_aggregate: str | None = None,
        forward: Forward | None = None,
        max_event_bytes: int | None = None,
        restarts: int | None = None,
        restart_delay_s: float | None = None,
        stage_engine: StageEngine = "auto",
        pipeline: str | None = None,
    ) -> None:
        self.given = {
            flag: str(value)
            for flag, value in (
                ("--pipeline", pipeline),
                ("--shuffle-partitions", shuffle_partitions),
                ("--max-offsets-per-trigger", max_offsets_per_trigger),
                ("--master", master),
                ("--forward", forward),
                ("--max-event-bytes", max_event_bytes),
                ("--restarts", restarts),
                ("--restart-delay-s", restart_delay_s),
            )
            if value is not None
        }
        """The job's options given here (None is not given), as its command line has them."""
        restarts = 0 if restarts is None else restarts
        forward = "pairs" if forward is None else forward
        if restarts < 0:
            raise JobError(f"restarts must be 0 or more, not {restarts}")
        if shuffle_partitions is not None and shuffle_partitions < 1:
            raise JobError(f"the job needs 1 state partition or more, not {shuffle_partitions}")
        if max_event_bytes is not None and max_event_bytes < 1:
            raise JobError(f"the event size bound must be 1 byte or more, not {max_event_bytes}")
        if restart_delay_s is not None and restart_delay_s < 0:
            raise JobError(f"the restart delay must be 0 s or more, not {restart_delay_s}")
        for spec in (stage_a_aggregate, stage_b_aggregate):
            if spec is not None:
                load_aggregate(spec)
        spec = pipeline or settings.pipeline
        self.pipeline = None if spec == REFERENCE_PIPELINE else spec
        """The pipeline the job runs and whose sink it writes; None: the reference one."""
        self.events_topic = settings.events_topic
        """What the job reads, and what ``status`` measures its lag on."""
        if self.pipeline is not None:
            source = load_pipeline(self.pipeline).source
            if len(source.topics) != 1:
                raise JobError(
                    f"pipeline {self.pipeline!r} reads {len(source.topics)} topics; the routed "
                    "job reads one"
                )
            self.events_topic = source.topics[0]
        self.settings = settings
        self.directory = settings.home.resolve() / "job"
        self.pid_file = self.directory / "job.pid"
        self.log = self.directory / "job.log"
        self.checkpoint = self.directory / "checkpoint"
        self.output = self.directory / "output"
        self.aggregates_file = self.directory / "aggregates.json"
        self.requested_partitions = shuffle_partitions
        self.max_offsets_per_trigger = max_offsets_per_trigger
        self.master = master or settings.spark_master
        self.forward = forward
        self.max_event_bytes = max_event_bytes
        self.restarts = restarts
        self.restart_delay_s = restart_delay_s
        self.stage_engine = stage_engine
        self.aggregates = {
            FIRST_STAGE: canonical_spec(stage_a_aggregate),
            SECOND_STAGE: canonical_spec(stage_b_aggregate),
        }

    def job_settings(self) -> CountsJobSettings:
        """The routed job's settings. Only values given become flags of its command
        line, so unset options are left out rather than passed as ``None``."""
        from keyplane.spark.counts_job import CountsJobSettings

        s = self.settings
        values: dict[str, object] = {
            "bootstrap_servers": s.resolved_bootstrap_servers(),
            "events_topic": self.events_topic,
            "checkpoint": self.checkpoint,
            "output": self.output,
            "master": self.master,
            "shuffle_partitions": self.shuffle_partitions(),
            # The routed source is keyplane's own; KEYPLANE_KAFKA_SOURCE=jvm would fail the job.
            "source": "python",
            "routing_store": s.config_store.resolve(),
            "control_topic": s.control_topic,
            "migration_topic": s.migration_topic,
            "metrics_topic": s.metrics_topic,
            "dead_letter_topic": s.dead_letter_topic,
        }
        if self.max_offsets_per_trigger is not None:
            values["max_offsets_per_trigger"] = self.max_offsets_per_trigger
        for stage, spec in self.aggregates.items():
            if spec is not None:
                values[f"stage_{stage.lower()}_aggregate"] = spec
        if self.forward != "pairs":
            values["forward"] = self.forward
        if self.max_event_bytes is not None:
            values["max_event_bytes"] = self.max_event_bytes
        if self.restarts:
            values["restarts"] = self.restarts
        if self.restart_delay_s is not None:
            values["restart_delay_s"] = self.restart_delay_s
        if self.stage_engine != "auto":
            values["stage_engine"] = self.stage_engine
        if self.pipeline is not None:
            values["pipeline"] = self.pipeline
        return CountsJobSettings.model_validate(values)

    def shuffle_partitions(self) -> int:
        """The job's state partitions per operator: the ones asked for, else the ones it must use.

        Spark keeps a checkpoint's ``spark.sql.shuffle.partitions`` for the
        life of its query, and a stored configuration routes over a fixed
        number of instances; the job refuses either mismatch, but only after
        Spark is up. So a restart takes its checkpoint's, a first start the
        newest stored configuration's (4 with an empty store), and a number
        asked for that differs is refused here, in one line.
        """
        recorded = self._partitions_on_record()
        asked = self.requested_partitions
        if recorded is None:
            return 4 if asked is None else asked
        if asked is None:
            return recorded.count or 4
        if asked != recorded.count:
            raise JobError(
                f"{recorded.source} state partitions per operator, not {asked}; start with "
                f"--shuffle-partitions {recorded.count}, or {recorded.fix}"
            )
        return asked

    def _partitions_on_record(self) -> _PartitionsOnRecord | None:
        """The checkpoint's partitions, else the newest stored configuration's; None when
        neither records a count the job must run with."""
        counted = _checkpoint_partitions(self.checkpoint)
        if counted is not None:
            return _PartitionsOnRecord(
                counted,
                source=f"the checkpoint {self.checkpoint} runs {counted}",
                fix=f"move {self.directory} aside to start afresh",
            )
        return self._stored_partitions()

    def _stored_partitions(self) -> _PartitionsOnRecord | None:
        """The instances the newest stored configuration routes over, and where that is said;
        None when the store holds no configuration, cannot be read (the job refuses it
        itself, with the store's reason) or routes its operators over different counts."""
        store = self.settings.config_store
        try:
            latest = config_store.latest_version(store)
            config = None if latest is None else config_store.load(store, latest)
        except config_store.ConfigStoreError:
            return None
        if config is None:
            return None
        counts = {routing.parallelism for routing in config.operators.values()}
        if len(counts) != 1:
            return None
        (count,) = counts
        return _PartitionsOnRecord(
            count,
            source=f"v{config.version} in {store} routes over {count}",
            fix="publish a configuration for that many first",
        )

    def running(self) -> JobRecord | None:
        """The record of the job running in this home, None when none runs."""
        return self._live_record()[0]

    def running_partitions(self, record: JobRecord) -> tuple[int, str] | None:
        """The state partitions per operator the running job ``record`` runs, and where that
        is recorded: its checkpoint's offset log, else its command line. None if neither says.
        """
        counted = _checkpoint_partitions(self.checkpoint)
        if counted is not None:
            return counted, f"its checkpoint {self.checkpoint}"
        for arg in record.command:
            flag, _, value = arg.partition("=")
            if flag == "--shuffle-partitions" and value.isdigit():
                return int(value), "its command line"
        return None

    # --- the pid file ----------------------------------------------------------------------

    def _read_record(self) -> JobRecord | None:
        return read_model_file(
            self.pid_file,
            JobRecord,
            what="a job pid file",
            fix="if no job is running, remove it",
            error=JobError,
        )

    def _live_record(self) -> tuple[JobRecord | None, JobRecord | None]:
        """(running, stale): the live job's record, or the dead one's, whose file is removed."""
        return live_or_removed(self.pid_file, self._read_record())

    @contextlib.contextmanager
    def _start_lock(self) -> Iterator[None]:
        """Serialise check-and-launch, so that two concurrent starts launch one job."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "job.pid.lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # --- start / stop ----------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> StartResult:
        """Launch the job unless one runs, and wait until it is up (module docstring).

        Kafka, the events topic, the signing key and the checkpoint's
        aggregates (:meth:`_check_checkpoint_aggregates`) are checked first,
        as the job would otherwise fail on them only after Spark has started.
        A running job with other aggregates is an error, not "already
        running". A job that exits before it is up raises :class:`JobExited`;
        one not up within ``timeout_s`` is stopped and raises
        :class:`JobError`. Either way its pid file is removed.
        """
        with self._start_lock():
            running, stale = self._live_record()
            if running is not None:
                if running.aggregates() != self.aggregates:
                    raise JobError(
                        f"the job already runs (pid {running.pid}) with "
                        f"{describe_aggregates(running.aggregates())}, not "
                        f"{describe_aggregates(self.aggregates)}; a checkpoint keeps its "
                        "aggregates for life"
                    )
                self._check_same_options(running)
                return StartResult(record=running, already_running=True)
            from keyplane.spark.counts_job import job_command, reference_shape
            from keyplane.spark.pipeline_frames import check_recorded_pipeline

            settings = self.job_settings()
            # The pipeline's shape and its checkpoint's record, in one line, before the launch.
            pipeline = settings.job_pipeline()
            if self.stage_engine in ("jvm", "python") and not reference_shape(pipeline):
                raise JobError(
                    f"stage engine {self.stage_engine!r} runs the reference pipeline's two "
                    f"stages only, not pipeline {pipeline.name!r} "
                    f"({', '.join(pipeline.stage_names)}); use --stage-engine chain or auto"
                )
            check_recorded_pipeline(self.checkpoint, pipeline)
            self._check_checkpoint_aggregates()
            self._check_checkpoint_engine()
            waiting = self._events_waiting(settings)
            command = job_command(settings)
            log_offset = self.log.stat().st_size if self.log.exists() else 0
            commits_before = _last_commit(self.checkpoint)
            env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
            launched = time.monotonic()
            proc = start_detached(command, self.log, env)
            record = JobRecord(
                pid=proc.pid,
                command=tuple(command),
                started_at=datetime.now(UTC),
                checkpoint=self.checkpoint,
                output=self.output,
                log_offset=log_offset,
            )
            write_atomically(self.pid_file, record.model_dump_json(indent=2) + "\n")
        try:
            progress = self._await_first_batch(
                proc, log_offset, commits_before, waiting == 0, launched + timeout_s
            )
        except TimeoutError:
            stop_detached(proc.pid, STOP_TIMEOUT_S, terminate_group=False)
            self.pid_file.unlink(missing_ok=True)
            raise JobError(
                f"the job was not up within {timeout_s:.0f} s and was stopped "
                f"(last log line: {_last_meaningful(self._tail(log_offset))}); "
                "see the log, or give it longer with --timeout"
            ) from None
        except JobExited:
            self.pid_file.unlink(missing_ok=True)
            raise
        except BaseException:
            stop_detached(proc.pid, STOP_TIMEOUT_S, terminate_group=False)
            self.pid_file.unlink(missing_ok=True)
            raise
        return StartResult(
            record=record,
            already_running=False,
            first_progress=progress,
            ready_after_s=time.monotonic() - launched,
            stale=stale,
            events_waiting=waiting,
        )

    def _check_same_options(self, running: JobRecord) -> None:
        """Refuse options given for a start that the running job does not run with: they
        would apply only at its next start, and "already running" would hide that."""
        defaults = {"--forward": "pairs", "--restarts": "0"}
        flags = running.flags()
        differ = [
            (flag, value, flags.get(flag, defaults.get(flag, "unset")))
            for flag, value in self.given.items()
            if _same_value(value) != _same_value(flags.get(flag, defaults.get(flag, "unset")))
        ]
        if differ:
            wanted = " ".join(f"{CLI_FLAGS.get(flag, flag)} {value}" for flag, value, _ in differ)
            has = ", ".join(f"{CLI_FLAGS.get(flag, flag)} {value}" for flag, _, value in differ)
            raise JobError(
                f"the job already runs (pid {running.pid}) with {has}; options apply when it "
                f"starts: stop it (`keyplane job stop`), then `keyplane job start {wanted}`"
            )

    def _check_checkpoint_aggregates(self) -> None:
        """Refuse aggregates other than those whose states the checkpoint holds.

        The aggregates are fixed for the life of a checkpoint: its state store
        keeps each routed key's state as their ``encode`` wrote it, and another
        aggregate's ``decode`` would misread it inside a Spark task, after the
        job is up. So the first start of a checkpoint records them next to it,
        and a restart must name the same ones.
        """
        if _last_commit(self.checkpoint) is None:
            write_atomically(self.aggregates_file, json.dumps(self.aggregates) + "\n")
            return
        try:
            recorded = json.loads(self.aggregates_file.read_text(encoding="utf-8"))
            stored = {stage: canonical_spec(spec) for stage, spec in recorded.items()}
        except (OSError, ValueError, AttributeError) as exc:
            raise JobError(
                f"cannot read {self.aggregates_file} ({exc}); it names the aggregates "
                f"whose states {self.checkpoint} holds"
            ) from None
        if stored != self.aggregates:
            raise JobError(
                f"the checkpoint {self.checkpoint} holds the states of "
                f"{describe_aggregates(stored)}, not {describe_aggregates(self.aggregates)}; "
                f"start with the same aggregates, or move {self.directory} aside to start afresh"
            )

    def _check_checkpoint_engine(self) -> None:
        """Refuse a stage engine other than the one the checkpoint's stages ran on.

        Spark refuses a checkpoint whose stateful operators changed only at its
        first batch, in a detached process; the job's own check
        (:func:`~keyplane.spark.routed_counts.resolve_engine`) runs after Spark
        has started. So it is made here too, in one line.
        """
        if self.stage_engine == "auto":
            return
        from keyplane.spark.routed_counts import recorded_engine

        recorded = recorded_engine(self.checkpoint)
        if recorded is not None and recorded != self.stage_engine:
            raise JobError(
                f"stage engine {self.stage_engine!r}: the checkpoint {self.checkpoint} was "
                f"written by the {recorded!r} stages, and a checkpoint keeps its engine for life; "
                f"start with --stage-engine {recorded}, or move {self.directory} aside to start "
                "afresh"
            )

    def _events_waiting(self, settings: CountsJobSettings) -> int | None:
        """Check what the job needs before Spark starts, and count the events it has to read.

        The count (None when unknown) tells the start whether to wait for a
        batch: a job with nothing to read runs no batch at all.
        """
        control_key()
        bootstrap = settings.bootstrap_servers
        if not answers_kafka(bootstrap, timeout_s=2.0):
            raise JobError(
                f"Kafka at {bootstrap} does not answer; start the embedded "
                "broker with `keyplane broker start` or set KEYPLANE_BOOTSTRAP_SERVERS"
            )
        self._check_checkpoint_not_ahead(bootstrap)
        try:
            partitions = partitions_of(bootstrap, settings.events_topic, timeout_s=2.0)
        except TopicError:
            raise JobError(
                f"the events topic {settings.events_topic!r} does not exist; write events "
                "with `keyplane generate` or create it with `keyplane topic create`"
            ) from None
        return self._unread(bootstrap, settings.events_topic, partitions)

    def _check_checkpoint_not_ahead(self, bootstrap: str) -> None:
        """Refuse to start a checkpoint that has read further than its topics now reach.

        A broker that lost its records (memory storage, restarted) leaves the
        checkpoint ahead of every topic it reads; the job would fail on it
        only after Spark is up, in terms of Spark's plan. So the offsets of the
        checkpoint's newest batch, which a restart replays, are compared with
        the topics' ends first, and the first partition ahead is named.
        """
        offsets = _newest_source_offset(self.checkpoint)
        if offsets is None:
            return
        s = self.settings
        read: list[tuple[str, dict[str, int]]] = [
            (topic, dict(parts)) for topic, parts in offsets.get("events", {}).items()
        ]
        if "control" in offsets:
            read.append((s.control_topic, {"0": int(offsets["control"])}))
        if isinstance(offsets.get("migration"), dict):
            read.append((s.migration_topic, dict(offsets["migration"])))
        for topic, through in read:
            if not any(int(offset) > 0 for offset in through.values()):
                continue
            try:
                ends: dict[int, int] = high_watermarks(bootstrap, topic)
            except TopicError:
                ends = {}
            try:
                check_not_ahead(topic, through, ends)
            except CheckpointAheadError as error:
                raise JobError(
                    f"{error}".replace(
                        "the checkpoint has", f"the checkpoint {self.checkpoint} has"
                    )
                ) from None

    def _unread(self, bootstrap: str, topic: str, partitions: list[int]) -> int | None:
        """Events of ``topic`` past the checkpoint's last committed batch (None: unknown)."""
        committed = _committed_events(self.checkpoint, topic)
        if committed is None:
            return None
        end = sum(high_watermarks(bootstrap, topic, partitions).values())
        return max(0, end - committed)

    def _await_first_batch(
        self,
        proc: subprocess.Popen[bytes],
        log_offset: int,
        commits_before: int | None,
        idle: bool,
        deadline: float,
    ) -> BatchProgress | None:
        """The first progress line, or None once the job is up without one.

        The job is up without a progress line when a batch without events
        commits (the driver prints a batch's line up to a second after Spark
        commits it, hence :data:`PROGRESS_GRACE_S`), or, when ``idle`` (no
        events to read), once its query runs: then no batch comes at all.
        Raises :class:`JobExited` when the process ends, TimeoutError at
        ``deadline``.
        """
        follower = _LogFollower(self.log, log_offset)
        ready_at: float | None = None
        while True:
            for line in follower.new_lines():
                progress = _parse_progress(line)
                if progress is not None:
                    return progress
            code = proc.poll()
            if code is not None:
                tail = self._tail(log_offset)
                raise JobExited(
                    f"the job exited with code {code} as it started: "
                    f"{_last_meaningful(tail)}; full log: {self.log}",
                    tail,
                )
            now = time.monotonic()
            if ready_at is None:
                last = _last_commit(self.checkpoint)
                if last is not None and (commits_before is None or last > commits_before):
                    ready_at = now + PROGRESS_GRACE_S
                elif idle and _query_running(proc.pid):
                    ready_at = now + QUERY_GRACE_S
            elif now >= ready_at:
                return None
            if now >= deadline:
                raise TimeoutError
            time.sleep(POLL_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> StopResult:
        """SIGTERM the job, SIGKILL it after ``timeout_s``, remove its pid file.

        Repeating it is harmless: with no job running it reports so.
        """
        running, stale = self._live_record()
        if stale is not None:
            return StopResult(outcome="stale", record=stale)
        if running is None:
            return StopResult(outcome="not running")
        started = time.monotonic()
        clean = stop_detached(running.pid, timeout_s, terminate_group=False)
        self.pid_file.unlink(missing_ok=True)
        return StopResult(
            outcome="stopped" if clean else "killed",
            record=running,
            seconds=time.monotonic() - started,
        )

    def wait_caught_up(self, timeout_s: float, poll_s: float = 2.0) -> JobStatus:
        """Wait until the running job has committed every event its topic holds.

        For a script that writes events and then reads the results, as the
        tutorial does: the sink has every answer once this returns. A job
        that is not running, or still behind after ``timeout_s``, is a
        :class:`JobError`.
        """
        deadline = time.monotonic() + timeout_s
        bootstrap = self.settings.resolved_bootstrap_servers()
        while True:
            running, _ = self._live_record()
            if running is None:
                raise JobError(f"no job is running (its log: {self.log})")
            self.events_topic = running.events_topic() or self.events_topic
            waiting = self._events_unread(bootstrap)
            if waiting == 0:
                return self.status(read_metrics=False)
            if time.monotonic() >= deadline:
                count = "an unknown number of" if waiting is None else f"{waiting:,}"
                raise JobError(
                    f"the job still had {count} events of {self.events_topic!r} to read "
                    f"after {timeout_s:.0f} s (its log: {self.log})"
                )
            time.sleep(poll_s)

    # --- status ----------------------------------------------------------------------------

    def status(self, *, read_metrics: bool = True) -> JobStatus:
        """The job's process, last progress, latest metrics and the controller's rollout.

        Kafka is asked first whether it answers at all (2 s at most), as a
        client bootstrapping from a stopped broker waits 30 s.
        ``read_metrics=False`` skips Kafka, for a caller that knows it is down.
        """
        running, stale = self._live_record()
        if running is not None:
            # What the running job reads, whatever pipeline this command was given.
            self.events_topic = running.events_topic() or self.events_topic
        log_offset = running.log_offset if running is not None else 0
        metrics = metrics_problem = waiting = None
        if read_metrics:
            bootstrap = self.settings.resolved_bootstrap_servers()
            try:
                if not answers_kafka(bootstrap, timeout_s=2.0):
                    raise KafkaTimeoutError
                metrics = read_metrics_topic(bootstrap, self.settings.metrics_topic)
                waiting = self._events_unread(bootstrap)
            except (KafkaError, TopicError, OSError) as exc:
                metrics_problem = (
                    f"Kafka at {bootstrap} did not answer ({type(exc).__name__}); "
                    "is the broker running? `keyplane broker status`"
                )
        rollout = rollout_problem = None
        try:
            rollout = read_rollout(self.settings.controller_state)
        except JobError as exc:
            rollout_problem = str(exc)
        return JobStatus(
            log=self.log,
            running=running,
            stale=stale,
            last_progress=_last_progress(self.log, log_offset),
            metrics=metrics,
            rollout=rollout,
            events_waiting=waiting,
            metrics_problem=metrics_problem,
            rollout_problem=rollout_problem,
            committed=last_committed_batch(self.checkpoint, self.events_topic),
        )

    def _events_unread(self, bootstrap: str) -> int | None:
        topic = self.events_topic
        try:
            partitions = partitions_of(bootstrap, topic, timeout_s=1.0)
        except TopicError:
            return None
        return self._unread(bootstrap, topic, partitions)

    def _tail(self, offset: int) -> tuple[str, ...]:
        """The last lines this run wrote to the log."""
        try:
            with self.log.open("rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(offset, size - 16_384))
                text = handle.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ()
        lines = [line for line in text.splitlines() if line.strip()]
        return tuple(lines[-LOG_TAIL_LINES:])


def _same_value(text: str) -> str:
    """A flag's value compared as a number when it is one: ``10`` and ``10.0`` s agree."""
    try:
        return repr(float(text))
    except ValueError:
        return text


def describe_aggregates(aggregates: dict[str, str | None]) -> str:
    """The stages' aggregates in words: "A the running count, B myjob.aggregates:Distinct"."""
    return ", ".join(
        f"{stage} {spec or 'the running count'}" for stage, spec in sorted(aggregates.items())
    )


# --- the log -------------------------------------------------------------------------------


class _LogFollower:
    """The complete lines appended to a log since ``offset``, as they come."""

    def __init__(self, path: Path, offset: int) -> None:
        self._path = path
        self._offset = offset
        self._partial = b""

    def new_lines(self) -> list[str]:
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


def _parse_progress(line: str) -> BatchProgress | None:
    """The batch a ``progress`` line of the job reports; None for any other line."""
    from keyplane.spark.counts_job import PROGRESS_PREFIX, BatchProgress

    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        return BatchProgress(**json.loads(line[len(PROGRESS_PREFIX) :]))
    except (ValueError, TypeError):
        return None


def _last_progress(log: Path, start: int, block: int = 65_536) -> BatchProgress | None:
    """The last complete ``progress`` line after byte ``start`` of ``log``, read backwards,
    so that a log grown over days costs one block, not a full read."""
    from keyplane.spark.counts_job import PROGRESS_PREFIX

    prefix = PROGRESS_PREFIX.encode()
    try:
        handle = log.open("rb")
    except FileNotFoundError:
        return None
    with handle:
        pos = handle.seek(0, os.SEEK_END)
        carry: bytes | None = None
        while pos > start:
            step = min(block, pos - start)
            pos -= step
            handle.seek(pos)
            data = handle.read(step) + (carry or b"")
            lines = data.split(b"\n")
            if carry is None:
                lines.pop()  # text after the last newline: a line still being written
            carry = lines.pop(0) if pos > start else None
            for line in reversed(lines):
                if line.startswith(prefix):
                    parsed = _parse_progress(line.decode("utf-8", errors="replace"))
                    if parsed is not None:
                        return parsed
            if carry is None:
                break
    return None


_ERROR_LINE = re.compile(r"^\S.*(Error|Exception)\b")


def _last_meaningful(lines: tuple[str, ...]) -> str:
    """The line of a log tail that explains a failure: the last exception line (a Python
    traceback ends with it), else the last line."""
    if not lines:
        return "the log is empty"
    line = next((line for line in reversed(lines) if _ERROR_LINE.match(line)), lines[-1])
    line = line.strip()
    return line if len(line) <= 300 else line[:297] + "..."


def _last_commit(checkpoint: Path) -> int | None:
    """The newest batch id in the checkpoint's commit log (Spark writes ``commits/<id>``
    once a batch has finished), or None before the first."""
    try:
        ids = [int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit()]
    except FileNotFoundError:
        return None
    return max(ids, default=None)


def _last_offset_log_entry(checkpoint: Path) -> list[str] | None:
    """The lines of the offset log entry of the checkpoint's last committed batch: a
    version line, a metadata line, then one JSON offset per source. None before the
    first commit; raises OSError when it cannot be read."""
    last = _last_commit(checkpoint)
    if last is None:
        return None
    return (checkpoint / "offsets" / str(last)).read_text(encoding="utf-8").splitlines()


def _newest_source_offset(checkpoint: Path) -> dict[str, Any] | None:
    """The routed source's offset in the checkpoint's newest offset log entry (the batch a
    restart runs first), or None before the first batch or when it cannot be read so."""
    try:
        ids = [int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit()]
        if not ids:
            return None
        lines = (checkpoint / "offsets" / str(max(ids))).read_text(encoding="utf-8").splitlines()
        for line in lines[2:]:
            offset = json.loads(line)
            if isinstance(offset, dict) and isinstance(offset.get("events"), dict):
                return offset
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class CommittedBatch:
    """The checkpoint's last committed batch, as Spark's commit and offset logs record it.

    Read from the checkpoint rather than from the job's progress lines: Spark
    writes ``commits/<id>`` once a batch is done and ``offsets/<id>`` before it
    runs, whatever the job printed, so the count holds after idle periods,
    restarts and a log rotated away. ``offsets`` are the events topic's end
    offsets per partition; ``committed_at`` the commit file's time.
    """

    batch_id: int
    offsets: dict[int, int]
    committed_at: datetime

    @property
    def events(self) -> int:
        return sum(self.offsets.values())

    def describe(self) -> str:
        """``51,004 events (batch 812; partitions 0: 25,502, 1: 25,502)``."""
        parts = ", ".join(f"{p}: {offset:,}" for p, offset in sorted(self.offsets.items()))
        return f"{self.events:,} events (batch {self.batch_id}; partitions {parts or 'none'})"


def last_committed_batch(checkpoint: Path, topic: str) -> CommittedBatch | None:
    """The last batch committed in ``checkpoint`` and the offsets of ``topic`` it read
    through; None before the first commit or when the logs cannot be read that way."""
    last = _last_commit(checkpoint)
    if last is None:
        return None
    try:
        committed_at = datetime.fromtimestamp(
            (checkpoint / "commits" / str(last)).stat().st_mtime, UTC
        )
        lines = (checkpoint / "offsets" / str(last)).read_text(encoding="utf-8").splitlines()
        for line in lines[2:]:
            offset = json.loads(line)
            if isinstance(offset, dict) and isinstance(offset.get("events"), dict):
                parts = offset["events"].get(topic, {})
                return CommittedBatch(
                    last, {int(p): int(off) for p, off in parts.items()}, committed_at
                )
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def _checkpoint_partitions(checkpoint: Path) -> int | None:
    """The state partitions of the checkpoint's query: Spark records its
    ``spark.sql.shuffle.partitions`` in each offset log entry's metadata and runs a
    restarted query with it. None before the first commit, or when the log cannot be
    read that way."""
    try:
        lines = _last_offset_log_entry(checkpoint)
        if lines is None:
            return None
        return int(json.loads(lines[1])["conf"]["spark.sql.shuffle.partitions"])
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return None


def _committed_events(checkpoint: Path, topic: str) -> int | None:
    """Events of ``topic`` the checkpoint's last committed batch had read through.

    The routed source's offset keeps the events' end offsets under
    ``events``. 0 for a new checkpoint; None when the log cannot be read
    that way.
    """
    try:
        lines = _last_offset_log_entry(checkpoint)
        if lines is None:
            return 0
        for line in lines[2:]:
            offset = json.loads(line)
            if isinstance(offset, dict) and isinstance(offset.get("events"), dict):
                return sum(int(off) for off in offset["events"].get(topic, {}).values())
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def _query_running(session: int) -> bool:
    """Whether the job's streaming query runs: PySpark starts the runner of a Python
    streaming source (the routed source is one) when the query starts, in the job's
    session. The only sign of a started query that has no events to show for it."""
    return any(
        "pyspark.sql.streaming.python_streaming_source_runner" in command
        for command in session_commands(session)
    )


# --- the metrics topic and the controller --------------------------------------------------


def read_metrics_topic(
    bootstrap_servers: str, topic: str, *, window: int = METRICS_WINDOW, timeout_s: float = 10.0
) -> MetricsSnapshot | None:
    """The newest :class:`BatchMetrics` of partition 0 of ``topic``, and the newest with rows.

    None when the topic does not exist yet or holds no metrics record. The
    window comes from :func:`~keyplane.kafka.admin.tail_offsets`: it ends at
    the high watermark, since the embedded broker's ListOffsets under-reports
    it, and starts no earlier than the first retained record. Records that
    are not metrics are skipped.
    """
    try:
        partitions_of(bootstrap_servers, topic, timeout_s=1.0)
    except TopicError:
        return None
    starts, ends = tail_offsets(bootstrap_servers, topic, window, [0])
    end = ends[0]
    if end <= starts[0]:
        return None
    records = read_metrics(bootstrap_servers, topic, starts, ends, idle_timeout_s=timeout_s)
    if not records:
        return None
    latest = records[-1]
    busy = [record.metrics for record in records if record.metrics.rows > 0]
    return MetricsSnapshot(
        latest=latest.metrics,
        latest_at=datetime.fromtimestamp(latest.published_s, UTC),
        last_busy=busy[-1] if busy else None,
        records=end,
    )


def read_rollout(state_file: Path) -> RolloutState | None:
    """The controller's state file summarised, read without a control channel or key.

    None when no rollout was ever started (no file).
    """
    try:
        saved = read_controller_file(state_file)
    except ControllerError as exc:
        raise JobError(str(exc)) from None
    if saved is None:
        return None
    state = saved.protocol
    last = state.last
    outcome: Literal["DONE", "ABORT"] | None = None
    if last is not None and last.finish is not None:
        outcome = "DONE" if last.finish.type == "DONE" else "ABORT"
    current = state.current
    return RolloutState(
        active_version=state.active_version,
        in_flight=None if current is None else current.version,
        step=None if current is None else _step(current, state.operators),
        last_version=None if last is None else last.version,
        last_outcome=outcome,
    )


def _step(rollout: Reconfiguration, operators: tuple[str, ...]) -> str:
    """Where a rollout in flight stands: the reply it waits for, or the step it sends next."""
    if rollout.ack is None:
        return "waiting for ACK"
    for operator in operators:
        if operator not in rollout.migrated:
            if operator in rollout.propagated:
                return f"waiting for MIGRATED {operator}"
            return f"next: PROPAGATE {operator}"
    return "next: DONE"
