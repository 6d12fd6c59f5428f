"""The routed source's record validation and its rows (pure: no broker, no Spark)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from keyplane.config import OperatorRouting, RoutingConfig, save
from keyplane.events import MAX_EVENT_BYTES, Forward, parse_event
from keyplane.handoff import routed_key_table
from keyplane.kafka.ranges import OffsetRange
from keyplane.routedkeys import find_salt, routed_key, spark_partition
from keyplane.spark import routed_source
from keyplane.spark.kafka_source import KafkaSourceOptionError
from keyplane.spark.routed_source import (
    RoutedEventsPartition,
    RoutedEventsReader,
    control_group,
    read_events,
)


def test_a_valid_event_parses_pure() -> None:
    raw = json.dumps({"seq": 3, "a": "x", "b": "y", "ts": 1000, "pad": ""}).encode()
    event, problem = parse_event(raw)
    assert problem is None
    assert event is not None and (event["seq"], event["a"], event["b"]) == (3, "x", "y")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "empty record"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"seq": 1, "b": "y", "ts": 5}).encode(), "field 'a'"),
        (json.dumps({"seq": "1", "a": "x", "b": "y", "ts": 5}).encode(), "field 'seq'"),
        (json.dumps({"seq": True, "a": "x", "b": "y", "ts": 5}).encode(), "field 'seq'"),
        (b"\xff\xfe", "not JSON"),
        (b"{" + b" " * MAX_EVENT_BYTES + b"}", "oversized"),
    ],
)
def test_invalid_records_say_why_pure(raw: bytes | None, reason: str) -> None:
    event, problem = parse_event(raw)
    assert event is None
    assert problem is not None and reason in problem


def test_control_groups_cannot_collide_with_keys_pure() -> None:
    assert control_group("B", "k", 4).startswith("\x00")
    assert control_group("A", "k", 4) != control_group("B", "k", 4)


def test_control_rows_share_one_group_per_instance_pure() -> None:
    """10,000 routed keys' control rows travel in P groups, each on its own instance,
    the group of the routed key's instance: one Python call per instance, not per key."""
    p = 4
    keys = [f"key{i}#{i % 7}" for i in range(10_000)]
    groups = {control_group("A", key, p) for key in keys}
    assert len(groups) == p
    assert sorted(spark_partition(group, p) for group in groups) == list(range(p))
    for key in keys[:200]:
        assert spark_partition(control_group("B", key, p), p) == spark_partition(key, p)


def _read_stand_in_records(
    values: list[bytes], forward: Forward, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[dict]:
    """``read_events`` over ``values``, served by a stand-in for the Kafka read, in two
    chunks; routing reads a real all-hash store."""
    half = len(values) // 2
    chunks = [(values[:half], 0), (values[half:], half)]
    monkeypatch.setattr(
        routed_source,
        "read_range",
        lambda part: iter(
            pa.table({"value": vs, "offset": list(range(first, first + len(vs)))})
            for vs, first in chunks
        ),
    )
    save(RoutingConfig.all_hash(4, ("A", "B")), tmp_path / "routing")
    kafka = OffsetRange("127.0.0.1:1", "events", 0, 0, len(values))
    partition = RoutedEventsPartition(
        kafka, str(tmp_path / "routing"), 4, 1, 1, MAX_EVENT_BYTES, forward
    )
    return pa.Table.from_batches(list(read_events(partition))).to_pylist()


@pytest.mark.parametrize("forward", ["pairs", "tuples"])
def test_the_padding_is_carried_in_tuples_mode_only_pure(
    forward: Forward, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = [
        json.dumps({"seq": 0, "a": "x", "b": "y", "ts": 1000, "pad": "pp"}).encode(),
        json.dumps({"seq": 1, "a": "x", "b": "z", "ts": 1000}).encode(),
        json.dumps({"seq": 2, "a": "w", "b": "y", "ts": 1000, "pad": 7}).encode(),
    ]
    rows = _read_stand_in_records(values, forward, tmp_path, monkeypatch)

    assert [(r["kind"], r["a"], r["b"], r["n"]) for r in rows] == [
        ("event", "x", "y", 1),
        ("event", "x", "z", 1),
        ("event", "w", "y", 1),
    ]
    if forward == "pairs":
        assert all("pad" not in r for r in rows)
    else:
        assert [r["pad"] for r in rows] == ["pp", None, None]


@pytest.mark.parametrize("forward", ["pairs", "tuples"])
def test_pairs_mode_combines_a_partitions_events_per_routed_key_and_field_2_key_pure(
    forward: Forward, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row per (routed key, field-2 key) over the whole partition, across its
    chunks, with the number of events and the latest event time; a malformed record
    stays a row of its own. ``tuples`` mode keeps one row per event."""
    events = [("x", "y", 5000), ("x", "z", 1000), ("x", "y", 9000), ("w", "y", 2000)]
    values = [
        json.dumps({"seq": seq, "a": a, "b": b, "ts": ts}).encode()
        for seq, (a, b, ts) in enumerate(events)
    ]
    values.insert(3, b"not json")
    rows = _read_stand_in_records(values, forward, tmp_path, monkeypatch)

    invalid = [r for r in rows if r["kind"] == "invalid"]
    assert [json.loads(r["detail"])["offset"] for r in invalid] == [3]
    got = [(r["a"], r["b"], r["n"], r["ts"].timestamp()) for r in rows if r["kind"] == "event"]
    if forward == "pairs":
        assert sorted(got) == [("w", "y", 1, 2.0), ("x", "y", 2, 9.0), ("x", "z", 1, 1.0)]
    else:
        assert got == [(a, b, 1, ts / 1000) for a, b, ts in events]


def test_an_unknown_forward_mode_is_refused_in_one_line_pure() -> None:
    options = {
        "kafka.bootstrap.servers": "127.0.0.1:1",
        "subscribe": "events",
        "control.topic": "control",
        "migration.topic": "migration",
        "routing.store": "/nowhere",
        "state.partitions": "4",
        "initial.version": "1",
    }
    assert RoutedEventsReader(options).forward == "pairs"
    assert RoutedEventsReader({**options, "forward": "tuples"}).forward == "tuples"
    with pytest.raises(KafkaSourceOptionError, match="one of pairs, tuples, got 'tuple'"):
        RoutedEventsReader({**options, "forward": "tuple"})


def test_events_go_to_the_stage_b_route_of_their_stage_a_instance_pure() -> None:
    """The source picks each pair's routed key of B (no routing table in the stages): an
    unsplit key keeps its one route; a split key takes the route on stage A's own
    instance when it has one there, and a route of the key otherwise."""
    p = 4
    routing = OperatorRouting(parallelism=p, table={"y": 2}, hot_keys={"x": (0, 1, 2)})
    table_b = routed_key_table(routing)
    route = routed_source._stage_b_routes(table_b, p)
    on = {i: routed_key("k", find_salt("k", i, p)) for i in range(p)}
    assert route(on[0], "y") == table_b.route("y")[0]
    assert spark_partition(route(on[0], "y"), p) == 2
    for instance in (0, 1, 2):
        chosen = route(on[instance], "x")
        assert chosen in table_b.route("x")
        assert spark_partition(chosen, p) == instance
    assert route(on[3], "x") in table_b.route("x")
