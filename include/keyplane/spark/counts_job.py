"""Run the reference two-stage counting job and report its progress.

The job reads the events topic through :mod:`keyplane.spark.kafka_source`,
keeps the running counts of :mod:`keyplane.spark.running_counts`, and writes
each micro-batch's updated counts

* to ``<output>/batch-<id>.parquet`` (atomic rename: a replayed batch after a
  crash rewrites the same file, so the output is idempotent), and
* optionally to a results topic.

A restarted job resumes from its checkpoint: source offsets and both stages'
state come back together, so every event is counted exactly once.

With a configuration store (``routing_store``), the job is the *routed*
job: both stages group by routed keys (paper 000 §3.3, paper 001 §4.1.2),
starting on ``routing_version`` (default: the newest stored; an empty store
gets an all-hash-fallback v1), and it takes new versions live from the
control topic, moving state through the migration topic
(:mod:`keyplane.spark.routed_source`, :mod:`keyplane.spark.routed_counts`,
:mod:`keyplane.spark.routed_sink`). Each batch file then holds partial counts
``stage, key, routed_key, instance, count``; :func:`read_output` merges them
(:mod:`keyplane.algorithms.partials`), so its answer keeps the same shape either way.
``forward`` says what the routed job's stage A sends stage B: a weight per
(field-1, field-2) pair and batch (``pairs``), or every tuple with its
padding, as paper 000 §4.1's application does (``tuples``).
Every routed batch also publishes a :class:`~keyplane.algorithms.batchmetrics.BatchMetrics`
record to the metrics topic.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

from keyplane.aggregates import AggregateSpecError, KeyedAggregate, RunningCount, load_aggregate
from keyplane.algorithms.partials import merge_partials
from keyplane.control.operators import OPERATORS
from keyplane.control.quarantine import PoisonUnresolved, Quarantine
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import Delivery
from keyplane.pipeline import Pipeline, PipelineError, load_pipeline
from keyplane.reference.events import FORWARD_MODES, MAX_EVENT_BYTES, Forward
from keyplane.reference.pipeline import FIRST_STAGE, REFERENCE_PIPELINE, SECOND_STAGE
from keyplane.reference.pipeline import counts as reference_counts
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.settings import BootstrapServers, KafkaSource, LogLevel, Settings, SinkWriter
from keyplane.spark import jvm as jvm_stages
from keyplane.spark.chain_connector import read_chain_connector_events
from keyplane.spark.chain_source import read_chain_events
from keyplane.spark.chain_stages import routed_chain
from keyplane.spark.connector import check_loaded as check_connector
from keyplane.spark.connector_events import ConnectorEventsRouter, read_connector_events
from keyplane.spark.executors import DriverExecutors, local_master, start_with_executors
from keyplane.spark.job_log import configure_job_logging
from keyplane.spark.kafka_sink import write_to_kafka
from keyplane.spark.kafka_source import read_kafka
from keyplane.spark.pipeline_frames import (
    check_expressions,
    check_recorded_pipeline,
    record_pipeline,
    routed_rows,
)
from keyplane.spark.pipeline_sink import MergedResults
from keyplane.spark.progress import PROGRESS_PREFIX, BatchProgress, progress_of
from keyplane.spark.routed_counts import (
    StageEngine,
    StageEngineError,
    record_engine,
    recorded_engine,
    resolve_engine,
    routed_running_counts,
)
from keyplane.spark.routed_partitions import HandoffMode
from keyplane.spark.routed_sink import MetricsListener, RoutedBatchWriter, merge_partial_states
from keyplane.spark.routed_source import read_routed_events, source_options
from keyplane.spark.running_counts import latest_counts, parse_events, running_counts
from keyplane.spark.session import build_session
from keyplane.util.parquet_files import read_frame

# By name: the job runs as ``python -m keyplane.spark.counts_job``, where ``__name__`` is
# ``__main__``, outside the ``keyplane`` logger that the job's log level applies to.
log = logging.getLogger("keyplane.spark.counts_job")


class CountsJobSettings(BaseModel):
    """Everything the counting job needs; validated before Spark starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: BootstrapServers
    events_topic: str = "keyplane.events"
    results_topic: str | None = None
    checkpoint: Path
    output: Path
    master: str = "local[2]"
    shuffle_partitions: int = Field(default=4, ge=1)
    max_offsets_per_trigger: int | None = Field(default=None, ge=1)
    trigger_interval: str = Field(
        default="1 second",
        pattern=r"^\d+ (milliseconds?|seconds?|minutes?)$",
        description="Spark's processingTime trigger: how often a micro-batch starts, and so "
        "how often the checkpoint's offset and commit logs and the state store are written.",
    )
    producer_acks: Literal["1", "all"] = Field(
        default="all",
        description="acks of the job's producers (results, migration, dead-letter, metrics).",
    )
    producer_idempotent: bool = Field(
        default=True, description="Idempotent producers (need producer_acks='all')."
    )
    stop_at_offset_total: int | None = Field(
        default=None, ge=0, description="Stop once this many events have been committed."
    )
    stop_when_idle_s: float | None = Field(
        default=None, gt=0, description="Stop after this long with no new input and no lag."
    )
    source: KafkaSource = Field(
        default="python",
        description="Who reads the events: 'python', keyplane's source; 'jvm', Spark's Kafka "
        "connector (the routed job's JVM and Python reference stages only).",
    )
    variant: Literal["two-stage", "count-by-first-key", "native-counts"] = Field(
        default="two-stage",
        description="The unrouted job (no routing_store): 'two-stage', the reference "
        "running counts in two stateful stages; 'count-by-first-key': Spark's native "
        "streaming count by field 1; 'native-counts': the same counts as the two-stage job "
        "from one plain Spark groupBy (baselines for benchmarks).",
    )
    pipeline: str | None = Field(
        default=None,
        description="The routed job's pipeline, 'module:attr' (keyplane.pipeline); default "
        "KEYPLANE_PIPELINE. Its stages' aggregates apply unless stage_a_aggregate or "
        "stage_b_aggregate name others.",
    )
    routing_store: Path | None = Field(
        default=None,
        description="Directory of stored routing configurations (keyplane.routing.config.save); "
        "when set, both stages group by routed keys.",
    )
    routing_version: int | None = Field(
        default=None,
        ge=1,
        description="Configuration version a new checkpoint starts on; default the latest.",
    )
    control_topic: str = "keyplane.control"
    executors_initial: int | None = Field(
        default=None,
        ge=1,
        description="The routed job's executors on a cluster before its first batch; the "
        "master keeps the cores of any others for a later scale-out. None: every executor "
        "the master grants up to spark.cores.max.",
    )
    migration_topic: str = "keyplane.migration"
    metrics_topic: str = "keyplane.metrics"
    dead_letter_topic: str = "keyplane.dead-letter"
    stage_a_aggregate: str | None = Field(
        default=None,
        description="'module:attr' of stage A's keyed aggregate (keyplane.aggregates); "
        "default the running count. Routed job only.",
    )
    stage_b_aggregate: str | None = Field(
        default=None,
        description="'module:attr' of stage B's keyed aggregate; default the running count.",
    )
    forward: Forward = Field(
        default="pairs",
        description="What the routed job's stage A sends stage B: 'pairs', one row per "
        "(field-1 routed key, field-2 key) and micro-batch with its weight; 'tuples', every "
        "tuple with its padding (paper 000 §4.1), so the A→B shuffle carries the tuples.",
    )
    max_event_bytes: int = Field(
        default_factory=lambda: Settings().max_event_bytes,
        ge=1,
        description="The routed job's bound on one event's record, in bytes: a larger one is "
        "dead-lettered as 'oversized' before it is parsed, so one huge record cannot exhaust "
        "a Python worker's memory. Default KEYPLANE_MAX_EVENT_BYTES, the bound the "
        "statistics use too.",
    )
    read_tasks: int | None = Field(
        default=None,
        ge=1,
        description="The most Spark tasks that read one micro-batch with keyplane's Kafka "
        "sources (their maxPartitions option); Kafka partitions share tasks when there are "
        "more. Default: the session's cores (spark.cores.max, else its default parallelism), "
        "since a Python task has a fixed cost to start whatever it reads.",
    )
    stage_engine: StageEngine = Field(
        default="auto",
        description="Where the routed job's stages run: 'jvm', Java stateful processors "
        "(the running count only; keyplane.spark.jvm), 'python' (any aggregate), or 'auto': "
        "the JVM when both stages run the running count and the session has the jar.",
    )
    sink_writer: SinkWriter = Field(
        default="auto",
        description="Who writes each batch's output: 'executors', each task its share of "
        "the batch file and of the topics' records, so the driver's time per batch stays "
        "flat as batches grow; 'driver', which gathers the batch first and is faster while "
        "batches are small; 'auto', the driver while the batch before was small "
        "(keyplane.spark.routed_sink).",
    )
    log_level: LogLevel = Field(
        default="INFO",
        description="The least severe of keyplane's own lines the job writes to its log.",
    )
    restarts: int = Field(
        default=0,
        ge=0,
        description="How many times a failed query is started again from its checkpoint, "
        "in the same session: a batch whose records the broker never acknowledged "
        "(DeliveryError), a task that failed. 0: the job ends with the query's error.",
    )
    restart_delay_s: float = Field(
        default=10.0, ge=0, description="Wait before each restart, so that a broker can return."
    )

    @field_validator("stage_a_aggregate", "stage_b_aggregate")
    @classmethod
    def _check_aggregate(cls, spec: str | None) -> str | None:
        if spec is not None:
            load_aggregate(spec)
        return spec

    def aggregates(self) -> dict[str, KeyedAggregate[Any]]:
        """Each stage's keyed aggregate, by stage name (:meth:`job_pipeline`)."""
        return {stage.name: stage.aggregate for stage in self.job_pipeline().stages}

    def job_pipeline(self) -> Pipeline:
        """The routed job's pipeline, with the aggregates the stage flags name in its stages.

        The stage flags name aggregates for the reference pipeline's two
        stages, A and B, the first and second of the chain.
        """
        pipeline = load_pipeline(self.pipeline or Settings().pipeline)
        named = self.pipeline not in (None, REFERENCE_PIPELINE)
        if named and pipeline.source.topics != (self.events_topic,):
            raise PipelineError(
                f"pipeline {pipeline.name!r} reads {list(pipeline.source.topics)}, but the job "
                f"is set to read {self.events_topic!r}"
            )
        flags = (self.stage_a_aggregate, self.stage_b_aggregate)
        flagged = dict(zip(pipeline.stage_names, flags, strict=False))
        stages = tuple(
            dataclasses.replace(stage, aggregate=load_aggregate(spec))
            if (spec := flagged.get(stage.name))
            else stage
            for stage in pipeline.stages
        )
        return dataclasses.replace(pipeline, stages=stages)

    @model_validator(mode="after")
    def _check_routing(self) -> CountsJobSettings:
        if self.routing_version is not None and self.routing_store is None:
            raise ValueError("routing_version needs routing_store")
        aggregates = (self.stage_a_aggregate, self.stage_b_aggregate)
        if self.routing_store is None and any(aggregates):
            raise ValueError("stage aggregates need the routed job (routing_store)")
        if self.routing_store is None and self.stage_engine != "auto":
            raise ValueError("stage_engine needs the routed job (routing_store)")
        if self.routing_store is None and self.forward != "pairs":
            raise ValueError(f"forward={self.forward!r} needs the routed job (routing_store)")
        if self.routing_store is None and "max_event_bytes" in self.model_fields_set:
            raise ValueError("max_event_bytes needs the routed job (routing_store)")
        if self.routing_store is not None and self.variant != "two-stage":
            raise ValueError("routing applies to the 'two-stage' variant only")
        if self.routing_store is None and self.pipeline is not None:
            raise ValueError("a pipeline needs the routed job (routing_store)")
        self.delivery()
        return self

    def delivery(self) -> Delivery:
        """The producers' guarantees (raises when idempotence is asked with acks=1)."""
        return Delivery(acks=self.producer_acks, idempotent=self.producer_idempotent)


