"""What the routed job's checkpoint records, read from Spark's commit and offset logs.

Spark writes ``offsets/<id>`` before a batch runs and ``commits/<id>`` once it
is done; each offset log entry holds a version line, a metadata line (the
query's ``spark.sql.shuffle.partitions`` among its settings), then one JSON
offset per source. The routed source's offset keeps the events' end offsets
per topic and partition under ``events``, unless Spark's connector reads the
events and keeps them in its own (:func:`events_read`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def _newest_batch(checkpoint: Path, log: str) -> int | None:
    """The newest batch id in the checkpoint's ``log`` folder, or None before the first."""
    try:
        ids = [int(p.name) for p in (checkpoint / log).iterdir() if p.name.isdigit()]
    except FileNotFoundError:
        return None
    return max(ids, default=None)


def last_commit(checkpoint: Path) -> int | None:
    """The newest batch id in the checkpoint's commit log (Spark writes ``commits/<id>``
    once a batch has finished), or None before the first."""
    return _newest_batch(checkpoint, "commits")


def newest_logged_batch(checkpoint: Path) -> int | None:
    """The newest batch id in the checkpoint's offset log (Spark writes ``offsets/<id>``
    before it runs the batch), or None before the first."""
    return _newest_batch(checkpoint, "offsets")


def offset_log_entry(checkpoint: Path, batch_id: int) -> list[str]:
    """The lines of ``batch_id``'s offset log entry: a version line, a metadata line, then
    one JSON offset per source. Raises OSError when it cannot be read."""
    return (checkpoint / "offsets" / str(batch_id)).read_text(encoding="utf-8").splitlines()


def _last_offset_log_entry(checkpoint: Path) -> list[str] | None:
    """The lines of the offset log entry of the checkpoint's last committed batch: a
    version line, a metadata line, then one JSON offset per source. None before the
    first commit; raises OSError when it cannot be read."""
    last = last_commit(checkpoint)
    return None if last is None else offset_log_entry(checkpoint, last)


def newest_offset_log_entry(checkpoint: Path) -> list[str] | None:
    """The lines of the checkpoint's newest offset log entry (the batch a restart runs
    first), or None before the first batch or when it cannot be read."""
    try:
        last = newest_logged_batch(checkpoint)
        return None if last is None else offset_log_entry(checkpoint, last)
    except OSError:
        return None


def source_offset(lines: list[str]) -> dict[str, Any] | None:
    """The routed source's offset among an offset log entry's ``lines``, or None. Raises
    ValueError on a line that is not JSON."""
    for line in lines[2:]:
        offset = json.loads(line)
        if isinstance(offset, dict) and isinstance(offset.get("events"), dict):
            return offset
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
    last = last_commit(checkpoint)
    if last is None:
        return None
    try:
        committed_at = datetime.fromtimestamp(
            (checkpoint / "commits" / str(last)).stat().st_mtime, UTC
        )
        parts = events_read(offset_log_entry(checkpoint, last), topic)
        if parts is not None:
            offsets = {int(p): int(off) for p, off in parts.items()}
            return CommittedBatch(last, offsets, committed_at)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def events_read(lines: list[str], topic: str) -> dict[str, int] | None:
    """The end offsets per partition of ``topic`` in an offset log entry's ``lines``.

    keyplane's routed source keeps them under ``events``; when Spark's
    connector reads the events (:mod:`keyplane.spark.connector_events`), the
    routed source's ``events`` is empty and the connector's own offset is
    ``{topic: {partition: offset}}``. Empty when the routed source has read
    none of ``topic``; None when no source's offset is either.
    """
    found: dict[str, int] | None = None
    for line in lines[2:]:
        offset = json.loads(line)
        if not isinstance(offset, dict):
            continue
        events = offset.get("events")
        if isinstance(events, dict) and topic in events:
            return dict(events[topic])
        if isinstance(offset.get(topic), dict):
            return dict(offset[topic])
        if isinstance(events, dict):
            found = {}
    return found


def checkpoint_partitions(checkpoint: Path) -> int | None:
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


def committed_events(checkpoint: Path, topic: str) -> int | None:
    """Events of ``topic`` the checkpoint's last committed batch had read through.

    The routed source's offset keeps the events' end offsets under
    ``events``. 0 for a new checkpoint; None when the log cannot be read
    that way.
    """
    try:
        lines = _last_offset_log_entry(checkpoint)
        if lines is None:
            return 0
        parts = events_read(lines, topic)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return None if parts is None else sum(int(off) for off in parts.values())
