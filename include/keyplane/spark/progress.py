"""A streaming query's progress reports, reduced to what operators and metrics need.

Spark reports each micro-batch as a JSON progress event. keyplane's job
prints one ``progress {json}`` line per batch (:data:`PROGRESS_PREFIX`) for
``keyplane demo`` and ``keyplane job status``, and the routed job's metrics
records take their rate, duration and lag from the same report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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


def progress_of(p: dict[str, Any]) -> BatchProgress:
    source = p["sources"][0] if p.get("sources") else {}
    end = _offset_total(source.get("endOffset"))
    latest = _offset_total(source.get("latestOffset")) or end
    return BatchProgress(
        batch_id=int(p["batchId"]),
        rows=int(p.get("numInputRows", 0)),
        rows_per_s=float(p.get("processedRowsPerSecond") or 0.0),
        duration_ms=int(p.get("durationMs", {}).get("triggerExecution", 0)),
        lag=max(0, latest - end),
        committed=end,
    )
