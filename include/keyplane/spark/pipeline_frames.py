"""A pipeline's events as Spark columns: parsed, keyed and valued per stage, checked first.

A stage's key and value are Spark SQL expressions (:class:`keyplane.pipeline.Stage`),
so Spark evaluates them, on the JVM side, over the value parsed with the
source's schema. What keyplane needs of each event is then a fixed set of
string columns whatever the user's schema: the event's identity in Kafka
(``topic, partition, offset``), and per stage its key and value as text.

An event that keyplane cannot key is not dropped: it becomes an ``invalid``
row with the reason (a value that does not parse, or a stage's key or value
that is null), so the sink can dead-letter it and the other events' results
stay exact.

:func:`check_expressions` runs the same analysis on an empty frame before the
query starts, so that an expression naming an unknown column fails in one line
that names the stage, not at the first batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keyplane.pipeline import Pipeline, PipelineError, fingerprint_changes

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

CORRUPT_COLUMN = "_keyplane_corrupt"
"""The column ``from_json`` fills with a value it could not parse against the schema."""
EVENT_ID_COLUMNS = ("topic", "partition", "offset")
"""What identifies an event: nothing of the user's own fields is required."""
PIPELINE_RECORD = "keyplane-pipeline.json"
"""The file in a checkpoint that holds the fingerprint of the pipeline it ran."""


def key_column(index: int) -> str:
    """The column of the ``index``-th stage's key (chain order, from 0)."""
    return f"k{index}"


def value_column(index: int) -> str:
    """The column of the ``index``-th stage's value (chain order, from 0)."""
    return f"v{index}"


def source_schema(pipeline: Pipeline) -> StructType:
    """The source's schema as a ``StructType``; a DDL string that does not parse is one line."""
    from pyspark.sql.types import StructType

    schema = pipeline.source.schema
    if isinstance(schema, StructType):
        return schema
    try:
        parsed = StructType.fromDDL(schema)
    except Exception as error:
        raise PipelineError(
            f"pipeline {pipeline.name!r}: the source schema {schema!r} does not parse: "
            f"{_first_line(error)}"
        ) from None
    if not isinstance(parsed, StructType):
        raise PipelineError(f"pipeline {pipeline.name!r}: the source schema is not a struct")
    return parsed


def _first_line(error: BaseException) -> str:
    """An error's message in one line: Spark's analysis errors run to many."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _as_text(column: Column, data_type: Any) -> Column:
    """``column`` as a string: structs, arrays and maps as JSON, anything else cast."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(data_type, StructType | ArrayType | MapType):
        return F.to_json(column)
    return column.cast("string")


def _stage_columns(parsed: DataFrame, pipeline: Pipeline) -> list[Column]:
    """Each stage's key and value over ``parsed`` (its columns: the schema's fields), as text,
    named by :func:`key_column` and :func:`value_column`; a bad expression is one line."""
    from pyspark.errors import AnalysisException, ParseException
    from pyspark.sql import functions as F

    columns = []
    for index, stage in enumerate(pipeline.stages):
        parts = (("key", stage.key, key_column(index)), ("value", stage.value, value_column(index)))
        for part, expression, name in parts:
            if expression is None:
                columns.append(F.lit("").alias(name))
                continue
            try:
                column = F.expr(expression)
                data_type = parsed.select(column).schema.fields[0].dataType
            except (AnalysisException, ParseException) as error:
                raise PipelineError(
                    f"stage {stage.name!r}: the {part} {expression!r} does not fit the source "
                    f"schema: {_first_line(error)}"
                ) from None
            columns.append(_as_text(column, data_type).alias(name))
    return columns


def check_expressions(spark: SparkSession, pipeline: Pipeline) -> None:
    """Refuse, in one line naming the stage, a key or value that the schema cannot evaluate.

    Spark analyses the expressions over an empty frame of the source's
    schema, so an unknown column, a bad function or a syntax error fails
    here, before the query starts.
    """
    empty = spark.createDataFrame([], source_schema(pipeline))
    _stage_columns(empty, pipeline)


