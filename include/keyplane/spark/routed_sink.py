"""Where each micro-batch of the routed job goes: counts, moved state, dead letters, metrics.

One ``foreachBatch`` call keeps the batch in memory for its actions (each
would otherwise run the stateful plan again) and splits it by ``kind``
(:data:`keyplane.spark.routed_counts.ROUTED_OUTPUT_SCHEMA`). The rows that
grow with the keys a batch updates stay on the executors: they write the
batch file and send the results topic's records. The driver collects only a
summary (:func:`batch_summary`): the protocol records and what the metrics
read.

* ``count`` rows: the latest partial (tuple count and encoded state) per
  routed key and instance (:func:`batch_partials`), written by the executors
  to ``<output>/batch-<id>.parquet`` (one file, renamed into place last, so a
  replay rewrites the same file) and optionally sent by them to the results
  topic; merged per key, to the pipeline's sink
  (:mod:`keyplane.spark.pipeline_sink`), which reads the batch file back on
  the driver, since the merge keeps every routed key's latest state;
* ``moved`` rows: to the migration topic, flushed before the batch commits,
  so the next batch's plan finds them (paper 000 §3.4's state transfer);
  ``moves`` rows are such records already packed by the JVM stages
  (:mod:`keyplane.spark.jvm`), sent as they are;
* ``partials`` rows: many ``count`` rows packed into one by the JVM stages'
  installs (``[stage, key, routed_key, instance, count, state]`` each), read
  as the rows they pack (:func:`batch_partials`; :func:`unpacked_partials`
  and :func:`latest_partials_of_batch` state the same rule on a pandas frame);
* ``invalid`` rows: to the dead-letter topic with their reason;
* ``hop`` and ``pair`` rows: the batch's :class:`~keyplane.algorithms.batchmetrics.BatchMetrics`,
  which :class:`MetricsListener` completes with the progress figures and
  publishes to the metrics topic.

Every record sent to a topic is checked for delivery
(:func:`keyplane.kafka.producer.send_confirmed`): if the broker stays down
past the producer's delivery timeout, the batch fails with
:class:`~keyplane.kafka.producer.DeliveryError` rather than committing with
records lost, and is replayed when the job restarts from its checkpoint.
The executors send the results topic's records with a producer per task
(:func:`keyplane.spark.kafka_sink.write_to_kafka`), whose failure fails the
batch. The driver sends through one producer for the query's run
(:class:`~keyplane.kafka.producer.LongLivedProducer`); a send that fails,
for example because the broker no longer knows an idempotent producer's id
after a restart, is tried once more through a new producer before the
batch fails.
A replayed batch sends its moved states again; installs are idempotent per
(marker, source), so a duplicate changes nothing. Its results and dead
letters are sent again too (at least once on those topics).
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
from kafka.errors import KafkaError
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from keyplane.aggregates import KeyedAggregate, merge_encoded
from keyplane.algorithms.batchmetrics import (
    TOP_PAIRS_PER_INSTANCE,
    BatchMetrics,
    traffic_metrics,
)
from keyplane.algorithms.partials import last_of_each, latest_partials
from keyplane.control.operators import OPERATORS
from keyplane.kafka.migration_topic import move_records
from keyplane.kafka.producer import SAFE_DELIVERY, Delivery, DeliveryError, LongLivedProducer
from keyplane.pipeline import Sink
from keyplane.spark.kafka_sink import write_to_kafka
from keyplane.spark.pipeline_sink import MergedResults, write_results
from keyplane.spark.progress import phases_ms, progress_of
from keyplane.util.parquet_files import read_frame

log = logging.getLogger(__name__)

COUNT_COLUMNS = ["stage", "key", "routed_key", "instance", "count", "state"]
PARTIAL_KEY = ["stage", "key", "routed_key", "instance"]


def latest_partials_of_batch(output: pd.DataFrame) -> pd.DataFrame:
    """The latest partial per (stage, key, routed key, instance) in one batch.

    Each stage reports a routed key once per batch; should a key report
    twice, the latest is the one holding the most tuples (``count``), since
    a group's tuple count only grows. ``state`` is the aggregate's encoded
    partial of that row. A tombstone (the zero a routed key reports once its
    state moved) has no instance and is kept as such.

    The rows keep the order the batch's output came in, which is the same
    on a replay. Their readers sort as they need
    (:func:`keyplane.algorithms.partials.latest_partials`). Sorting here by four text
    columns would cost every batch a sort of text, the install batch of a
    large rollout most of all.
    """
    counts = output.loc[output["kind"] == "count", COUNT_COLUMNS]
    latest = last_of_each(counts.sort_values("count", kind="mergesort"), PARTIAL_KEY)
    frame = latest.sort_index(kind="mergesort").reset_index(drop=True)
    frame["instance"] = frame["instance"].astype("Int32")
    frame["count"] = frame["count"].astype("int64")
    return frame


def unpacked_partials(output: pd.DataFrame) -> pd.DataFrame:
    """``output`` with each ``partials`` row replaced by the ``count`` rows it packs.

    The JVM stages report a batch's installs per instance, one row for
    thousands of tombstones and partials, so that those reports do not each
    cross stage B's shuffle and the collect.
    """
    packed = output["kind"] == "partials"
    if not packed.any():
        return output
    reports = [r for text in output.loc[packed, "state"].tolist() for r in json.loads(text)]
    counts = pd.DataFrame(reports, columns=COUNT_COLUMNS).assign(kind="count")
    counts["instance"] = counts["instance"].astype("Int32")
    rest = output[~packed]
    if rest.empty:
        # A batch whose output is only install reports (moves, no events): concatenating
        # an empty frame is deprecated in pandas, and would only contribute its columns.
        return counts.reindex(columns=output.columns.union(counts.columns, sort=False))
    return pd.concat([rest, counts], ignore_index=True)


def merge_partial_states(
    partials: pd.DataFrame, aggregates: Mapping[str, KeyedAggregate[Any]]
) -> pd.DataFrame:
    """``stage, key, result``: each key's answer from its routed keys' latest partials.

    ``partials`` are batch files' rows (:func:`latest_partials_of_batch`,
    with their ``batch``); ``aggregates`` maps each stage to its aggregate.
    A split key's partials are combined with the aggregate's ``merge``
    (001 §4.1.2); a moved key's old routed key reports the zero, which the
    merge leaves unchanged (000 §3.4).
    """
    latest = latest_partials(partials)
    states: dict[tuple[str, str], list[str]] = {}
    for stage, key, text in latest[["stage", "key", "state"]].itertuples(index=False):
        states.setdefault((stage, key), []).append(text)
    rows = [
        {"stage": stage, "key": key, "result": merge_encoded(aggregates[stage], texts)}
        for (stage, key), texts in sorted(states.items())
    ]
    return pd.DataFrame(rows, columns=["stage", "key", "result"])


SUMMARY_KINDS = ("hop", "moved", "moves", "invalid")
"""The output rows the driver reads whole: few, except ``moved`` during a migration."""
TOPIC_KEY = "_topic_key"


def batch_partials(batch: DataFrame) -> DataFrame:
    """:func:`latest_partials_of_batch` of :func:`unpacked_partials`, computed by the executors.

    The same rule, with Spark's functions: the JVM stages' packed reports
    are exploded into ``count`` rows, then each (stage, key, routed key,
    instance) keeps its row with the most tuples. Two reports of one routed
    key with the same count carry the same state, so which one is kept does
    not matter. The rows come in no particular order; readers sort as they
    need.
    """
    counts = batch.where(F.col("kind") == "count").select(*COUNT_COLUMNS)
    report = F.col("report")
    unpacked = (
        batch.where(F.col("kind") == "partials")
        .select(F.explode(F.from_json("state", "array<array<string>>")).alias("report"))
        .select(
            report[0].alias("stage"),
            report[1].alias("key"),
            report[2].alias("routed_key"),
            report[3].cast("int").alias("instance"),
            report[4].cast("long").alias("count"),
            report[5].alias("state"),
        )
    )
    latest = F.max_by(F.struct("count", "state"), "count").alias("latest")
    return (
        counts.unionByName(unpacked)
        .groupBy(*PARTIAL_KEY)
        .agg(latest)
        .select(*PARTIAL_KEY, "latest.count", "latest.state")
    )


def batch_summary(batch: DataFrame) -> DataFrame:
    """The rows of ``batch`` the driver needs, few whatever the keys a batch updates.

    What :func:`~keyplane.algorithms.batchmetrics.traffic_metrics` reads and
    the protocol records: ``hop``, ``moved``, ``moves`` and ``invalid`` rows
    as they are; ``pair`` rows cut to each instance's heaviest, as the
    metrics keep them; and one ``count`` row per (stage, instance) carrying
    the sum of its ``busy_ns``, which is all the metrics read of them.
    """
    kind = F.col("kind")
    columns = batch.columns
    heaviest = Window.partitionBy("instance").orderBy(F.col("n").desc())
    pairs = (
        batch.where(kind == "pair")
        .withColumn("_rank", F.row_number().over(heaviest))
        .where(F.col("_rank") <= TOP_PAIRS_PER_INSTANCE)
        .select(*columns)
    )
    busy = (
        batch.where((kind == "count") & F.col("busy_ns").isNotNull())
        .groupBy("stage", "instance")
        .agg(F.sum("busy_ns").alias("busy_ns"))
        .select(
            *(
                F.lit("count").alias(c)
                if c == "kind"
                else F.col(c)
                if c in ("stage", "instance", "busy_ns")
                else F.lit(None).cast(batch.schema[c].dataType).alias(c)
                for c in columns
            )
        )
    )
    return batch.where(kind.isin(*SUMMARY_KINDS)).unionByName(pairs).unionByName(busy)


def write_single_parquet(frame: DataFrame, path: Path) -> None:
    """Write ``frame`` from the executors as the one parquet file ``path``.

    Spark writes a directory of part files; one partition gives one file
    (an empty one too), which is moved to ``path`` so the batch file stays
    one file that its readers open as before, renamed into place atomically
    by the caller. The directory must be the same shared path on the driver
    and the executors; a part file the driver cannot see is an error, never
    an empty batch.
    """
    parts = path.with_name(path.name + ".parts")
    frame.repartition(1).write.mode("overwrite").parquet(str(parts))
    files = sorted(parts.glob("part-*.parquet"))
    if len(files) != 1:
        raise RuntimeError(
            f"expected one part file in {parts}, found {len(files)}: the output directory "
            "must be the same shared path on the driver and every executor"
        )
    files[0].replace(path)
    shutil.rmtree(parts)


def _json(records: Iterable[tuple[str, Any]]) -> Iterator[tuple[bytes, bytes]]:
    """``(key, value)`` pairs as Kafka records, the value as compact JSON."""
    for key, value in records:
        yield key.encode(), json.dumps(value, default=str, separators=(",", ":")).encode()


class RoutedBatchWriter:
    """The routed job's ``foreachBatch`` function (see the module docstring)."""

    def __init__(
        self,
        *,
        output: Path,
        bootstrap_servers: str,
        migration_topic: str,
        dead_letter_topic: str,
        parallelism: int,
        stages: tuple[str, ...] | None = None,
        results_topic: str | None = None,
        delivery: Delivery = SAFE_DELIVERY,
        sink: tuple[Sink, MergedResults] | None = None,
    ) -> None:
        self.output = output
        self.sink = sink
        """The pipeline's sink and the merge that feeds it (:mod:`keyplane.spark.pipeline_sink`)."""
        self.migration_topic = migration_topic
        self.dead_letter_topic = dead_letter_topic
        self.results_topic = results_topic
        self.parallelism = parallelism
        self.stages = stages or OPERATORS
        """The job's stages, upstream first, for its metrics."""
        self.metrics: dict[int, BatchMetrics] = {}
        self.producer = LongLivedProducer(bootstrap_servers, delivery)
        """Every topic's sends, one producer for the query's run (the listener closes it)."""
        output.mkdir(parents=True, exist_ok=True)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        # Each action below reads the batch: kept once, the stateful plan runs once.
        batch.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            self._write(batch, batch_id)
        finally:
            batch.unpersist()

    def _write(self, batch: DataFrame, batch_id: int) -> None:
        partials = batch_partials(batch)
        tmp = self.output / f".batch-{batch_id:08d}.parquet.tmp"
        write_single_parquet(partials, tmp)
        small = batch_summary(batch).toPandas()
        moved = small[small["kind"] == "moved"]
        packed = small.loc[small["kind"] == "moves", "state"].tolist()
        if len(moved) or packed:
            moves = (
                {
                    "operator": row["stage"],
                    "key": row["key"],
                    "source": row["routed_key"],
                    "target": row["target"],
                    "count": int(row["count"]),
                    "state": row["state"],
                    "marker": int(row["marker"]),
                }
                for row in moved.to_dict("records")
            )
            key = str(batch_id).encode()
            values = itertools.chain(move_records(moves), (text.encode() for text in packed))
            self.producer.send(self.migration_topic, ((key, value) for value in values))
        invalid = small[small["kind"] == "invalid"]
        if len(invalid):
            self.producer.send(
                self.dead_letter_topic,
                _json((str(batch_id), json.loads(detail)) for detail in invalid["detail"].tolist()),
            )
        if self.results_topic:
            write_to_kafka(
                partials.withColumn(TOPIC_KEY, F.concat_ws(":", "stage", "key")),
                self.producer.bootstrap_servers,
                self.results_topic,
                TOPIC_KEY,
                self.producer.delivery,
                key_in_value=False,
            )
        if self.sink is not None:
            sink, merged = self.sink
            results = merged.batch(read_frame(tmp), batch_id)
            write_results(sink, results, batch_id, spark=batch.sparkSession, producer=self.producer)
        tmp.rename(self.output / f"batch-{batch_id:08d}.parquet")
        self.metrics[batch_id] = traffic_metrics(
            batch_id, small, dict.fromkeys(self.stages, self.parallelism)
        )


