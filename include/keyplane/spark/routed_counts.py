"""The routed job: two keyed stages grouped by routed keys, state moved live.

Each stage runs a :class:`~keyplane.aggregates.KeyedAggregate` (the
reference application, paper 000 §4.1, runs :class:`~keyplane.aggregates.RunningCount`
in both: stage A per field-1 key, stage B per field-2 key). Each stage
groups by the *routed key* the running configuration gives the key
(:mod:`keyplane.routing.routedkeys`), so a routing table places keys on chosen
instances (000 §3.3) and a hot key is split over several, each holding a
partial state (001 §4.1.2). The input comes from
:mod:`keyplane.spark.routed_source`, which plans every batch's routing and
state moves on the driver.

A group's Spark state is ``state`` (the aggregate's encoded state),
``count`` (how many tuples it holds: the routed key's load, and the order
of its reports within a batch) and ``marker`` (the last hand-off installed).
Every group handles its rows in the order of 000 §3.4, whatever order Spark
delivers them in:

1. ``install`` rows: merge the moved-in state, once per (marker, source);
   report each source routed key's partial as the aggregate's zero from now
   on (a *tombstone*), so the merge never counts a moved state twice;
2. ``event`` rows: ``add`` their values, one call per group and batch (a
   row stands for ``n`` events of one field-2 key: in ``pairs`` mode the
   source combines each task's events, :func:`keyplane.spark.routed_reads.read_events`);
3. an ``evict`` row: emit the state (``moved``) and clear it. The sink writes
   moved states to the migration topic; the next batch installs them.

Stage A sends each of its output rows to the routed key of stage B that the
source chose for the row's pair (``rb``). The job's ``forward`` mode
(:data:`~keyplane.reference.events.Forward`) says what: one row per (field-2 key, B
version) and batch with its tuple count ``n`` (``pairs``), or every tuple
with its padding, as paper 000 §4.1-4.2 forwards them, so that the A→B
shuffle carries the bytes a locality-aware table keeps on one executor
(``tuples``). Both stages report where they ran, read from ``TaskContext``,
so placement is observed, not assumed.

The Python stages run any aggregate; for the running count
:func:`routed_running_counts` may pick the same stages in the JVM
(:mod:`keyplane.spark.jvm`, :data:`StageEngine`), with the same protocol and
output. Both are row-based ``transformWithState`` processors without a time
mode. PySpark builds each row cell by cell and serves each state call with a
round trip to the JVM, so the fields only control rows use travel packed in
one JSON column, ``ctl`` (:func:`_narrow_input`), and stage A's partial
travels once per group and batch, not on the rows it sends stage B.
"""

from __future__ import annotations

import heapq
import json
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from pyspark import TaskContext
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from keyplane.aggregates import KeyedAggregate, RunningCount
from keyplane.algorithms.batchmetrics import TOP_PAIRS_PER_INSTANCE
from keyplane.control.quarantine import Stage, blame
from keyplane.reference.events import Forward
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.settings import StageEngine
from keyplane.spark import jvm as jvm_stages
from keyplane.spark.routed_partitions import CONTROL_PREFIX, control_group
from keyplane.spark.routed_reads import PAD_COLUMN