def keyed_events(raw: DataFrame, pipeline: Pipeline, keep: Sequence[str] = ()) -> DataFrame:
    """Kafka records → one row per record: its identity, each stage's key and value as text,
    and ``invalid`` (null for a good event, else why it cannot be keyed).

    ``raw`` has Kafka's ``topic, partition, offset, value`` columns; its
    columns ``keep`` pass through unchanged. A value
    that is null or does not parse against the schema is invalid; so is an
    event whose key or value (when the stage has one) is null in any stage,
    since every stage sees every event.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructType

    schema = source_schema(pipeline)
    with_corrupt = StructType([*schema.fields]).add(CORRUPT_COLUMN, StringType())
    text = F.col("value").cast("string")
    parsed = raw.select(
        *EVENT_ID_COLUMNS,
        *keep,
        text.alias("_keyplane_text"),
        F.from_json(text, with_corrupt, {"columnNameOfCorruptRecord": CORRUPT_COLUMN}).alias(
            "_keyplane_event"
        ),
    ).select(*EVENT_ID_COLUMNS, *keep, "_keyplane_text", "_keyplane_event.*")
    columns = _stage_columns(parsed, pipeline)
    keyed = parsed.select(*EVENT_ID_COLUMNS, *keep, "_keyplane_text", CORRUPT_COLUMN, *columns)
    reasons = [
        F.when(F.col("_keyplane_text").isNull(), F.lit("a record with no value")),
        F.when(
            F.col(CORRUPT_COLUMN).isNotNull(),
            F.lit("the value does not parse against the source schema"),
        ),
    ]
    for index, stage in enumerate(pipeline.stages):
        reasons.append(
            F.when(
                F.col(key_column(index)).isNull(),
                F.lit(f"stage {stage.name!r}: the key {stage.key!r} is null"),
            )
        )
        if stage.value is not None:
            reasons.append(
                F.when(
                    F.col(value_column(index)).isNull(),
                    F.lit(f"stage {stage.name!r}: the value {stage.value!r} is null"),
                )
            )
    return keyed.select(
        *EVENT_ID_COLUMNS,
        *keep,
        *[key_column(i) for i in range(len(pipeline.stages))],
        *[value_column(i) for i in range(len(pipeline.stages))],
        F.coalesce(*reasons).alias("invalid"),
    )


def routed_column(index: int) -> str:
    """The column of the ``index``-th stage's routed key (chain order, from 0)."""
    return f"r{index}"


def chain_columns(stages: int) -> tuple[str, ...]:
    """Every stage's key, value and routed key columns, in that order."""
    return (
        *(key_column(i) for i in range(stages)),
        *(value_column(i) for i in range(stages)),
        *(routed_column(i) for i in range(stages)),
    )


def chain_schema(stages: int) -> str:
    """The rows the stages of a chain of ``stages`` pass on: the job's output rows
    (:data:`~keyplane.spark.routed_counts.ROUTED_OUTPUT_SCHEMA`) and, per stage, the key,
    value and routed key of the events a row stands for."""
    from keyplane.spark.routed_counts import ROUTED_OUTPUT_SCHEMA

    chain = ", ".join(f"{name} STRING" for name in chain_columns(stages))
    return f"{ROUTED_OUTPUT_SCHEMA}, {chain}"


VERSIONS_COLUMN = "versions"
"""The routing version of each stage (chain order) that an event is routed by: the
batch's, as the driver fixed it (:mod:`keyplane.spark.chain_source`)."""

_ARROW_TYPES = {"STRING": "string", "INT": "int32", "LONG": "int64"}


def _arrow_schema(ddl: str) -> Any:
    """A flat DDL of STRING, INT and LONG columns as an Arrow schema."""
    import pyarrow as pa

    fields = [field.split() for field in ddl.split(", ")]
    return pa.schema([(name, getattr(pa, _ARROW_TYPES[kind])()) for name, kind in fields])


