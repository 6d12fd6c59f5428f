"""The connector's events routed in the JVM give the rows the Python router gives.

``RoutedEvents.route`` runs on a real SparkSession over records as Spark's
connector hands them over, on a batch whose plan is in an offset log the test
writes; :func:`keyplane.spark.routed_reads.route_events`, the Python router,
routes the same records on the same versions. Both must refuse the same
records for the same reasons and route, split and combine the rest alike: a
job's dead letters and counts must not depend on which one runs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyplane.control.operators import OPERATORS
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.exported_tables import export_tables
from keyplane.spark.batch_plan import BATCH_ID_PROPERTY
from keyplane.spark.connector_events import ConnectorEventsRouter, route_in_jvm
from keyplane.spark.routed_partitions import EventRouting, tables_for
from keyplane.spark.routed_reads import batch_end_rows, route_events

pytestmark = pytest.mark.integration

P = 4
MAX_BYTES = 8_192
BATCH = 7
QUARANTINE = (("qa", "qb", "quarantined: poison pair"),)

KEYS = ["k1", "k2", "hot", "x#y", "", "\x00ctl", "\x01esc", "é", "\U0001f600", "#", "cold"]
"""Field-1 keys: tabled, hot, plain, and every kind the hash fallback salts or escapes."""

REFUSED: list[bytes | None] = [
    None,
    b"x" * (MAX_BYTES + 1),
    b"\xff\xfe",
    b"[" * 300,
    b"",
    b'{"seq":1,"a":"k1","b":"j","ts":5} x',
    b'{"seq":1,"a":"k1","b":"j","ts":5,}',
    b"{'seq':1}",
    b'{"seq":01,"a":"k1","b":"j","ts":5}',
    b'{"seq":1,"a":"k1","b":"j","ts":5,"pad":"\x01"}',
    b"\xef\xbb\xbf" + b'{"seq":1,"a":"k1","b":"j","ts":5}',
    b'{"seq":1,"a":"\xc0\xaf","b":"j","ts":5}',
    b'{"seq":1,"a":"\xed\xa0\x80","b":"j","ts":5}',
    b"[1,2]",
    b'{"a":"k1","b":"j","ts":5}',
    b'{"seq":true,"a":"k1","b":"j","ts":5}',
    b'{"seq":1,"a":3,"b":"j","ts":5}',
    b'{"seq":1,"a":"k1","b":null,"ts":5}',
    b'{"seq":1,"a":"k1","b":"j","ts":5.0}',
    b'{"seq":1,"a":"k1","b":"j","ts":1e3}',
    b'{"seq":99999999999999999999,"a":"k1","b":"j","ts":5}',
    b'{"seq":1,"a":"k1","b":"j","ts":253402300800000}',
    b'{"seq":1,"a":"k1","b":"j","ts":-62135596800001}',
    b'{"seq":1,"a":"\\ud800","b":"j","ts":5}',
    b'{"seq":1,"a":"k1","b":"j","ts":5,"\\udc00":1}',
    b'{"seq":1,"a":"qa","b":"qb","ts":5}',
    b"x" * 1023 + "é".encode() + b" cut inside a character",
    b"x" * 1021 + "\ufffd".encode() + b" a replacement character kept whole",
]
"""Records that are not valid events, one of each reason and of the JSON readers' corners, and
two whose dead letters keep their first 1,024 bytes, cut inside a character and after one."""

ACCEPTED = [
    b'{"seq":1,"a":"k1","b":"j","ts":5,"pad":NaN}',
    b' {"seq":-0,"a":"k1","b":"j","ts":5}\n',
    b'{"seq":1,"a":"k1","b":"j","ts":5,"a":"k2"}',
    b'{"seq":1,"a":"\\u00e9","b":"\\ud83d\\ude00","ts":5}',
    b'{"seq":1,"a":"k1","b":"j","ts":5,"pad":1' + b"0" * 5_000 + b"}",
    b'{"seq":9223372036854775807,"a":"k1","b":"j","ts":253402300799999}',
    b'{"seq":-9223372036854775808,"a":"k1","b":"j","ts":-62135596800000}',
    b'{"seq":1,"a":"k1","b":"j","ts":5,"pad":[[[[{"x":"]]]]"}]]]]}',
]
"""Valid events on the edges of what each reader takes."""


def _events(count: int, seed: int) -> list[bytes | None]:
    """Events over :data:`KEYS` with a hot key, and field-2 keys of which one is hot."""
    rng = random.Random(seed)
    values: list[bytes | None] = []
    for seq in range(count):
        a = "hot" if rng.random() < 0.4 else rng.choice(KEYS)
        b = "b-hot" if rng.random() < 0.3 else f"b{rng.randrange(12)}"
        event = {"seq": seq, "a": a, "b": b, "ts": 1_700_000_000_000 + rng.randrange(10_000)}
        values.append(json.dumps(event).encode())
    return values


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v1: tabled and hot keys in both stages; v2: stage A scaled in to two instances."""
    store = tmp_path_factory.mktemp("store")
    a = OperatorRouting(parallelism=P, table={"k1": 2, "x#y": 1}, hot_keys={"hot": (0, 1, 3)})
    b = OperatorRouting(parallelism=P, table={"b1": 0}, hot_keys={"b-hot": (1, 3)})
    save(RoutingConfig(version=1, created_by="initial", operators={"A": a, "B": b}), store)
    scaled = OperatorRouting(parallelism=P, hot_keys={"hot": (0, 2)}, active_instances=(0, 2))
    save(
        RoutingConfig(
            version=2, parent_version=1, created_by="scale", operators={"A": scaled, "B": b}
        ),
        store,
    )
    for version in (1, 2):
        export_tables(tables_for(str(store), P), version, OPERATORS)
    return store


