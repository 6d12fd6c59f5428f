"""The lines that ``keyplane job status`` and ``keyplane status`` share: a label and its
value, durations, the job's process, its routing versions and the rollout."""

from __future__ import annotations

from datetime import UTC, datetime

from keyplane.spark.job_status import JobStatus


def _line(label: str, value: str) -> str:
    return f"{label:<12} {value}"


def _duration(seconds: float) -> str:
    """A short human duration: "42 s", "3 min 05 s", "2 h 07 min", "3 d 4 h"."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h} h"


def _since(moment: datetime) -> float:
    return (datetime.now(UTC) - moment).total_seconds()


def _job_line(status: JobStatus) -> str:
    if status.running is not None:
        record = status.running
        return f"running (pid {record.pid}, up {_duration(_since(record.started_at))})"
    if status.stale is not None:
        return (
            f"not running: its process (pid {status.stale.pid}) had died; "
            "removed the stale pid file"
        )
    return "not running"


def _rollout_line(status: JobStatus) -> str:
    rollout = status.rollout
    if status.rollout_problem is not None:
        return f"unknown: {status.rollout_problem}"
    if rollout is None:
        return "none on record"
    if rollout.in_flight is not None:
        text = f"v{rollout.in_flight} in flight from v{rollout.active_version}, {rollout.step}"
    else:
        text = f"idle at v{rollout.active_version}"
    if rollout.last_version is not None:
        outcome = "done" if rollout.last_outcome == "DONE" else "aborted"
        text += f"; last: v{rollout.last_version} {outcome}"
    return text


def _versions(versions: dict[str, int]) -> str:
    return ", ".join(f"{op} v{version}" for op, version in sorted(versions.items())) or "unknown"
