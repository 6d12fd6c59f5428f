"""The routed job's source: events, routed by the version the driver planned, plus state moves.

Why the source plans the batch. Structured Streaming fixes a query's plan when
it starts; the only code that runs on the driver at *every* micro-batch
boundary, before the batch is written to the checkpoint's offset log, is the
sources' ``latestOffset``. So this source is where keyplane's driver side of
the reconfiguration protocol lives (paper 000 §3.4): at each boundary it

1. reads the new control messages (:class:`~keyplane.kafka.control.ControlChannel`)
   and feeds them to the job's :class:`~keyplane.control.job_protocol.JobProtocol`, which
   refuses (one log line, a count in the metrics, no reply) one that is
   unsigned, stale or for a configuration it cannot load;
2. fixes the batch's routing with :meth:`JobProtocol.begin_batch`;
3. publishes the protocol's replies (ACK, MIGRATED);
4. returns an *offset* that holds everything the batch needs: the events
   range, the control and migration topic positions, the protocol checkpoint,
   the routing version of each operator and the hand-offs that switch in it.

Spark writes that offset to its write-ahead log before running the batch, so
a batch replayed after a crash gets the same offset back, and with it the same
routing, the same evictions and the same installs: counts stay exact across
driver restarts with no checkpoint of keyplane's own.

What the batch reads, as rows of :data:`ROUTED_INPUT_SCHEMA` distinguished
by ``kind`` (:meth:`RoutedEventsReader.partitions`): ``event`` rows with
their stage-A and stage-B routed keys computed here from the planned
versions (no Python UDF and no join on the data path); ``evict`` and
``install`` rows for the states moving in this batch, or ``evicts`` and
``installs`` rows that carry an instance's moves together in a control group
(``per-instance`` hand-offs, the JVM stages: :func:`install_groups`,
:func:`evict_groups`, :func:`batch_end_rows`); and ``invalid`` rows, so that
the sink dead-letters a bad record rather than dropping it.

The switch batch routes its tuples with the *old* version, so the old group
sees every tuple up to the switch before it hands over, and the new group
gets its state in the same batch as its first tuples. No tuple ever reaches a
group before its state, which is what the buffer of 000 §3.4 guarantees.
Rows addressed to stage B travel through stage A under a reserved grouping
value (``CONTROL_PREFIX``, :func:`control_group`) that no key can take
(:mod:`keyplane.routing.routedkeys`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from keyplane.control.job_protocol import JobProtocol
from keyplane.control.messages import ControlMessage, Reaction
from keyplane.control.operators import OPERATORS
from keyplane.kafka.migration_topic import moves_of
from keyplane.kafka.offsets import PartitionOffsets, cap_offsets, check_not_ahead, total_rows
from keyplane.kafka.ranges import OffsetRange, read_range, split_range
from keyplane.reference.events import (
    _EPOCH,
    FORWARD_MODES,
    MAX_EVENT_BYTES,
    Forward,
    dead_letter_value,
    decode_events,
    parse_event,
)
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.routing import config as config_store
from keyplane.routing.handoff import LeastLoadedRoutes, StateMove, VersionedTables
from keyplane.routing.routedkeys import (
    CONTROL_STARTS,
    RoutedKeyTable,
    find_salt,
    routed_key,
    spark_partition,
    spark_partitions,
)
from keyplane.spark.kafka_source import (
    KafkaSourceOptionError,
    ReadTask,
    grouped_into_tasks,
    max_partitions_option,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from keyplane.kafka.admin import HighWatermarks
    from keyplane.kafka.control import ControlChannel, ControlRead

SOURCE_NAME = "keyplane-routed-events"
CONTROL_PREFIX, CLOSING_PREFIX = CONTROL_STARTS
"""What the grouping values that are not a key's routed key start with: NUL, and, for
the control groups that sort after every routed key, U+10FFFF (the last code point:
Spark calls a stateful operator's groups in the order of their grouping values). No
key's grouping value starts with either (:data:`keyplane.routing.routedkeys.CONTROL_STARTS`)."""

HandoffMode = Literal["per-key", "per-instance"]
"""How a rollout's moves reach the stages: one row per moved routed key, which the
key's own group handles (the Python stages), or one row per stage and instance,
which a control group handles for all its keys (the JVM stages)."""
HANDOFF_MODES: tuple[HandoffMode, ...] = get_args(HandoffMode)
_Mode = TypeVar("_Mode", bound=str)

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

log = logging.getLogger(__name__)


def routed_input_schema(forward: Forward) -> str:
    """The source's rows in ``forward`` mode: ``tuples`` rows carry each event's padding."""
    return ROUTED_INPUT_SCHEMA if forward == "pairs" else f"{ROUTED_INPUT_SCHEMA}, {PAD_COLUMN}"


def control_group(stage: str, about: str, parallelism: int) -> str:
    """The grouping value under which a control row about ``about`` travels.

    Rows for stage B travel through stage A under it, and stage A's reports
    reach the sink through stage B under it. There is one such group per
    ``stage`` and instance, not one per routed key: every group costs a
    stateful operator one Python call with its own state-server round trips,
    so a rollout that moves 10,000 keys would otherwise add 10,000 groups to
    each of its batches. A row travels in the group of its routed key's own
    instance (``spark_partition(about)``), so control work spreads over the
    instances as the keys do.
    """
    return control_groups(stage, parallelism)[spark_partition(about, parallelism)]


def control_groups(stage: str, parallelism: int) -> tuple[str, ...]:
    """The control groups of ``stage``, the i-th salted onto instance i."""
    return _salted_groups(f"{CONTROL_PREFIX}{stage}", parallelism)


def install_groups(stage: str, parallelism: int) -> tuple[str, ...]:
    """Where ``stage`` installs a batch's moved-in states, per instance, before any key's group.

    The group's value starts with :data:`CONTROL_PREFIX`, which sorts first, so
    a moved-in state is in place before its key's first tuple of the batch.
    Stage-B installs pass through stage A under the same value.
    """
    return _salted_groups(f"{CONTROL_PREFIX}install-{stage}", parallelism)


def evict_groups(stage: str, parallelism: int) -> tuple[str, ...]:
    """Where ``stage`` evicts a batch's moved-out states, per instance, after every key's group.

    The group's value starts with :data:`CLOSING_PREFIX`, which sorts last, so
    an evicted state holds every tuple its key had in the switch batch.
    """
    return _salted_groups(f"{CLOSING_PREFIX}evict-{stage}", parallelism)


@functools.cache
def _salted_groups(prefix: str, parallelism: int) -> tuple[str, ...]:
    return tuple(
        routed_key(prefix, find_salt(prefix, instance, parallelism))
        for instance in range(parallelism)
    )


@dataclass(frozen=True)
class Switch:
    """An operator whose state moves in this batch: from ``from_version``'s routed keys
    to ``to_version``'s. The batch is ``marker``, the plan id every move carries."""

    operator: str
    from_version: int
    to_version: int


MoveTriple = tuple[str, str, str]
"""One state move of an operator: (key, source routed key, target routed key)."""


@dataclass(frozen=True)
class EvictPartition(InputPartition):
    """A share of the evict rows of one switching operator: ``moves``, as the driver planned them.

    The driver computes a switch's moves once (:meth:`RoutedEventsReader.partitions`)
    and deals them out. Each Python worker computing all of them itself, to
    emit its share, would load the new version and salt its routed keys in
    the switch batch. The moves travel as plain tuples (:meth:`of`), not
    :class:`~keyplane.routing.handoff.StateMove` objects: Spark pickles the partition
    on the driver and unpickles it in the task, and tuples pickle far faster
    than dataclass instances.
    """

    operator: str
    moves: tuple[MoveTriple, ...]
    parallelism: int
    marker: int
    forward: Forward = "pairs"
    handoff: HandoffMode = "per-key"

    @classmethod
    def of(
        cls,
        operator: str,
        moves: Sequence[StateMove],
        parallelism: int,
        marker: int,
        forward: Forward = "pairs",
        handoff: HandoffMode = "per-key",
    ) -> EvictPartition:
        """The share of ``operator``'s ``moves``, packed as :data:`MoveTriple` tuples."""
        triples = tuple((move.key, move.source, move.target) for move in moves)
        return cls(operator, triples, parallelism, marker, forward, handoff)


@dataclass(frozen=True)
class MigrationPartition(InputPartition):
    """Moved states written by the previous batch: become install rows."""

    records: OffsetRange
    parallelism: int
    forward: Forward = "pairs"
    handoff: HandoffMode = "per-key"


HandOff = EvictPartition | MigrationPartition
"""A batch's share of a rollout's work: evict rows, or install rows."""


@dataclass(frozen=True)
class RoutedEventsPartition(InputPartition):
    """Events ``start <= offset < end`` of one partition, routed on the planned versions,
    then the rows of ``handoffs``, the share of a rollout's work this task reads
    (:meth:`RoutedEventsReader.partitions`)."""

    events: OffsetRange
    store: str
    parallelism: int
    version_a: int
    version_b: int
    max_event_bytes: int = MAX_EVENT_BYTES
    forward: Forward = "pairs"
    handoffs: tuple[HandOff, ...] = ()
    prepared: int | None = None
    """A version the job has acknowledged and not yet routes on: the task loads its
    tables ahead (:func:`read_events`)."""
    batch_end: bool = False
    """Whether this task reads the batch's :func:`batch_end_rows` before its events."""
    quarantine: tuple[tuple[str, str, str], ...] = ()
    """The quarantined (field-1 key, field-2 key, reason) pairs, whose events are
    dead-lettered with that reason rather than routed (:mod:`keyplane.control.quarantine`)."""


_TABLES: dict[tuple[str, int], VersionedTables] = {}


def tables_for(store: str, parallelism: int) -> VersionedTables:
    """The process's cached routed-key tables of ``store`` (one per Python worker)."""
    found = _TABLES.get((store, parallelism))
    if found is None:
        found = VersionedTables(store, parallelism)
        _TABLES[(store, parallelism)] = found
    return found


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
    plan = {
        (q.store, q.parallelism, q.version_a, q.version_b, q.forward, q.prepared) for q in parts
    }
    if len(plan) > 1:
        raise ValueError(f"a task's event partitions route on one plan, not {len(plan)}: {plan}")
    tables = tables_for(p.store, p.parallelism)
    if p.prepared is not None:
        # 000 §3.4: an instance that acknowledges a PREPARE holds the new
        # configuration. Loading it here, in the batches before the switch,
        # keeps its cost (it grows with the routed keys) out of the switch
        # and install batches, which route on it.
        for operator in OPERATORS:
            tables.table(p.prepared, operator)
    table_a = tables.table(p.version_a, FIRST_STAGE)
    to_b = _StageBRoutes(tables.table(p.version_b, SECOND_STAGE))
    balancer = LeastLoadedRoutes(table_a.instances_of, split=bool(table_a.hot_keys))
    routed: list[pa.Table] = []
    for part in parts:
        yield from _routed_part(part, table_a, balancer, to_b, routed)
    if routed:
        yield _combined(pa.concat_tables(routed), p.version_b, to_b)


def _routed_part(
    p: RoutedEventsPartition,
    table_a: RoutedKeyTable,
    balancer: LeastLoadedRoutes,
    to_b: _StageBRoutes,
    routed: list[pa.Table],
) -> Iterator[pa.RecordBatch]:
    """One Kafka partition's events: rows for the refused records and, in ``tuples``
    mode, the tuples; in ``pairs`` mode the routed events are appended to ``routed``,
    which :func:`read_events` combines over its task."""
    source = f"{p.events.topic}[{p.events.partition}]"
    tuples = p.forward == "tuples"
    quarantined = {(a, b): reason for a, b, reason in p.quarantine}
    for records in read_range(p.events):
        values = records.column("value").to_pylist()
        decoded = None if tuples else decode_events(values, p.max_event_bytes)
        if decoded is not None and quarantined and _holds_any(decoded, quarantined):
            decoded = None
        if decoded is not None:
            routed.append(_routed(decoded, table_a, balancer))
            continue
        out = _Columns(p.forward)
        events: dict[str, list[Any]] = {"ra": [], "a": [], "b": [], "ts": []}
        offsets = records.column("offset").to_pylist()
        for value, offset in zip(values, offsets, strict=True):
            event, problem = parse_event(value, p.max_event_bytes)
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
                out.add(kind="invalid", ra=control_group("I", source, p.parallelism), detail=detail)
                continue
            seq, a, b, ts = event["seq"], event["a"], event["b"], event["ts"]
            ra = balancer.pick(table_a.route(a))
            if tuples:
                pad = event.get("pad")
                out.add(
                    kind="event", seq=seq, a=a, b=b, ts=event_time(ts),
                    ra=ra, rb=to_b.tuple_route(b), vb=p.version_b, n=1,
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
    rows = [
        (stage, evict_groups(stage, parallelism)[i])
        for stage in OPERATORS
        for i in range(parallelism)
    ]
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


def _required(options: Mapping[str, str], name: str) -> str:
    value = options.get(name.lower())
    if not value:
        raise KafkaSourceOptionError(f"the keyplane routed source needs option {name!r}")
    return value


def _forward(options: Mapping[str, str]) -> Forward:
    """The ``forward`` option (default ``pairs``), refused in one line if unknown."""
    return _one_of(options, "forward", FORWARD_MODES)


def _handoff(options: Mapping[str, str]) -> HandoffMode:
    """The ``handoff`` option (default ``per-key``), refused in one line if unknown."""
    return _one_of(options, "handoff", HANDOFF_MODES)


def _one_of(options: Mapping[str, str], name: str, modes: tuple[_Mode, ...]) -> _Mode:
    """Option ``name``, one of ``modes`` (default: the first)."""
    raw = options.get(name, modes[0])
    for mode in modes:
        if raw == mode:
            return mode
    raise KafkaSourceOptionError(f"option {name!r} is one of {', '.join(modes)}, got {raw!r}")


def _quarantine(options: Mapping[str, str]) -> tuple[tuple[str, str, str], ...]:
    """The ``quarantine`` option: a JSON list of [field-1 key, field-2 key, reason]."""
    text = options.get("quarantine")
    if not text:
        return ()
    try:
        pairs = tuple((str(a), str(b), str(reason)) for a, b, reason in json.loads(text))
    except (ValueError, TypeError) as error:
        message = f"option quarantine: not a JSON list of triples ({error})"
        raise KafkaSourceOptionError(message) from None
    return pairs


def _max_event_bytes(options: Mapping[str, str]) -> int:
    raw = options.get("max.event.bytes")
    if raw is None:
        return MAX_EVENT_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KafkaSourceOptionError(
            f"option 'max.event.bytes' is a positive number of bytes, got {raw!r}"
        )
    return value


class ControlMessagesLost(RuntimeError):
    """Retention deleted control messages the job never read (one line, for a CLI)."""


class RoutedEventsReader(DataSourceStreamReader):
    """Plans each micro-batch of the routed job on the driver; reads it on executors."""

    def __init__(self, options: Mapping[str, str]) -> None:
        options = {k.lower(): v for k, v in options.items()}
        self.bootstrap_servers = _required(options, "kafka.bootstrap.servers")
        self.events_topic = _required(options, "subscribe")
        self.control_topic = _required(options, "control.topic")
        self.migration_topic = _required(options, "migration.topic")
        self.store = _required(options, "routing.store")
        self.parallelism = int(_required(options, "state.partitions"))
        self.initial_version = int(_required(options, "initial.version"))
        max_rows = options.get("maxoffsetspertrigger")
        self.max_rows = int(max_rows) if max_rows else None
        self.max_event_bytes = _max_event_bytes(options)
        self.max_partitions = max_partitions_option(options)
        self.forward = _forward(options)
        self.handoff = _handoff(options)
        self.quarantine = _quarantine(options)
        stages = options.get("stages")
        self.stages: tuple[str, ...] = tuple(stages.split(",")) if stages else OPERATORS
        """The job's stages, upstream first: the operators its protocol steers."""
        self._channel: ControlChannel | None = None
        self._watermarks: HighWatermarks | None = None
        self._planner: ThreadPoolExecutor | None = None
        self._planning: tuple[tuple[int, int], Future[None]] | None = None
        self._unusable: dict[int, str] = {}
        self._latest: PartitionOffsets | None = None

    # -- driver side ---------------------------------------------------------

    def channel(self) -> ControlChannel:
        from keyplane.kafka.control import ControlChannel

        if self._channel is None:
            self._channel = ControlChannel(self.bootstrap_servers, self.control_topic)
        return self._channel

    def _marks(self, topic: str) -> dict[str, int]:
        from keyplane.kafka.admin import HighWatermarks

        if self._watermarks is None:
            self._watermarks = HighWatermarks(self.bootstrap_servers)
        return {str(p): off for p, off in self._watermarks.of(topic).items()}

    def _earliest(self, topic: str) -> dict[str, int]:
        from keyplane.kafka.admin import earliest_offsets

        return {str(p): off for p, off in earliest_offsets(self.bootstrap_servers, topic).items()}

    def lookup_checksum(self, version: int) -> str | None:
        """The stored checksum of ``version`` if this job can route on it, else None.

        The job checks a configuration itself before it acknowledges it, even
        if a validation step already did (000 §3.4: an instance acts only on a
        configuration it holds): files that do not match their checksums, a
        manifest that is not a configuration, or tables over instances the
        query does not have. Whatever is wrong, the answer is None and the
        job stays on its last good version; the reason is kept for the
        refusal's log line (:meth:`unusable`).
        """
        try:
            found = config_store.checksum(self.store, version)
            tables = tables_for(self.store, self.parallelism)
            for operator in self.stages:
                # Its tables are built with its hand-offs, off the batch's path.
                tables.routing(version, operator)
        except (config_store.ConfigStoreError, ValueError, KeyError, TypeError, OSError) as error:
            # One line, so that the refusal stays one line of the driver's log.
            self._unusable[version] = " ".join(f"{type(error).__name__}: {error}".split())
            return None
        self._unusable.pop(version, None)
        return found

    def unusable(self, version: int) -> str | None:
        """Why the last :meth:`lookup_checksum` of ``version`` found it unusable."""
        return self._unusable.get(version)

    def initialOffset(self) -> dict[str, Any]:
        checksum = self.lookup_checksum(self.initial_version)
        if checksum is None:
            raise config_store.UnknownVersionError(
                f"the job starts on v{self.initial_version}, which {self.store} does not hold "
                f"in a form this job can route: {self.unusable(self.initial_version)}"
            )
        protocol = JobProtocol(
            self.stages, self.initial_version, checksum, lookup_checksum=self.lookup_checksum
        )
        return {
            "plan": -1,
            "events": {self.events_topic: self._earliest(self.events_topic)},
            # Control messages sent before the job started still apply; moved
            # states in the migration topic belong to an older checkpoint.
            "control": self._control_earliest(),
            "migration": self._marks(self.migration_topic),
            "protocol": protocol.to_dict(),
            "routing": dict.fromkeys(self.stages, self.initial_version),
            "switch": [],
        }

    def _control_earliest(self) -> int:
        """The first offset of the control topic that the broker still keeps.

        A new checkpoint starts reading there, as it starts each events
        partition at its first kept offset: retention may have deleted the
        topic's first records, and a read from offset 0 would then fail at
        every start. What retention deleted is older than anything kept; a
        rollout it belonged to has long ended, and the controller repeats
        whatever step it still waits for (each step is an idempotent,
        retryable call), so a new job misses nothing it could act on.
        """
        from keyplane.kafka.control import PARTITION

        return self._earliest(self.control_topic).get(str(PARTITION), 0)

    def _read_control(self, start: int, *, new: bool) -> ControlRead:
        """The control messages from ``start``, the checkpoint's position, to the topic's end.

        Raises :class:`ControlMessagesLost` when retention has deleted records
        the job never read. A job that restarts after being down longer than
        the topic's retention may have missed a PREPARE, a PROPAGATE or an
        ABORT addressed to it; it cannot know which, and skipping ahead would
        leave its protocol state and the controller's apart (000 §3.4: every
        instance takes every step). So it stops with an error that says what
        happened, and never skips silently. A ``new`` checkpoint, whose first
        batch this is, has read nothing yet: should retention delete records
        between its start (:meth:`_control_earliest`) and this read, it reads
        from the first kept one. Only a failed read pays for the broker's
        earliest offset.
        """
        from keyplane.kafka.admin import TopicError

        try:
            return self.channel().read(start)
        except TopicError as error:
            earliest = self._control_earliest()
            if start >= earliest:
                raise
            if new:
                return self.channel().read(earliest)
            raise ControlMessagesLost(
                f"the checkpoint's position in control topic {self.control_topic!r} is offset "
                f"{start}, but the broker keeps records from offset {earliest} only: retention "
                f"deleted {earliest - start} control message(s) this job never read, and a "
                "PREPARE, PROPAGATE or ABORT among them would leave the job and the controller "
                "disagreeing on its routing. Keep the control topic's records longer than a job "
                "may be down; to go on, start the job on a new checkpoint"
            ) from error

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.max_rows is None else ReadMaxRows(self.max_rows)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        plan = int(start["plan"]) + 1
        protocol = JobProtocol.from_dict(
            start["protocol"], lookup_checksum=self.lookup_checksum, explain=self.unusable
        )
        replies: list[ControlMessage] = []
        control = self._read_control(int(start["control"]), new=plan == 0)
        refused: Counter[str] = Counter()
        for offset, invalid in control.rejected:
            refused[invalid.reason] += 1
            log.warning(
                "keyplane: control record %s refused (%s): %s",
                offset,
                invalid.reason,
                invalid.detail,
            )
        for offset, message in control.messages:
            reaction: Reaction = protocol.react(message, plan)
            if reaction.outcome == "ignored" and reaction.reason != "own_message":
                assert reaction.reason is not None
                refused[reaction.reason] += 1
                why = self.unusable(message.config_version)
                log.warning(
                    "keyplane: control record %s refused (%s): %s%s",
                    offset,
                    reaction.reason,
                    reaction.detail,
                    f" ({why})" if reaction.reason == "unknown_checksum" and why else "",
                )
            replies += reaction.replies
        events = self._events_end(start["events"], limit)
        migration_marks = self._marks(self.migration_topic)
        check_not_ahead(self.migration_topic, start["migration"], migration_marks)
        migration = {**start["migration"], **migration_marks}
        work = (
            total_rows(start["events"], events) > 0
            or control.end != int(start["control"])
            or migration != start["migration"]
            or bool(protocol.migrating())
            or bool(replies)
        )
        if not work:
            return start
        routing = protocol.begin_batch(plan)
        for handoff in protocol.migrating():
            # This batch installs the state its switch batch moved. Its plan,
            # installs included, is in Spark's offset log before any row runs,
            # and every later batch runs after it: from here on the operator
            # has migrated, even if the driver dies and replays this batch.
            if handoff.switch_batch is not None and handoff.switch_batch == plan - 1:
                replies += protocol.state_installed(handoff.operator, plan)
        switches = [
            Switch(h.operator, h.from_version, h.to_version)
            for h in protocol.migrating()
            if h.switch_batch == plan
        ]
        effective = dict(routing)
        for switch in switches:
            effective[switch.operator] = switch.from_version
        if replies:
            self.channel().send(replies)
        prepared = protocol.pending_version
        if prepared is not None:
            self._plan_handoffs(protocol.active_version, prepared)
        return {
            "plan": plan,
            "events": events,
            "control": control.end,
            "migration": migration,
            "protocol": protocol.to_dict(),
            "routing": effective,
            "switch": [vars(s) for s in switches],
            # The batch's events: its rows are fewer in pairs mode (read_events),
            # so progress_of counts the batch by this.
            "read": total_rows(start["events"], events),
            # Control messages refused at this boundary, by reason: the
            # batch's metrics record reports them (keyplane.algorithms.batchmetrics).
            "rejected": dict(sorted(refused.items())),
            # The acknowledged version the tasks load ahead of its switch.
            "prepared": prepared,
        }

    def _plan_handoffs(self, active: int, prepared: int) -> None:
        """Plan the hand-offs to ``prepared`` while the controller is still to PROPAGATE.

        The switch batch then finds its moves computed (000 §3.4, PREPARE).
        The version's tables are built and its moves planned on a thread of
        their own, which overlaps the batch that acknowledges: done in
        ``latestOffset``, planning many moves would hold that batch's start back.
        :meth:`partitions` waits for them before it reads them.
        """
        if self._planning is not None and self._planning[0] == (active, prepared):
            return
        tables = tables_for(self.store, self.parallelism)

        def plan() -> None:
            for operator in self.stages:
                tables.moves(operator, active, prepared)

        if self._planner is None:
            self._planner = ThreadPoolExecutor(1, thread_name_prefix="keyplane-handoffs")
        self._planning = ((active, prepared), self._planner.submit(plan))

    def _handoffs_planned(self) -> None:
        """Wait for the hand-offs being planned, if any; raise what planning raised."""
        if self._planning is not None:
            self._planning[1].result()

    def _events_end(self, start: PartitionOffsets, limit: ReadLimit) -> PartitionOffsets:
        marks = {self.events_topic: self._marks(self.events_topic)}
        check_not_ahead(
            self.events_topic, start.get(self.events_topic, {}), marks[self.events_topic]
        )
        self._latest = marks
        known = all(p in start.get(t, {}) for t, parts in marks.items() for p in parts)
        earliest = {} if known else {self.events_topic: self._earliest(self.events_topic)}
        base = {t: {**earliest.get(t, {}), **start.get(t, {})} for t in marks}
        if isinstance(limit, ReadMaxRows):
            return cap_offsets(base, marks, limit.max_rows)
        return marks

    def reportLatestOffset(self) -> dict[str, Any]:
        # Spark asks right after latestOffset, for the progress report's lag:
        # the marks that call read are that recent.
        latest = self._latest or {self.events_topic: self._marks(self.events_topic)}
        return {"events": latest}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        """The batch's tasks: one per events partition with new events.

        A rollout's evict and install rows ride along with those tasks, each
        reading a share (:func:`spread_handoffs`), rather than in tasks of
        their own: a task of its own for 10,000 moves ran after every events
        task, alone, and lengthened the switch and install batches by its
        whole duration. With no new events, the shares are the tasks.
        """
        events = self._event_partitions(start, end)
        shares = max(1, len(events))
        handoffs: list[HandOff] = []
        tables = tables_for(self.store, self.parallelism)
        if end["switch"]:
            self._handoffs_planned()
        for raw in end["switch"]:
            switch = Switch(**raw)
            moves = tables.moves(switch.operator, switch.from_version, switch.to_version)
            handoffs += [
                EvictPartition.of(
                    switch.operator,
                    moves[share::shares],
                    self.parallelism,
                    end["plan"],
                    self.forward,
                    self.handoff,
                )
                for share in range(shares)
            ]
        for part, stop in sorted(end["migration"].items(), key=_by_partition):
            begin = int(start["migration"].get(part, 0))
            if stop > begin:
                kafka = OffsetRange(
                    self.bootstrap_servers, self.migration_topic, int(part), begin, int(stop)
                )
                handoffs += [
                    MigrationPartition(piece, self.parallelism, self.forward, self.handoff)
                    for piece in split_range(kafka, shares)
                ]
        if not events:
            return list(handoffs)
        if self.handoff == "per-instance":
            events[0] = dataclasses.replace(events[0], batch_end=True)
        tasks = spread_handoffs(events, handoffs)
        sizes = [p.events.end - p.events.start for p in events]
        return grouped_into_tasks(tasks, sizes, self.max_partitions)

    def _event_partitions(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> list[RoutedEventsPartition]:
        out: list[RoutedEventsPartition] = []
        routing = end["routing"]
        for part, stop in sorted(end["events"][self.events_topic].items(), key=_by_partition):
            begin = int(start["events"].get(self.events_topic, {}).get(part, 0))
            if stop > begin:
                kafka = OffsetRange(
                    self.bootstrap_servers, self.events_topic, int(part), begin, int(stop)
                )
                out.append(
                    RoutedEventsPartition(
                        kafka,
                        self.store,
                        self.parallelism,
                        routing[FIRST_STAGE],
                        routing[SECOND_STAGE],
                        self.max_event_bytes,
                        self.forward,
                        prepared=end.get("prepared"),
                        quarantine=self.quarantine,
                    )
                )
        return out

    def commit(self, end: dict[str, Any]) -> None:
        """Offsets live in Spark's checkpoint; nothing to commit to Kafka."""

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._watermarks is not None:
            self._watermarks.close()
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)

    # -- executor side -------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, ReadTask):
            # partitions() groups only events partitions into tasks (grouped_into_tasks).
            events = [p for p in partition.parts if isinstance(p, RoutedEventsPartition)]
            if len(events) != len(partition.parts):
                raise TypeError(f"a routed-source task groups events partitions: {partition!r}")
            yield from self._read_event_task(events)
        elif isinstance(partition, RoutedEventsPartition):
            yield from self._read_event_task([partition])
        elif isinstance(partition, EvictPartition):
            yield from read_evictions(partition)
        elif isinstance(partition, MigrationPartition):
            yield from read_installs(partition)
        else:
            raise TypeError(f"not a routed-source partition: {partition!r}")

    def _read_event_task(self, parts: list[RoutedEventsPartition]) -> Iterator[pa.RecordBatch]:
        """A task's event partitions: the batch's end rows if the task carries them, the
        events of all its partitions combined (:func:`read_events`), then the hand-offs
        each partition brought along (:func:`spread_handoffs`)."""
        for part in parts:
            if part.batch_end:
                yield batch_end_rows(part.forward, part.parallelism)
        yield from read_events(*parts)
        for part in parts:
            for handoff in part.handoffs:
                yield from self.read(handoff)


def _by_partition(item: tuple[str, int]) -> int:
    return int(item[0])


def spread_handoffs(
    events: list[RoutedEventsPartition], handoffs: list[HandOff]
) -> list[InputPartition]:
    """``events`` with ``handoffs`` dealt round robin over them, the i-th to task i mod n."""
    dealt: list[list[HandOff]] = [[] for _ in events]
    for i, handoff in enumerate(handoffs):
        dealt[i % len(events)].append(handoff)
    return [
        dataclasses.replace(part, handoffs=tuple(mine))
        for part, mine in zip(events, dealt, strict=True)
    ]


class RoutedEventsSource(DataSource):
    """``spark.readStream.format("keyplane-routed-events")``."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return routed_input_schema(_forward({k.lower(): v for k, v in self.options.items()}))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RoutedEventsReader(dict(self.options))


def read_routed_events(
    spark: SparkSession,
    bootstrap_servers: str,
    *,
    events_topic: str,
    control_topic: str,
    migration_topic: str,
    store: Path,
    state_partitions: int,
    initial_version: int,
    max_offsets_per_trigger: int | None = None,
    max_event_bytes: int | None = None,
    max_partitions: int | None = None,
    forward: Forward = "pairs",
    handoff: HandoffMode = "per-key",
    quarantine: str | None = None,
) -> DataFrame:
    """A streaming DataFrame of :func:`routed_input_schema` rows for the routed job.

    ``max_event_bytes`` (default :data:`MAX_EVENT_BYTES`) bounds an event's
    record; larger ones are dead-lettered as ``oversized``. ``max_partitions``
    bounds the tasks that read a batch (:class:`~keyplane.spark.kafka_source.ReadTask`;
    default: one per events partition). ``forward`` is what stage A will send
    stage B, and ``handoff`` how its stages take a rollout's moves (module docstring).
    ``quarantine`` is the quarantined pairs
    (:meth:`keyplane.control.quarantine.Quarantine.option`), whose events are dead-lettered.
    """
    spark.dataSource.register(RoutedEventsSource)
    reader = (
        spark.readStream.format(SOURCE_NAME)
        .option("kafka.bootstrap.servers", bootstrap_servers)
        .option("subscribe", events_topic)
        .option("control.topic", control_topic)
        .option("migration.topic", migration_topic)
        .option("routing.store", str(store.resolve()))
        .option("state.partitions", str(state_partitions))
        .option("initial.version", str(initial_version))
        .option("forward", forward)
        .option("handoff", handoff)
    )
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    if max_event_bytes is not None:
        reader = reader.option("max.event.bytes", str(max_event_bytes))
    if max_partitions is not None:
        reader = reader.option("maxPartitions", str(max_partitions))
    if quarantine:
        reader = reader.option("quarantine", quarantine)
    return reader.load()