def read_partials(output: Path) -> pd.DataFrame:
    """Every row of every batch file written so far, with its ``batch`` id.

    Unrouted batches have ``stage, key, count``; routed ones also
    ``routed_key`` and ``instance``.
    """
    files = sorted(output.glob("batch-*.parquet"))
    if not files:
        return pd.DataFrame({"stage": [], "key": [], "count": [], "batch": []})
    frames = [
        read_frame(f).assign(batch=int(f.name.removeprefix("batch-").split(".")[0])) for f in files
    ]
    return pd.concat(frames, ignore_index=True)


def read_output(output: Path) -> pd.DataFrame:
    """Latest count per (stage, key) over every batch file written so far.

    Partials of split keys are merged: the routed job's through the stages'
    :class:`~keyplane.aggregates.RunningCount` (:func:`read_results`), the
    unrouted job's as sums (:func:`keyplane.algorithms.partials.merge_partials`). For
    a job with other aggregates, use :func:`read_results`.
    """
    partials = read_partials(output)
    if partials.empty:
        return pd.DataFrame({"stage": [], "key": [], "count": []})
    if "state" not in partials.columns:
        return merge_partials(partials)[["stage", "key", "count"]]
    results = read_results(output, dict.fromkeys(partials["stage"].unique(), RunningCount()))
    counts = results.rename(columns={"result": "count"})
    counts["count"] = counts["count"].astype("int64")
    return counts


