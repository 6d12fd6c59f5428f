"""The routed job's events read by Spark's own Kafka connector, routed on the executors.

Spark's connector (``spark-sql-kafka-0-10``, :mod:`keyplane.spark.connector`)
reads and hands over the events topic's records in the JVM, a task per Kafka
partition, where keyplane's source reads them with a Kafka client in Python.
keyplane's source then reads no events (its ``events`` option is ``skip``): it
still runs the reconfiguration protocol on the driver at every batch boundary
and fixes the batch's routing in its offset, and it still reads a rollout's
evictions and installs (:mod:`keyplane.spark.routed_source`). The query is the
union of both sources.

The connector's tasks route their records in the JVM (``RoutedEvents.java``
in :mod:`keyplane.spark.jvm`, :func:`route_in_jvm`), on the versions that the
batch's offset in Spark's offset log names (:mod:`keyplane.spark.batch_plan`),
with the same rules and the same rows as keyplane's source
(:func:`keyplane.spark.routed_reads.route_events`): a replayed batch reads the
same records and the same versions, so it routes as it first did (000 §3.3,
§3.4). The driver writes each version's routed-key tables for them once
(:mod:`keyplane.routing.exported_tables`). Where keyplane's jar is not loaded,
or in ``tuples`` mode, which forwards every event with its padding, they route
in Python, in Arrow batches (:class:`ConnectorEventsRouter`).

The connector keeps its own offsets in the same checkpoint, and fails the
query when retention deleted records it had still to read
(``failOnDataLoss``, its default), as keyplane's source does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from keyplane.reference.events import MAX_EVENT_BYTES, Forward
from keyplane.spark import jvm
from keyplane.spark.batch_plan import planned_offset, running_batch_id
from keyplane.spark.kafka_source import read_kafka
from keyplane.spark.routed_partitions import EventRouting, HandoffMode, control_groups
from keyplane.spark.routed_reads import (
    batch_end_groups,
    batch_end_rows,
    route_events,
    routed_input_schema,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

CONNECTOR_COLUMNS = ("topic", "partition", "offset", "value")
"""What the tasks take of each record the connector reads."""


@dataclass(frozen=True)
class ConnectorEventsRouter:
    """A ``mapInArrow`` function: one task's records → rows of :func:`routed_input_schema`.

    ``checkpoint`` is the query's, whose offset log holds each batch's plan.
    With ``per-instance`` hand-offs (the JVM stages), every task also sends the
    batch's closing rows (:func:`~keyplane.spark.routed_reads.batch_end_rows`):
    a JVM stage's task writes what it gathered in them, and no task of the
    connector knows whether another one sent them already.
    """

    checkpoint: str
    store: str
    parallelism: int
    forward: Forward = "pairs"
    handoff: HandoffMode = "per-key"
    max_event_bytes: int = MAX_EVENT_BYTES
    quarantine: tuple[tuple[str, str, str], ...] = ()

    def routing(self, offset: Mapping[str, Any]) -> EventRouting:
        """What the batch planned with ``offset`` routes its events by."""
        return EventRouting.planned(
            offset,
            self.store,
            self.parallelism,
            max_event_bytes=self.max_event_bytes,
            forward=self.forward,
            quarantine=self.quarantine,
        )

    def __call__(self, chunks: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        routing = self.routing(planned_offset(self.checkpoint, running_batch_id()))
        if self.handoff == "per-instance":
            yield batch_end_rows(self.forward, self.parallelism)
        sources = (piece for chunk in chunks for piece in by_source(chunk))
        yield from route_events(routing, sources)

    def jvm_settings(self) -> str:
        """What ``RoutedEvents.route`` takes: these settings, the dead letters' control
        groups and the batch's closing rows, as JSON."""
        return json.dumps(
            {
                "checkpoint": self.checkpoint,
                "store": self.store,
                "parallelism": self.parallelism,
                "max_event_bytes": self.max_event_bytes,
                "quarantine": [list(q) for q in self.quarantine],
                "invalid_groups": list(control_groups("I", self.parallelism)),
                "batch_end": batch_end_groups(self.parallelism)
                if self.handoff == "per-instance"
                else [],
            }
        )

    def routes_in_jvm(self, spark: SparkSession) -> bool:
        """Whether this job's tasks route in the JVM: ``pairs`` mode, keyplane's jar loaded."""
        return self.forward == "pairs" and jvm.class_loaded(spark, jvm.ROUTER_CLASS)