def _arrow_batch(schema: Any, length: int, columns: dict[str, Any]) -> Any:
    """``length`` rows of ``schema``: ``columns`` by name, every other column null."""
    import pyarrow as pa

    arrays = []
    for f in schema:
        value = columns.get(f.name)
        if value is None:
            arrays.append(pa.nulls(length, f.type))
        elif isinstance(value, pa.Array):
            arrays.append(value.cast(f.type))
        else:
            arrays.append(pa.array(value, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_CONTROL_COLUMNS = ("kind", "stage", "key", "routed_key", "target", "count", "state", "marker")
"""The source's columns that a rollout's rows carry on
(:data:`keyplane.spark.chain_source.CHAIN_INPUT_SCHEMA`)."""


def routed_rows(
    inputs: DataFrame,
    pipeline: Pipeline,
    store: Path,
    parallelism: int,
    quarantine: Sequence[tuple[str, str, str, str]] = (),
) -> DataFrame:
    """The pipeline source's rows → the first stage's input, :func:`chain_schema` rows.

    Events are keyed by Spark (:func:`keyed_events`), then routed on the
    executors (:func:`batch_router`): each stage's key by the version of its
    stored table the row carries (000 §3.3), a hot key's events spread over
    its routed keys by the task's least-loaded choice in row order (001
    §4.1.2), any other key to itself. The same rows in the same order route
    the same way, so a replayed batch routes as it first did. A task's events
    are then combined into one row per distinct (keys, values, routed keys)
    with their number ``n``, as Spark's partial aggregation combines a
    partition before its shuffle. An event that cannot be keyed becomes an
    ``invalid`` row, as does one ``quarantine`` holds (a stage's aggregate
    raised on its key and value: ``(stage, key, value, reason)``,
    :mod:`keyplane.control.quarantine`), and a rollout's rows take the grouping
    values the source gave them.

    Only a row that is not an event or may become a dead letter (one that
    cannot be keyed, or whose key in some stage ``quarantine`` names) carries
    its raw value and its other source columns to the Arrow step, those packed
    in one JSON column (:data:`CONTROL_JSON`): every column that crosses to
    Python costs for every row, null or not, and the other events need none.
    """
    from pyspark.sql import functions as F

    n = len(pipeline.stage_names)
    keyed = keyed_events(inputs, pipeline, keep=(*_CONTROL_COLUMNS[1:], "detail", "value",
                                                  "versions", "routes", "kind"))  # fmt: skip
    passed = (F.col("kind") != "event") | F.col("invalid").isNotNull()
    for index, keys in sorted(_held_keys(_held(pipeline, quarantine)).items()):
        passed = passed | F.col(key_column(index)).isin(keys)
    control = F.struct(*_CONTROL_COLUMNS[1:], "detail", *EVENT_ID_COLUMNS, "routes")
    routed_input = keyed.select(
        "kind",
        *(key_column(i) for i in range(n)),
        *(value_column(i) for i in range(n)),
        VERSIONS_COLUMN,
        "invalid",
        F.when(passed, F.col("value")).alias("value"),
        F.when(passed, F.to_json(control)).alias(CONTROL_JSON),
    )
    route = batch_router(pipeline, store, parallelism, quarantine)
    return routed_input.mapInArrow(route, chain_schema(n))


CONTROL_JSON = "control"
"""The Arrow step's input column that holds, as a JSON object, a row's source columns
other than its kind, keys, values, versions, reason and raw value (rollout fields,
``detail``, ``topic, partition, offset``, ``routes``), for the rows that are not events
or may be dead letters; null, and absent from the object, where not needed."""


def _held(
    pipeline: Pipeline, quarantine: Sequence[tuple[str, str, str, str]]
) -> dict[tuple[int, str, str], str]:
    """``quarantine``'s entries for ``pipeline``'s stages: (stage index, key, value) → reason."""
    names = pipeline.stage_names
    return {(names.index(stage), key, value): reason for stage, key, value, reason in quarantine
            if stage in names}  # fmt: skip


def _held_keys(held: dict[tuple[int, str, str], str]) -> dict[int, list[str]]:
    """The keys ``held`` names, by stage index."""
    keys: dict[int, list[str]] = {}
    for index, key, _ in held:
        keys.setdefault(index, []).append(key)
    return keys


def batch_router(
    pipeline: Pipeline,
    store: Path,
    parallelism: int,
    quarantine: Sequence[tuple[str, str, str, str]] = (),
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The Arrow step of :func:`routed_rows`: a task's keyed events → its :func:`chain_schema`
    batches. Spark-free, so that it runs on plain Arrow batches.

    Its input has, per row, ``kind``, each stage's key and value, ``versions``,
    ``invalid``, and, where the row is not an event or may be a dead letter,
    its raw ``value`` and :data:`CONTROL_JSON`.

    Work is columnar but for the choices that need Python: a table that
    splits no key routes each distinct key of a batch once, since its route
    is a function of the key alone; a table that splits one routes row by row
    in order, as the least-loaded choice needs (001 §4.1.2).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from keyplane.reference.events import dead_letter_value
    from keyplane.routing.handoff import LeastLoadedRoutes
    from keyplane.spark.routed_partitions import control_group, tables_for

    names = pipeline.stage_names
    n = len(names)
    location = str(store.resolve())
    arrow = _arrow_schema(chain_schema(n))
    columns = chain_columns(n)
    routed_names = [routed_column(i) for i in range(n)]
    held = _held(pipeline, quarantine)
    held_keys = {index: pa.array(keys, pa.string()) for index, keys in _held_keys(held).items()}

    def quarantined(batch: pa.RecordBatch) -> dict[int, str]:
        """The batch's rows that ``quarantine`` holds, with the reason; only the rows whose
        key it names are looked at one by one."""
        found: dict[int, str] = {}
        for index in sorted(held_keys):
            keys, values = batch.column(key_column(index)), batch.column(value_column(index))
            named = pc.indices_nonzero(pc.is_in(keys, value_set=held_keys[index]))
            for row in named.to_pylist():
                reason = held.get((index, keys[row].as_py(), values[row].as_py()))
                if reason is not None:
                    found.setdefault(row, reason)
        return found

    def control_rows(
        batch: pa.RecordBatch, rows: list[int], reasons: dict[int, str]
    ) -> dict[str, list[Any]]:
        picked = batch.take(pa.array(rows, pa.int64()))
        fields = [json.loads(text or "{}") for text in picked.column(CONTROL_JSON).to_pylist()]
        out: dict[str, list[Any]] = {"kind": picked.column("kind").to_pylist()}
        for name in (*_CONTROL_COLUMNS[1:], "detail"):
            out[name] = [f.get(name) for f in fields]
        invalid = [reasons.get(row, reason) for row, reason in
                   zip(rows, picked.column("invalid").to_pylist(), strict=True)]  # fmt: skip
        routes = [f.get("routes") for f in fields]
        values = picked.column("value").to_pylist()
        for i, kind in enumerate(out["kind"]):
            if kind != "event":
                continue
            # An event that cannot be keyed: its dead letter, in the control groups.
            source = f"{fields[i].get('topic')}[{fields[i].get('partition')}]"
            out["kind"][i] = "invalid"
            out["detail"][i] = json.dumps(
                {"source": source, "offset": fields[i].get("offset"), "reason": invalid[i],
                 **dead_letter_value(values[i])}
            )  # fmt: skip
            routes[i] = [control_group(name, source, parallelism) for name in names]
        for index, name in enumerate(routed_names):
            out[name] = [r[index] if r is not None and index < len(r) else None for r in routes]
        return out

    def route(batches: Any) -> Any:
        tables = tables_for(location, parallelism)
        balancers: dict[tuple[int, int], LeastLoadedRoutes] = {}

        def routed(index: int, version: int, keys: pa.Array) -> pa.Array:
            """Stage ``index``'s routed keys of ``keys``, in order, by table ``version``."""
            table = tables.table(version, names[index])
            balancer = balancers.get((index, version))
            if balancer is None:
                balancer = LeastLoadedRoutes(table.instances_of, split=bool(table.hot_keys))
                balancers[index, version] = balancer
            if not table.hot_keys:
                encoded = pc.dictionary_encode(keys)
                distinct = encoded.dictionary.to_pylist()
                picked = balancer.pick_all(distinct, table.route_all(distinct))
                return pa.array(picked, pa.string()).take(encoded.indices)
            listed = keys.to_pylist()
            return pa.array(balancer.pick_all(listed, table.route_all(listed)), pa.string())

        events: list[pa.Table] = []
        for batch in batches:
            held_rows = quarantined(batch) if held else {}
            good = pc.fill_null(
                pc.and_(
                    pc.equal(batch.column("kind"), "event"), pc.is_null(batch.column("invalid"))
                ),
                False,
            )
            if held_rows:
                flags = good.to_pylist()
                for row in held_rows:
                    flags[row] = False
                good = pa.array(flags, pa.bool_())
            other = pc.indices_nonzero(pc.invert(good)).to_pylist()
            if other:
                out = control_rows(batch, other, held_rows)
                yield _arrow_batch(arrow, len(other), out)
            picked = batch.filter(good)
            if picked.num_rows == 0:
                continue
            versions = picked.column(VERSIONS_COLUMN)
            chosen: dict[str, Any] = {}
            for index in range(n):
                keys = picked.column(key_column(index))
                stage_versions = pc.list_element(versions, index)
                distinct = pc.unique(stage_versions).to_pylist()
                if len(distinct) == 1:
                    chosen[routed_column(index)] = routed(index, int(distinct[0]), keys)
                    continue
                scattered: list[str] = [""] * len(keys)
                for version in distinct:
                    rows = pc.indices_nonzero(pc.equal(stage_versions, version))
                    these = routed(index, int(version), keys.take(rows)).to_pylist()
                    for row, route_ in zip(rows.to_pylist(), these, strict=True):
                        scattered[row] = route_
                chosen[routed_column(index)] = pa.array(scattered, pa.string())
            events.append(
                pa.table(
                    {
                        **{c: picked.column(c) for c in columns if c not in chosen},
                        **chosen,
                    }
                )
            )
        if events:
            combined = (
                pa.concat_tables(events)
                .group_by(list(columns), use_threads=False)
                .aggregate([([], "count_all")])
            )
            rows = combined.num_rows
            yield _arrow_batch(
                arrow,
                rows,
                {
                    "kind": ["event"] * rows,
                    "n": combined.column("count_all").combine_chunks(),
                    **{c: combined.column(c).combine_chunks() for c in columns},
                },
            )

    return route


def _ddl(frame: DataFrame) -> str:
    """``frame``'s schema as a DDL string."""
    return ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in frame.schema.fields)


def check_recorded_pipeline(checkpoint: Path, pipeline: Pipeline) -> None:
    """Refuse to run ``pipeline`` on a checkpoint that another definition of it wrote.

    The stored states are the recorded stages' aggregates over their keys;
    run on a stage that was added, removed or re-keyed, they would answer
    for something else. One line lists what changed. A checkpoint with no
    record has not run yet.
    """
    record = checkpoint / PIPELINE_RECORD
    if not record.is_file():
        return
    try:
        stored = json.loads(record.read_text())
    except ValueError as error:
        raise PipelineError(f"{record}: not a pipeline record: {error}") from None
    changes = fingerprint_changes(stored, pipeline.fingerprint())
    if changes:
        raise PipelineError(
            f"pipeline {pipeline.name!r} differs from the one checkpoint {checkpoint} ran: "
            f"{'; '.join(changes)} (start a new checkpoint to run it)"
        )


def record_pipeline(checkpoint: Path, pipeline: Pipeline) -> None:
    """Write ``pipeline``'s fingerprint into ``checkpoint`` (:func:`check_recorded_pipeline`)."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / PIPELINE_RECORD).write_text(json.dumps(pipeline.fingerprint()) + "\n")
