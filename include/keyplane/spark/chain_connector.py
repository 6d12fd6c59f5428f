"""A pipeline's events read by Spark's own Kafka connector (``--source jvm``).

A chain of stages (:mod:`keyplane.spark.chain_stages`) takes ``event`` rows:
a Kafka record as it is, with the routing version of each of its stages
(:data:`~keyplane.spark.chain_source.CHAIN_INPUT_SCHEMA`). keyplane's source
attaches the versions it fixed in the batch's offset. With the connector
reading the records, keyplane's source reads none (``events=skip``): it runs
the reconfiguration protocol on the driver, fixes each batch's versions in its
offset and reads a rollout's evictions and installs, as beside the reference
pipeline's connector (:mod:`keyplane.spark.connector_events`). The tasks of
the connector find their batch's versions where the reference pipeline's do,
in Spark's offset log (:mod:`keyplane.spark.batch_plan`), so a replayed batch
carries the versions it first carried (000 §3.4).

Only the versions and the size check happen here, in Arrow batches; the
records are parsed, keyed and routed by the chain's own steps
(:func:`keyplane.spark.pipeline_frames.routed_rows`), as with keyplane's source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from keyplane.reference.events import MAX_EVENT_BYTES
from keyplane.spark.batch_plan import planned_offset, running_batch_id
from keyplane.spark.chain_source import (
    CHAIN_INPUT_SCHEMA,
    load_tables,
    read_chain_events,
    record_rows,
)
from keyplane.spark.connector import check_loaded as check_connector
from keyplane.spark.connector_events import by_source, connector_records

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainConnectorRecords:
    """A ``mapInArrow`` function: one task's connector records → ``event`` and ``invalid``
    rows of :data:`~keyplane.spark.chain_source.CHAIN_INPUT_SCHEMA`.

    ``checkpoint`` is the query's, whose offset log holds each batch's plan.
    """

    checkpoint: str
    store: str
    parallelism: int
    stages: tuple[str, ...]
    max_event_bytes: int = MAX_EVENT_BYTES

    def __call__(self, chunks: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        offset = planned_offset(self.checkpoint, running_batch_id())
        versions = [int(offset["routing"][stage]) for stage in self.stages]
        if offset.get("prepared") is not None:
            load_tables(self.store, self.parallelism, self.stages, int(offset["prepared"]))
        for chunk in chunks:
            for _, (piece,) in by_source(chunk):
                yield from record_rows(
                    piece,
                    piece.column("topic")[0].as_py(),
                    piece.column("partition")[0].as_py(),
                    versions,
                    stages=self.stages,
                    parallelism=self.parallelism,
                    max_event_bytes=self.max_event_bytes,
                )


def read_chain_connector_events(
    spark: SparkSession, options: dict[str, str], *, stages: Sequence[str], checkpoint: Path
) -> DataFrame:
    """A chain's input rows for the query checkpointed at ``checkpoint``: the events
    topic's records read by Spark's connector (:class:`ChainConnectorRecords`), and a
    rollout's rows read by keyplane's source, which then reads no events.

    ``options`` are :func:`keyplane.spark.routed_source.source_options`; the
    connector reads with the same ``maxOffsetsPerTrigger`` and in at most
    ``maxPartitions`` tasks a batch.
    """
    check_connector(spark)
    log.info("Spark's connector reads the pipeline's events")
    handoffs = read_chain_events(
        spark, {**options, "events": "skip", "checkpoint": str(checkpoint)}, stages=stages
    )
    records = ChainConnectorRecords(
        str(checkpoint),
        options["routing.store"],
        int(options["state.partitions"]),
        tuple(stages),
        int(options.get("max.event.bytes", MAX_EVENT_BYTES)),
    )
    events = connector_records(
        spark,
        options["kafka.bootstrap.servers"],
        options["subscribe"],
        max_offsets_per_trigger=_count(options.get("maxOffsetsPerTrigger")),
        tasks=_count(options.get("maxPartitions")),
    ).mapInArrow(records, CHAIN_INPUT_SCHEMA)
    return events.unionByName(handoffs)


def _count(option: str | None) -> int | None:
    return None if option is None else int(option)
