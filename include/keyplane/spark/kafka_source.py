"""A Kafka source for Structured Streaming, written with PySpark's Python Data Source API.

Spark's own Kafka connector is a separate JVM artifact that many clusters (and
offline machines) do not have. This source needs only kafka-python and gives
the same guarantees: offsets stored in Spark's checkpoint (so a restarted
driver resumes exactly where the last committed batch ended), and the same
output schema as Spark's connector.
Where the JVM connector is on the classpath, :func:`read_kafka` can select it
(``KEYPLANE_KAFKA_SOURCE=jvm``) and downstream code does not change.

Options: ``kafka.bootstrap.servers``, ``subscribe`` (comma-separated topics),
``startingOffsets`` (earliest | latest | JSON), ``maxOffsetsPerTrigger``, and
``maxPartitions``: the most tasks one read uses. Spark's connector reads each
Kafka partition in a task of its own, and so does this source without the
option; with it, partitions share tasks, balanced by their records
(:class:`ReadTask`). A Python task costs far more to start than a JVM one,
so the jobs set it to the session's cores.
Credentials are not options: every reader, on the driver and on the
executors, takes them from its own environment (:mod:`keyplane.kafka.security`),
so they never enter the query plan or the checkpoint. For the JVM connector
:func:`read_kafka` maps the same settings to its ``kafka.*`` options.

The same source also reads in batch mode (``spark.read.format("keyplane-kafka")``),
for jobs that look back over a window of a topic: ``startingOffsets`` and
``endingOffsets`` (earliest | latest | JSON ``{"topic": {"0": offset}}``) bound
the records read, the end exclusive, as in Spark's own Kafka connector. Exact
bounds make a rerun read the very same records.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from keyplane.kafka.offsets import PartitionOffsets, cap_offsets, parse_starting_offsets
from keyplane.kafka.ranges import OffsetRange, balanced_groups, offset_ranges, read_range
from keyplane.kafka.security import kafka_security

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from keyplane.kafka.admin import HighWatermarks

SOURCE_NAME = "keyplane-kafka"

KAFKA_SCHEMA = (
    "key BINARY, value BINARY, topic STRING, partition INT, offset LONG, timestamp TIMESTAMP"
)


class KafkaSourceOptionError(ValueError):
    """A required option is missing or malformed."""


@dataclass(frozen=True)
class KafkaInputPartition(OffsetRange, InputPartition):
    """An :class:`~keyplane.kafka.ranges.OffsetRange` as one Spark task's input."""


@dataclass(frozen=True)
class ReadTask(InputPartition):
    """Several input partitions read one after the other in one Spark task.

    A Python source's task has a fixed cost whatever it reads: the task's
    launch, the hand-off to a Python worker and the shuffle files it writes.
    A micro-batch of many Kafka partitions on few cores would pay it once a
    partition; grouped into as many tasks as cores, it pays it once a core.
    """

    parts: tuple[InputPartition, ...]


def grouped_into_tasks(
    parts: list[InputPartition], sizes: list[int], max_tasks: int | None
) -> list[InputPartition]:
    """``parts`` in at most ``max_tasks`` tasks balanced by ``sizes``; unchanged without a
    bound or when each part already has a task (:func:`~keyplane.kafka.ranges.balanced_groups`)."""
    if max_tasks is None or len(parts) <= max_tasks:
        return parts
    return [ReadTask(tuple(parts[i] for i in group)) for group in balanced_groups(sizes, max_tasks)]


def max_partitions_option(options: Mapping[str, str]) -> int | None:
    """The ``maxPartitions`` option (lower-cased, as Spark hands it over): a positive count,
    or None when absent."""
    raw = options.get("maxpartitions")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KafkaSourceOptionError(f"option 'maxPartitions' is a positive count, got {raw!r}")
    return value


def _input_partitions(
    bootstrap_servers: str, topic: str, start: Mapping[Any, int], end: Mapping[Any, int]
) -> list[KafkaInputPartition]:
    """The non-empty ranges ``[start, end)`` of ``topic``, one Spark task each."""
    return [
        KafkaInputPartition(**asdict(r))
        for r in offset_ranges(bootstrap_servers, topic, start, end)
    ]


def _required(options: dict[str, str], name: str) -> str:
    value = options.get(name.lower())
    if not value:
        raise KafkaSourceOptionError(f"the keyplane Kafka source needs option {name!r}")
    return value


