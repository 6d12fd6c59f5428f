"""Progress parsing of the counting job (pure: Spark's progress JSON as input)."""

from __future__ import annotations

import json

from keyplane.spark.counts_job import progress_of


def _progress(end: object, latest: object) -> dict[str, object]:
    return {
        "batchId": 7,
        "numInputRows": 300,
        "processedRowsPerSecond": 150.0,
        "durationMs": {"triggerExecution": 2000},
        "sources": [{"endOffset": end, "latestOffset": latest}],
    }


def test_lag_is_latest_minus_committed() -> None:
    end = json.dumps({"t": {"0": 100, "1": 200}})
    latest = json.dumps({"t": {"0": 150, "1": 260}})
    p = progress_of(_progress(end, latest))
    assert (p.batch_id, p.rows, p.committed, p.lag, p.duration_ms) == (7, 300, 300, 110, 2000)


def test_null_latest_offset_after_restart_counts_as_no_lag() -> None:
    p = progress_of(_progress(json.dumps({"t": {"0": 5}}), None))
    assert (p.committed, p.lag) == (5, 0)
    p = progress_of(_progress(json.dumps({"t": {"0": 5}}), "null"))
    assert (p.committed, p.lag) == (5, 0)