CONTROL_FIELDS = ("stage", "source_rk", "target_rk", "count", "state", "marker", "detail")
"""The source's columns that only control rows use; both stages read them packed into
one JSON column, ``ctl`` (:func:`_narrow_input`)."""
ROUTED_STAGE_A_OUTPUT = (
    "kind STRING, a STRING, ra STRING, ia INT, ea STRING, b STRING, rb STRING, n LONG, ctl STRING"
)
"""Stage A's rows for stage B in ``pairs`` mode; see :func:`stage_a_output`."""
ROUTED_OUTPUT_SCHEMA = (
    "kind STRING, stage STRING, key STRING, routed_key STRING, instance INT, count LONG, "
    "state STRING, target STRING, marker LONG, upstream INT, n LONG, executor STRING, "
    "upstream_executor STRING, detail STRING, busy_ns LONG"
)
"""The stages' output rows, by ``kind``:

* ``count`` — a routed key's partial (``stage, key, routed_key, instance,
  count, state``); a tombstone has ``count`` 0, the encoded zero and no
  instance. ``busy_ns``: the nanoseconds the stage spent on the group in
  this batch (:func:`busy_since`), which the metrics sum per instance
  (:func:`keyplane.algorithms.batchmetrics.instance_busy_ms`); the JVM stages
  leave it null;
* ``moved`` — a state leaving ``routed_key`` for ``target`` (``marker``: the
  switch batch's plan id);
* ``hop`` — ``n`` tuples went from stage-A instance ``upstream`` (on
  ``upstream_executor``) to stage-B instance ``instance`` (on ``executor``):
  the traffic matrix, from which loads and locality follow;
* ``pair`` — heavy (a, b) pairs that reached stage-B instance ``instance``
  (``detail`` = a): here each group's heaviest; the JVM stages report each
  stage-A task's heaviest per instance (``RoutedStages``), and the metrics
  keep an instance's heaviest of either (:func:`keyplane.algorithms.batchmetrics.traffic_metrics`);
* ``invalid`` — a record that was not a valid event (``detail``: why)."""
STATE_SCHEMA = "state STRING, count LONG, marker LONG"
TOP_PAIRS_PER_GROUP = TOP_PAIRS_PER_INSTANCE
"""Pairs a stage-B group reports per batch: as many as the metrics keep per instance.

The instance's heaviest pairs (:func:`keyplane.algorithms.batchmetrics.traffic_metrics`)
can all belong to one B key, so a group that reported fewer would let a
lighter pair of another key take their place."""

T = TypeVar("T")


def stage_a_output(forward: Forward) -> str:
    """Stage A's output schema in ``forward`` mode: ``tuples`` rows carry the padding."""
    return ROUTED_STAGE_A_OUTPUT if forward == "pairs" else f"{ROUTED_STAGE_A_OUTPUT}, {PAD_COLUMN}"


def _stage_a_row(forward: Forward, pad: str | None = None, **fields: Any) -> Row:
    """A row of :func:`stage_a_output`: the ``pad`` column exists in ``tuples`` mode only."""
    return Row(**fields) if forward == "pairs" else Row(**fields, pad=pad)


def busy_since(started_ns: int) -> int:
    """Nanoseconds since ``started_ns`` (``time.perf_counter_ns``): a group's work.

    A stage times each routed key's group from the moment it holds the
    group's rows to the end of the aggregate's ``encode``: its state, the
    installs, the tuples and the aggregate's ``add``, the work a stage's cost
    per tuple is made of. Reading the rows is left out, as the first group of
    a task waits there for Spark to load the task's state store and input,
    and so are the rows the stage yields, which Spark consumes after the
    stage hands them on. Stela's execute rate of an operator is measured from
    such time, not from tuple counts (paper 003 §4.1).
    """
    return time.perf_counter_ns() - started_ns


def _task_partition() -> int:
    """The partition (operator instance) the calling task processes."""
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("no TaskContext: stateful functions run inside Spark tasks")
    return context.partitionId()


def executor_id() -> str:
    """This Python worker's executor, as ``host:executor``.

    PySpark tells Python no executor id, but every executor starts its Python
    workers in its own working directory (``work/<app>/<executor id>`` under
    a standalone or local-cluster master, the container's directory on YARN,
    its own host on Kubernetes), so host and directory name the executor; in
    local mode every task shares the driver's, which is right: one executor.
    The worker's parent pid would not do: each kind of Python worker (pandas
    UDF, ``transformWithState``) has a daemon of its own.
    """
    return f"{socket.gethostname()}:{Path.cwd().name}"


def take_installs(
    installs: Iterable[tuple[str, T, int]], installed_marker: int
) -> tuple[list[T], int, list[str]]:
    """Choose the moved-in states to merge, idempotently (000 §3.4).

    ``installs`` are ``(source routed key, moved state, marker)``. A marker
    at or below ``installed_marker`` was installed already (a replayed
    migration record); within one marker each source counts once. Returns
    the states to merge in, the new marker, and the sources now merged in
    (to tombstone).
    """
    marker = installed_marker
    taken: dict[str, T] = {}
    for source, moved, move_marker in installs:
        if move_marker <= installed_marker or source in taken:
            continue
        taken[source] = moved
        marker = max(marker, int(move_marker))
    return list(taken.values()), marker, sorted(taken)


