"""Routing the connector's records: the plan a batch's offset names (pure logic; the job
runs the router on Spark's connector and Apache Kafka in test_routed_counts.py)."""

from __future__ import annotations

import pyarrow as pa

from keyplane.spark.connector_events import ConnectorEventsRouter, by_source
from keyplane.spark.routed_partitions import EventRouting


def test_a_batch_routes_on_the_versions_and_prepared_version_of_its_logged_offset() -> None:
    router = ConnectorEventsRouter(
        "/ck", "/store", 4, "tuples", "per-instance", 2_048, (("a", "b", "poison"),)
    )
    offset = {"plan": 9, "routing": {"A": 3, "B": 2}, "prepared": 4, "protocol": {}}
    assert router.routing(offset) == EventRouting(
        "/store", 4, 3, 2, 2_048, "tuples", 4, (("a", "b", "poison"),)
    )
    assert router.routing({**offset, "prepared": None}).prepared is None


def test_a_chunk_is_routed_per_kafka_partition_it_holds_records_of() -> None:
    """A task that routes several partitions names each dead letter's own partition."""
    one = pa.RecordBatch.from_pydict(
        {"topic": ["clicks", "clicks"], "partition": [3, 3], "offset": [7, 8], "value": [b"", b""]}
    )
    assert [(name, [c.num_rows for c in cs]) for name, cs in by_source(one)] == [("clicks[3]", [2])]
    two = pa.RecordBatch.from_pydict(
        {
            "topic": ["clicks"] * 4,
            "partition": [3, 3, 0, 0],
            "offset": [9, 10, 0, 1],
            "value": [b"a", b"b", b"c", b"d"],
        }
    )
    pieces = [(name, [c.column("value").to_pylist() for c in cs]) for name, cs in by_source(two)]
    assert pieces == [("clicks[3]", [[b"a", b"b"]]), ("clicks[0]", [[b"c", b"d"]])]
    assert list(by_source(one.slice(0, 0))) == []
