"""The routed source's record validation and its rows (pure: no broker, no Spark)."""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import TopicError
from keyplane.kafka.control import ControlRead
from keyplane.kafka.migration_topic import move_records
from keyplane.kafka.ranges import OffsetRange
from keyplane.reference.events import MAX_EVENT_BYTES, Forward, parse_event
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.handoff import StateMove, VersionedTables, routed_key_table, state_moves
from keyplane.routing.routedkeys import RoutedKeyTable, spark_partition
from keyplane.spark import routed_reads, routed_source
from keyplane.spark.kafka_source import KafkaSourceOptionError, ReadTask
from keyplane.spark.routed_partitions import (
    EventRouting,
    EvictPartition,
    MigrationPartition,
    RoutedEventsPartition,
    control_group,
    evict_groups,
    install_groups,
)
from keyplane.spark.routed_reads import batch_end_rows, read_events, read_evictions, read_installs
from keyplane.spark.routed_source import ControlMessagesLost, RoutedEventsReader
from keyplane.testing import moved_off_hash


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
        (b'{"seq":1,"a":"\xed\xa0\x80","b":"y","ts":5}', "not JSON"),
        (b'{"seq":1,"a":"\\ud800","b":"y","ts":5}', "surrogate"),
        (b'{"seq":1,"a":"x","b":"y","ts":5,"pad":"\\udc00"}', "surrogate"),
        (b'\xef\xbb\xbf{"seq":1,"a":"x","b":"y","ts":5}', "not JSON"),
        ('{"seq":1,"a":"x","b":"y","ts":5}'.encode("utf-16"), "not JSON"),
        (
            b'{"seq":1,"a":"x","b":"y","ts":5,"pad":' + b"[" * 30_000 + b"]" * 30_000 + b"}",
            "not JSON: nested deeper than 256",
        ),
        (b'{"seq":9223372036854775808,"a":"x","b":"y","ts":5}', "schema: field 'seq' out of range"),
        (b'{"seq":' + b"9" * 5_000 + b',"a":"x","b":"y","ts":5}', "schema: field 'seq'"),
        (b'{"seq":1,"a":"x","b":"y","ts":9223372036854775808}', "schema: field 'ts' out of range"),
        (b'{"seq":1,"a":"x","b":"y","ts":1000000000000000}', "schema: field 'ts' out of range"),
        (b'{"seq":1,"a":"x","b":"y","ts":-62135596800001}', "schema: field 'ts' out of range"),
    ],
)
def test_invalid_records_say_why_pure(raw: bytes | None, reason: str) -> None:
    event, problem = parse_event(raw)
    assert event is None
    assert problem is not None and reason in problem


@pytest.mark.parametrize("key", ["", "\x00B#2", "\U0010ffffe", "\x01", " "])
def test_keys_like_control_groups_are_valid_events_pure(key: str) -> None:
    """A key is data: its grouping value is escaped (keyplane.routing.routedkeys), not refused."""
    event, problem = parse_event(json.dumps({"seq": 1, "a": key, "b": key, "ts": 5}).encode())
    assert problem is None and event is not None and event["a"] == event["b"] == key


def test_control_groups_cannot_collide_with_keys_pure() -> None:
    assert control_group("B", "k", 4).startswith("\x00")
    assert control_group("A", "k", 4) != control_group("B", "k", 4)


