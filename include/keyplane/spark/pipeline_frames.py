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


def keyed_events(raw: DataFrame, pipeline: Pipeline) -> DataFrame:
    """Kafka records → one row per record: its identity, each stage's key and value as text,
    and ``invalid`` (null for a good event, else why it cannot be keyed).

    ``raw`` has Kafka's ``topic, partition, offset, value`` columns. A value
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
        text.alias("_keyplane_text"),
        F.from_json(text, with_corrupt, {"columnNameOfCorruptRecord": CORRUPT_COLUMN}).alias(
            "_keyplane_event"
        ),
    ).select(*EVENT_ID_COLUMNS, "_keyplane_text", "_keyplane_event.*")
    columns = _stage_columns(parsed, pipeline)
    keyed = parsed.select(*EVENT_ID_COLUMNS, "_keyplane_text", CORRUPT_COLUMN, *columns)
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
        *[key_column(i) for i in range(len(pipeline.stages))],
        *[value_column(i) for i in range(len(pipeline.stages))],
        F.coalesce(*reasons).alias("invalid"),
    )


def routed_column(index: int) -> str:
    """The column of the ``index``-th stage's routed key (chain order, from 0)."""
    return f"r{index}"


VERSIONS_COLUMN = "versions"
"""The routing version of each stage (chain order) that an event is routed by: the
batch's, as the driver fixed it (:mod:`keyplane.spark.routed_source`)."""


def with_routed_keys(
    keyed: DataFrame, pipeline: Pipeline, store: Path, parallelism: int
) -> DataFrame:
    """:func:`keyed_events` rows with each stage's routed key, ``r0 .. r{n-1}``.

    Each row carries its stages' routing versions in :data:`VERSIONS_COLUMN`.
    On the executors, each stage's key is routed by that version's stored
    table (000 §3.3): a tabled key to its routed key, a hot key's events
    spread over its routed keys by the reader's own least-loaded choice in
    row order (001 §4.1.2), any other key to itself. The same rows in the same
    order route the same way, so a replayed batch routes as it first did.
    An invalid row gets no routed key.
    """
    import pyarrow as pa

    from keyplane.routing.handoff import LeastLoadedRoutes
    from keyplane.spark.routed_source import tables_for

    names = pipeline.stage_names
    location = str(store.resolve())
    routed_fields = ", ".join(f"{routed_column(i)} STRING" for i in range(len(names)))
    schema = f"{_ddl(keyed)}, {routed_fields}"

    def route(batches: Any) -> Any:
        tables = tables_for(location, parallelism)
        balancers: dict[tuple[int, int], LeastLoadedRoutes] = {}
        for batch in batches:
            versions = batch.column(VERSIONS_COLUMN).to_pylist()
            invalid = batch.column("invalid").to_pylist()
            columns = {}
            for index, name in enumerate(names):
                keys = batch.column(key_column(index)).to_pylist()
                routed: list[str | None] = []
                for key, version, bad in zip(keys, versions, invalid, strict=True):
                    if bad is not None or key is None:
                        routed.append(None)
                        continue
                    table = tables.table(int(version[index]), name)
                    balancer = balancers.get((index, int(version[index])))
                    if balancer is None:
                        balancer = LeastLoadedRoutes(table.instances_of, split=bool(table.hot_keys))
                        balancers[index, int(version[index])] = balancer
                    routed.append(balancer.pick(table.route(key)))
                columns[routed_column(index)] = pa.array(routed, pa.string())
            for column_name, values in columns.items():
                batch = batch.append_column(column_name, values)
            yield batch

    return keyed.mapInArrow(route, schema)


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