class MetricsListener(StreamingQueryListener):
    """Publishes one :class:`BatchMetrics` record per batch of one routed query.

    A query listener, rather than the loop that runs the job, because it
    hears every batch of the query however the query was started, and it
    runs on the driver after the batch's progress is known: the record joins
    what the sink measured with the progress figures (rows, rate, duration,
    lag) and the routing the batch was planned with (from the source's end
    offset, :mod:`keyplane.spark.routed_source`).

    It hears one *run* of the query: a query started again from its
    checkpoint keeps its id and gets a new run, and attaching the new run's
    listener removes the old run's. Attaching also removes the listeners of
    the session's queries that are no longer active: a driver that stops a
    query itself (``query.stop()``) would otherwise keep its listener
    registered, hearing every later query's events, for the session's life.
    """

    _attached: ClassVar[dict[str, MetricsListener]] = {}
    """The listener attached to each query id in this driver."""

    def __init__(self, writer: RoutedBatchWriter, topic: str) -> None:
        self.writer = writer
        self.topic = topic
        self.run_id: str | None = None
        self.spark: SparkSession | None = None
        """The session whose listener bus it is on (set by :meth:`attach`)."""
        sink = writer.producer
        self.producer = LongLivedProducer(sink.bootstrap_servers, sink.delivery)
        self._closed = False
        self._lock = threading.Lock()
        """Orders :meth:`publish` on Spark's listener thread and :meth:`close` on another."""

    @classmethod
    def attach(
        cls, spark: SparkSession, query: StreamingQuery, writer: RoutedBatchWriter, topic: str
    ) -> MetricsListener:
        listener = cls(writer, topic)
        listener.run_id = str(query.runId)
        listener.spark = spark
        # A restarted query keeps its id: its last run's listener goes first, as that
        # run has ended and its listener may never hear the termination.
        cls._detach(str(query.id))
        for query_id, attached in list(cls._attached.items()):
            if attached.spark is spark and spark.streams.get(query_id) is None:
                cls._detach(query_id)
        spark.streams.addListener(listener)
        cls._attached[str(query.id)] = listener
        return listener

    @classmethod
    def _detach(cls, query_id: str) -> None:
        """Remove and close the listener attached for ``query_id``, if one is."""
        listener = cls._attached.pop(query_id, None)
        if listener is None:
            return
        if listener.spark is not None:
            listener.spark.streams.removeListener(listener)
        listener.close()

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        if str(event.progress.runId) != self.run_id:
            return
        record = self.record(json.loads(event.progress.json))
        if record is None:
            return
        self.publish(record)

    def publish(self, record: BatchMetrics) -> bool:
        """Send ``record`` and wait for the broker's acknowledgement; False if it was lost.

        The producer lives as long as the query, and a broker restart can
        leave it unable to deliver; :class:`LongLivedProducer` then sends
        once more through a new one, so one restart costs at most one
        record, never all the records after it. The metrics topic is
        advisory (the checkpoint and the sink's topics carry the job's
        state), so a lost record is logged, not raised into Spark.
        """
        value = record.model_dump_json().encode()
        with self._lock:
            if self._closed:
                # A run's last progress event can come after a restart closed its
                # listener: a send would open a producer that no one closes.
                log.warning("metrics record of batch %d not sent: its run ended", record.batch_id)
                return False
            try:
                self.producer.send(self.topic, [(str(record.batch_id).encode(), value)])
            except (KafkaError, DeliveryError) as error:
                log.warning("metrics record of batch %d not delivered: %s", record.batch_id, error)
                return False
        return True

    def record(self, raw_progress: dict[str, Any]) -> BatchMetrics | None:
        """The metrics record of the batch ``raw_progress`` reports (None if it wrote nothing)."""
        progress = progress_of(raw_progress)
        measured = self.writer.metrics.pop(progress.batch_id, None)
        if measured is None:
            return None
        started = raw_progress.get("timestamp")
        sources = raw_progress.get("sources") or [{}]
        end = sources[0].get("endOffset")
        offset = json.loads(end) if isinstance(end, str) else (end or {})
        return measured.model_copy(
            update={
                # model_copy does not validate: the timestamp is parsed here.
                "started_at": datetime.fromisoformat(started) if started else None,
                "plan": offset.get("plan"),
                "versions": offset.get("routing", {}),
                "rows": progress.rows,
                "rows_per_s": progress.rows_per_s,
                "duration_ms": progress.duration_ms,
                "phases_ms": phases_ms(raw_progress),
                "input_lag": progress.lag,
                "rejected_control": offset.get("rejected", {}),
            }
        )

    def onQueryTerminated(self, event: Any) -> None:
        if str(event.runId) != self.run_id:
            return
        self.close()

    def close(self) -> None:
        """Close this run's producers, the listener's and its sink's, for good."""
        with self._lock:
            self._closed = True
            self.producer.close()
        self.writer.producer.close()