@dataclass(frozen=True, slots=True)
class HeldState:
    """A routed key's state as a stage holds it between its rows (module docstring)."""

    state: Any
    count: int
    marker: int


def _installed(
    aggregate: KeyedAggregate[Any],
    held: HeldState,
    installs: Iterable[tuple[str, tuple[str, int], int]],
) -> tuple[HeldState, list[str]]:
    """``held`` with the new moved-in states merged in, and the sources to tombstone."""
    moved_in, marker, sources = take_installs(installs, held.marker)
    state, count = held.state, held.count
    for text, moved_count in moved_in:
        state = aggregate.merge(state, aggregate.decode(text))
        count += moved_count
    return HeldState(state, count, marker), sources


class _RoutedStage(StatefulProcessor):
    """What both routed stages share: ``aggregate``'s partial per routed key, held as
    :data:`STATE_SCHEMA` in one value state."""

    aggregate: KeyedAggregate[Any]

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getValueState("state", STATE_SCHEMA)
        self.zero_text = self.aggregate.encode(self.aggregate.zero())

    def _held(self) -> HeldState:
        """The group's stored state, or the aggregate's zero when it holds none."""
        agg = self.aggregate
        # get() is None when the group holds no state: one call to the JVM, not two.
        stored = self.state.get()
        if not stored:
            return HeldState(agg.zero(), 0, -1)
        return HeldState(agg.decode(stored[0]), int(stored[1]), int(stored[2]))

    def close(self) -> None:
        pass


class RoutedStageA(_RoutedStage):
    """Stage A: ``aggregate``'s partial state per routed key of field 1, with live hand-off.

    ``parallelism`` names the control groups its reports travel in;
    ``forward`` is what it sends stage B (module docstring).
    """

    def __init__(
        self,
        parallelism: int,
        aggregate: KeyedAggregate[Any],
        forward: Forward = "pairs",
    ) -> None:
        self.parallelism = parallelism
        self.aggregate = aggregate
        self.forward = forward

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        group: str = key[0]
        if group.startswith(CONTROL_PREFIX):
            yield from _forward_through_a(rows, self.forward)
            return
        installs: list[Row] = []
        events: list[Row] = []
        evicts: list[Row] = []
        by_kind = {"install": installs, "event": events, "evict": evicts}
        for row in rows:
            by_kind[row.kind].append(row)
        started = time.perf_counter_ns()
        agg = self.aggregate
        held = self._held()
        held, sources = _installed(agg, held, map(_install, installs))
        key_a = (installs or events or evicts)[0].a
        instance, executor = _task_partition(), executor_id()
        state, count = held.state, held.count
        if events:
            # A row stands for n events of one field-2 key (routed_reads.read_events).
            values: list[str] = []
            for row in events:
                values += [row.b] * row.n
            state = _added(agg, FIRST_STAGE, key_a, state, values)
            count += len(values)
        text = agg.encode(state)
        busy = busy_since(started)
        for source in sources:
            yield self._report("report", key_a, source, count=0, state=self.zero_text)
        if installs or events:
            yield self._report(
                "report", key_a, group, count=count, state=text, instance=instance, busy_ns=busy
            )
        if events:
            yield from self._to_stage_b(group, key_a, events, (instance, executor))
        if evicts:
            if count > 0:
                evict = json.loads(evicts[0].ctl)
                yield self._report(
                    "moved", key_a, group, count=count, state=text,
                    target=evict["target_rk"], marker=evict["marker"],
                )  # fmt: skip
            self.state.clear()
        elif installs or events:
            self.state.update((text, count, held.marker))

    def _to_stage_b(
        self,
        group: str,
        key_a: str,
        events: list[Row],
        where: tuple[int, str],
    ) -> Iterator[Row]:
        """The batch's events as rows for stage B, on the routed keys the source chose (``rb``).

        In ``pairs`` mode one row per (field-2 key, routed key of B), weighing
        ``n`` tuples; in ``tuples`` mode one row per tuple, with its padding.
        The group's partial after the batch travels apart, as one ``report``
        row (:meth:`_report`): riding on these rows, it would reach the sink
        once per field-2 key the group sent to.
        """
        weights: dict[tuple[str, str], int] = {}
        for row in events:
            weights[(row.b, row.rb)] = weights.get((row.b, row.rb), 0) + row.n
        instance, executor = where
        if self.forward == "pairs":
            sent = [(pair, n, None) for pair, n in weights.items()]
        else:
            sent = [((row.b, row.rb), 1, row.pad) for row in events]
        for (b, rb), n, pad in sent:
            yield _stage_a_row(
                self.forward, pad, kind="event", a=key_a, ra=group, ia=instance, ea=executor,
                b=b, rb=rb, n=n, ctl=None,
            )  # fmt: skip

    def _report(
        self,
        kind: str,
        key: str,
        routed: str,
        *,
        count: int,
        state: str,
        instance: int | None = None,
        target: str | None = None,
        marker: int | None = None,
        busy_ns: int | None = None,
    ) -> Row:
        """A ``report`` (a partial; zero for a tombstone) or ``moved`` row for the sink.

        It reaches the sink through stage B in a control group. A report of
        the group's partial carries the group's busy time (:func:`busy_since`).
        """
        control = {"count": count, "state": state, "target_rk": target, "marker": marker}
        if busy_ns is not None:
            control["busy_ns"] = busy_ns
        return _stage_a_row(
            self.forward, kind=kind, a=key, ra=routed, ia=instance, ea=None, b=None,
            rb=control_group(FIRST_STAGE, routed, self.parallelism), n=None,
            ctl=json.dumps(control),
        )  # fmt: skip


