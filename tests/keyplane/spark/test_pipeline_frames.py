"""A pipeline's events as Spark columns (real SparkSession), and the checks before a query.

Keys and values are the user's Spark SQL expressions over their own schema,
nested fields included; an event that cannot be keyed is an ``invalid`` row
with its reason, never dropped; an expression naming an unknown column and a
pipeline that differs from its checkpoint's are refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from keyplane.aggregates import DistinctCount, Sum, TopK
from keyplane.pipeline import KafkaSource, ParquetSink, Pipeline, PipelineError, Stage
from keyplane.spark.pipeline_frames import (
    check_expressions,
    check_recorded_pipeline,
    keyed_events,
    record_pipeline,
    routed_rows,
)

SCHEMA = (
    "user_id STRING, session_id STRING, amount DOUBLE, "
    "page STRUCT<category: STRING, tags: ARRAY<STRING>>"
)


def clicks(*stages: Stage) -> Pipeline:
    stages = stages or (
        Stage("users", "user_id", DistinctCount(), value="session_id"),
        Stage("categories", "lower(page.category)", Sum(), value="amount"),
        Stage("sessions", "session_id", TopK(2), value="page.tags"),
    )
    return Pipeline("clicks", KafkaSource("clicks", SCHEMA), stages, ParquetSink("out"))


def _raw(spark, values: Sequence[bytes | None]):
    rows = [("clicks", 0, offset, value) for offset, value in enumerate(values)]
    return spark.createDataFrame(rows, "topic STRING, partition INT, offset LONG, value BINARY")


@pytest.mark.integration
def test_events_are_keyed_by_each_stages_expression_and_bad_ones_say_why(spark) -> None:
    good = {
        "user_id": "u1",
        "session_id": "s1",
        "amount": 2.5,
        "page": {"category": "Shoes", "tags": ["red", "x"]},
        "extra": "ignored",
    }
    values = [
        json.dumps(good).encode(),
        b"{not json",
        None,
        json.dumps({**good, "user_id": None}).encode(),
        json.dumps({**good, "page": {"category": "Hats"}}).encode(),
        json.dumps(
            {"user_id": 7, "session_id": "s2", "amount": 1, "page": {"category": "A"}}
        ).encode(),
    ]
    rows = keyed_events(_raw(spark, values), clicks()).orderBy("offset").collect()

    assert [tuple(r) for r in rows] == [
        ("clicks", 0, 0, "u1", "shoes", "s1", "s1", "2.5", '["red","x"]', None),
        *[
            ("clicks", 0, 1, None, None, None, None, None, None,
             "the value does not parse against the source schema"),
        ],
        ("clicks", 0, 2, None, None, None, None, None, None, "a record with no value"),
        ("clicks", 0, 3, None, "shoes", "s1", "s1", "2.5", '["red","x"]',
         "stage 'users': the key 'user_id' is null"),
        ("clicks", 0, 4, "u1", "hats", "s1", "s1", "2.5", None,
         "stage 'sessions': the value 'page.tags' is null"),
        ("clicks", 0, 5, "7", "a", "s2", "s2", "1.0", None,
         "stage 'sessions': the value 'page.tags' is null"),
    ]  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(
    ("stage", "message"),
    [
        (Stage("pages", "page.title"), r"stage 'pages': the key 'page.title' does not fit"),
        (Stage("pages", "user_id", value="nope"), r"stage 'pages': the value 'nope' does not fit"),
        (Stage("pages", "user_id +* 1"), r"stage 'pages': the key 'user_id \+\* 1' does not fit"),
    ],
)
def test_an_expression_the_schema_cannot_evaluate_is_one_line_naming_the_stage(
    spark, stage: Stage, message: str
) -> None:
    check_expressions(spark, clicks())  # the good one passes
    with pytest.raises(PipelineError, match=message) as refused:
        check_expressions(spark, clicks(Stage("users", "user_id"), stage))
    assert "\n" not in str(refused.value)


@pytest.mark.integration
def test_a_schema_that_does_not_parse_is_one_line(spark) -> None:
    bad = Pipeline("clicks", KafkaSource("clicks", "user_id STRNG,"), (Stage("u", "user_id"),),
                   ParquetSink("out"))  # fmt: skip
    with pytest.raises(PipelineError, match="the source schema 'user_id STRNG,' does not parse"):
        check_expressions(spark, bad)


def test_a_checkpoint_refuses_a_pipeline_that_changed_pure(tmp_path: Path) -> None:
    """A new checkpoint takes any pipeline; one that ran a pipeline takes it again (topics and
    sink may change), and refuses one whose stages changed, saying what changed."""
    checkpoint = tmp_path / "checkpoint"
    check_recorded_pipeline(checkpoint, clicks())
    record_pipeline(checkpoint, clicks())
    check_recorded_pipeline(checkpoint, clicks())

    users, categories, sessions = clicks().stages
    added = clicks(users, categories, sessions, Stage("more", "user_id"))
    with pytest.raises(PipelineError, match="stage 'more' was added"):
        check_recorded_pipeline(checkpoint, added)
    rekeyed = clicks(users, Stage("categories", "page.category", Sum(), value="amount"), sessions)
    with pytest.raises(PipelineError, match=r"key 'lower\(page.category\)' became 'page.category'"):
        check_recorded_pipeline(checkpoint, rekeyed)
    with pytest.raises(PipelineError, match="stage 'sessions' was removed"):
        check_recorded_pipeline(checkpoint, clicks(users, categories))


@pytest.mark.integration
def test_each_stage_routes_its_key_by_the_rows_version_of_its_table(spark, tmp_path: Path) -> None:
    """v1 moves user u1 off its hash instance and splits the hot user u0 over three
    instances; the categories stage routes by hash. u0's events spread over exactly its
    three routed keys, u1's reach the instance the table names, the rest route to
    themselves; a task's events are combined, every event counted once in ``n``; a record
    that does not parse is an invalid row with its reason, in the control groups."""
    from keyplane.routing.config import save
    from keyplane.routing.routedkeys import CONTROL_STARTS, spark_partition
    from keyplane.spark.chain_source import CHAIN_INPUT_SCHEMA
    from keyplane.testing import moved_off_hash, moved_off_hash_config

    pipeline = clicks(
        Stage("users", "user_id", value="session_id"), Stage("categories", "page.category")
    )
    save(moved_off_hash_config(1, {"users": ["u1"]}, 4, hot_keys={"users": {"u0": (0, 1, 2)}}),
         tmp_path / "store")  # fmt: skip
    events = [
        {"user_id": f"u{i % 3 if i % 2 else 0}", "session_id": f"s{i % 5}",
         "page": {"category": "c"}}
        for i in range(60)
    ]  # fmt: skip
    values = [json.dumps(e).encode() for e in events] + [b"{broken"]
    width = len(CHAIN_INPUT_SCHEMA.split(", "))
    source_rows = [
        ("event", *[None] * 8, "clicks", 0, offset, value, [1, 1], None, *[None] * (width - 15))
        for offset, value in enumerate(values)
    ]
    inputs = spark.createDataFrame(source_rows, CHAIN_INPUT_SCHEMA).coalesce(1)  # one task
    rows = routed_rows(inputs, pipeline, tmp_path / "store", 4).collect()

    [invalid] = [row for row in rows if row.kind == "invalid"]
    assert json.loads(invalid.detail)["reason"] == (
        "the value does not parse against the source schema"
    )
    assert json.loads(invalid.detail)["value"] == "{broken"
    assert invalid.r0.startswith(CONTROL_STARTS[0]) and invalid.r1.startswith(CONTROL_STARTS[0])
    good = [row for row in rows if row.kind == "event"]
    assert sum(row.n for row in good) == 60
    combined = {(e["user_id"], e["session_id"]) for e in events}
    # One row per distinct (user, session) and route: u0's five sessions take up to 3 each.
    assert len(good) <= len(combined) + 2 * 5
    by_user: dict[str, set[str]] = {}
    for row in good:
        by_user.setdefault(row.k0, set()).add(row.r0)
        assert row.r1 == row.k1 == "c"
    hot = by_user.pop("u0")
    assert len(hot) == 3 and {spark_partition(r, 4) for r in hot} == {0, 1, 2}
    [moved] = by_user.pop("u1")
    assert spark_partition(moved, 4) == moved_off_hash(["u1"], 4, 1)["u1"]
    assert by_user == {"u2": {"u2"}}


def _keyed_batch(rows: Sequence[tuple[str | None, str | None, str | None, bytes | None]]):
    """The Arrow step's input for a two-stage pipeline, as :func:`routed_rows` gives it:
    ``(k0, v0, invalid, value)`` per event, offsets in order, every stage on version 1; the
    raw value and source columns of every row, as if each might be a dead letter."""
    import pyarrow as pa

    from keyplane.spark.pipeline_frames import CONTROL_JSON

    n = len(rows)
    text = pa.string()
    control = [json.dumps({"topic": "clicks", "partition": 0, "offset": i}) for i in range(n)]
    columns = {
        "kind": pa.array(["event"] * n),
        "k0": pa.array([r[0] for r in rows], text),
        "k1": pa.array(["c" if r[2] is None else None for r in rows], text),
        "v0": pa.array([r[1] for r in rows], text),
        "v1": pa.array(["" if r[2] is None else None for r in rows], text),
        "versions": pa.array([[1, 1]] * n, pa.list_(pa.int32())),
        "invalid": pa.array([r[2] for r in rows], text),
        "value": pa.array([r[3] for r in rows], pa.binary()),
        CONTROL_JSON: pa.array(control, text),
    }
    return pa.RecordBatch.from_pydict(columns)


def _route(store: Path, batch, quarantine=()) -> list[dict]:
    from keyplane.spark.pipeline_frames import batch_router

    pipeline = clicks(
        Stage("users", "user_id", value="session_id"), Stage("pages", "page.category")
    )
    route = batch_router(pipeline, store, 4, quarantine)
    return [row for out in route(iter([batch])) for row in out.to_pylist()]


def _hot_store(tmp_path: Path) -> Path:
    from keyplane.routing.config import save
    from keyplane.testing import moved_off_hash_config

    store = tmp_path / "store"
    save(moved_off_hash_config(1, {"users": ["u1"]}, 4, hot_keys={"users": {"u0": (0, 1, 2)}}),
         store)  # fmt: skip
    return store


def test_a_replayed_batch_spreads_a_hot_key_as_it_first_did_pure(tmp_path: Path) -> None:
    """Two readers of the same Arrow batch (a batch and its replay, each in a fresh
    task) give the same rows: the hot key u0 spread over its three routed keys with the
    same counts, every event counted once."""
    from keyplane.routing.routedkeys import spark_partition

    store = _hot_store(tmp_path)
    events = [(f"u{i % 3 if i % 4 == 3 else 0}", f"s{i % 2}", None, b"{}") for i in range(90)]
    batch = _keyed_batch(events)
    first, replay = _route(store, batch), _route(store, batch)

    def key(row: dict) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in row.items()))

    assert sorted(first, key=key) == sorted(replay, key=key)
    assert sum(row["n"] for row in first) == 90
    hot = {row["r0"] for row in first if row["k0"] == "u0"}
    assert {spark_partition(r, 4) for r in hot} == {0, 1, 2}
    spread = [sum(r["n"] for r in first if r["r0"] == routed) for routed in sorted(hot)]
    assert max(spread) - min(spread) <= 1 + 90 // 4  # the cold keys fill their instance too


def test_a_batch_of_only_dead_letters_gives_them_with_reasons_and_raw_bytes_pure(
    tmp_path: Path,
) -> None:
    """No event can be keyed: each is an invalid row with its reason and raw value, in the
    control groups, and no event row is combined."""
    from keyplane.routing.routedkeys import CONTROL_STARTS

    store = _hot_store(tmp_path)
    rows = _route(store, _keyed_batch([
        (None, None, "the value does not parse against the source schema", b"{broken"),
        (None, None, "stage 'users': the key 'user_id' is null", b'{"page": "p"}'),
    ]))  # fmt: skip
    assert [row["kind"] for row in rows] == ["invalid", "invalid"]
    details = [json.loads(row["detail"]) for row in rows]
    assert [(d["offset"], d["reason"], d["value"]) for d in details] == [
        (0, "the value does not parse against the source schema", "{broken"),
        (1, "stage 'users': the key 'user_id' is null", '{"page": "p"}'),
    ]
    assert all(row["r0"].startswith(CONTROL_STARTS[0]) for row in rows)


def test_a_quarantined_pair_is_dead_lettered_and_its_key_otherwise_routed_pure(
    tmp_path: Path,
) -> None:
    """Only the held (key, value) pair is refused, with the quarantine's reason and its raw
    value; the same key with another value routes as ever."""
    store = _hot_store(tmp_path)
    batch = _keyed_batch([("u2", "s1", None, b"sick"), ("u2", "s2", None, b"fine"),
                          ("u2", "s1", None, b"sick again")])  # fmt: skip
    rows = _route(store, batch, [("users", "u2", "s1", "boom"), ("pages", "u2", "s2", "no")])
    invalid = [json.loads(row["detail"]) for row in rows if row["kind"] == "invalid"]
    assert [(d["offset"], d["reason"], d["value"]) for d in invalid] == [
        (0, "boom", "sick"),
        (2, "boom", "sick again"),
    ]
    [event] = [row for row in rows if row["kind"] == "event"]
    assert (event["k0"], event["v0"], event["r0"], event["n"]) == ("u2", "s2", "u2", 1)


@pytest.mark.integration
def test_a_quarantined_pair_keeps_its_raw_value_through_spark(spark, tmp_path: Path) -> None:
    """Spark passes the raw value on only for rows that may be dead letters; a held pair's
    rows are among them, so their dead letters keep their bytes."""
    from keyplane.spark.chain_source import CHAIN_INPUT_SCHEMA

    pipeline = clicks(
        Stage("users", "user_id", value="session_id"), Stage("pages", "page.category")
    )
    values = [json.dumps({"user_id": "u", "session_id": s, "page": {"category": "p"}}).encode()
              for s in ("s1", "s2", "s1")]  # fmt: skip
    width = len(CHAIN_INPUT_SCHEMA.split(", "))
    source_rows = [
        ("event", *[None] * 8, "clicks", 0, offset, value, [1, 1], None, *[None] * (width - 15))
        for offset, value in enumerate(values)
    ]
    inputs = spark.createDataFrame(source_rows, CHAIN_INPUT_SCHEMA).coalesce(1)
    quarantine = [("users", "u", "s1", "boom")]
    rows = routed_rows(inputs, pipeline, _hot_store(tmp_path), 4, quarantine).collect()
    dead = sorted(json.loads(row.detail)["offset"] for row in rows if row.kind == "invalid")
    assert dead == [0, 2]
    assert {json.loads(row.detail)["value"] for row in rows if row.kind == "invalid"} == {
        values[0].decode()
    }
    assert [(row.k0, row.v0, row.n) for row in rows if row.kind == "event"] == [("u", "s2", 1)]


def test_a_sources_own_dead_letter_and_rollout_row_pass_as_the_source_gave_them_pure(
    tmp_path: Path,
) -> None:
    """An ``invalid`` row the source made (an oversized record) and an ``evict`` row keep
    their detail, rollout fields and grouping values through the Arrow step."""
    import pyarrow as pa

    from keyplane.spark.pipeline_frames import CONTROL_JSON

    batch = _keyed_batch([("u2", "s1", None, b"{}")])
    oversized = {"detail": '{"reason": "oversized"}', "routes": ["\x00a", "\x00b"]}
    evict = {"stage": "users", "key": "u1", "routed_key": "u1", "target": "u1#2",
             "marker": 7, "routes": ["u1"]}  # fmt: skip
    extra = pa.RecordBatch.from_pylist(
        [
            {
                "kind": "invalid",
                "invalid": "a record with no value",
                CONTROL_JSON: json.dumps(oversized),
            },
            {"kind": "evict", "invalid": "a record with no value", CONTROL_JSON: json.dumps(evict)},
        ],
        schema=batch.schema,
    )
    rows = _route(_hot_store(tmp_path), pa.Table.from_batches([batch, extra]).combine_chunks()
                  .to_batches()[0])  # fmt: skip
    by_kind = {row["kind"]: row for row in rows}
    assert (by_kind["invalid"]["detail"], by_kind["invalid"]["r0"], by_kind["invalid"]["r1"]) == (
        oversized["detail"], "\x00a", "\x00b"
    )  # fmt: skip
    moved = by_kind["evict"]
    assert (moved["stage"], moved["key"], moved["routed_key"], moved["target"]) == (
        "users", "u1", "u1", "u1#2"
    )  # fmt: skip
    assert (moved["marker"], moved["r0"], moved["r1"]) == (7, "u1", None)
    assert by_kind["event"]["n"] == 1