def read_results(output: Path, aggregates: Mapping[str, KeyedAggregate[Any]]) -> pd.DataFrame:
    """``stage, key, result`` of a routed job's output: each key's answer so far.

    ``aggregates`` are the stages' aggregates
    (:meth:`CountsJobSettings.aggregates`); a split key's partial states are
    combined with their ``merge`` (:func:`keyplane.spark.routed_sink.merge_partial_states`).
    """
    partials = read_partials(output)
    if partials.empty:
        return pd.DataFrame({"stage": [], "key": [], "result": []})
    return merge_partial_states(partials, aggregates)


def initial_version(settings: CountsJobSettings, stages: Sequence[str] | None = None) -> int:
    """The version a new checkpoint of the routed job starts on.

    The newest stored version unless ``routing_version`` names one; an empty
    store first gets an initial, all-hash-fallback v1 for both operators, so
    that the job can start before any statistics exist.
    """
    assert settings.routing_store is not None
    if settings.routing_version is not None:
        config_store.checksum(settings.routing_store, settings.routing_version)
        return settings.routing_version
    latest = config_store.latest_version(settings.routing_store)
    if latest is not None:
        return latest
    n = settings.shuffle_partitions
    initial = RoutingConfig.all_hash(n, stages or OPERATORS)
    return config_store.save(initial, settings.routing_store).version