def route_in_jvm(records: DataFrame, router: ConnectorEventsRouter) -> DataFrame:
    """The connector's ``records`` routed by ``RoutedEvents`` in the JVM: rows of
    :func:`routed_input_schema` in ``pairs`` mode, with no Python per record."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    spark = records.sparkSession
    routed = getattr(spark._jvm, jvm.ROUTER_CLASS).route(records._jdf, router.jvm_settings())
    return DataFrame(routed, spark).withColumn("ts", F.timestamp_micros("ts"))


def by_source(chunk: pa.RecordBatch) -> Iterator[tuple[str, tuple[pa.RecordBatch]]]:
    """A chunk's records per Kafka partition, ``topic[partition]`` and its rows, in the
    order the partitions first appear: a task reads several partitions one after another
    (:func:`read_connector_events`), and a chunk may hold the end of one and the start of
    the next."""
    if not chunk.num_rows:
        return
    topics, partitions = chunk.column("topic"), chunk.column("partition")
    if pc.count_distinct(topics).as_py() == 1 and pc.count_distinct(partitions).as_py() == 1:
        yield f"{topics[0].as_py()}[{partitions[0].as_py()}]", (chunk,)
        return
    names = [f"{t}[{p}]" for t, p in zip(topics.to_pylist(), partitions.to_pylist(), strict=True)]
    for name in dict.fromkeys(names):
        mask = pa.array([n == name for n in names])
        yield name, (chunk.filter(mask),)


def connector_records(
    spark: SparkSession,
    bootstrap_servers: str,
    topic: str,
    *,
    max_offsets_per_trigger: int | None = None,
    tasks: int | None = None,
) -> DataFrame:
    """``topic``'s records (:data:`CONNECTOR_COLUMNS`) as Spark's connector reads them, in
    at most ``tasks`` tasks a batch (see :func:`read_connector_events`)."""
    records = read_kafka(
        spark,
        bootstrap_servers,
        topic,
        max_offsets_per_trigger=max_offsets_per_trigger,
        implementation="jvm",
    ).select(*CONNECTOR_COLUMNS)
    return records if tasks is None else records.coalesce(tasks)


def read_connector_events(
    spark: SparkSession,
    bootstrap_servers: str,
    topic: str,
    router: ConnectorEventsRouter,
    *,
    max_offsets_per_trigger: int | None = None,
    tasks: int | None = None,
) -> DataFrame:
    """The events topic through Spark's connector, routed by ``router``: a streaming
    DataFrame of :func:`routed_input_schema` rows, to union with keyplane's source.

    ``tasks`` bounds the tasks that route a batch, as keyplane's source bounds
    its reading tasks (``maxPartitions``): the connector reads a task per Kafka
    partition, and ``coalesce`` has each task route several partitions' records
    one after another, whose pairs it then combines into fewer rows for stage A.
    """
    records = connector_records(
        spark,
        bootstrap_servers,
        topic,
        max_offsets_per_trigger=max_offsets_per_trigger,
        tasks=tasks,
    )
    if router.routes_in_jvm(spark):
        log.info("Spark's connector reads the events; they are routed in the JVM")
        return route_in_jvm(records, router)
    log.warning(
        "the connector's events are routed in Python (%s)",
        "tuples mode" if router.forward == "tuples" else "keyplane's jar is not loaded",
    )
    return records.mapInArrow(router, routed_input_schema(router.forward))