def _added(
    aggregate: KeyedAggregate[Any], stage: Stage, key: str, state: Any, values: list[str]
) -> Any:
    """``aggregate.add(state, values)``; when it raises, the task fails with the values to
    blame (:func:`keyplane.control.quarantine.blame`), which the driver quarantines if the
    batch's replay fails the same way."""
    try:
        return aggregate.add(state, values)
    except Exception as error:
        raise blame(aggregate, stage, key, state, values, error) from error


def _forward_through_a(rows: Iterable[Any], forward: Forward) -> Iterator[Row]:
    """Rows for stage B and invalid records pass stage A unchanged (module docstring)."""
    for row in rows:
        rb = row.rb or row.ra
        yield _stage_a_row(
            forward, kind=row.kind, a=row.a, ra=row.ra, ia=None, ea=None, b=row.b, rb=rb, n=None,
            ctl=row.ctl,
        )  # fmt: skip


def _install(row: Row) -> tuple[str, tuple[str, int], int]:
    """An ``install`` row as (source routed key, (moved state, its count), marker)."""
    control = json.loads(row.ctl)
    return control["source_rk"], (control["state"], int(control["count"])), int(control["marker"])


OUTPUT_FIELDS = tuple(field.split()[0] for field in ROUTED_OUTPUT_SCHEMA.split(", "))
"""The names of :data:`ROUTED_OUTPUT_SCHEMA`'s columns, in order."""
_NO_OUTPUT_FIELDS = dict.fromkeys(OUTPUT_FIELDS)


def _output_row(**fields: Any) -> Row:
    """A row of :data:`ROUTED_OUTPUT_SCHEMA`; the fields not given are null."""
    return Row(**{**_NO_OUTPUT_FIELDS, **fields})