def _batch_writer(settings: CountsJobSettings) -> Callable[[DataFrame, int], None]:
    settings.output.mkdir(parents=True, exist_ok=True)

    def write(batch: DataFrame, batch_id: int) -> None:
        updates = latest_counts(batch).cache()
        pdf = updates.toPandas()
        tmp = settings.output / f".batch-{batch_id:08d}.parquet.tmp"
        pdf.to_parquet(tmp, index=False)
        tmp.rename(settings.output / f"batch-{batch_id:08d}.parquet")
        if settings.results_topic:
            write_to_kafka(
                updates,
                settings.bootstrap_servers,
                settings.results_topic,
                "key",
                settings.delivery(),
            )
        updates.unpersist()

    return write


def read_tasks(spark: SparkSession, settings: CountsJobSettings) -> int:
    """How many tasks read a micro-batch: ``settings.read_tasks``, else the session's cores.

    On a cluster those are ``spark.cores.max``, the cores the job holds
    (docker-compose sets it), rather than the default parallelism, which
    counts only the executors registered when the query starts.
    """
    if settings.read_tasks is not None:
        return settings.read_tasks
    held = spark.conf.get("spark.cores.max", None)
    return int(held) if held else spark.sparkContext.defaultParallelism


def start_counts_query(spark: SparkSession, settings: CountsJobSettings) -> StreamingQuery:
    """Start the counting query on ``spark``; the caller waits for and stops it.

    With ``settings.routing_store`` this is the routed job, whose operators
    have as many instances as the session's ``spark.sql.shuffle.partitions``.
    """
    if settings.routing_store is not None:
        return _start_routed_query(spark, settings)
    raw = read_kafka(
        spark,
        settings.bootstrap_servers,
        settings.events_topic,
        max_offsets_per_trigger=settings.max_offsets_per_trigger,
        max_partitions=read_tasks(spark, settings),
        implementation=settings.source,
    )
    events = parse_events(raw)
    if settings.variant == "two-stage":
        updates, mode = running_counts(events), "append"
    elif settings.variant == "native-counts":
        # One scan: each event becomes its stage-A and its stage-B key.
        both = events.select(
            F.explode(
                F.array(
                    F.struct(F.lit(FIRST_STAGE).alias("stage"), F.col("a").alias("key")),
                    F.struct(F.lit(SECOND_STAGE).alias("stage"), F.col("b").alias("key")),
                )
            ).alias("k")
        ).select("k.stage", "k.key")
        updates, mode = both.groupBy("stage", "key").count(), "update"
    else:
        updates = (
            events.groupBy("a")
            .count()
            .select(F.lit(FIRST_STAGE).alias("stage"), F.col("a").alias("key"), "count")
        )
        mode = "update"
    return _start(
        updates.writeStream.outputMode(mode).foreachBatch(_batch_writer(settings)), settings
    )


def _start(writer: DataStreamWriter, settings: CountsJobSettings) -> StreamingQuery:
    return (
        writer.option("checkpointLocation", str(settings.checkpoint))
        .trigger(processingTime=settings.trigger_interval)
        .queryName("keyplane_running_counts")
        .start()
    )


