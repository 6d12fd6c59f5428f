"""Whether the routed job a start launched is up.

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
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from keyplane.spark.job_checkpoint import last_commit
from keyplane.spark.job_log import LogFollower, last_meaningful, log_tail, parse_progress
from keyplane.spark.job_record import JobExited
from keyplane.util.processes import session_commands

if TYPE_CHECKING:
    from keyplane.spark.counts_job import BatchProgress

POLL_S = 0.25
PROGRESS_GRACE_S = 2.0
QUERY_GRACE_S = 3.0
"""How long a started query with no events must keep running to count as up: the
routed source fails on a bad store or key at its first planning, a trigger later."""


def await_first_batch(
    proc: subprocess.Popen[bytes],
    log: Path,
    checkpoint: Path,
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
    follower = LogFollower(log, log_offset)
    ready_at: float | None = None
    while True:
        for line in follower.new_lines():
            progress = parse_progress(line)
            if progress is not None:
                return progress
        code = proc.poll()
        if code is not None:
            tail = log_tail(log, log_offset)
            raise JobExited(
                f"the job exited with code {code} as it started: "
                f"{last_meaningful(tail)}; full log: {log}",
                tail,
            )
        now = time.monotonic()
        if ready_at is None:
            last = last_commit(checkpoint)
            if last is not None and (commits_before is None or last > commits_before):
                ready_at = now + PROGRESS_GRACE_S
            elif idle and _query_running(proc.pid):
                ready_at = now + QUERY_GRACE_S
        elif now >= ready_at:
            return None
        if now >= deadline:
            raise TimeoutError
        time.sleep(POLL_S)


def _query_running(session: int) -> bool:
    """Whether the job's streaming query runs: PySpark starts the runner of a Python
    streaming source (the routed source is one) when the query starts, in the job's
    session. The only sign of a started query that has no events to show for it."""
    return any(
        "pyspark.sql.streaming.python_streaming_source_runner" in command
        for command in session_commands(session)
    )
