"""What the routed job's checkpoint records, read from offset log entries in Spark's layout
(pure logic: the job's integration tests read real ones)."""

from __future__ import annotations

import json

from keyplane.spark.job_checkpoint import events_read, source_offset

METADATA = '{"batchWatermarkMs":0,"batchTimestampMs":1796636762858,"conf":{}}'
PLAN = {"plan": 4, "protocol": {"format": 1}, "routing": {"A": 2, "B": 1}}


def test_the_committed_events_are_the_connectors_offsets_when_it_reads_them() -> None:
    """When Spark's connector reads the events, keyplane's offset has none of them, and the
    checkpoint's count of committed events comes from the connector's own offset."""
    skip = json.dumps({**PLAN, "events": {}})
    connector = json.dumps({"clicks": {"0": 1000, "1": 980}})
    assert events_read(["v1", METADATA, skip, connector], "clicks") == {"0": 1000, "1": 980}
    assert events_read(["v1", METADATA, connector, skip], "clicks") == {"0": 1000, "1": 980}
    own = json.dumps({**PLAN, "events": {"clicks": {"0": 7}}})
    assert events_read(["v1", METADATA, own], "clicks") == {"0": 7}
    assert events_read(["v1", METADATA, skip], "clicks") == {}
    assert events_read(["v1", METADATA, connector], "other") is None


def test_the_routed_sources_offset_is_found_among_the_entrys_lines_by_its_content() -> None:
    own = {**PLAN, "events": {}}
    connector = {"clicks": {"0": 1000}}
    assert source_offset(["v1", METADATA, json.dumps(connector), json.dumps(own)]) == own
    assert source_offset(["v1", METADATA, json.dumps(connector)]) is None