class RoutedStageB(_RoutedStage):
    """Stage B: ``aggregate``'s partial state per routed key of field 2, with live hand-off.

    Also reports the traffic from each stage-A instance and the group's
    heaviest pairs; stage A's own reports pass through its control groups.

    Called once per routed key per micro-batch, so its fixed cost bounds the
    job's throughput when batches touch many keys. That is why stage B is a
    row-based ``transformWithState`` and not ``applyInPandasWithState``:
    PySpark hands the latter each group as one pandas Series per input
    column, concatenated into a frame, and takes a frame back. For stage A's
    many columns that costs a group far more than this stage's state calls
    do.
    """

    def __init__(self, aggregate: KeyedAggregate[Any]) -> None:
        self.aggregate = aggregate

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        group: str = key[0]
        if group.startswith(CONTROL_PREFIX):
            yield from (_passed_through(row) for row in rows)
            return
        group_rows = list(rows)
        started = time.perf_counter_ns()
        agg = self.aggregate
        held = self._held()
        installs: list[tuple[str, tuple[str, int], int]] = []
        evict: tuple[str, int] | None = None
        values: list[str] = []
        hops: dict[tuple[int, str], int] = {}
        pairs: dict[str, int] = {}
        key_b: str | None = None
        for row in group_rows:
            kind = row.kind
            key_b = row.b if key_b is None else key_b
            if kind == "event":
                a, n, ia = row.a, int(row.n), int(row.ia)
                values += [a] * n
                hops[(ia, row.ea)] = hops.get((ia, row.ea), 0) + n
                pairs[a] = pairs.get(a, 0) + n
            elif kind == "install":
                installs.append(_install(row))
            elif kind == "evict":
                control = json.loads(row.ctl)
                evict = (control["target_rk"], int(control["marker"]))
        held, sources = _installed(agg, held, installs)
        partial = (
            _added(agg, SECOND_STAGE, key_b or "", held.state, values) if values else held.state
        )
        count = held.count + len(values)
        partial_text = agg.encode(partial)
        busy = busy_since(started)
        instance, executor = _task_partition(), executor_id()
        for source in sources:
            yield _output_row(
                kind="count", stage=SECOND_STAGE, key=key_b, routed_key=source, count=0,
                state=self.zero_text,
            )  # fmt: skip
        for (ia, ea), n in hops.items():
            yield _output_row(
                kind="hop", instance=instance, executor=executor, upstream=ia,
                upstream_executor=ea, n=n,
            )  # fmt: skip
        for a, n in heapq.nlargest(TOP_PAIRS_PER_GROUP, pairs.items(), key=lambda item: item[1]):
            yield _output_row(kind="pair", key=key_b, detail=a, instance=instance, n=n)
        yield _output_row(
            kind="count", stage=SECOND_STAGE, key=key_b, routed_key=group, instance=instance,
            count=count, state=partial_text, busy_ns=busy,
        )  # fmt: skip
        if evict is None:
            self.state.update((partial_text, count, held.marker))
            return
        if count > 0:
            yield _output_row(
                kind="moved", stage=SECOND_STAGE, key=key_b, routed_key=group, count=count,
                state=partial_text, target=evict[0], marker=evict[1],
            )  # fmt: skip
        self.state.clear()


def _passed_through(row: Row) -> Row:
    """A stage-A report or an invalid record, as an output row."""
    control = json.loads(row.ctl)
    if row.kind == "invalid":
        return _output_row(kind="invalid", detail=control["detail"])
    common = {
        "stage": FIRST_STAGE, "key": row.a, "routed_key": row.ra, "count": int(control["count"]),
        "state": control["state"],
    }  # fmt: skip
    if row.kind == "report":
        return _output_row(kind="count", **common, instance=row.ia, busy_ns=control.get("busy_ns"))
    return _output_row(
        kind="moved", **common, target=control["target_rk"], marker=int(control["marker"])
    )


def _narrow_input(inputs: DataFrame, forward: Forward) -> DataFrame:
    """The source's rows with the control-only columns packed into one JSON column, ``ctl``.

    PySpark hands a row-based ``transformWithState`` each input row as a
    ``Row`` built cell by cell, one Arrow-to-Python conversion per column,
    so a stage's cost grows with the width of its input as much as with its
    rows. Stage A reads six of the source's columns from an event;
    seven others are null on every event and read only by the few control
    rows, so Spark packs them here (in the JVM, null for an event) and a
    stage unpacks them for a control row only; ``seq``, ``vb`` and the
    event's own ``ts`` no stage reads.
    Stage A's output to stage B is narrow for the same reason.
    """
    control = F.when(F.col("kind") != "event", F.to_json(F.struct(*CONTROL_FIELDS)))
    padding = ["pad"] if forward == "tuples" else []
    return inputs.select("ra", "kind", "a", "b", "rb", "n", control.alias("ctl"), *padding)


class StageEngineError(ValueError):
    """The stages cannot run where the job's settings ask (one line, for a CLI)."""


ENGINE_RECORD = "keyplane-stages.json"
"""The file in a checkpoint that names the engine its stages ran on."""


Engine = Literal["jvm", "python", "chain"]
"""Where a checkpoint's stages run (:data:`~keyplane.settings.StageEngine` once resolved)."""
ENGINES: tuple[Engine, ...] = ("jvm", "python", "chain")


