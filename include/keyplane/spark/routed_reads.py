"""What the reference pipeline's routed source reads on the executors.

Its tasks parse and validate the reference events, route them on the batch's
versions (stage A's routed key and stage B's, 000 §3.3, 001 §4.1.2) and
combine them (:func:`read_events`), and turn a rollout's moves into ``evict``
and ``install`` rows (:func:`read_evictions`, :func:`read_installs`): rows of
:data:`ROUTED_INPUT_SCHEMA`. The driver side that plans each batch is
:mod:`keyplane.spark.routed_source`; a pipeline of any other shape reads
through :mod:`keyplane.spark.chain_source`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keyplane.control.operators import OPERATORS
from keyplane.kafka.migration_topic import moves_of
from keyplane.kafka.ranges import read_range
from keyplane.reference.events import (
    _EPOCH,
    Forward,
    dead_letter_value,
    decode_events,
    parse_event,
)
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.routing.handoff import LeastLoadedRoutes
from keyplane.routing.routedkeys import (
    RoutedKeyTable,
    spark_partitions,
)
from keyplane.spark.routed_partitions import (
    EventRouting,
    EvictPartition,
    MigrationPartition,
    RoutedEventsPartition,
    control_group,
    evict_groups,
    install_groups,
    tables_for,
)

ROUTED_INPUT_SCHEMA = (
    "kind STRING, stage STRING, seq LONG, a STRING, b STRING, ts TIMESTAMP, ra STRING, "
    "rb STRING, vb INT, source_rk STRING, target_rk STRING, count LONG, state STRING, "
    "marker LONG, detail STRING, n LONG"
)
"""The rows of the ``pairs`` mode; ``tuples`` rows add ``pad`` (:func:`routed_input_schema`)."""
PAD_COLUMN = "pad STRING"

_ARROW_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("stage", pa.string()),
        ("seq", pa.int64()),
        ("a", pa.string()),
        ("b", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("ra", pa.string()),
        ("rb", pa.string()),
        ("vb", pa.int32()),
        ("source_rk", pa.string()),
        ("target_rk", pa.string()),
        ("count", pa.int64()),
        ("state", pa.string()),
        ("marker", pa.int64()),
        ("detail", pa.string()),
        ("n", pa.int64()),
    ]
)

_TUPLES_ARROW_SCHEMA = _ARROW_SCHEMA.append(pa.field("pad", pa.string()))


def routed_input_schema(forward: Forward) -> str:
    """The source's rows in ``forward`` mode: ``tuples`` rows carry each event's padding."""
    return ROUTED_INPUT_SCHEMA if forward == "pairs" else f"{ROUTED_INPUT_SCHEMA}, {PAD_COLUMN}"


def _arrow_schema(forward: Forward) -> pa.Schema:
    """The Arrow form of :func:`routed_input_schema`."""
    return _ARROW_SCHEMA if forward == "pairs" else _TUPLES_ARROW_SCHEMA


def _rows(forward: Forward, length: int, /, **columns: Any) -> pa.RecordBatch:
    """``length`` rows of :func:`routed_input_schema`: ``columns`` (lists or arrays by
    name), every other column null."""
    schema = _arrow_schema(forward)
    arrays = {field.name: pa.nulls(length, field.type) for field in schema}
    arrays.update(columns)
    return pa.RecordBatch.from_pydict(arrays, schema=schema)


class _Columns:
    """Column lists for one Arrow batch of :func:`routed_input_schema` in ``forward`` mode."""

    def __init__(self, forward: Forward) -> None:
        self.schema = _arrow_schema(forward)
        self.values: dict[str, list[Any]] = {name: [] for name in self.schema.names}

    def add(self, **row: Any) -> None:
        for name, column in self.values.items():
            column.append(row.get(name))

    def __len__(self) -> int:
        return len(self.values["kind"])

    def batch(self) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(self.values, schema=self.schema)


def read_events(*parts: RoutedEventsPartition) -> Iterator[pa.RecordBatch]:
    """Parse, validate and route one task's events (001 §4.1.2, 000 §3.3).

    In ``pairs`` mode the task's events are combined here, one ``event``
    row per (stage-A routed key, field-2 key) with their number ``n`` and
    latest time, as Spark's own ``groupBy`` counts each input partition
    before its shuffle: stage A then builds one row per pair, not per event
    (PySpark builds each row of a ``transformWithState`` cell by cell, see
    :mod:`keyplane.spark.routed_counts`). A task that reads several Kafka
    partitions (:class:`~keyplane.spark.kafka_source.ReadTask`) combines
    them all, as Spark's partial aggregation combines its input partition:
    per Kafka partition, the same pair would come once from each, and stage A
    would read more rows.
    Stage A adds a pair's field-2 key
    ``n`` times, so an aggregate sees every event's value, and the batch's
    events are counted from its offsets, not its rows
    (:func:`keyplane.spark.progress.progress_of`). A chunk of valid events
    is parsed and combined in Arrow (:func:`keyplane.reference.events.decode_events`);
    one with a malformed record, value by value, so each refused record gets
    its reason. ``tuples`` mode forwards every tuple with its padding, so
    each event stays a row with ``n`` = 1.

    The parts route on one plan (the batch's versions); their events are
    routed in the order of the parts and of their offsets, so a replayed
    batch, whose tasks hold the same parts, routes as before. (Replayed with
    another ``maxPartitions``, a split key's events may spread otherwise
    over its instances, which changes no count.)
    """
    p = parts[0]
    plan = {q.routing for q in parts}
    if len(plan) > 1:
        raise ValueError(f"a task's event partitions route on one plan, not {len(plan)}: {plan}")
    sources = ((f"{q.events.topic}[{q.events.partition}]", read_range(q.events)) for q in parts)
    yield from route_events(p.routing, sources)


def route_events(
    r: EventRouting, sources: Iterable[tuple[str, Iterable[pa.RecordBatch]]]
) -> Iterator[pa.RecordBatch]:
    """Route one task's Kafka records, ``(source, chunks)`` per partition it read, on ``r``.

    A chunk is an Arrow batch with at least the records' ``value`` and
    ``offset``: keyplane's reader's (:func:`keyplane.kafka.ranges.read_range`)
    or Spark's own connector's (:mod:`keyplane.spark.connector_events`).
    ``source`` (``topic[partition]``) names where a dead-lettered record came
    from. See :func:`read_events` for what the rows are.
    """
    tables = tables_for(r.store, r.parallelism)
    if r.prepared is not None:
        # 000 §3.4: an instance that acknowledges a PREPARE holds the new
        # configuration. Loading it here, in the batches before the switch,
        # keeps its cost (it grows with the routed keys) out of the switch
        # and install batches, which route on it.
        for operator in OPERATORS:
            tables.table(r.prepared, operator)
    table_a = tables.table(r.version_a, FIRST_STAGE)
    to_b = _StageBRoutes(tables.table(r.version_b, SECOND_STAGE))
    balancer = LeastLoadedRoutes(table_a.instances_of, split=bool(table_a.hot_keys))
    routed: list[pa.Table] = []
    for source, chunks in sources:
        yield from _routed_part(r, source, chunks, table_a, balancer, to_b, routed)
    if routed:
        yield _combined(pa.concat_tables(routed), r.version_b, to_b)


def _routed_part(
    r: EventRouting,
    source: str,
    chunks: Iterable[pa.RecordBatch],
    table_a: RoutedKeyTable,
    balancer: LeastLoadedRoutes,
    to_b: _StageBRoutes,
    routed: list[pa.Table],
) -> Iterator[pa.RecordBatch]:
    """One Kafka partition's events: rows for the refused records and, in ``tuples``
    mode, the tuples; in ``pairs`` mode the routed events are appended to ``routed``,
    which :func:`route_events` combines over its task."""
    tuples = r.forward == "tuples"
    quarantined = {(a, b): reason for a, b, reason in r.quarantine}
    for records in chunks:
        values = records.column("value").to_pylist()
        decoded = None if tuples else decode_events(values, r.max_event_bytes)
        if decoded is not None and quarantined and _holds_any(decoded, quarantined):
            decoded = None
        if decoded is not None:
            routed.append(_routed(decoded, table_a, balancer))
            continue
        out = _Columns(r.forward)
        events: dict[str, list[Any]] = {"ra": [], "a": [], "b": [], "ts": []}
        offsets = records.column("offset").to_pylist()
        for value, offset in zip(values, offsets, strict=True):
            event, problem = parse_event(value, r.max_event_bytes)
            if event is not None and quarantined:
                problem = quarantined.get((event["a"], event["b"]))
                event = None if problem else event
            if event is None:
                detail = json.dumps(
                    {
                        "source": source,
                        "offset": offset,
                        "reason": problem,
                        **dead_letter_value(value),
                    }
                )
                out.add(kind="invalid", ra=control_group("I", source, r.parallelism), detail=detail)
                continue
            seq, a, b, ts = event["seq"], event["a"], event["b"], event["ts"]
            ra = balancer.pick(table_a.route(a))
            if tuples:
                pad = event.get("pad")
                out.add(
                    kind="event", seq=seq, a=a, b=b, ts=event_time(ts),
                    ra=ra, rb=to_b.tuple_route(b), vb=r.version_b, n=1,
                    pad=pad if isinstance(pad, str) else None,
                )  # fmt: skip
            else:
                for name, field in (("ra", ra), ("a", a), ("b", b), ("ts", ts)):
                    events[name].append(field)
        if len(out):
            yield out.batch()
        if events["ra"]:
            routed.append(pa.table(events, schema=_ROUTED_EVENTS))


def _holds_any(decoded: pa.Table, pairs: Mapping[tuple[str, str], str]) -> bool:
    """Whether a chunk of decoded events holds one of ``pairs`` (its field-1 and field-2 keys)."""
    keys = zip(decoded.column("a").to_pylist(), decoded.column("b").to_pylist(), strict=True)
    return any(pair in pairs for pair in keys)


def event_time(ts_ms: int) -> datetime:
    """An event's ``ts`` (epoch milliseconds) as the exact instant, in integers.

    ``datetime.fromtimestamp(ts_ms / 1000)`` goes through a float, whose
    53 bits hold a time of the events' range (years 1 to 9999) only to some
    microseconds (9999-12-31T23:59:59.999 would become …59.998993), and an
    event's ``ts`` in ``tuples`` mode would differ from the same event's in
    ``pairs`` mode, which Arrow computes in integers.
    """
    return _EPOCH + timedelta(milliseconds=ts_ms)


_ROUTED_EVENTS = pa.schema(
    [("ra", pa.string()), ("a", pa.string()), ("b", pa.string()), ("ts", pa.int64())]
)


def _routed(decoded: pa.Table, table_a: RoutedKeyTable, balancer: LeastLoadedRoutes) -> pa.Table:
    """Decoded events with their stage-A routed keys (:data:`_ROUTED_EVENTS`).

    A key's routes are looked up once per chunk, the chunk's keys at once
    (:meth:`~keyplane.routing.routedkeys.RoutedKeyTable.route_all`: a scaled-in
    operator's new keys share one salt search). Each event takes its route
    from the task's ``balancer``, which counts every event when the
    version splits a key (:class:`~keyplane.routing.handoff.LeastLoadedRoutes`).
    """
    keys = decoded.column("a").to_pylist()
    routes = table_a.route_all(keys)
    ra = balancer.pick_all(keys, routes)
    return pa.table(
        {"ra": ra, "a": decoded.column("a"), "b": decoded.column("b"), "ts": decoded.column("ts")},
        schema=_ROUTED_EVENTS,
    )


class _StageBRoutes:
    """The stage-B routed keys of a task's rows or tuples, by their field-2 key.

    Chosen here, where the events are parsed, rather than in stage A, so that
    a stage needs no routing table and may run in the JVM
    (:mod:`keyplane.spark.jvm`). A split key's rows take the least loaded of
    its routes by this task's own stage-B counts, as stage A's tuples do
    (:class:`~keyplane.routing.handoff.LeastLoadedRoutes`). Stage A's balancer gives
    a split A key's partials unequal sizes, to fill the instances its
    neighbours leave light; B rows that followed their A partial's instance
    carried that inequality into stage B (1.56 max/avg in the hot-key
    benchmark). The rows come in an order fixed by the task's offset
    ranges, so a replayed batch routes as before. A key's routes are looked
    up once per task.
    """

    def __init__(self, table_b: RoutedKeyTable) -> None:
        self._routes_of = functools.cache(table_b.route)
        self._balancer = LeastLoadedRoutes(table_b.instances_of, split=bool(table_b.hot_keys))

    def tuple_route(self, b: str) -> str:
        """The route of one forwarded tuple."""
        return self._balancer.pick(self._routes_of(b))

    def row_routes(self, bs: list[str], tuples: list[int]) -> list[str]:
        """The routes of rows that each carry ``tuples`` tuples of their key."""
        routes = {b: self._routes_of(b) for b in set(bs)}
        return self._balancer.pick_heaviest_first(bs, routes, tuples)


def _combined(events: pa.Table, version_b: int, to_b: _StageBRoutes) -> pa.RecordBatch:
    """One ``event`` row per (routed key, field-2 key): its events' number and latest time."""
    pairs = events.group_by(["ra", "a", "b"], use_threads=False).aggregate(
        [("ts", "max"), ("ts", "count")]
    )
    rows = pairs.num_rows
    ra, b = pairs.column("ra").combine_chunks(), pairs.column("b").combine_chunks()
    counts = pairs.column("ts_count").combine_chunks()
    rb = to_b.row_routes(b.to_pylist(), counts.to_pylist())
    return _rows(
        "pairs",
        rows,
        kind=pa.array(["event"] * rows, pa.string()),
        a=pairs.column("a").combine_chunks(),
        b=b,
        ra=ra,
        rb=pa.array(rb, pa.string()),
        ts=pc.multiply_checked(pairs.column("ts_max"), 1000)
        .combine_chunks()
        .cast(pa.timestamp("us", tz="UTC")),
        vb=pa.array([version_b] * rows, pa.int32()),
        n=counts,
    )


def read_evictions(p: EvictPartition) -> Iterator[pa.RecordBatch]:
    """One evict row per state move in this share (000 §3.4), or one per instance."""
    if not p.moves:
        return
    if p.handoff == "per-instance":
        yield _evicts_per_instance(p)
        return
    keys = [key for key, _, _ in p.moves]
    sources = [source for _, source, _ in p.moves]
    common = {
        "kind": ["evict"] * len(p.moves),
        "stage": [p.operator] * len(p.moves),
        "target_rk": [target for _, _, target in p.moves],
        "marker": [p.marker] * len(p.moves),
    }
    if p.operator == FIRST_STAGE:
        yield _rows(p.forward, len(p.moves), a=keys, ra=sources, **common)
    else:
        groups = [control_group(SECOND_STAGE, source, p.parallelism) for source in sources]
        yield _rows(p.forward, len(p.moves), b=keys, rb=sources, ra=groups, **common)


def _evicts_per_instance(p: EvictPartition) -> pa.RecordBatch:
    """An ``evicts`` row per instance the share's moves leave: ``[key, source, target]`` each."""
    by_instance: dict[int, list[list[str]]] = {}
    instances_of = spark_partitions([source for _, source, _ in p.moves], p.parallelism)
    for (key, source, target), instance in zip(p.moves, instances_of.tolist(), strict=True):
        by_instance.setdefault(instance, []).append([key, source, target])
    instances = sorted(by_instance)
    groups = [evict_groups(p.operator, p.parallelism)[i] for i in instances]
    return _rows(
        p.forward,
        len(instances),
        kind=["evicts"] * len(instances),
        stage=[p.operator] * len(instances),
        ra=groups,
        rb=groups if p.operator == SECOND_STAGE else [None] * len(instances),
        state=[json.dumps(by_instance[i], separators=(",", ":")) for i in instances],
        marker=[p.marker] * len(instances),
    )


def batch_end_groups(parallelism: int) -> list[tuple[str, str]]:
    """(stage, closing group) of each row of :func:`batch_end_rows`."""
    return [
        (stage, evict_groups(stage, parallelism)[i])
        for stage in OPERATORS
        for i in range(parallelism)
    ]


@functools.cache
def batch_end_rows(forward: Forward, parallelism: int) -> pa.RecordBatch:
    """An empty ``evicts`` row per stage and instance, in the instance's closing group.

    A JVM stage's task gathers rows over its routed keys' groups (stage A its
    events for B per field-2 key, stage B its traffic per upstream instance)
    and writes them in its first closing group, which Spark calls after every
    routed key's (``RoutedStages.Stage.endOfTask``). So every batch of events
    carries one for each stage and instance; a task that ends without one
    fails rather than lose what it gathered. Stage B's rows name their group in
    ``rb`` too, so they pass through stage A's.
    """
    rows = batch_end_groups(parallelism)
    return _rows(
        forward,
        len(rows),
        kind=["evicts"] * len(rows),
        stage=[stage for stage, _ in rows],
        ra=[group for _, group in rows],
        rb=[group if stage == SECOND_STAGE else None for stage, group in rows],
        state=["[]"] * len(rows),
        marker=[-1] * len(rows),
    )


def read_installs(p: MigrationPartition) -> Iterator[pa.RecordBatch]:
    """Install rows for the states the previous batch handed over.

    Per key: a stage-A move is installed in the group of its target routed
    key; a stage-B move travels through stage A in the control group of its
    target's instance, with the target in ``rb``. Per instance: one
    ``installs`` row per stage and target instance.
    """
    for records in read_range(p.records):
        moves = [m for value in records.column("value").to_pylist() for m in moves_of(value)]
        if not moves:
            continue
        if p.handoff == "per-instance":
            yield _installs_per_instance(moves, p)
            continue
        to_a = [m["operator"] == FIRST_STAGE for m in moves]
        targets = [m["target"] for m in moves]
        keys = [m["key"] for m in moves]
        yield _rows(
            p.forward,
            len(moves),
            kind=["install"] * len(moves),
            stage=[m["operator"] for m in moves],
            a=[key if a else None for key, a in zip(keys, to_a, strict=True)],
            b=[None if a else key for key, a in zip(keys, to_a, strict=True)],
            ra=[
                target if a else control_group(SECOND_STAGE, target, p.parallelism)
                for target, a in zip(targets, to_a, strict=True)
            ],
            rb=[None if a else target for target, a in zip(targets, to_a, strict=True)],
            source_rk=[m["source"] for m in moves],
            count=[int(m["count"]) for m in moves],
            state=[m["state"] for m in moves],
            marker=[int(m["marker"]) for m in moves],
        )


def _installs_per_instance(moves: list[dict[str, Any]], p: MigrationPartition) -> pa.RecordBatch:
    """An ``installs`` row per stage and target instance:
    ``[key, source, target, count, state, marker]`` each."""
    by_group: dict[tuple[str, int], list[list[Any]]] = {}
    instances = spark_partitions([m["target"] for m in moves], p.parallelism).tolist()
    for m, instance in zip(moves, instances, strict=True):
        by_group.setdefault((m["operator"], instance), []).append(
            [m["key"], m["source"], m["target"], int(m["count"]), m["state"], int(m["marker"])]
        )
    order = sorted(by_group)
    stages = [stage for stage, _ in order]
    groups = [install_groups(stage, p.parallelism)[i] for stage, i in order]
    return _rows(
        p.forward,
        len(order),
        kind=["installs"] * len(order),
        stage=stages,
        ra=groups,
        rb=[g if stage == SECOND_STAGE else None for g, stage in zip(groups, stages, strict=True)],
        state=[json.dumps(by_group[g], separators=(",", ":")) for g in order],
    )