def _start_routed_query(spark: SparkSession, settings: CountsJobSettings) -> StreamingQuery:
    assert settings.routing_store is not None
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or 0)
    bootstrap = settings.bootstrap_servers
    ensure_topic(bootstrap, settings.control_topic, 1)
    for topic in (settings.migration_topic, settings.metrics_topic, settings.dead_letter_topic):
        ensure_topic(bootstrap, topic, 1)
    store = settings.routing_store.resolve()
    pipeline = settings.job_pipeline()
    check_expressions(spark, pipeline)
    check_recorded_pipeline(settings.checkpoint, pipeline)
    aggregates = {stage.name: stage.aggregate for stage in pipeline.stages}
    first, second = [*[stage.aggregate for stage in pipeline.stages], None][:2]
    engine = resolve_engine(
        settings.stage_engine,
        first,
        second,
        jvm_loaded=jvm_stages.loaded(spark),
        recorded=recorded_engine(settings.checkpoint),
        reference_shape=reference_shape(pipeline),
    )
    if engine == "jvm":
        check_jvm_stages(spark, partitions)
    record_engine(settings.checkpoint, engine)
    record_pipeline(settings.checkpoint, pipeline)
    log.info(
        "pipeline %r: stages %s run in %s",
        pipeline.name,
        ", ".join(pipeline.stage_names),
        {"jvm": "the JVM", "python": "Python", "chain": "Python, as a chain"}[engine],
    )
    tasks = read_tasks(spark, settings)
    options = source_options(
        bootstrap,
        events_topic=settings.events_topic,
        control_topic=settings.control_topic,
        migration_topic=settings.migration_topic,
        store=store,
        state_partitions=partitions,
        initial_version=initial_version(settings, pipeline.stage_names),
        max_offsets_per_trigger=settings.max_offsets_per_trigger,
        max_event_bytes=settings.max_event_bytes,
        max_partitions=tasks,
    )
    if engine == "chain":
        if settings.source == "jvm":
            checkpoint = settings.checkpoint.resolve()
            records = read_chain_connector_events(
                spark, options, stages=pipeline.stage_names, checkpoint=checkpoint
            )
        else:
            records = read_chain_events(spark, options, stages=pipeline.stage_names)
        inputs = routed_rows(
            records,
            pipeline,
            store,
            partitions,
            quarantine=Quarantine(settings.checkpoint).quarantined_values(),
        )
        updates = routed_chain(inputs, pipeline, partitions)
    else:
        # The JVM stages take a rollout's moves per instance (routed_source).
        handoff: HandoffMode = "per-instance" if engine == "jvm" else "per-key"
        quarantine = Quarantine(settings.checkpoint)
        checkpoint = settings.checkpoint.resolve()
        inputs = read_routed_events(
            spark,
            options,
            forward=settings.forward,
            handoff=handoff,
            quarantine=quarantine.option(),
            events="skip" if settings.source == "jvm" else "read",
            checkpoint=checkpoint,
        )
        if settings.source == "jvm":
            check_connector(spark)
            router = ConnectorEventsRouter(
                str(checkpoint),
                str(store),
                partitions,
                settings.forward,
                handoff,
                settings.max_event_bytes,
                quarantine.pairs(),
            )
            events = read_connector_events(
                spark,
                bootstrap,
                settings.events_topic,
                router,
                max_offsets_per_trigger=settings.max_offsets_per_trigger,
                tasks=tasks,
            )
            inputs = events.unionByName(inputs)
        updates = routed_running_counts(
            inputs,
            partitions,
            stage_a=pipeline.stages[0].aggregate,
            stage_b=pipeline.stages[1].aggregate,
            forward=settings.forward,
            engine=engine,
        )
    writer = RoutedBatchWriter(
        output=settings.output,
        bootstrap_servers=bootstrap,
        migration_topic=settings.migration_topic,
        dead_letter_topic=settings.dead_letter_topic,
        parallelism=partitions,
        stages=pipeline.stage_names,
        results_topic=settings.results_topic,
        delivery=settings.delivery(),
        writer=settings.sink_writer,
        # The pipeline's own sink gets merged results when a pipeline is named.
        sink=None
        if settings.pipeline is None
        else (pipeline.sink, MergedResults(aggregates, settings.output)),
    )
    query = _start(updates.writeStream.outputMode("append").foreachBatch(writer), settings)
    MetricsListener.attach(spark, query, writer, settings.metrics_topic)
    return query


def reference_shape(pipeline: Pipeline) -> bool:
    """Whether ``pipeline`` has the reference pipeline's stages (names, keys, values), which
    the ``jvm`` and ``python`` engines run (:func:`keyplane.spark.routed_counts.resolve_engine`)."""
    shape = [(s.name, s.key, s.value) for s in pipeline.stages]
    return shape == [(s.name, s.key, s.value) for s in reference_counts().stages]


_JVM_STAGES_CHECKED: set[tuple[str, int]] = set()
"""The sessions (application id) and state partitions whose Spark passed the check."""