def _records(sources: dict[str, list[bytes | None]]) -> list[tuple[str, int, int, bytes | None]]:
    """(topic, partition, offset, value) rows, as the connector hands them over."""
    rows = []
    for name, values in sources.items():
        topic, partition = name.rstrip("]").split("[")
        rows += [(topic, int(partition), i, v) for i, v in enumerate(values)]
    return rows


def _python(
    routing: EventRouting, sources: dict[str, list[bytes | None]], batch_end: bool
) -> Iterator[dict[str, Any]]:
    """The Python router's rows of one task that read ``sources`` in order."""
    parts = (
        (name, [pa.RecordBatch.from_pydict({"value": vs, "offset": list(range(len(vs)))})])
        for name, vs in sources.items()
    )
    if batch_end:
        yield from batch_end_rows("pairs", P).to_pylist()
    for batch in route_events(routing, parts):
        yield from batch.to_pylist()


def _jvm(
    spark: Any, router: ConnectorEventsRouter, sources: dict[str, list[bytes | None]]
) -> list[dict[str, Any]]:
    """``RoutedEvents``' rows of one task that read ``sources`` in order, in batch ``BATCH``."""
    frame = spark.createDataFrame(
        _records(sources), "topic STRING, partition INT, offset LONG, value BINARY"
    ).coalesce(1)
    context = spark.sparkContext
    context.setLocalProperty(BATCH_ID_PROPERTY, str(BATCH))
    try:
        return [row.asDict() for row in route_in_jvm(frame, router).collect()]
    finally:
        context.setLocalProperty(BATCH_ID_PROPERTY, None)


def _comparable(row: dict[str, Any]) -> tuple[Any, ...]:
    """A row, its dead letter's detail parsed; a parser's own words after "not JSON:" left out."""
    detail = row.get("detail")
    if detail is not None:
        detail = json.loads(detail)
        if detail["reason"].startswith("not JSON: ") and "nested" not in detail["reason"]:
            detail["reason"] = "not JSON"
        detail = tuple(sorted(detail.items()))
    # Spark collects a timestamp in the session's time zone, Arrow in UTC: both as instants.
    ts = None if row["ts"] is None else row["ts"].timestamp()
    fields = {**row, "detail": detail, "ts": ts}
    return tuple((k, v) for k, v in sorted(fields.items()) if k != "pad")


def _write_plan(
    checkpoint: Path, version_a: int, version_b: int, prepared: int | None = None
) -> None:
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True, exist_ok=True)
    plan = {
        "plan": BATCH,
        "routing": {"A": version_a, "B": version_b},
        "protocol": {},
        "prepared": prepared,
    }
    lines = ["v1", json.dumps({"batchWatermarkMs": 0}), '{"logOffset":3}', json.dumps(plan)]
    (offsets / str(BATCH)).write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("version_a", "handoff"), [(1, "per-instance"), (2, "per-key")])
def test_the_jvm_router_refuses_routes_and_combines_as_the_python_router(
    spark: Any, store: Path, tmp_path: Path, version_a: int, handoff: Any
) -> None:
    _write_plan(tmp_path, version_a, 1, prepared=2 if version_a == 1 else None)
    sources: dict[str, list[bytes | None]] = {
        "events[2]": [*_events(1_500, seed=1), *REFUSED[:13]],
        "events[0]": [*ACCEPTED, *REFUSED[13:], *_events(1_500, seed=2)],
    }
    router = ConnectorEventsRouter(
        str(tmp_path), str(store), P, "pairs", handoff, MAX_BYTES, QUARANTINE
    )
    plan = json.loads((tmp_path / "offsets" / str(BATCH)).read_text().splitlines()[-1])
    expected = list(_python(router.routing(plan), sources, handoff == "per-instance"))
    got = _jvm(spark, router, sources)

    assert sorted(map(_comparable, got), key=repr) == sorted(map(_comparable, expected), key=repr)
    refused = [json.loads(r["detail"]) for r in got if r["kind"] == "invalid"]
    assert len(refused) == len(REFUSED), "every refused record has its dead letter"
    events = [r for r in got if r["kind"] == "event"]
    assert sum(r["n"] for r in events) == 3_000 + len(ACCEPTED)
    hot = {r["ra"] for r in events if r["a"] == "hot"}
    assert len(hot) == (3 if version_a == 1 else 2), "the hot key is split over its instances"


def test_a_batch_whose_table_was_never_written_fails_its_task_saying_which(
    spark: Any, store: Path, tmp_path: Path
) -> None:
    _write_plan(tmp_path, 9, 1)
    router = ConnectorEventsRouter(str(tmp_path), str(store), P, "pairs", "per-key", MAX_BYTES)
    with pytest.raises(Exception, match=r"v9: no routed-key table .*v9-p4\.json"):
        _jvm(spark, router, {"events[0]": _events(3, seed=3)})


def test_a_prepared_version_not_yet_written_is_loaded_later_and_the_batch_routes(
    spark: Any, store: Path, tmp_path: Path
) -> None:
    """The driver writes a prepared version's tables on a thread of their own: a batch
    planned before they are written loads them in a later batch, not now."""
    _write_plan(tmp_path, 1, 1, prepared=9)
    router = ConnectorEventsRouter(str(tmp_path), str(store), P, "pairs", "per-key", MAX_BYTES)
    rows = _jvm(spark, router, {"events[0]": _events(50, seed=4)})
    assert sum(r["n"] for r in rows if r["kind"] == "event") == 50
