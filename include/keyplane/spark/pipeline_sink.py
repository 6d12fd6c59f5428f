"""What a pipeline's sink receives: one merged result per (stage, key) updated in a batch.

The stages report partial states per *routed* key: a split hot key has
several (001 §4.1.2), and a moved key's old routed key reports the zero once
its state has left (000 §3.4). A user's sink must not have to know that, so
:class:`MergedResults` keeps every routed key's latest partial and, for each
(stage, key) a batch updated, merges its routed keys' partials with the
stage's aggregate into the key's running result:
:data:`keyplane.pipeline.OUTPUT_SCHEMA` rows.

The latest partials are rebuilt from the job's own per-batch partial files
(``<output>/batch-<id>.parquet``) whenever the batches do not follow on from
the last one seen (a new run of the query, a replayed batch), so a replay
gives the same rows as the first run.

:func:`write_results` hands them to the pipeline's sink: a Kafka topic
(record key ``stage/key``, the row as JSON), a parquet directory (one file
per batch, renamed into place, so a replay rewrites it) or the user's
function.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from keyplane.aggregates import KeyedAggregate, merge_encoded
from keyplane.algorithms.partials import latest_partials
from keyplane.pipeline import OUTPUT_SCHEMA, BatchSink, KafkaSink, ParquetSink, Sink
from keyplane.util.parquet_files import read_frame

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from keyplane.kafka.producer import LongLivedProducer

OUTPUT_COLUMNS = [field.split()[0] for field in OUTPUT_SCHEMA.split(", ")]


class MergedResults:
    """Each routed key's latest partial, to turn a batch's partials into merged results."""

    def __init__(self, aggregates: Mapping[str, KeyedAggregate[Any]], output: Path) -> None:
        self.aggregates = dict(aggregates)
        self.output = output
        self.states: dict[tuple[str, str], dict[str, str]] = {}
        self.last_batch: int | None = None

    def _rebuild(self, before: int) -> None:
        """The latest partials of every batch file below ``before``."""
        from keyplane.spark.counts_job import read_partials

        self.states = {}
        partials = read_partials(self.output)
        if not partials.empty:
            self._take(partials[partials["batch"] < before])

    def _take(self, partials: pd.DataFrame) -> set[tuple[str, str]]:
        """Keep ``partials``' latest state per routed key; the (stage, key)s they touch."""
        touched: set[tuple[str, str]] = set()
        if partials.empty:
            return touched
        latest = latest_partials(partials)
        for stage, key, routed, text in latest[["stage", "key", "routed_key", "state"]].itertuples(
            index=False
        ):
            self.states.setdefault((stage, key), {})[routed] = text
            touched.add((stage, key))
        return touched

    def batch(self, partials: pd.DataFrame, batch_id: int) -> pd.DataFrame:
        """:data:`~keyplane.pipeline.OUTPUT_SCHEMA` rows for the keys batch ``batch_id`` updated.

        ``partials`` are the batch's latest partials
        (:func:`keyplane.spark.routed_sink.latest_partials_of_batch`).
        """
        if self.last_batch is None or batch_id != self.last_batch + 1:
            self._rebuild(batch_id)
        touched = self._take(partials)
        self.last_batch = batch_id
        rows = [
            {
                "stage": stage,
                "key": key,
                "result": json.dumps(
                    merge_encoded(self.aggregates[stage], list(self.states[stage, key].values())),
                    separators=(",", ":"),
                ),
                "batch_id": batch_id,
            }
            for stage, key in sorted(touched)
        ]
        return pd.DataFrame(rows, columns=OUTPUT_COLUMNS).astype({"batch_id": "int64"})


def write_results(
    sink: Sink,
    results: pd.DataFrame,
    batch_id: int,
    *,
    spark: SparkSession,
    producer: LongLivedProducer,
) -> None:
    """Hand one batch's merged results to ``sink`` (module docstring)."""
    if isinstance(sink, ParquetSink):
        directory = Path(sink.path)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".part-{batch_id:08d}.parquet.tmp"
        results.to_parquet(tmp, index=False)
        tmp.rename(directory / f"part-{batch_id:08d}.parquet")
    elif isinstance(sink, KafkaSink):
        if len(results):
            producer.send(
                sink.topic,
                (
                    (
                        f"{row['stage']}/{row['key']}".encode(),
                        json.dumps(row, separators=(",", ":")).encode(),
                    )
                    for row in results.to_dict("records")
                ),
            )
    elif isinstance(sink, BatchSink):
        sink.function(spark.createDataFrame(results, OUTPUT_SCHEMA), batch_id)
    else:  # pragma: no cover - Pipeline refuses other sinks
        raise TypeError(f"not a sink: {sink!r}")


def read_parquet_results(path: Path) -> pd.DataFrame:
    """Every row a :class:`~keyplane.pipeline.ParquetSink` holds, in batch order."""
    files = sorted(Path(path).glob("part-*.parquet"))
    if not files:
        return pd.DataFrame(columns=OUTPUT_COLUMNS)
    return pd.concat([read_frame(f) for f in files], ignore_index=True)