def check_jvm_stages(spark: SparkSession, partitions: int) -> None:
    """Refuse, in one line, to run the JVM stages on a Spark that does not behave as they need.

    :func:`keyplane.spark.jvm.spark_behaviour_problems` says what they rely on; a
    session is checked once, not again at each of the query's restarts.
    """
    checked = (spark.sparkContext.applicationId, partitions)
    if checked in _JVM_STAGES_CHECKED:
        return
    problems = jvm_stages.spark_behaviour_problems(spark, partitions)
    if problems:
        raise StageEngineError(
            f"stage engine 'jvm': {problems[0]}; run the job with --stage-engine python"
        )
    _JVM_STAGES_CHECKED.add(checked)


def job_command(settings: CountsJobSettings) -> list[str]:
    """The command line that runs this job with ``settings`` in a new process.

    Only the fields set explicitly become flags, so the child's defaults (for
    example ``KEYPLANE_KAFKA_SOURCE``) apply to the rest; :func:`main` parses
    the flags back into the same settings. Each is one ``--flag=value``
    argument: argparse would take a separate value that starts with ``-``
    (a topic ``-events``, a master ``-x``) for a flag of its own.
    """
    cmd = [sys.executable, "-m", "keyplane.spark.counts_job"]
    for name, value in settings.model_dump(exclude_unset=True, exclude_none=True).items():
        cmd.append(f"--{name.replace('_', '-')}={value}")
    return cmd