def resolve_engine(
    requested: StageEngine,
    stage_a: KeyedAggregate[Any] | None,
    stage_b: KeyedAggregate[Any] | None,
    jvm_loaded: bool,
    recorded: Engine | None = None,
    reference_shape: bool = True,
) -> Engine:
    """The engine the stages run on: the JVM for the running count, where its jar is loaded.

    The JVM stages implement :class:`~keyplane.aggregates.RunningCount` only
    (its state is a number); any other aggregate is user code and runs in
    Python. The ``jvm`` and ``python`` engines run the reference pipeline's
    two stages (``reference_shape``); the ``chain`` runs any pipeline, and
    is what ``auto`` picks for one of another shape. ``auto`` falls back to
    Python where the session has no jar. A checkpoint keeps its engine for
    life (``recorded``, :func:`recorded_engine`): Spark refuses a checkpoint
    whose stateful operators changed, at its first batch, so a change is
    refused here, in one line, before the query starts.
    """
    counts = all(agg is None or type(agg) is RunningCount for agg in (stage_a, stage_b))
    wanted: Engine
    if requested != "auto":
        wanted = requested
    elif recorded is not None:
        wanted = recorded
    elif not reference_shape:
        wanted = "chain"
    else:
        wanted = "jvm" if counts and jvm_loaded else "python"
    if recorded is not None and wanted != recorded:
        raise StageEngineError(
            f"stage engine {wanted!r}: this checkpoint's stages ran in {recorded!r}, and a "
            "checkpoint keeps its engine for life (start a new checkpoint to change it)"
        )
    if wanted != "chain" and not reference_shape:
        raise StageEngineError(
            f"stage engine {wanted!r} runs the reference pipeline's two stages only; "
            "use 'chain' (or 'auto') for this pipeline"
        )
    if wanted == "jvm" and not counts:
        raise StageEngineError("stage engine 'jvm' runs only the running count in both stages")
    if wanted == "jvm" and not jvm_loaded:
        raise StageEngineError(
            "stage engine 'jvm': the session has no keyplane JVM stages on its classpath "
            "(see keyplane.spark.jvm)"
        )
    return wanted


def recorded_engine(checkpoint: Path) -> Engine | None:
    """The engine ``checkpoint``'s stages ran on; None for a checkpoint that has not run yet."""
    record = checkpoint / ENGINE_RECORD
    if not record.is_file():
        return None
    engine = json.loads(record.read_text()).get("engine")
    if engine not in ENGINES:
        raise StageEngineError(f"{record}: unknown stage engine {engine!r}")
    return cast(Engine, engine)


def record_engine(checkpoint: Path, engine: Engine) -> None:
    """Write the engine into ``checkpoint`` (see :func:`recorded_engine`)."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / ENGINE_RECORD).write_text(json.dumps({"engine": engine}) + "\n")


def routed_running_counts(
    inputs: DataFrame,
    parallelism: int,
    stage_a: KeyedAggregate[Any] | None = None,
    stage_b: KeyedAggregate[Any] | None = None,
    forward: Forward = "pairs",
    engine: StageEngine = "auto",
) -> DataFrame:
    """Routed-source rows → both stages' outputs (:data:`ROUTED_OUTPUT_SCHEMA`).

    ``stage_a`` and ``stage_b`` are the stages' aggregates (default: the
    reference application's :class:`~keyplane.aggregates.RunningCount`).
    ``forward`` is what stage A sends stage B (module docstring); ``inputs``
    must come from a routed source read in the same mode.
    Both stages run without a time mode: neither sets a timer. ``engine`` says where the stages run
    (:data:`StageEngine`); both engines write the same rows.
    """
    loaded = jvm_stages.loaded(inputs.sparkSession)
    if resolve_engine(engine, stage_a, stage_b, loaded) == "jvm":
        return jvm_stages.routed_running_counts_jvm(inputs, parallelism, forward == "tuples")
    stage_a_rows = (
        _narrow_input(inputs, forward)
        .groupBy("ra")
        .transformWithState(
            RoutedStageA(parallelism, stage_a or RunningCount(), forward),
            stage_a_output(forward),
            "Append",
            "None",
        )
    )
    return stage_a_rows.groupBy("rb").transformWithState(
        RoutedStageB(stage_b or RunningCount()), ROUTED_OUTPUT_SCHEMA, "Append", "None"
    )