class KafkaStreamReader(DataSourceStreamReader):
    """Plans micro-batches from Kafka offsets and reads them, a partition or more per task."""

    def __init__(self, options: dict[str, str]) -> None:
        # Spark hands data sources their options with lower-cased names.
        options = {k.lower(): v for k, v in options.items()}
        self.bootstrap_servers = _required(options, "kafka.bootstrap.servers")
        self.topics = [t.strip() for t in _required(options, "subscribe").split(",") if t.strip()]
        self.starting = parse_starting_offsets(options.get("startingoffsets", "earliest"))
        max_rows = options.get("maxoffsetspertrigger")
        self.max_rows = int(max_rows) if max_rows else None
        if self.max_rows is not None and self.max_rows < 1:
            raise KafkaSourceOptionError(f"maxOffsetsPerTrigger must be >= 1, got {max_rows}")
        self.max_partitions = max_partitions_option(options)
        self._watermarks: HighWatermarks | None = None

    def _marks(self) -> PartitionOffsets:
        from keyplane.kafka.admin import HighWatermarks

        if self._watermarks is None:
            self._watermarks = HighWatermarks(self.bootstrap_servers)
        return {
            topic: {str(p): off for p, off in self._watermarks.of(topic).items()}
            for topic in self.topics
        }

    def stop(self) -> None:
        if self._watermarks is not None:
            self._watermarks.close()

    def _earliest(self) -> PartitionOffsets:
        from keyplane.kafka.admin import earliest_offsets

        return {
            topic: {
                str(p): off for p, off in earliest_offsets(self.bootstrap_servers, topic).items()
            }
            for topic in self.topics
        }

    def initialOffset(self) -> dict[str, Any]:
        if self.starting == "latest":
            return self._marks()
        earliest = self._earliest()
        if self.starting == "earliest":
            return earliest
        assert isinstance(self.starting, dict)
        return {t: {**earliest.get(t, {}), **self.starting.get(t, {})} for t in self.topics}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.max_rows is None else ReadMaxRows(self.max_rows)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        marks = self._marks()
        # Partitions unknown to ``start`` (new topic partitions) begin at their
        # earliest offset; asked of the broker only when there are any.
        known = all(p in start.get(t, {}) for t, parts in marks.items() for p in parts)
        earliest = {} if known else self._earliest()
        base = {t: {**earliest.get(t, {}), **start.get(t, {})} for t in marks}
        if isinstance(limit, ReadMaxRows):
            return cap_offsets(base, marks, limit.max_rows)
        return marks

    def reportLatestOffset(self) -> dict[str, Any]:
        return self._marks()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        ranges: list[KafkaInputPartition] = []
        for topic, parts in sorted(end.items()):
            ranges += _input_partitions(self.bootstrap_servers, topic, start.get(topic, {}), parts)
        sizes = [r.end - r.start for r in ranges]
        return grouped_into_tasks(list(ranges), sizes, self.max_partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, ReadTask):
            for part in partition.parts:
                yield from self.read(part)
            return
        assert isinstance(partition, KafkaInputPartition)
        yield from read_range(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Offsets live in Spark's checkpoint; nothing to commit to Kafka."""


class KafkaBatchReader(DataSourceReader):
    """Reads a fixed offset range of every partition, one task per partition.

    The range is resolved once, when Spark builds the reader on the driver:
    ``startingOffsets`` defaults to the earliest offsets, ``endingOffsets`` to
    the high watermarks at that moment. A partition missing from a JSON bound
    takes the default bound.
    """

    def __init__(self, options: dict[str, str]) -> None:
        options = {k.lower(): v for k, v in options.items()}
        self.bootstrap_servers = _required(options, "kafka.bootstrap.servers")
        self.topics = [t.strip() for t in _required(options, "subscribe").split(",") if t.strip()]
        starting = parse_starting_offsets(options.get("startingoffsets", "earliest"))
        ending = parse_starting_offsets(options.get("endingoffsets", "latest"))
        if ending == "earliest":
            raise KafkaSourceOptionError("endingOffsets must be 'latest' or JSON, not 'earliest'")
        self.start = self._resolve(starting, "earliest")
        self.end = self._resolve(ending, "latest")

    def _resolve(
        self, bound: str | PartitionOffsets, default: Literal["earliest", "latest"]
    ) -> PartitionOffsets:
        """``bound`` per partition; partitions a JSON bound leaves out take ``default``."""
        from keyplane.kafka.admin import earliest_offsets, high_watermarks

        named = bound if isinstance(bound, str) else default
        query = high_watermarks if named == "latest" else earliest_offsets
        resolved: PartitionOffsets = {}
        for topic in self.topics:
            defaults = {str(p): off for p, off in query(self.bootstrap_servers, topic).items()}
            explicit = bound.get(topic, {}) if isinstance(bound, dict) else {}
            resolved[topic] = {**defaults, **explicit}
        return resolved

    def partitions(self) -> list[InputPartition]:
        out: list[InputPartition] = []
        for topic in self.topics:
            out += _input_partitions(
                self.bootstrap_servers, topic, self.start[topic], self.end[topic]
            )
        # Spark needs at least one partition; an empty range reads no record.
        return out or [KafkaInputPartition(self.bootstrap_servers, self.topics[0], 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaInputPartition)
        if partition.end > partition.start:
            yield from read_range(partition)


class KafkaDataSource(DataSource):
    """``spark.readStream.format("keyplane-kafka")``, and ``spark.read`` for offset ranges."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return KAFKA_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(dict(self.options))

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaBatchReader(dict(self.options))


def read_kafka(
    spark: SparkSession,
    bootstrap_servers: str,
    topics: str,
    *,
    starting_offsets: str = "earliest",
    max_offsets_per_trigger: int | None = None,
    max_partitions: int | None = None,
    implementation: str = "python",
) -> DataFrame:
    """A streaming DataFrame over ``topics`` with Spark's Kafka source schema.

    ``max_partitions`` bounds the tasks of a micro-batch's read (the
    ``maxPartitions`` option); Spark's own connector has no such bound and
    reads a task per Kafka partition."""
    security: dict[str, str] = {}
    if implementation == "python":
        spark.dataSource.register(KafkaDataSource)
        fmt = SOURCE_NAME
    elif implementation == "jvm":
        fmt = "kafka"
        security = kafka_security().spark_options()
    else:
        raise KafkaSourceOptionError(
            f"implementation must be 'python' or 'jvm', got {implementation!r}"
        )
    reader = (
        spark.readStream.format(fmt)
        .option("kafka.bootstrap.servers", bootstrap_servers)
        .option("subscribe", topics)
        .option("startingOffsets", starting_offsets)
        .options(**security)
    )
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    if max_partitions is not None and implementation == "python":
        reader = reader.option("maxPartitions", str(max_partitions))
    return reader.load()
