"""A streaming query's progress reports, reduced to what operators and metrics need.

Spark reports each micro-batch as a JSON progress event. keyplane's job
prints one ``progress {json}`` line per batch (:data:`PROGRESS_PREFIX`) for
``keyplane demo`` and ``keyplane job status``, and the routed job's metrics
records take their rate, duration and lag from the same report. A batch's
rows are the records it read from the events topic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql.streaming import StreamingQuery

PROGRESS_PREFIX = "progress "


@dataclass(frozen=True)
class BatchProgress:
    """One micro-batch, as shown to the operator."""

    batch_id: int
    rows: int
    rows_per_s: float
    duration_ms: int
    lag: int
    committed: int


def _offset_total(offsets: Any) -> int:
    """Sum of a progress report's per-partition offsets.

    Spark reports offsets as a JSON string, and reports ``null`` for the
    latest offset of the first batch after a restart.
    """
    if isinstance(offsets, str):
        offsets = json.loads(offsets)
    if not isinstance(offsets, dict):
        return 0
    if isinstance(offsets.get("events"), dict):
        offsets = offsets["events"]  # the routed source's offset
    return sum(int(o) for parts in offsets.values() for o in parts.values())


def _records_read(source: dict[str, Any], end: Any) -> int | None:
    """The records the routed source's batch read, which its offset records.

    Its rows are not its records: in ``pairs`` mode one row stands for a
    task's events of one pair (:func:`keyplane.spark.routed_reads.read_events`)
    and control rows are not records of the events topic, so Spark's
    ``numInputRows`` would not count the batch's events. A report of no rows
    read nothing: Spark reports a trigger that ran no batch under the last
    batch's id and end offset. ``end`` is the source's parsed end offset.
    """
    if not (isinstance(end, dict) and isinstance(end.get("read"), int)):
        return None
    return int(end["read"]) if source.get("numInputRows") else 0


def records_read(query: StreamingQuery) -> int:
    """The records ``query`` has read so far, over its recent progress reports."""
    return sum(progress_of(p).rows for p in query.recentProgress)


def phases_ms(p: dict[str, Any]) -> dict[str, int]:
    """Where a batch's time went: Spark's ``durationMs`` by phase, the whole left out.

    ``triggerExecution`` is the batch's whole duration (``duration_ms``); the
    others are its phases, timed on the driver: asking the source for its
    offsets (``latestOffset``), planning (``queryPlanning``), running the
    batch's Spark jobs and the sink (``addBatch``), and writing the offset
    and commit logs (``walCommit``, ``commitOffsets``). A slow batch's phases
    tell an operator whether the driver or the tasks took the time.
    """
    durations = p.get("durationMs") or {}
    return {name: int(ms) for name, ms in durations.items() if name != "triggerExecution"}


def _input_rows(p: dict[str, Any]) -> int:
    """A report's input rows. A live report has them at the top; the copy of a report in
    Spark's event log has them only per source."""
    if "numInputRows" in p:
        return int(p["numInputRows"])
    return sum(int(source.get("numInputRows", 0)) for source in p.get("sources") or [])


def _parsed(offset: Any) -> Any:
    return json.loads(offset) if isinstance(offset, str) else offset


def _plans(source: dict[str, Any]) -> bool:
    """Whether ``source`` is keyplane's routed source, whose offset holds the batch's plan."""
    end = _parsed(source.get("endOffset"))
    return isinstance(end, dict) and "protocol" in end


def events_source(p: dict[str, Any]) -> dict[str, Any]:
    """The source of a progress report that read the events topic.

    The only source, unless Spark's connector reads the events beside
    keyplane's routed source, which then plans the batch and reads no events
    (:mod:`keyplane.spark.connector_events`).
    """
    sources = p.get("sources") or [{}]
    return next((source for source in sources if not _plans(source)), sources[0])


def planning_source(p: dict[str, Any]) -> dict[str, Any]:
    """The source of a progress report whose offset holds the batch's plan (else the first)."""
    sources = p.get("sources") or [{}]
    return next((source for source in sources if _plans(source)), sources[0])


def progress_of(p: dict[str, Any]) -> BatchProgress:
    source = events_source(p)
    end_offset = _parsed(source.get("endOffset"))
    end = _offset_total(end_offset)
    latest = _offset_total(source.get("latestOffset")) or end
    duration_ms = int(p.get("durationMs", {}).get("triggerExecution", 0))
    read = _records_read(source, end_offset)
    if read is None and _plans(planning_source(p)) and not _plans(source):
        # Spark's connector beside keyplane's source: the connector's rows are the events.
        rows = int(source.get("numInputRows") or 0)
        rows_per_s = rows * 1000 / duration_ms if duration_ms else 0.0
    elif read is None:
        rows = _input_rows(p)
        rows_per_s = float(p.get("processedRowsPerSecond") or 0.0)
    else:
        rows = read
        rows_per_s = read * 1000 / duration_ms if duration_ms else 0.0
    return BatchProgress(
        batch_id=int(p["batchId"]),
        rows=rows,
        rows_per_s=rows_per_s,
        duration_ms=duration_ms,
        lag=max(0, latest - end),
        committed=end,
    )
