"""``keyplane job start|stop|wait|status``: the routed streaming job as a background process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from keyplane.cli.display import _duration, _job_line, _line, _rollout_line, _since, _versions
from keyplane.settings import Settings
from keyplane.spark.job_record import describe_aggregates
from keyplane.spark.job_status import JobStatus
from keyplane.spark.jobprocess import JobProcess


def render_job_status(status: JobStatus, metrics_topic: str) -> list[str]:
    """``keyplane job status``: the process, what its batches did, and the rollout."""
    lines = [_line("job", _job_line(status))]
    if status.running is not None and status.running.pipeline() is not None:
        lines.append(_line("pipeline", str(status.running.pipeline())))
    elif status.running is not None:
        lines.append(_line("aggregates", describe_aggregates(status.running.aggregates())))
    snapshot = status.metrics
    if status.metrics_problem is not None:
        lines.append(_line("metrics", f"unavailable: {status.metrics_problem}"))
    elif snapshot is None:
        lines.append(_line("metrics", f"no record on {metrics_topic} yet"))
    else:
        latest, busy = snapshot.latest, snapshot.last_busy
        lines += [
            _line("versions", _versions(latest.versions)),
            _line("last batch", f"{latest.batch_id} ({_duration(_since(snapshot.latest_at))} ago)"),
            _line("input lag", f"{latest.input_lag:,} events at that batch"),
        ]
        if busy is None:
            lines.append(_line("rows/s", "no batch with events among the last records"))
        else:
            lines.append(
                _line(
                    "rows/s",
                    f"{busy.rows_per_s:,.0f} (batch {busy.batch_id}: {busy.rows:,} rows "
                    f"in {busy.duration_ms / 1000:.1f} s)",
                )
            )
            locality = busy.locality
            lines.append(
                _line(
                    "locality",
                    "no tuples between stages"
                    if locality is None
                    else f"{locality:.1%} ({busy.local_hops:,} of {busy.hops:,} tuples between "
                    "stages stayed on their executor)",
                )
            )
            imbalances = [
                f"{op} {value:.2f}"
                for op in sorted(busy.load)
                if (value := busy.imbalance(op)) is not None
            ]
            lines.append(
                _line("imbalance", ", ".join(imbalances) + " (max/mean instance load)")
                if imbalances
                else _line("imbalance", "no load measured")
            )
    if status.events_waiting is not None:
        lines.append(_line("unread", f"{status.events_waiting:,} events past the checkpoint"))
    committed = status.committed
    if committed is not None:
        ago = _duration(_since(committed.committed_at))
        lines.append(_line("committed", f"{committed.describe()}, {ago} ago"))
    lines.append(_line("rollout", _rollout_line(status)))
    lines.append(_line("log", str(status.log)))
    return lines


def _import_from_the_working_directory() -> None:
    """Let a stage's ``module:attr`` name a module of the current directory, as the job does.

    The job runs as ``python -m`` in this directory, which puts it first on the
    job's import path; the ``keyplane`` script's path has the script's own
    directory there instead, so without this the check at the boundary would
    refuse a module the job imports (uvicorn's ``--app-dir`` does the same).
    """
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)


def _job_process(settings: Settings, args: argparse.Namespace) -> JobProcess:
    specs = (getattr(args, "stage_a_aggregate", None), getattr(args, "stage_b_aggregate", None))
    if any(specs) or getattr(args, "pipeline", None):
        _import_from_the_working_directory()
    return JobProcess(
        settings,
        pipeline=getattr(args, "pipeline", None),
        shuffle_partitions=getattr(args, "shuffle_partitions", None),
        max_offsets_per_trigger=getattr(args, "max_offsets_per_trigger", None),
        master=getattr(args, "master", None),
        stage_a_aggregate=specs[0],
        stage_b_aggregate=specs[1],
        forward=getattr(args, "forward", None),
        max_event_bytes=getattr(args, "max_event_bytes", None),
        restarts=getattr(args, "restarts", None),
        restart_delay_s=getattr(args, "restart_delay", None),
        stage_engine=getattr(args, "stage_engine", "auto"),
    )


def cmd_job(settings: Settings, args: argparse.Namespace) -> int:
    job = _job_process(settings, args)
    if args.action == "start":
        started = job.start(timeout_s=args.timeout)
        record = started.record
        if started.already_running:
            print(
                f"job already running (pid {record.pid}, up "
                f"{_duration(_since(record.started_at))}); nothing to do"
            )
            return 0
        if started.stale is not None:
            print(f"removed the stale pid file of pid {started.stale.pid} (its process had died)")
        first = started.first_progress
        if first is not None:
            batch = f"batch {first.batch_id} read {first.rows:,} events"
        elif started.events_waiting == 0:
            batch = "no events to read yet"
        else:
            batch = "its first batch read no events"
        print(
            f"job started (pid {record.pid}) in {started.ready_after_s:.0f} s: {batch}; "
            f"log {job.log}"
        )
        return 0
    if args.action == "stop":
        stopped = job.stop(timeout_s=args.timeout)
        if stopped.outcome == "not running":
            print("no job was running")
        elif stopped.outcome == "stale":
            assert stopped.record is not None
            print(
                f"no job was running; removed the stale pid file of pid {stopped.record.pid} "
                "(its process had died)"
            )
        elif stopped.outcome == "stopped":
            assert stopped.record is not None
            print(f"job stopped (pid {stopped.record.pid}, {stopped.seconds:.1f} s)")
        else:
            assert stopped.record is not None
            print(
                f"job killed (pid {stopped.record.pid}): it did not stop within "
                f"{args.timeout:.0f} s of SIGTERM; its checkpoint makes the restart exact"
            )
        return 0
    if args.action == "wait":
        caught_up = job.wait_caught_up(timeout_s=args.timeout)
        done = caught_up.committed
        through = done.describe() if done is not None else "no events"
        print(f"job caught up with {job.events_topic!r}: {through}")
        return 0
    status = job.status()
    for line in render_job_status(status, settings.metrics_topic):
        print(line)
    return 0 if status.running is not None else 1
