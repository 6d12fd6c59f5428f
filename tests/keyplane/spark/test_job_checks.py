"""What a start compares with the topics' ends before Spark starts (pure logic; the CLI's
integration test restarts a broker under a real checkpoint)."""

from __future__ import annotations

from keyplane.spark.job_checks import checkpoint_reads


def test_a_checkpoint_whose_events_the_connector_read_is_checked_on_the_connectors_offsets() -> (
    None
):
    skip = {"plan": 4, "events": {}, "control": 12, "migration": {"0": 3}}
    reads = checkpoint_reads(skip, {"0": 1000, "1": 980}, "clicks", "ctl", "moves")
    assert reads == [
        ("clicks", {"0": 1000, "1": 980}),
        ("ctl", {"0": 12}),
        ("moves", {"0": 3}),
    ]


def test_a_checkpoint_whose_source_read_the_events_is_checked_on_the_sources_offsets() -> None:
    own = {"plan": 4, "events": {"clicks": {"0": 7}}, "control": 2}
    reads = checkpoint_reads(own, {"0": 7}, "clicks", "ctl", "moves")
    assert reads == [("clicks", {"0": 7}), ("ctl", {"0": 2})]
    assert checkpoint_reads({"events": {}}, {}, "clicks", "ctl", "moves") == []
