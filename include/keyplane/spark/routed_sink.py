"""Where each micro-batch of the routed job goes: counts, moved state, dead letters, metrics.

The batch's output is written where it was computed. Each task of the
batch's last stage holds its instances' output rows; one ``mapInPandas``
over the batch (:class:`BatchPartWriter`, in the one action the batch runs:
a second would run the stateful plan again) has every task split its rows
by ``kind`` (:data:`keyplane.spark.routed_counts.ROUTED_OUTPUT_SCHEMA`):

* ``count`` rows: the latest partial (tuple count and encoded state) per
  routed key and instance, to the task's part of
  ``<output>/batch-<id>.parquet``, a directory the driver renames into
  place once every task wrote its part (so a replay rewrites the same
  file), and optionally the results topic;
* ``moved`` rows: to the migration topic, flushed before the batch commits,
  so the next batch's plan finds them (paper 000 §3.4's state transfer);
  ``moves`` rows are such records already packed by the JVM stages
  (:mod:`keyplane.spark.jvm`), sent as they are;
* ``partials`` rows: many ``count`` rows packed into one by the JVM stages'
  installs (``[stage, key, routed_key, instance, count, state]`` each), read
  as the rows they pack (:func:`unpacked_partials`);
* ``invalid`` rows: to the dead-letter topic with their reason;
* ``hop`` and ``pair`` rows: the task's share of the batch's
  :class:`~keyplane.algorithms.batchmetrics.BatchMetrics`.

The driver receives one row per task, its metrics, and adds them up
(:func:`~keyplane.algorithms.batchmetrics.combined_metrics`), so its work
per batch does not grow with the keys the batch updated;
:class:`MetricsListener` completes the record with the progress figures and
publishes it to the metrics topic. A pipeline's own sink takes results
merged per key across instances (:mod:`keyplane.spark.pipeline_sink`), so
for it the tasks return their partials to the driver as well.

The batch file's directory must be one every executor and the driver see
at the same path: on one machine any directory, on a cluster a shared one.

The other writer, ``driver`` (:data:`keyplane.settings.SinkWriter`), gathers
the whole batch on the driver with one collect and writes it from there as
a single file. While a batch is small the collect costs less than a Python
step in every task; the driver's time then grows with the keys the batch
updated. ``auto``, the default, takes the driver for a batch while the batch
before it had at most :data:`AUTO_DRIVER_ROWS` output rows, and the tasks
otherwise (:func:`writer_for_batch`).

Every record sent to a topic is checked for delivery
(:func:`keyplane.kafka.producer.send_confirmed`): if the broker stays down
past the producer's delivery timeout, the batch fails with
:class:`~keyplane.kafka.producer.DeliveryError` rather than committing with
records lost, and is replayed when the job restarts from its checkpoint.
Each Python worker sends through one producer that it keeps across its
tasks (:class:`~keyplane.kafka.producer.LongLivedProducer`); a send that fails,
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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
from kafka.errors import KafkaError
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from keyplane.aggregates import KeyedAggregate, merge_encoded
from keyplane.algorithms.batchmetrics import BatchMetrics, combined_metrics, traffic_metrics
from keyplane.algorithms.partials import last_of_each, latest_partials
from keyplane.control.operators import OPERATORS
from keyplane.kafka.migration_topic import move_records
from keyplane.kafka.producer import (
    SAFE_DELIVERY,
    Delivery,
    DeliveryError,
    LongLivedProducer,
    executor_producer,
)
from keyplane.pipeline import Sink
from keyplane.settings import BatchWriter, SinkWriter
from keyplane.spark.pipeline_sink import MergedResults, write_results
from keyplane.spark.progress import phases_ms, planning_source, progress_of
from keyplane.spark.routed_counts import OUTPUT_FIELDS

log = logging.getLogger(__name__)

AUTO_DRIVER_ROWS = 50_000
"""``auto``'s bound: a batch is gathered on the driver while the batch before it had at most
this many output rows, a few megabytes of partials, moves and traffic rows."""

COUNT_COLUMNS = ["stage", "key", "routed_key", "instance", "count", "state"]
PARTIAL_KEY = ["stage", "key", "routed_key", "instance"]


def writer_for_batch(setting: SinkWriter, rows_before: int | None) -> BatchWriter:
    """Who writes the next batch, given the job's setting and the output rows of the batch
    before it (None for a run's first batch).

    ``auto`` decides on the batch before, since a batch's own size is known only once it
    ran, and consecutive batches of a stream are alike in size. A run's first batch goes to
    the tasks: it may be the backlog of a restart, however small the batches were before.
    """
    if setting != "auto":
        return setting
    if rows_before is not None and rows_before <= AUTO_DRIVER_ROWS:
        return "driver"
    return "executors"


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


def _json(records: Iterable[tuple[str, Any]]) -> Iterator[tuple[bytes, bytes]]:
    """``(key, value)`` pairs as Kafka records, the value as compact JSON."""
    for key, value in records:
        yield key.encode(), json.dumps(value, default=str, separators=(",", ":")).encode()


REPORT_SCHEMA = (
    "kind STRING, stage STRING, key STRING, routed_key STRING, instance INT, count LONG, "
    "state STRING, detail STRING"
)
"""What each task of the sink tells the driver: one ``metrics`` row (``detail``: its share
of the batch's :class:`BatchMetrics` as JSON; ``count``: the output rows it wrote) and, when
the pipeline's sink needs them, the task's latest partials as ``count`` rows
(:data:`COUNT_COLUMNS`)."""

_REPORT_FIELDS = [field.split()[0] for field in REPORT_SCHEMA.split(", ")]


@dataclass(frozen=True)
class BatchPartWriter:
    """One task's share of a batch, written where the task runs (``mapInPandas``).

    The task that ran a stage's instances holds their output already, so it
    writes that share itself: its latest partials to a part of the batch
    file, its moved states, dead letters and results to their topics, each
    record's delivery confirmed before the task ends (and so before the
    batch commits). What reaches the driver is one summary row per task,
    whatever the number of keys the batch updated. A retried task rewrites
    its part under the same name and sends its records again, which the
    topics tolerate (see the module docstring).
    """

    batch_id: int
    parts: Path
    """The batch's directory of parts, renamed into place by the driver."""
    bootstrap_servers: str
    migration_topic: str
    dead_letter_topic: str
    results_topic: str | None
    delivery: Delivery
    parallelism: Mapping[str, int]
    with_partials: bool
    """Return the task's partials to the driver too, for the pipeline's sink."""

    def __call__(self, frames: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        given = [frame for frame in frames if len(frame)]
        rows = sum(len(frame) for frame in given)
        empty = pd.DataFrame(columns=list(OUTPUT_FIELDS))
        output = unpacked_partials(pd.concat(given, ignore_index=True) if given else empty)
        partials = latest_partials_of_batch(output)
        context = TaskContext.get()
        part = f"part-{context.partitionId() if context else 0:05d}.parquet"
        tmp = self.parts / f".{part}.tmp"
        partials.to_parquet(tmp, index=False)
        self.send(output, partials)
        tmp.rename(self.parts / part)
        metrics = traffic_metrics(self.batch_id, output, self.parallelism)
        report: list[dict[Any, Any]] = [
            {"kind": "metrics", "count": rows, "detail": metrics.model_dump_json()}
        ]
        if self.with_partials:
            known = partials.astype(object).where(partials.notna(), None)
            report += [{**row, "kind": "count"} for row in known.to_dict("records")]
        # Object columns, None for null: Arrow takes them as the schema's types.
        yield pd.DataFrame(
            [{**dict.fromkeys(_REPORT_FIELDS), **row} for row in report], dtype=object
        )

    def send(self, output: pd.DataFrame, partials: pd.DataFrame) -> None:
        """The part's moved states, dead letters and results, each delivery confirmed."""
        send_batch_records(
            executor_producer(self.bootstrap_servers, self.delivery),
            self.batch_id,
            output,
            partials,
            migration_topic=self.migration_topic,
            dead_letter_topic=self.dead_letter_topic,
            results_topic=self.results_topic,
        )


def send_batch_records(
    producer: LongLivedProducer,
    batch_id: int,
    output: pd.DataFrame,
    partials: pd.DataFrame,
    *,
    migration_topic: str,
    dead_letter_topic: str,
    results_topic: str | None,
) -> None:
    """``output``'s moved states and dead letters, and ``partials`` as results, to their
    topics, each delivery confirmed (by a task or by the driver, whichever writes)."""
    moved = output[output["kind"] == "moved"]
    packed = output.loc[output["kind"] == "moves", "state"].tolist()
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
        producer.send(migration_topic, ((key, value) for value in values))
    invalid = output[output["kind"] == "invalid"]
    if len(invalid):
        producer.send(
            dead_letter_topic,
            _json((str(batch_id), json.loads(detail)) for detail in invalid["detail"].tolist()),
        )
    if results_topic and len(partials):
        producer.send(
            results_topic,
            _json((f"{r['stage']}:{r['key']}", r) for r in partials.to_dict("records")),
        )


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
        writer: SinkWriter = "auto",
        sink: tuple[Sink, MergedResults] | None = None,
    ) -> None:
        self.output = output
        self.writer = writer
        """Who writes a batch: its tasks (:class:`BatchPartWriter`), the driver, or ``auto``
        (:func:`writer_for_batch`)."""
        self.rows_before: int | None = None
        """The output rows of the batch this query run wrote last (None before its first)."""
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
        """The driver's sends (the pipeline's sink, and every record when the driver
        writes), one producer for the query's run (the listener closes it)."""
        output.mkdir(parents=True, exist_ok=True)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        if writer_for_batch(self.writer, self.rows_before) == "driver":
            self.rows_before = self.write_on_driver(batch, batch_id)
        else:
            self.rows_before = self.write_on_executors(batch, batch_id)

    def write_on_driver(self, batch: DataFrame, batch_id: int) -> int:
        """The whole batch gathered on the driver and written from there, as one file;
        returns the output rows gathered.

        One collect costs less than a Python step in every task while batches
        are small; the driver's time then grows with the keys a batch updates.
        """
        collected = batch.toPandas()
        output = unpacked_partials(collected)
        partials = latest_partials_of_batch(output)
        tmp, final = self.batch_paths(batch_id)
        partials.to_parquet(tmp, index=False)
        send_batch_records(
            self.producer,
            batch_id,
            output,
            partials,
            migration_topic=self.migration_topic,
            dead_letter_topic=self.dead_letter_topic,
            results_topic=self.results_topic,
        )
        self.feed_sink(batch, batch_id, partials)
        replace_batch_file(tmp, final)
        self.metrics[batch_id] = traffic_metrics(
            batch_id, output, dict.fromkeys(self.stages, self.parallelism)
        )
        return len(collected)

    def batch_paths(self, batch_id: int) -> tuple[Path, Path]:
        """Where either writer puts the batch's unfinished output, cleared of what a killed
        run left there (:func:`remove_leftover`), and the batch file it becomes."""
        final = self.output / f"batch-{batch_id:08d}.parquet"
        unfinished = final.with_name(f".{final.name}.tmp")
        remove_leftover(unfinished)
        return unfinished, final

    def feed_sink(self, batch: DataFrame, batch_id: int, partials: pd.DataFrame) -> None:
        """The pipeline's own sink, if it has one: the batch's results merged per key."""
        if self.sink is not None:
            sink, merged = self.sink
            results = merged.batch(partials, batch_id)
            write_results(sink, results, batch_id, spark=batch.sparkSession, producer=self.producer)

    def write_on_executors(self, batch: DataFrame, batch_id: int) -> int:
        """Each task writes its share (:class:`BatchPartWriter`); the driver adds up one
        summary row per task and renames the batch's directory of parts into place.
        Returns the output rows the tasks wrote."""
        parts, final = self.batch_paths(batch_id)
        parts.mkdir()
        parallelism = dict.fromkeys(self.stages, self.parallelism)
        writer = BatchPartWriter(
            batch_id=batch_id,
            parts=parts,
            bootstrap_servers=self.producer.bootstrap_servers,
            migration_topic=self.migration_topic,
            dead_letter_topic=self.dead_letter_topic,
            results_topic=self.results_topic,
            delivery=self.producer.delivery,
            parallelism=parallelism,
            with_partials=self.sink is not None,
        )
        # One action: a second would run the batch's stateful plan again.
        reports = batch.mapInPandas(writer, REPORT_SCHEMA).toPandas()
        if not any(parts.iterdir()):
            # A batch of no partitions: its file still exists, empty, as every batch's does.
            latest_partials_of_batch(pd.DataFrame(columns=list(OUTPUT_FIELDS))).to_parquet(
                parts / "part-00000.parquet", index=False
            )
        if self.sink is not None:
            partials = reports.loc[reports["kind"] == "count", COUNT_COLUMNS]
            partials = partials.astype({"instance": "Int32", "count": "int64"})
            self.feed_sink(batch, batch_id, partials.reset_index(drop=True))
        replace_batch_file(parts, final)
        summaries = reports[reports["kind"] == "metrics"]
        self.metrics[batch_id] = combined_metrics(
            batch_id,
            [BatchMetrics.model_validate_json(text) for text in summaries["detail"].tolist()],
            parallelism,
        )
        return int(summaries["count"].sum())


def remove_leftover(path: Path) -> None:
    """Remove what a run killed while writing a batch left at ``path``.

    The two writers share the name of a batch's unfinished output, and a
    replayed batch may be written by the other one (``auto`` has the tasks
    write a run's first batch): a file the driver left, or a directory of
    parts the tasks left.
    """
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def replace_batch_file(source: Path, target: Path) -> None:
    """Put ``source`` (a file, or a directory of parts) at ``target``, replacing what a
    replay of the batch wrote there before.

    A first run renames once, atomically, and so does a file replacing a
    file. Otherwise a replay moves the earlier copy aside first, since a
    directory cannot be renamed over a file or another directory (the replay
    may even be by the other writer).
    """
    if source.is_file() and not target.is_dir():
        source.replace(target)
        return
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        source.rename(target)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
        return
    source.rename(target)


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
        planning = planning_source(raw_progress)
        end = planning.get("endOffset")
        offset = json.loads(end) if isinstance(end, str) else (end or {})
        # Beside Spark's connector, a batch may run on the plan of an earlier one.
        replanned = planning.get("startOffset") != end
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
                "rejected_control": offset.get("rejected", {}) if replanned else {},
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
