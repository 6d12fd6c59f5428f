"""The pipeline job's source: Kafka records as they are, plus the batch's routing and state moves.

The driver side is the routed source's (:class:`~keyplane.spark.routed_source.RoutedEventsReader`):
at every micro-batch boundary it runs the reconfiguration protocol and fixes
the routing version of each stage in the offset it writes to Spark's log, so
a replayed batch routes and moves state as it first did (paper 000 §3.4).
What differs is what the tasks read. A user's events have a schema of their
own, and a stage's key is a Spark SQL expression over it, so the source does
not parse them: an ``event`` row is a Kafka record (``topic, partition,
offset, value``) with the versions its stages route on, in chain order.
Spark parses and keys it (:func:`keyplane.spark.pipeline_frames.keyed_events`)
and routes it (:func:`keyplane.spark.pipeline_frames.routed_rows`).

A rollout's ``evict`` and ``install`` rows name their stage, key and routed
keys, and carry ``routes``: the grouping value they take in each stage up to
theirs. A row for stage *j* passes the stages before it in their control
groups (:func:`~keyplane.spark.routed_partitions.control_group`, which no key can
take) and reaches stage *j* in the group of its routed key, with that key's
events of the batch. A record larger than ``max.event.bytes`` is an
``invalid`` row with its reason, before anything parses it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from keyplane.kafka.migration_topic import moves_of
from keyplane.kafka.ranges import OffsetRange, read_range
from keyplane.reference.events import dead_letter_value
from keyplane.spark.kafka_source import ReadTask
from keyplane.spark.routed_partitions import (
    EvictPartition,
    HandOff,
    MigrationPartition,
    control_group,
    tables_for,
)
from keyplane.spark.routed_source import RoutedEventsReader

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

SOURCE_NAME = "keyplane-pipeline-events"

CHAIN_INPUT_SCHEMA = (
    "kind STRING, stage STRING, key STRING, routed_key STRING, target STRING, count LONG, "
    "state STRING, marker LONG, detail STRING, topic STRING, partition INT, offset LONG, "
    "value BINARY, versions ARRAY<INT>, routes ARRAY<STRING>"
)
"""The source's rows, by ``kind``: ``event`` (a Kafka record and its stages' versions),
``invalid`` (``detail``: the dead letter), ``evict`` (``routed_key`` leaves for
``target``) and ``install`` (``routed_key``'s moved ``state`` lands in ``target``)."""

_ARROW_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("stage", pa.string()),
        ("key", pa.string()),
        ("routed_key", pa.string()),
        ("target", pa.string()),
        ("count", pa.int64()),
        ("state", pa.string()),
        ("marker", pa.int64()),
        ("detail", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("value", pa.binary()),
        ("versions", pa.list_(pa.int32())),
        ("routes", pa.list_(pa.string())),
    ]
)


def _rows(length: int, /, **columns: Any) -> pa.RecordBatch:
    """``length`` rows of :data:`CHAIN_INPUT_SCHEMA`: ``columns`` by name, the rest null."""
    arrays = {field.name: pa.nulls(length, field.type) for field in _ARROW_SCHEMA}
    arrays.update(columns)
    return pa.RecordBatch.from_pydict(arrays, schema=_ARROW_SCHEMA)


def routes_to(stages: Sequence[str], stage: str, routed: str, parallelism: int) -> list[str]:
    """The grouping values of a row for ``stage``'s routed key ``routed``: the control
    group of ``routed`` in each stage before it, then ``routed`` itself (module docstring)."""
    index = stages.index(stage)
    passed = [control_group(name, routed, parallelism) for name in stages[:index]]
    return [*passed, routed]


@dataclass(frozen=True)
class ChainEventsPartition(InputPartition):
    """Records ``start <= offset < end`` of one partition, for stages routed on ``versions``,
    then the rollout work ``handoffs`` this task reads along."""

    events: OffsetRange
    store: str
    parallelism: int
    stages: tuple[str, ...]
    versions: tuple[int, ...]
    max_event_bytes: int
    handoffs: tuple[HandOff, ...] = ()
    prepared: int | None = None
    """A version the job has acknowledged and not yet routes on: its tables load ahead."""


def read_records(part: ChainEventsPartition) -> Iterator[pa.RecordBatch]:
    """One partition's records as ``event`` rows; an oversized one as an ``invalid`` row."""
    if part.prepared is not None:
        load_tables(part.store, part.parallelism, part.stages, part.prepared)
    for records in read_range(part.events):
        yield from record_rows(
            records,
            part.events.topic,
            part.events.partition,
            part.versions,
            stages=part.stages,
            parallelism=part.parallelism,
            max_event_bytes=part.max_event_bytes,
        )


