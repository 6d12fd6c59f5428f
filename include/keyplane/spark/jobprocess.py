"""The routed streaming job as a managed background process (``keyplane job start|stop|status``).

The job runs for days, long after the shell that started it is gone, and the
controller, Airflow and the operator all need to know whether it runs and
what it does. So, like :class:`~keyplane.kafka.broker.EmbeddedBroker`, it runs
detached, and ``<home>/job/job.pid`` records its pid, command line, start
time, checkpoint and output, so that ``stop`` and ``status`` in another shell
find it. Its stdout and stderr go to ``<home>/job/job.log``, and
``<home>/job/aggregates.json`` names the stages' keyed aggregates
(:mod:`keyplane.aggregates`) whose states the checkpoint holds.

Start returns once the job is demonstrably up
(:func:`~keyplane.spark.job_startup.await_first_batch`); one that is not up
in time is stopped.

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
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from kafka.errors import KafkaError, KafkaTimeoutError

from keyplane.aggregates import canonical_spec, load_aggregate
from keyplane.control.signing import control_key
from keyplane.kafka.admin import TopicError, high_watermarks, partitions_of
from keyplane.kafka.broker import answers_kafka
from keyplane.pipeline import load_pipeline
from keyplane.reference.events import Forward
from keyplane.reference.pipeline import FIRST_STAGE, REFERENCE_PIPELINE, SECOND_STAGE
from keyplane.settings import Settings, StageEngine
from keyplane.spark.job_checkpoint import (
    checkpoint_partitions,
    committed_events,
    last_commit,
    last_committed_batch,
)
from keyplane.spark.job_checks import (
    check_checkpoint_aggregates,
    check_checkpoint_engine,
    check_checkpoint_not_ahead,
    check_same_options,
    partitions_on_record,
)
from keyplane.spark.job_log import last_meaningful, last_progress, log_tail
from keyplane.spark.job_record import JobError, JobExited, JobRecord, describe_aggregates
from keyplane.spark.job_startup import await_first_batch
from keyplane.spark.job_status import JobStatus, read_metrics_topic, read_rollout
from keyplane.util.processes import live_or_removed, start_detached, stop_detached, write_atomically
from keyplane.util.statefiles import read_model_file

if TYPE_CHECKING:
    from keyplane.spark.counts_job import BatchProgress, CountsJobSettings

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
WAIT_TIMEOUT_S = 600.0


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


def local_embedded_broker(settings: Settings) -> bool:
    """Whether the job reads the embedded broker that ``keyplane broker start`` runs here."""
    return settings.bootstrap_servers is None and settings.broker_engine == "embedded"


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
        if settings.kafka_source == "jvm" and local_embedded_broker(settings):
            raise JobError(
                "KEYPLANE_KAFKA_SOURCE=jvm: Spark's Kafka connector does not read the embedded "
                "broker (it takes the start of a partition's last record batch for its end, so "
                "the job would stop short of the topic's last events); start Apache Kafka with "
                "`keyplane broker start --engine kafka`, or read through keyplane's source "
                "(KEYPLANE_KAFKA_SOURCE=python)"
            )
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
            "source": s.kafka_source,
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
        if s.executors_initial is not None:
            values["executors_initial"] = s.executors_initial
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
        recorded = partitions_on_record(self.checkpoint, self.directory, self.settings.config_store)
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

    def running(self) -> JobRecord | None:
        """The record of the job running in this home, None when none runs."""
        return self._live_record()[0]

    def running_partitions(self, record: JobRecord) -> tuple[int, str] | None:
        """The state partitions per operator the running job ``record`` runs, and where that
        is recorded: its checkpoint's offset log, else its command line. None if neither says.
        """
        counted = checkpoint_partitions(self.checkpoint)
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
        aggregates (:func:`~keyplane.spark.job_checks.check_checkpoint_aggregates`)
        are checked first, as the job would otherwise fail on them only after Spark has started.
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
                check_same_options(running, self.given)
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
            check_checkpoint_aggregates(
                self.checkpoint, self.directory, self.aggregates_file, self.aggregates
            )
            check_checkpoint_engine(self.checkpoint, self.directory, self.stage_engine)
            waiting = self._events_waiting(settings)
            command = job_command(settings)
            log_offset = self.log.stat().st_size if self.log.exists() else 0
            commits_before = last_commit(self.checkpoint)
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
            progress = await_first_batch(
                proc,
                self.log,
                self.checkpoint,
                log_offset,
                commits_before,
                waiting == 0,
                launched + timeout_s,
            )
        except TimeoutError:
            stop_detached(proc.pid, STOP_TIMEOUT_S, terminate_group=False)
            self.pid_file.unlink(missing_ok=True)
            raise JobError(
                f"the job was not up within {timeout_s:.0f} s and was stopped "
                f"(last log line: {last_meaningful(log_tail(self.log, log_offset))}); "
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
        check_checkpoint_not_ahead(
            self.checkpoint,
            bootstrap,
            settings.events_topic,
            settings.control_topic,
            settings.migration_topic,
        )
        try:
            partitions = partitions_of(bootstrap, settings.events_topic, timeout_s=2.0)
        except TopicError:
            raise JobError(
                f"the events topic {settings.events_topic!r} does not exist; write events "
                "with `keyplane generate` or create it with `keyplane topic create`"
            ) from None
        return self._unread(bootstrap, settings.events_topic, partitions)

    def _unread(self, bootstrap: str, topic: str, partitions: list[int]) -> int | None:
        """Events of ``topic`` past the checkpoint's last committed batch (None: unknown)."""
        committed = committed_events(self.checkpoint, topic)
        if committed is None:
            return None
        end = sum(high_watermarks(bootstrap, topic, partitions).values())
        return max(0, end - committed)

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
            last_progress=last_progress(self.log, log_offset),
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
