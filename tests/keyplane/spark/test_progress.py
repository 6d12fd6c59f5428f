"""Reading Spark's progress reports, live and as Spark's event log keeps them (pure logic)."""

from __future__ import annotations

from keyplane.spark.progress import progress_of

LIVE = {
    "batchId": 3,
    "numInputRows": 500,
    "processedRowsPerSecond": 250.0,
    "durationMs": {"triggerExecution": 2000},
    "sources": [
        {
            "numInputRows": 500,
            "endOffset": '{"t": {"0": 900}}',
            "latestOffset": '{"t": {"0": 1000}}',
        }
    ],
}


def test_a_live_report_counts_its_top_level_input_rows() -> None:
    progress = progress_of(LIVE)
    assert (progress.rows, progress.committed, progress.lag) == (500, 900, 100)


def test_an_event_log_report_counts_its_sources_input_rows() -> None:
    """The event log's copy of a report has no top-level ``numInputRows`` (Spark computes it
    from the sources), and its offsets are objects rather than JSON strings."""
    logged = {key: value for key, value in LIVE.items() if key != "numInputRows"}
    logged["sources"] = [
        {"numInputRows": 300, "endOffset": {"t": {"0": 900}}},
        {"numInputRows": 200, "endOffset": {"u": {"0": 1}}},
    ]
    assert progress_of(logged).rows == 500