def load_tables(store: str, parallelism: int, stages: Sequence[str], version: int) -> None:
    """Load ``version``'s tables of every stage into this worker's cache.

    000 §3.4: an instance holds a version it acknowledged before the batch
    that switches to it, so the switch batch does not wait for its tables.
    """
    tables = tables_for(store, parallelism)
    for stage in stages:
        tables.table(version, stage)


def record_rows(
    records: pa.RecordBatch,
    topic: str,
    partition: int,
    versions: Sequence[int],
    *,
    stages: Sequence[str],
    parallelism: int,
    max_event_bytes: int,
) -> Iterator[pa.RecordBatch]:
    """``records`` (``offset``, ``value``) of one Kafka partition as ``event`` rows routed
    on ``versions``; one larger than ``max_event_bytes`` as an ``invalid`` row."""
    source = f"{topic}[{partition}]"
    values = records.column("value").to_pylist()
    offsets = records.column("offset").to_pylist()
    fits = [v is None or len(v) <= max_event_bytes for v in values]
    kept = [i for i, ok in enumerate(fits) if ok]
    if kept:
        yield _rows(
            len(kept),
            kind=["event"] * len(kept),
            topic=[topic] * len(kept),
            partition=[partition] * len(kept),
            offset=[offsets[i] for i in kept],
            value=[values[i] for i in kept],
            versions=[list(versions)] * len(kept),
        )
    refused = [i for i, ok in enumerate(fits) if not ok]
    if refused:
        details = [
            json.dumps(
                {
                    "source": source,
                    "offset": offsets[i],
                    "reason": "oversized",
                    **dead_letter_value(values[i]),
                }
            )
            for i in refused
        ]
        yield _rows(
            len(refused),
            kind=["invalid"] * len(refused),
            detail=details,
            routes=[[control_group(stage, source, parallelism) for stage in stages]] * len(refused),
        )


def read_evictions(p: EvictPartition, stages: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """One ``evict`` row per state move of this share, in its source routed key's group."""
    if not p.moves:
        return
    n = len(p.moves)
    yield _rows(
        n,
        kind=["evict"] * n,
        stage=[p.operator] * n,
        key=[key for key, _, _ in p.moves],
        routed_key=[source for _, source, _ in p.moves],
        target=[target for _, _, target in p.moves],
        marker=[p.marker] * n,
        routes=[routes_to(stages, p.operator, source, p.parallelism) for _, source, _ in p.moves],
    )


def read_installs(p: MigrationPartition, stages: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """One ``install`` row per state the previous batch moved, in its target's group."""
    for records in read_range(p.records):
        moves = [m for value in records.column("value").to_pylist() for m in moves_of(value)]
        if not moves:
            continue
        n = len(moves)
        yield _rows(
            n,
            kind=["install"] * n,
            stage=[m["operator"] for m in moves],
            key=[m["key"] for m in moves],
            routed_key=[m["source"] for m in moves],
            target=[m["target"] for m in moves],
            count=[int(m["count"]) for m in moves],
            state=[m["state"] for m in moves],
            marker=[int(m["marker"]) for m in moves],
            routes=[routes_to(stages, m["operator"], m["target"], p.parallelism) for m in moves],
        )


class ChainEventsReader(RoutedEventsReader):
    """The routed source's driver side, reading records for a chain of stages (module docstring)."""

    def _event_partitions(  # type: ignore[override]
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> list[ChainEventsPartition]:
        versions = tuple(int(end["routing"][stage]) for stage in self.stages)
        return [
            ChainEventsPartition(
                kafka,
                self.store,
                self.parallelism,
                self.stages,
                versions,
                self.max_event_bytes,
                prepared=end.get("prepared"),
            )
            for kafka in self._event_ranges(start, end)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, ReadTask):
            for part in partition.parts:
                yield from self.read(part)
        elif isinstance(partition, ChainEventsPartition):
            yield from read_records(partition)
            for handoff in partition.handoffs:
                yield from self.read(handoff)
        elif isinstance(partition, EvictPartition):
            yield from read_evictions(partition, self.stages)
        elif isinstance(partition, MigrationPartition):
            yield from read_installs(partition, self.stages)
        else:
            raise TypeError(f"not a pipeline-source partition: {partition!r}")


class ChainEventsSource(DataSource):
    """``spark.readStream.format("keyplane-pipeline-events")``."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return CHAIN_INPUT_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return ChainEventsReader(dict(self.options))


def read_chain_events(
    spark: SparkSession, options: dict[str, str], *, stages: Sequence[str]
) -> DataFrame:
    """A streaming DataFrame of :data:`CHAIN_INPUT_SCHEMA` rows for a chain of ``stages``;
    ``options`` are :func:`keyplane.spark.routed_source.source_options`."""
    spark.dataSource.register(ChainEventsSource)
    reader = spark.readStream.format(SOURCE_NAME).options(**options)
    return reader.option("stages", ",".join(stages)).load()