def test_install_groups_sort_before_every_key_and_evict_groups_after_pure() -> None:
    """Spark calls a stateful operator's groups in the order of their grouping values
    (UTF-8 bytes): installs must run before any key's tuples, evictions after them."""
    table = RoutedKeyTable(n_instances=4, routing={})
    raw = ["", "a", "\x00", "\x01", "zz#3", "\uffff", "\U0010fffe#1", "\U0010ffff", "日本#0"]
    keys = [value for key in raw for value in table.route(key)]
    for stage in OPERATORS:
        for instance, (first, last) in enumerate(
            zip(install_groups(stage, 4), evict_groups(stage, 4), strict=True)
        ):
            assert spark_partition(first, 4) == spark_partition(last, 4) == instance
            for key in keys:
                assert first.encode() < key.encode() < last.encode()
    assert len(set(install_groups("A", 4)) | set(install_groups("B", 4))) == 8


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
        routed_reads,
        "read_range",
        lambda part: iter(
            pa.table({"value": vs, "offset": list(range(first, first + len(vs)))})
            for vs, first in chunks
        ),
    )
    save(RoutingConfig.all_hash(4, OPERATORS), tmp_path / "routing")
    kafka = OffsetRange("127.0.0.1:1", "events", 0, 0, len(values))
    partition = RoutedEventsPartition(
        kafka, EventRouting(str(tmp_path / "routing"), 4, 1, 1, MAX_EVENT_BYTES, forward)
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


@pytest.mark.parametrize("forward", ["pairs", "tuples"])
def test_an_events_time_is_exact_to_the_millisecond_in_both_modes_pure(
    forward: Forward, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last millisecond of the year 9999 and a time before 1970 come out exact:
    a float of seconds held them only to some microseconds (…59.998993)."""
    times = {253402300799999: datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)}
    times[-1] = datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    values = [
        json.dumps({"seq": seq, "a": f"a{seq}", "b": "y", "ts": ts}).encode()
        for seq, ts in enumerate(times)
    ]
    rows = _read_stand_in_records(values, forward, tmp_path, monkeypatch)

    assert sorted(r["ts"] for r in rows) == sorted(times.values())


@pytest.mark.parametrize("forward", ["pairs", "tuples"])
def test_records_that_are_not_utf8_are_dead_lettered_not_a_failed_task_pure(
    forward: Forward, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of these failed the task on every retry: in the first chunk, a key or a
    padding (forwarded in ``tuples`` mode) that Arrow cannot write as UTF-8; in the
    second, which Arrow's reader takes, bytes that are not UTF-8, kept as a key."""
    bad = {
        1: b'{"seq":1,"a":"\\ud800","b":"y","ts":1000}',
        2: b'{"seq":2,"a":"\xed\xa0\x80","b":"y","ts":1000}',
        3: b'{"seq":3,"a":"x","b":"y","ts":1000,"pad":"\\udc00"}',
        5: b'{"seq":5,"a":"\xff","b":"y","ts":1000}',
        6: b'{"seq":6,"a":"x","b":"y","ts":1000,"pad":"\xc0\xaf"}',
    }
    values = [
        bad.get(seq, json.dumps({"seq": seq, "a": "x", "b": "y", "ts": 1000}).encode())
        for seq in range(8)
    ]
    rows = _read_stand_in_records(values, forward, tmp_path, monkeypatch)

    details = [json.loads(r["detail"]) for r in rows if r["kind"] == "invalid"]
    assert [d["offset"] for d in details] == sorted(bad)
    assert all(d["reason"].startswith("not JSON") for d in details)
    # Each dead letter keeps the record's bytes: its text if UTF-8, else base64.
    assert {d["offset"] for d in details if "value_base64" in d} == {2, 5, 6}
    for d in details:
        kept = base64.b64decode(d["value_base64"]) if "value_base64" in d else d["value"].encode()
        assert kept == bad[d["offset"]]
    assert sum(r["n"] for r in rows if r["kind"] == "event") == len(values) - len(bad)
    assert {(r["a"], r["b"]) for r in rows if r["kind"] == "event"} == {("x", "y")}


@pytest.mark.parametrize("forward", ["pairs", "tuples"])
def test_deep_records_and_out_of_range_numbers_are_dead_lettered_not_a_failed_task_pure(
    forward: Forward, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of these failed the task on every retry: ``json.loads`` recursing past the
    limit; a ``seq`` or ``ts`` past 64 bits written to a ``LONG`` column; a ``ts``
    past year 9999 made a ``datetime`` (``tuples``) or a ``TIMESTAMP`` that no
    ``datetime`` holds (``pairs``). In the second chunk Arrow's reader takes every
    value, the bad ones included. The first and last milliseconds of the range stay
    events, in both modes."""
    deep = b"[" * 30_000 + b"]" * 30_000
    bad = {
        1: b'{"seq":1,"a":"x","b":"y","ts":1000,"pad":' + deep + b"}",
        2: b'{"seq":9223372036854775808,"a":"x","b":"y","ts":1000}',
        3: b'{"seq":3,"a":"x","b":"y","ts":9223372036854775808}',
        6: b'{"seq":6,"a":"x","b":"y","ts":1000000000000000}',
        8: b'{"seq":8,"a":"x","b":"y","ts":1000,"extra":' + b"[" * 256 + b"]" * 256 + b"}",
    }
    first_and_last = {4: ("first", -62135596800000), 7: ("last", 253402300799999)}
    values = []
    for seq in range(10):
        a, ts = first_and_last.get(seq, ("x", 1000))
        good = json.dumps({"seq": seq, "a": a, "b": "y", "ts": ts}).encode()
        values.append(bad.get(seq, good))
    rows = _read_stand_in_records(values, forward, tmp_path, monkeypatch)

    details = [json.loads(r["detail"]) for r in rows if r["kind"] == "invalid"]
    assert [(d["offset"], d["reason"].split(":")[0]) for d in details] == [
        (1, "not JSON"),
        (2, "schema"),
        (3, "schema"),
        (6, "schema"),
        (8, "not JSON"),
    ]
    events = [r for r in rows if r["kind"] == "event"]
    assert sum(r["n"] for r in events) == len(values) - len(bad)
    assert {r["a"]: r["ts"].year for r in events} == {"first": 1, "last": 9999, "x": 1970}


OPTIONS = {
    "kafka.bootstrap.servers": "127.0.0.1:1",
    "subscribe": "events",
    "control.topic": "control",
    "migration.topic": "migration",
    "state.partitions": "4",
    "initial.version": "1",
}


class _DeletedControlRecords:
    """A control topic whose records below ``earliest`` retention has deleted."""

    def __init__(self, earliest: int, end: int) -> None:
        self.earliest, self.end = earliest, end
        self.reads: list[int] = []

    def read(self, start: int) -> ControlRead:
        self.reads.append(start)
        if start < self.earliest:
            raise TopicError(f"offset {start} is out of range of control topic 'control'")
        return ControlRead(messages=(), rejected=(), end=self.end)

    def send(self, replies: object) -> None:
        pass


def _reader_over(
    topic: _DeletedControlRecords, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> RoutedEventsReader:
    """A reader whose control topic is ``topic`` and whose events topic has no events."""
    save(RoutingConfig.all_hash(4, OPERATORS), tmp_path / "routing")
    reader = RoutedEventsReader({**OPTIONS, "routing.store": str(tmp_path / "routing")})
    monkeypatch.setattr(reader, "channel", lambda: topic)
    earliest = {"events": {"0": 0}, "control": {"0": topic.earliest}}
    monkeypatch.setattr(reader, "_earliest", lambda name: earliest[name])
    monkeypatch.setattr(reader, "_marks", lambda name: {"0": 0})
    return reader


def test_a_new_checkpoint_reads_the_control_topic_from_its_first_kept_record_pure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deleted offsets 0-4: a new job starts at 5, as it starts each events
    partition at its first kept offset, rather than fail at every start."""
    topic = _DeletedControlRecords(earliest=5, end=8)
    reader = _reader_over(topic, tmp_path, monkeypatch)

    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())

    assert start["control"] == 5
    assert topic.reads == [5]
    assert end["control"] == 8


def test_a_restarted_job_that_missed_deleted_control_messages_says_so_pure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint at control offset 2 when the broker keeps 5 on: the job may have
    missed a PREPARE, PROPAGATE or ABORT, so it stops and says why, never skips ahead;
    a new checkpoint's first batch, which has read nothing, reads from the first kept."""
    topic = _DeletedControlRecords(earliest=5, end=8)
    reader = _reader_over(topic, tmp_path, monkeypatch)
    planned = {**reader.initialOffset(), "plan": 3, "control": 2}

    with pytest.raises(ControlMessagesLost, match=r"offset 2, but the broker keeps .* offset 5"):
        reader.latestOffset(planned, reader.getDefaultReadLimit())

    new = {**reader.initialOffset(), "control": 2}
    assert reader.latestOffset(new, reader.getDefaultReadLimit())["control"] == 8


def test_an_unknown_forward_mode_is_refused_in_one_line_pure() -> None:
    options = {**OPTIONS, "routing.store": "/nowhere"}
    assert RoutedEventsReader(options).forward == "pairs"
    assert RoutedEventsReader({**options, "forward": "tuples"}).forward == "tuples"
    with pytest.raises(KafkaSourceOptionError, match="one of pairs, tuples, got 'tuple'"):
        RoutedEventsReader({**options, "forward": "tuple"})


def test_rows_take_the_least_loaded_stage_b_route_of_their_key_pure() -> None:
    """The source picks each pair's routed key of B (no routing table in the stages): an
    unsplit key keeps its one route; a split key's rows, heaviest first, fill the
    instances the unsplit keys leave light, by this partition's own counts."""
    p = 4
    routing = OperatorRouting(parallelism=p, table={"y": 2}, hot_keys={"x": (0, 1, 2)})
    table_b = routed_key_table(routing)
    route = routed_reads._StageBRoutes(table_b)
    picked = route.row_routes(["x", "y", "x", "x", "z"], [5, 30, 20, 10, 1])
    assert picked[1] == table_b.route("y")[0]
    assert picked[4] == "z"
    instances = [spark_partition(r, p) for r in picked]
    assert all(r in table_b.route("x") for r in (picked[0], picked[2], picked[3]))
    assert instances[2] != 2 and instances[3] != 2
    assert {instances[2], instances[3]} == {0, 1}
    assert route.tuple_route("x") in table_b.route("x")
    unsplit = routed_reads._StageBRoutes(routed_key_table(OperatorRouting(parallelism=p)))
    assert unsplit.row_routes(["x", "y"], [3, 4]) == ["x", "y"]
    assert unsplit.tuple_route("y") == "y"


def _rollout_store(tmp_path: Path) -> tuple[Path, RoutingConfig, RoutingConfig]:
    """v1 all-hash; v2 moves 300 stage-A keys and 20 stage-B keys off their hash instance."""
    store = tmp_path / "routing"
    v1 = RoutingConfig.all_hash(4, OPERATORS)
    off_hash = {
        "A": moved_off_hash([f"a{i}" for i in range(300)], 4),
        "B": moved_off_hash([f"b{i}" for i in range(20)], 4),
    }
    v2 = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="manual",
        operators={op: OperatorRouting(parallelism=4, table=t) for op, t in off_hash.items()},
    )
    save(v1, store)
    save(v2, store)
    return store, v1, v2


def _offsets(events: dict[str, int], migration: dict[str, int], switch: list) -> dict:
    return {
        "plan": 7,
        "events": {"events": events},
        "migration": migration,
        "routing": {"A": 1, "B": 1},
        "switch": switch,
    }


def test_a_rollouts_evict_and_install_rows_ride_in_the_events_tasks_pure(tmp_path: Path) -> None:
    """A switch's evict rows and the moved states to install are shared out over the
    batch's events tasks (no task of their own, which ran alone after them); each
    switch's shares and the migration range's pieces are each read exactly once."""
    store, v1, v2 = _rollout_store(tmp_path)
    reader = RoutedEventsReader({**OPTIONS, "routing.store": str(store)})
    switches = [
        {"operator": "A", "from_version": 1, "to_version": 2},
        {"operator": "B", "from_version": 1, "to_version": 2},
    ]
    start = _offsets({"0": 0, "1": 0, "2": 5}, {"0": 10}, [])
    end = _offsets({"0": 50, "1": 50, "2": 5}, {"0": 13}, switches)

    parts = reader.partitions(start, end)

    assert all(isinstance(p, RoutedEventsPartition) for p in parts)
    assert [p.events.partition for p in parts] == [0, 1]  # partition 2 has nothing new
    handoffs = [h for p in parts for h in p.handoffs]
    for op in OPERATORS:
        shares = [h for h in handoffs if isinstance(h, EvictPartition) and h.operator == op]
        # The driver deals the switch's moves out: each once, the shares even.
        planned = [move for h in shares for move in h.moves]
        moves = state_moves(v1, v2, op, 4)
        assert Counter(planned) == Counter((m.key, m.source, m.target) for m in moves)
        assert len(shares) == 2 and abs(len(shares[0].moves) - len(shares[1].moves)) <= 1
        assert {h.marker for h in shares} == {7}
    pieces = [h.records for h in handoffs if isinstance(h, MigrationPartition)]
    assert sorted(o for r in pieces for o in range(r.start, r.end)) == [10, 11, 12]
    # Each task reads about as much of the rollout as the others.
    assert [len(p.handoffs) for p in parts] == [3, 3]

    # With no new events, the shares are the batch's tasks.
    idle = reader.partitions(end, {**end, "migration": {"0": 14}, "switch": []})
    assert [type(p) for p in idle] == [MigrationPartition]


class _RecordingTables(VersionedTables):
    """The worker's table cache, recording each table it loads."""

    def __init__(self, store: Path, parallelism: int) -> None:
        super().__init__(store, parallelism)
        self.loaded: list[tuple[int, str]] = []

    def _table(self, version: int, operator: str) -> RoutedKeyTable:
        self.loaded.append((version, operator))
        return super()._table(version, operator)


def test_beside_sparks_connector_the_source_reads_a_rollouts_rows_and_no_events_pure(
    tmp_path: Path,
) -> None:
    """With ``events=skip`` Spark's connector reads the events in the same query: the
    source's tasks read the switch's evictions and the moved states only, and it reports
    no events of its own."""
    store, _, _ = _rollout_store(tmp_path)
    skip = {**OPTIONS, "routing.store": str(store), "events": "skip"}
    with pytest.raises(KafkaSourceOptionError, match="needs option 'checkpoint'"):
        RoutedEventsReader(skip)
    reader = RoutedEventsReader({**skip, "checkpoint": str(tmp_path / "checkpoint")})
    switch = [{"operator": "A", "from_version": 1, "to_version": 2}]
    parts = reader.partitions(_offsets({}, {"0": 10}, []), _offsets({}, {"0": 13}, switch))
    assert parts and not any(isinstance(p, RoutedEventsPartition) for p in parts)
    assert {type(p).__name__ for p in parts} == {"EvictPartition", "MigrationPartition"}
    assert reader.reportLatestOffset() == {"events": {}}
    with pytest.raises(KafkaSourceOptionError, match="option 'events' is one of read, skip"):
        RoutedEventsReader({**OPTIONS, "routing.store": str(store), "events": "connector"})


def test_beside_sparks_connector_the_source_plans_the_batch_spark_runs_next_fake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan a ``skip`` source makes is stamped with the id Spark gives the next batch
    (the offset log's newest plus one), and it makes one whenever the topic holds events
    the connector has not read by that newest batch (with a fake broker's offsets)."""
    checkpoint = tmp_path / "checkpoint"
    reader = RoutedEventsReader(
        {**OPTIONS, "routing.store": str(tmp_path), "events": "skip", "checkpoint": str(checkpoint)}
    )
    ends = {"0": 50, "1": 30}
    monkeypatch.setattr(reader, "_marks", lambda topic: dict(ends))
    monkeypatch.setattr(reader, "_earliest", lambda topic: {"0": 0, "1": 0})
    assert reader._skipped_batch() == (0, True)
    (checkpoint / "offsets").mkdir(parents=True)
    plan = json.dumps({"plan": 6, "protocol": {}, "routing": {"A": 1, "B": 1}, "events": {}})
    for batch, read in ((6, {"0": 20, "1": 30}), (7, {"0": 50, "1": 30})):
        connector = json.dumps({"events": read})
        (checkpoint / "offsets" / str(batch)).write_text(f"v1\n{{}}\n{connector}\n{plan}\n")
    assert reader._skipped_batch() == (8, False)
    ends["1"] = 31
    assert reader._skipped_batch() == (8, True)


@pytest.mark.parametrize("prepared", [None, 2])
def test_tasks_load_an_acknowledged_version_ahead_of_its_switch_pure(
    prepared: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the job has acknowledged v2 and routes on v1 (the offset's ``prepared``),
    each events task loads v2's tables too (000 §3.4, PREPARE), so that the switch
    and install batches find them loaded."""
    store, _, _ = _rollout_store(tmp_path)
    reader = RoutedEventsReader({**OPTIONS, "routing.store": str(store)})
    start = _offsets({"0": 0}, {"0": 0}, [])
    end = {**_offsets({"0": 1}, {"0": 0}, []), "prepared": prepared}
    [part] = reader.partitions(start, end)
    assert isinstance(part, RoutedEventsPartition) and part.routing.prepared == prepared

    tables = _RecordingTables(store, 4)
    monkeypatch.setattr(routed_reads, "tables_for", lambda store, parallelism: tables)
    value = json.dumps({"seq": 0, "a": "a1", "b": "b1", "ts": 1000}).encode()
    monkeypatch.setattr(
        routed_reads, "read_range", lambda r: iter([pa.table({"value": [value], "offset": [0]})])
    )
    rows = pa.Table.from_batches(list(read_events(part))).to_pylist()

    assert [(r["a"], r["n"]) for r in rows] == [("a1", 1)]  # routed on v1 all the same
    ahead = [(2, "A"), (2, "B")] if prepared else []
    assert sorted(tables.loaded) == [(1, "A"), (1, "B"), *ahead]


class _GatedTables(VersionedTables):
    """The driver's table cache, whose hand-off planning waits for a gate to open."""

    def __init__(self, store: Path, parallelism: int) -> None:
        super().__init__(store, parallelism)
        self.gate = threading.Event()
        self.planned: list[tuple[str, int, int]] = []

    def _moves(self, operator: str, from_version: int, to_version: int) -> tuple[StateMove, ...]:
        assert self.gate.wait(timeout=30)
        self.planned.append((operator, from_version, to_version))
        return super()._moves(operator, from_version, to_version)


def test_the_driver_plans_an_acknowledged_versions_handoffs_off_the_batchs_path_pure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the boundary that acknowledges v2 the driver starts planning v1 → v2's moves and
    returns at once (the batch need not wait); later boundaries of the same rollout start
    nothing new; the switch batch's partitions wait for the plan and carry its moves."""
    store, v1, v2 = _rollout_store(tmp_path)
    tables = _GatedTables(store, 4)
    monkeypatch.setattr(routed_source, "tables_for", lambda store, parallelism: tables)
    reader = RoutedEventsReader({**OPTIONS, "routing.store": str(store)})

    reader._plan_handoffs(1, 2)  # the gate is shut: planning cannot have finished
    reader._plan_handoffs(1, 2)
    assert tables.planned == []
    tables.gate.set()
    switches = [{"operator": "A", "from_version": 1, "to_version": 2}]
    parts = reader.partitions(
        _offsets({"0": 0}, {"0": 0}, []), _offsets({"0": 1}, {"0": 0}, switches)
    )
    reader.stop()

    assert tables.planned == [("A", 1, 2), ("B", 1, 2)]  # once each, on the planning thread
    evicted = [move for part in parts for share in part.handoffs for move in share.moves]
    assert len(evicted) == len(state_moves(v1, v2, "A", 4)) == 300


def test_a_batch_reads_in_at_most_max_partitions_tasks_each_range_and_share_once_pure(
    tmp_path: Path,
) -> None:
    """With ``maxPartitions``, events ranges (their rollout shares with them) share tasks,
    balanced by their events; without it, each range has a task of its own."""
    store, _, _ = _rollout_store(tmp_path)
    options = {**OPTIONS, "routing.store": str(store)}
    switches = [{"operator": "A", "from_version": 1, "to_version": 2}]
    start = _offsets({str(p): 0 for p in range(5)}, {"0": 0}, [])
    end = _offsets({"0": 90, "1": 10, "2": 10, "3": 40, "4": 40}, {"0": 4}, switches)

    alone = RoutedEventsReader(options).partitions(start, end)
    tasks = RoutedEventsReader({**options, "maxPartitions": "2"}).partitions(start, end)

    assert len(alone) == 5 and len(tasks) == 2
    assert all(isinstance(t, ReadTask) for t in tasks)
    grouped = [[p.events.partition for p in t.parts] for t in tasks]
    assert grouped == [[0, 2], [1, 3, 4]]  # 100 and 90 events
    assert sorted((p for t in tasks for p in t.parts), key=lambda p: p.events.partition) == alone
    assert RoutedEventsReader({**options, "maxPartitions": "8"}).partitions(start, end) == alone
    for bad in ("0", "two"):
        with pytest.raises(KafkaSourceOptionError, match="'maxPartitions' is a positive count"):
            RoutedEventsReader({**options, "maxPartitions": bad})


def test_a_task_combines_the_events_of_all_its_partitions_per_pair_pure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task that reads several Kafka partitions sends one row per pair over all of
    them, as Spark's partial aggregation combines its input partition: a pair in
    every partition is one row with the events of all, not one per partition. Its
    refused records keep their own partition, and the hand-offs of each partition
    and the batch's end rows are read once."""
    store, v1, v2 = _rollout_store(tmp_path)
    options = {"routing.store": str(store), "maxPartitions": "1", "handoff": "per-instance"}
    reader = RoutedEventsReader({**OPTIONS, **options})
    values = {
        0: [("x", "y", 5000), ("x", "z", 1000)],
        1: [("x", "y", 9000), ("w", "y", 2000)],
        2: [("x", "y", 3000)],
    }
    records = {
        part: [json.dumps({"seq": i, "a": a, "b": b, "ts": ts}).encode() for i, (a, b, ts) in evs]
        for part, evs in ((p, list(enumerate(e))) for p, e in values.items())
    }
    records[1].append(b"not json")
    monkeypatch.setattr(
        routed_reads,
        "read_range",
        lambda r: iter(
            [pa.table({"value": records[r.partition], "offset": list(range(r.start, r.end))})]
        ),
    )
    switches = [{"operator": "A", "from_version": 1, "to_version": 2}]
    start = _offsets({"0": 0, "1": 0, "2": 0}, {"0": 0}, [])
    end = _offsets({"0": 2, "1": 3, "2": 1}, {"0": 0}, switches)
    [task] = reader.partitions(start, end)
    assert isinstance(task, ReadTask) and len(task.parts) == 3

    rows = pa.Table.from_batches(list(reader.read(task))).to_pylist()

    events = [(r["a"], r["b"], r["n"], r["ts"].timestamp()) for r in rows if r["kind"] == "event"]
    assert sorted(events) == [("w", "y", 1, 2.0), ("x", "y", 3, 9.0), ("x", "z", 1, 1.0)]
    [invalid] = [json.loads(r["detail"]) for r in rows if r["kind"] == "invalid"]
    assert (invalid["source"], invalid["offset"]) == ("events[1]", 2)
    evicts = [json.loads(r["state"]) for r in rows if r["kind"] == "evicts"]
    moved = sorted(tuple(m) for listed in evicts for m in listed)
    assert moved == sorted((m.key, m.source, m.target) for m in state_moves(v1, v2, "A", 4))
    assert evicts.count([]) == 2 * 4  # the batch's end rows, once: each stage's instances


def test_a_task_refuses_partitions_planned_on_different_versions_pure(tmp_path: Path) -> None:
    """The partitions of one task route on the batch's one plan; two that name different
    versions are a planning bug, refused in one line rather than routed on the first's."""
    store, _, _ = _rollout_store(tmp_path)
    kafka = OffsetRange("127.0.0.1:1", "events", 0, 0, 1)
    on_v1 = RoutedEventsPartition(kafka, EventRouting(str(store), 4, 1, 1))
    on_v2 = RoutedEventsPartition(
        dataclasses.replace(kafka, partition=1), EventRouting(str(store), 4, 2, 1)
    )
    with pytest.raises(ValueError, match="route on one plan, not 2"):
        list(read_events(on_v1, on_v2))


def test_evict_shares_emit_every_move_once_pure(tmp_path: Path) -> None:
    _, v1, v2 = _rollout_store(tmp_path)
    for op, forward in (("A", "pairs"), ("B", "tuples")):
        moves = state_moves(v1, v2, op, 4)
        rows = [
            row
            for share in range(3)
            for batch in read_evictions(EvictPartition.of(op, moves[share::3], 4, 7, forward))
            for row in pa.Table.from_batches([batch]).to_pylist()
        ]
        assert all(r["kind"] == "evict" and r["stage"] == op and r["marker"] == 7 for r in rows)
        if op == "A":
            got = sorted((r["a"], r["ra"], r["target_rk"]) for r in rows)
        else:
            # A stage-B row travels through stage A in the control group of its instance.
            assert all(r["ra"] == control_group("B", r["rb"], 4) for r in rows)
            got = sorted((r["b"], r["rb"], r["target_rk"]) for r in rows)
            assert all("pad" in r for r in rows)
        assert got == sorted((m.key, m.source, m.target) for m in moves)
        assert len(got) == len(moves) == {"A": 300, "B": 20}[op]


def test_install_rows_carry_each_moved_state_to_its_target_pure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moves = [
        {"operator": "A", "key": "k", "source": "k", "target": "k#3", "count": 4,
         "state": "4", "marker": 7},
        {"operator": "B", "key": "m", "source": "m", "target": "m#1", "count": 2,
         "state": "2", "marker": 7},
    ]  # fmt: skip
    values = list(move_records(moves))
    monkeypatch.setattr(
        routed_reads, "read_range", lambda part: iter([pa.table({"value": values})])
    )
    kafka = OffsetRange("127.0.0.1:1", "migration", 0, 0, len(values))
    rows = pa.Table.from_batches(list(read_installs(MigrationPartition(kafka, 4)))).to_pylist()

    picked = ["kind", "stage", "a", "b", "ra", "rb", "source_rk", "count", "state", "marker"]
    assert [{k: r[k] for k in picked} for r in rows] == [
        {"kind": "install", "stage": "A", "a": "k", "b": None, "ra": "k#3", "rb": None,
         "source_rk": "k", "count": 4, "state": "4", "marker": 7},
        {"kind": "install", "stage": "B", "a": None, "b": "m", "ra": control_group("B", "m#1", 4),
         "rb": "m#1", "source_rk": "m", "count": 2, "state": "2", "marker": 7},
    ]  # fmt: skip


def test_per_instance_evicts_list_each_instances_moves_once_pure(tmp_path: Path) -> None:
    """The JVM stages' hand-off: one ``evicts`` row per stage and instance a share's
    moves leave, in that instance's closing group, listing ``[key, source, target]``."""
    _, v1, v2 = _rollout_store(tmp_path)
    for op in OPERATORS:
        moves = state_moves(v1, v2, op, 4)
        rows = [
            row
            for share in range(3)
            for batch in read_evictions(
                EvictPartition.of(op, moves[share::3], 4, 7, "pairs", "per-instance")
            )
            for row in pa.Table.from_batches([batch]).to_pylist()
        ]
        assert all(r["kind"] == "evicts" and r["stage"] == op and r["marker"] == 7 for r in rows)
        assert len(rows) <= 3 * 4
        listed = []
        for r in rows:
            instance = evict_groups(op, 4).index(r["ra"])
            # Stage-B rows pass stage A under the same closing group, then group by rb.
            assert r["rb"] == (r["ra"] if op == "B" else None)
            for key, source, target in json.loads(r["state"]):
                assert spark_partition(source, 4) == instance
                listed.append((key, source, target))
        assert sorted(listed) == sorted((m.key, m.source, m.target) for m in moves)


def test_per_instance_installs_go_to_their_targets_instance_pure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moves = [
        {"operator": op, "key": f"k{i}", "source": f"k{i}", "target": f"k{i}#{i % 5}",
         "count": i + 1, "state": str(i + 1), "marker": 7}
        for i in range(40)
        for op in OPERATORS
    ]  # fmt: skip
    values = list(move_records(moves))
    monkeypatch.setattr(
        routed_reads, "read_range", lambda part: iter([pa.table({"value": values})])
    )
    kafka = OffsetRange("127.0.0.1:1", "migration", 0, 0, len(values))
    partition = MigrationPartition(kafka, 4, "pairs", "per-instance")
    rows = pa.Table.from_batches(list(read_installs(partition))).to_pylist()

    assert {r["kind"] for r in rows} == {"installs"}
    listed = []
    for r in rows:
        instance = install_groups(r["stage"], 4).index(r["ra"])
        assert r["rb"] == (r["ra"] if r["stage"] == "B" else None)
        fields = ("key", "source", "target", "count", "state", "marker")
        for move in json.loads(r["state"]):
            assert spark_partition(move[2], 4) == instance
            listed.append({"operator": r["stage"], **dict(zip(fields, move, strict=True))})

    def by_key(m: dict) -> tuple[str, str]:
        return m["operator"], m["key"]

    assert sorted(listed, key=by_key) == sorted(moves, key=by_key)


def test_an_unknown_handoff_mode_is_refused_in_one_line_pure(tmp_path: Path) -> None:
    options = {
        "kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "e", "control.topic": "c",
        "migration.topic": "m", "routing.store": str(tmp_path), "state.partitions": "4",
        "initial.version": "1",
    }  # fmt: skip
    assert RoutedEventsReader(options).handoff == "per-key"
    assert RoutedEventsReader({**options, "handoff": "per-instance"}).handoff == "per-instance"
    with pytest.raises(KafkaSourceOptionError, match="'handoff' is one of per-key, per-instance"):
        RoutedEventsReader({**options, "handoff": "batched"})


@pytest.mark.parametrize(
    ("options", "ended"),
    [({"handoff": "per-instance"}, True), ({"handoff": "per-key"}, False)],
)
def test_per_instance_batches_carry_one_set_of_end_rows_in_their_first_task_pure(
    options: dict[str, str], ended: bool, tmp_path: Path
) -> None:
    """With the JVM stages' hand-offs, every batch with events carries its end rows once,
    in its first task, rollout or not. The Python stages' batches carry none."""
    store, _, _ = _rollout_store(tmp_path)
    reader = RoutedEventsReader({**OPTIONS, "routing.store": str(store), **options})
    switches = [{"operator": "A", "from_version": 1, "to_version": 2}]
    start = _offsets({"0": 0, "1": 0, "2": 0}, {"0": 0}, [])
    for end in (
        _offsets({"0": 5, "1": 5, "2": 5}, {"0": 0}, []),
        _offsets({"0": 5, "1": 5, "2": 5}, {"0": 0}, switches),
    ):
        parts = reader.partitions(start, end)
        assert [isinstance(p, RoutedEventsPartition) and p.batch_end for p in parts] == [
            ended,
            False,
            False,
        ]


def test_end_rows_are_an_empty_evicts_row_in_every_closing_group_pure() -> None:
    """One ``evicts`` row per stage and instance, in that instance's closing group (stage
    B's addressed to B through stage A), each listing no move."""
    rows = pa.Table.from_batches([batch_end_rows("pairs", 4)]).to_pylist()
    expected = sorted((stage, group) for stage in OPERATORS for group in evict_groups(stage, 4))

    assert sorted((r["stage"], r["ra"]) for r in rows) == expected
    assert {(r["kind"], r["state"]) for r in rows} == {("evicts", "[]")}
    assert all(r["rb"] == (r["ra"] if r["stage"] == "B" else None) for r in rows)
