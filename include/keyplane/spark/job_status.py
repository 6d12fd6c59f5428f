"""What ``keyplane job status`` shows, and the readers of its sources besides the job's own
files: the end of the metrics topic and the controller's state file.

Each source is read on its own, so that one being unavailable (broker down,
no rollout yet) does not hide the others. Nothing is sent anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.controller import ControllerError, read_controller_file
from keyplane.control.controller_protocol import Reconfiguration
from keyplane.kafka.admin import TopicError, partitions_of, tail_offsets
from keyplane.kafka.metrics_topic import read_metrics
from keyplane.spark.job_checkpoint import CommittedBatch
from keyplane.spark.job_record import JobError, JobRecord

if TYPE_CHECKING:
    from keyplane.spark.counts_job import BatchProgress

METRICS_WINDOW = 600
"""Metrics records searched back from the end for the last batch that read events."""


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
    batch (:func:`~keyplane.spark.job_checkpoint.last_committed_batch`). ``metrics``
    and ``rollout`` are None when there is nothing yet, or when their source could
    not be read: then
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
