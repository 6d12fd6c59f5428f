"""The routed job's metrics topic, read back.

The job writes one :class:`~keyplane.algorithms.batchmetrics.BatchMetrics` record per
micro-batch. The statistics job, the DAG steps, ``keyplane job status`` and
the dashboard all read them through :func:`read_metrics`, over an exact
offset range (:mod:`keyplane.kafka.ranges`), so they agree on which records
a window holds. A record that is not metrics (another writer's, or an older
format) is skipped, never fatal: the topic is a report, not an input. Skipped
records are logged, one warning per read, so that loads computed from fewer
records than the topic holds do not go unnoticed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.kafka.ranges import IDLE_TIMEOUT_S, offset_ranges, read_range
from keyplane.util.validation_errors import first_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishedMetrics:
    """One metrics record and where and when it reached the topic.

    The job's sink writes a batch's record as the batch ends, so the gap
    between two records' ``published_s`` is the wall-clock time of the later
    batch, idle triggers included (Stela's rates, 003 §4.1).
    """

    metrics: BatchMetrics
    partition: int
    offset: int
    published_s: float
    """The record's Kafka timestamp, in seconds since the epoch."""


def read_metrics(
    bootstrap_servers: str,
    topic: str,
    start: Mapping[int, int],
    end: Mapping[int, int],
    *,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> list[PublishedMetrics]:
    """The metrics records ``start <= offset < end`` of each partition, by partition and offset.

    A partition missing from ``start`` is read from offset 0. Raises
    TimeoutError as :func:`~keyplane.kafka.ranges.read_range` does.
    """
    out: list[PublishedMetrics] = []
    skipped: list[str] = []
    for r in offset_ranges(bootstrap_servers, topic, start, end):
        for batch in read_range(r, idle_timeout_s=idle_timeout_s):
            offsets = batch.column("offset").to_pylist()
            stamps = batch.column("timestamp").cast("int64").to_pylist()
            for value, offset, micros in zip(
                batch.column("value").to_pylist(), offsets, stamps, strict=True
            ):
                try:
                    metrics = BatchMetrics.model_validate_json(value or b"")
                except ValidationError as error:
                    skipped.append(
                        f"partition {r.partition} offset {offset}: {first_problem(error)}"
                    )
                    continue
                out.append(PublishedMetrics(metrics, r.partition, offset, micros / 1e6))
    if skipped:
        log.warning(
            "metrics topic %s: skipped %d record(s) that are not metrics records, first %s",
            topic,
            len(skipped),
            skipped[0],
        )
    return out
