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


def test_beside_keyplanes_planning_source_the_connectors_rows_are_the_batchs_events() -> None:
    """Spark's connector reads the events and keyplane's source only plans the batch and
    reads a rollout's rows: the batch is the connector's records, its offsets the
    connector's, and the plan keyplane's offset, whichever source Spark lists first."""
    from keyplane.spark.progress import events_source, planning_source

    planning = {
        "numInputRows": 40,
        "startOffset": '{"plan": 2, "protocol": {}, "routing": {"A": 1}, "read": 0}',
        "endOffset": '{"plan": 3, "protocol": {}, "routing": {"A": 2}, "read": 0, "events": {}}',
    }
    connector = {
        "numInputRows": 700,
        "endOffset": '{"t": {"0": 900, "1": 800}}',
        "latestOffset": '{"t": {"0": 1000, "1": 800}}',
    }
    for sources in ([planning, connector], [connector, planning]):
        report = {**LIVE, "numInputRows": 740, "sources": sources}
        assert events_source(report) is connector and planning_source(report) is planning
        progress = progress_of(report)
        assert (progress.rows, progress.committed, progress.lag) == (700, 1700, 100)
        assert progress.rows_per_s == 350.0