def run_counts_job(
    settings: CountsJobSettings,
    on_progress: Callable[[BatchProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[BatchProgress]:
    """Run until a stop condition holds or ``should_stop()`` (else forever).

    A routed job also publishes each batch's metrics to the metrics topic.
    A query that fails is started again from its checkpoint up to
    ``settings.restarts`` times (:class:`QueryRestarts`); the checkpoint
    replays the failed batch with the offsets, routing and moves it was
    planned with, so counts stay exact.
    """
    spark = build_session(
        "keyplane-running-counts", settings.master, shuffle_partitions=settings.shuffle_partitions
    )
    restarts = QueryRestarts(settings.restarts, settings.restart_delay_s, should_stop)
    quarantine = Quarantine(settings.checkpoint) if settings.routing_store else None
    start = functools.partial(start_counts_query, spark, settings)
    on_cluster = not local_master(settings.master)
    initial = settings.executors_initial if settings.routing_store and on_cluster else None
    try:
        if initial is not None:
            kept = start_with_executors(spark.sparkContext, initial)
            print(f"keyplane: started with executors {', '.join(kept)}", flush=True)
        query = restarts.start(start)
    except RestartStopped:
        spark.stop()
        return []
    except BaseException:
        spark.stop()
        raise
    seen: set[int] = set()
    history: list[BatchProgress] = []

    def take_new_progress() -> bool:
        """Report the batches not reported yet; True if one read records or left a lag."""
        took = False
        for raw_progress in query.recentProgress:
            progress = progress_of(raw_progress)
            if progress.batch_id in seen:
                continue
            seen.add(progress.batch_id)
            if progress.rows == 0 and progress.lag == 0:
                continue
            history.append(progress)
            took = True
            if on_progress is not None:
                on_progress(progress)
        return took

    idle_since = time.monotonic()
    executors = (
        DriverExecutors(spark, settings.bootstrap_servers, settings.control_topic, initial=initial)
        if settings.routing_store
        else None
    )
    try:
        while not (should_stop is not None and should_stop()):
            if executors is not None:
                executors.tick(query)
            if not query.isActive:
                if query.exception() is None:
                    break
                if quarantine is not None and quarantine.after_failure(str(query.exception())):
                    # A poison record (keyplane.control.quarantine): a restart that spends none of
                    # the user's, since each one either retries once or quarantines.
                    log.warning("a stage's aggregate failed the batch; starting it again")
                    query = restarts.start(start)
                    continue
                try:
                    query = restarts.after_failure(query.exception(), start)
                except RestartStopped:
                    break
                continue
            time.sleep(0.5)
            if take_new_progress():
                idle_since = time.monotonic()
            committed = history[-1].committed if history else 0
            lag = history[-1].lag if history else 0
            if (
                settings.stop_at_offset_total is not None
                and committed >= settings.stop_at_offset_total
            ):
                break
            if (
                settings.stop_when_idle_s is not None
                and lag == 0
                and time.monotonic() - idle_since > settings.stop_when_idle_s
            ):
                break
        # The batch that was running when the loop ended runs to its end
        # (stop_between_batches): report it too, or its records would be
        # committed without a progress line.
        stop_between_batches(query)
        take_new_progress()
    finally:
        if executors is not None:
            executors.close()
        stop_between_batches(query)
        spark.stop()
    return history


STOP_GRACE_S = 20.0
"""How long a stop waits for the running batch to end; below the 30 s after which
``keyplane job stop`` kills the job."""


def stop_between_batches(
    query: StreamingQuery, grace_s: float = STOP_GRACE_S, poll_s: float = 0.05
) -> None:
    """Stop ``query`` once the batch running now has ended, or after ``grace_s`` regardless.

    Why wait: ``StreamingQuery.stop`` cancels the running batch's Spark jobs.
    Counts stay exact either way, since the checkpoint replays that batch on
    the next start, but its work is lost, and the cancelled collect inside
    ``foreachBatch`` fills the log with stack traces (on Spark 4.3 the stream
    thread can even overflow its stack formatting them). Only the batch
    running at the request is waited for: a job with a backlog starts the
    next one at once, and that one is stopped while it is still planned.
    """
    deadline = time.monotonic() + grace_s
    before = query.lastProgress
    last_batch = before["batchId"] if before else -1
    while query.isActive and time.monotonic() < deadline:
        if not query.status["isTriggerActive"]:
            break
        latest = query.lastProgress
        if latest is not None and latest["batchId"] > last_batch:
            break
        time.sleep(poll_s)
    query.stop()


class RestartStopped(Exception):
    """A stop was asked while a failed query waited to start again; the job ends cleanly."""


PERMANENT_START_ERRORS: tuple[type[Exception], ...] = (
    config_store.ConfigStoreError,
    ValueError,
    TypeError,
    AnalysisException,
)
"""Errors of a query start that no restart heals: an unknown or altered routing
version, invalid settings or aggregate (pydantic's errors are ``ValueError``s),
a query Spark cannot plan. :class:`QueryRestarts` raises them at once."""


class QueryRestarts:
    """Starts a query again from its checkpoint after it fails, a bounded number of times.

    Why in the driver: a query that fails (a broker down longer than the
    producers' delivery timeout, a task error) has committed nothing of its
    failed batch, and Spark replays that batch only when the query starts
    again. A process supervisor could restart the whole job, but it would pay
    for a new JVM and session; a restart here reuses both. A start that
    fails too (the broker still down) uses up a restart of its own, unless
    its error is one of :data:`PERMANENT_START_ERRORS`: waiting would not
    change a bad configuration, so those surface at once.
    """

    def __init__(
        self, restarts: int, delay_s: float, should_stop: Callable[[], bool] | None = None
    ) -> None:
        self.left = restarts
        self.delay_s = delay_s
        self.should_stop = should_stop
        self.errors: list[str] = []

    def start(self, start_query: Callable[[], StreamingQuery]) -> StreamingQuery:
        """``start_query()``, tried again after a failure while restarts are left."""
        while True:
            try:
                return start_query()
            except PERMANENT_START_ERRORS:
                raise
            except Exception as error:
                if self.left == 0:
                    raise
                self._wait_after(error)

    def after_failure(
        self, error: object, start_query: Callable[[], StreamingQuery]
    ) -> StreamingQuery:
        """The query started again after it failed with ``error``; raises if none are left."""
        if self.left == 0:
            raise RuntimeError(f"streaming query failed: {error}")
        self._wait_after(error)
        return self.start(start_query)

    def _wait_after(self, error: object) -> None:
        self.left -= 1
        self.errors.append(str(error).splitlines()[0] if str(error) else repr(error))
        log.warning(
            "streaming query failed (%s); starting it again from its checkpoint in %.0f s "
            "(%d restart(s) left)",
            self.errors[-1], self.delay_s, self.left,
        )  # fmt: skip
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline:
            if self.should_stop is not None and self.should_stop():
                raise RestartStopped(f"stopped while waiting to restart after: {error}")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _print_progress(p: BatchProgress) -> None:
    sys.stdout.write(PROGRESS_PREFIX + json.dumps(dataclasses.asdict(p)) + "\n")
    sys.stdout.flush()


def parse_settings(argv: list[str] | None = None) -> CountsJobSettings:
    """The job's settings from its command line (the inverse of :func:`job_command`)."""
    parser = argparse.ArgumentParser(
        prog="running_counts", description="Run keyplane's reference two-stage counting job."
    )
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--events-topic", default="keyplane.events")
    parser.add_argument("--results-topic")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--shuffle-partitions", type=int, default=4)
    parser.add_argument("--max-offsets-per-trigger", type=int)
    parser.add_argument("--trigger-interval", default="1 second")
    parser.add_argument("--producer-acks", choices=["1", "all"])
    parser.add_argument("--producer-idempotent", choices=["True", "False"])
    parser.add_argument("--stop-at-offset-total", type=int)
    parser.add_argument("--stop-when-idle-s", type=float)
    parser.add_argument(
        "--source",
        choices=get_args(KafkaSource),
        default=Settings().kafka_source,
        help="Kafka source implementation (default: KEYPLANE_KAFKA_SOURCE or python)",
    )
    parser.add_argument("--variant", choices=["two-stage", "count-by-first-key", "native-counts"])
    parser.add_argument(
        "--sink-writer",
        choices=get_args(SinkWriter),
        default=Settings().sink_writer,
        help="who writes each batch's output: executors (the driver's time stays flat), "
        "driver (faster for small batches) or auto (the driver while the batch before was "
        "small) (default: KEYPLANE_SINK_WRITER or auto)",
    )
    parser.add_argument(
        "--log-level",
        choices=get_args(LogLevel),
        default=Settings().log_level,
        help="the least severe of keyplane's own lines to log (default: KEYPLANE_LOG_LEVEL "
        "or INFO); other libraries log their warnings and errors only",
    )
    parser.add_argument(
        "--pipeline",
        metavar="MODULE:ATTR",
        help="the routed job's pipeline (default: KEYPLANE_PIPELINE)",
    )
    parser.add_argument(
        "--routing-store",
        type=Path,
        help="directory of stored routing configurations; group both stages by routed keys",
    )
    parser.add_argument(
        "--routing-version", type=int, help="version a new checkpoint starts on (default: latest)"
    )
    for topic in ("control", "migration", "metrics", "dead-letter"):
        parser.add_argument(f"--{topic}-topic", help=f"the routed job's {topic} topic")
    for stage in ("a", "b"):
        parser.add_argument(
            f"--stage-{stage}-aggregate",
            type=_aggregate_spec,
            metavar="MODULE:ATTR",
            help=f"stage {stage.upper()}'s keyed aggregate (default: the running count)",
        )
    parser.add_argument(
        "--forward",
        choices=FORWARD_MODES,
        help="what the routed job's stage A sends stage B: a weight per pair and batch "
        "(pairs, the default) or every tuple with its padding (tuples)",
    )
    parser.add_argument(
        "--max-event-bytes",
        type=int,
        help="the routed job's bound on one event's record; a larger one is dead-lettered "
        f"(default: KEYPLANE_MAX_EVENT_BYTES or {MAX_EVENT_BYTES:,})",
    )
    parser.add_argument(
        "--read-tasks",
        type=int,
        help="the most tasks that read one micro-batch; Kafka partitions share tasks when "
        "there are more (default: the session's cores)",
    )
    parser.add_argument(
        "--stage-engine",
        choices=get_args(StageEngine),
        help="where the routed job's stages run: jvm (the running count), python (any "
        "aggregate) or auto (the JVM where it can; the default)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        help="start a failed query again from its checkpoint up to this many times (default 0)",
    )
    parser.add_argument("--restart-delay-s", type=float, help="wait before each restart")
    parser.add_argument(
        "--executors-initial",
        type=int,
        help="the routed job's executors on a cluster before its first batch (default: every "
        "one the master grants up to spark.cores.max)",
    )
    args = parser.parse_args(argv)
    return CountsJobSettings(**{k: v for k, v in vars(args).items() if v is not None})


def _aggregate_spec(spec: str) -> str:
    """A ``module:attr`` naming a keyed aggregate, checked at the command line (one line)."""
    try:
        load_aggregate(spec)
    except AggregateSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def main(argv: list[str] | None = None) -> int:
    """Run the job; SIGTERM stops the query between batches and exits 0.

    Stopping is safe at any moment (the checkpoint makes a restart exact),
    but a clean stop does not leave a half-run batch to replay.
    """
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settings = parse_settings(argv)
    configure_job_logging(settings.log_level)
    try:
        run_counts_job(settings, on_progress=_print_progress, should_stop=stop.is_set)
    except (StageEngineError, PoisonUnresolved, PipelineError) as exc:
        print(f"running_counts: error: {exc}", file=sys.stderr)
        return 2
    _print_committed(settings)
    return 0


def _print_committed(settings: CountsJobSettings) -> None:
    """The log's last word: what the checkpoint has committed, read from Spark's commit and
    offset logs, which count every batch, printed or not."""
    from keyplane.spark.job_checkpoint import last_committed_batch

    committed = last_committed_batch(Path(settings.checkpoint), settings.events_topic)
    what = "no batch" if committed is None else committed.describe()
    print(f"stopped; the checkpoint has committed {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
