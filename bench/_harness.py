"""What every streaming benchmark needs: a private broker, the job as a process, its reports.

Benchmarks run the job exactly as users do (``python -m keyplane.spark.counts_job``,
:func:`keyplane.spark.counts_job.job_command`), each variant in its own
process on the same topic, one after the other in the same run, so that
their ratio is measured on the same machine state.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from kafka import KafkaConsumer, TopicPartition

from keyplane.algorithms import statistics as stats
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.apache_kafka import ApacheKafkaBroker
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.orchestration.planning import PlanParams, plan_configuration
from keyplane.reference.events import key_name
from keyplane.reference.workloads import WorkloadSpec
from keyplane.routing.config import RoutingConfig
from keyplane.settings import KafkaSource
from keyplane.spark.counts_job import CountsJobSettings, job_command
from keyplane.spark.progress import PROGRESS_PREFIX
from keyplane.testing import free_port, routed_job_topics

# Control messages are signed; a benchmark run signs with a key of its own.
os.environ.setdefault("KEYPLANE_CONTROL_KEY", secrets.token_hex(16))


@contextmanager
def private_broker(
    engine: Literal["embedded", "kafka"] = "embedded",
) -> Iterator[tuple[str, Path]]:
    """A broker on a free port and a scratch directory, removed afterwards.

    ``engine``: the embedded broker, or Apache Kafka (one KRaft node,
    :mod:`keyplane.kafka.apache_kafka`) for the numbers that must hold on the
    broker users run in production.
    """
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        broker: EmbeddedBroker | ApacheKafkaBroker = (
            EmbeddedBroker(tmp / "broker", free_port())
            if engine == "embedded"
            else ApacheKafkaBroker(tmp / "broker", free_port())
        )
        bootstrap = broker.start().bootstrap_servers
        try:
            yield bootstrap, tmp
        finally:
            broker.stop()


def routed_on_backlog(
    bootstrap: str,
    topic: str,
    work: Path,
    store: Path,
    *,
    parallelism: int,
    batch: int,
    events: int,
    source: KafkaSource = "python",
) -> CountsJobSettings:
    """The routed job on v1 of ``store``, reading ``topic``'s backlog ``batch`` events a
    batch until ``events``, its checkpoint, output and topics its own (named after ``work``),
    its events read by ``source``."""
    return CountsJobSettings(
        source=source,
        bootstrap_servers=bootstrap,
        events_topic=topic,
        checkpoint=work / "ck",
        output=work / "out",
        shuffle_partitions=parallelism,
        max_offsets_per_trigger=batch,
        stop_at_offset_total=events,
        routing_store=store,
        routing_version=1,
        **routed_job_topics(f"{topic}-{work.name}"),
    )


def planned_version(spec: WorkloadSpec, seen: int, alpha: float, parallelism: int) -> RoutingConfig:
    """What the reconfiguration DAG would publish as v2 over an all-hash v1, having seen
    the first ``seen`` events of ``spec``: a statistics snapshot of them, then
    :func:`keyplane.orchestration.planning.plan_configuration` (METIS tables under
    ``alpha``, FISH hot keys; paper 000 §3.3, paper 001 §4.1.2)."""
    batch = spec.events(0, seen)
    pairs = pd.DataFrame({"a": batch.a, "b": batch.b}).value_counts().reset_index(name="n")
    grouped = pd.DataFrame(
        {
            "a": [key_name(int(k)) for k in pairs["a"]],
            "b": [key_name(int(k)) for k in pairs["b"]],
            "holdout": False,
            "n": pairs["n"],
        }
    )
    _, frames = stats.build_snapshot(
        run_id="bench",
        grouped=stats.chain_rows(grouped, OPERATORS),
        stages=OPERATORS,
        metrics=[],
        events=stats.TopicWindow(topic="events", start={0: 0}, end={0: seen}),
        metrics_window=stats.TopicWindow(topic="metrics", start={}, end={}),
        previous=None,
        config=None,
        settings=stats.StatisticsSettings(),
    )
    plan = plan_configuration(
        frames["pairs"],
        frames["frequencies"],
        RoutingConfig.all_hash(parallelism, OPERATORS),
        PlanParams(alpha=alpha),
        version=2,
    )
    return plan.config


def run_job(settings: CountsJobSettings, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run the job to its stop condition; return its ``progress`` reports."""
    return run_progress_command(job_command(settings), env)


def run_progress_command(
    command: list[str], env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run a job that prints the job's ``progress`` lines to its end; return its reports."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"job failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [
        json.loads(line[len(PROGRESS_PREFIX) :])
        for line in done.stdout.splitlines()
        if line.startswith(PROGRESS_PREFIX)
    ]


def read_topic(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Every JSON record of partition 0 of ``topic``, in order."""
    end = high_watermarks(bootstrap, topic).get(0, 0)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        records: list[dict[str, Any]] = []
        while len(records) < end:
            batch = consumer.poll(timeout_ms=1000).get(tp, [])
            records += [json.loads(r.value) for r in batch]
        return records
    finally:
        consumer.close()


def steady_rate(progress: list[dict[str, Any]]) -> float:
    """Rows per second over every batch but the first (JVM and worker start-up)."""
    rest = progress[1:] or progress
    seconds = sum(p["duration_ms"] for p in rest) / 1000
    return sum(p["rows"] for p in rest) / seconds if seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100), linear interpolation; needs at least one value."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def spark_conf_env(conf_dir: Path, conf: dict[str, str]) -> dict[str, str]:
    """Environment for :func:`run_job` under which the job's Spark configuration holds ``conf``.

    The job builds its session through ``spark-submit``, which reads
    ``spark-defaults.conf`` from ``SPARK_CONF_DIR``, as a user's settings
    would be; the job's own code is untouched.
    """
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "spark-defaults.conf").write_text(
        "".join(f"{key} {value}\n" for key, value in conf.items())
    )
    return {**os.environ, "SPARK_CONF_DIR": str(conf_dir)}


def event_log_env(log_dir: Path) -> dict[str, str]:
    """Environment for :func:`run_job` under which Spark writes its event log to ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return spark_conf_env(
        log_dir / "conf",
        {
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": log_dir.as_uri(),
            # One plain JSON-lines file per application (Spark 4 rolls and compresses by default).
            "spark.eventLog.rolling.enabled": "false",
            "spark.eventLog.compress": "false",
        },
    )


STATEFUL_SCOPE = "TransformWithState"
"""The physical operator of both keyed stages, as named in RDD scopes."""
SCAN_SCOPE = "MicroBatchScan"
"""The operator that reads the source, as named in RDD scopes."""


def batch_stage_seconds(log_dir: Path) -> dict[int, dict[str, float]]:
    """Per micro-batch, the wall time of the Spark stages that read the source and run
    each keyed stage: ``scan``, ``A`` and ``B``.

    Read from the event log (:func:`event_log_env`): a stage belongs to the
    batch its ``streaming.sql.batchId`` property names; it runs a keyed
    stage when one of its RDDs was made by a ``transformWithState``
    operator, else it reads the source when one was made by the scan. Stage
    A's feeds stage B's through a shuffle, so within a batch the first keyed
    Spark stage is stage A and the second stage B. This is where a straggler
    shows: the stage lasts as long as its slowest task.
    """
    submitted: dict[int, tuple[int, str]] = {}
    took: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for path in sorted(p for p in log_dir.iterdir() if p.is_file()):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerStageSubmitted":
                info, props = event["Stage Info"], event.get("Properties") or {}
                scopes = " ".join(rdd.get("Scope", "") for rdd in info["RDD Info"])
                if "streaming.sql.batchId" not in props:
                    continue
                if STATEFUL_SCOPE in scopes:
                    submitted[info["Stage ID"]] = (int(props["streaming.sql.batchId"]), "keyed")
                elif SCAN_SCOPE in scopes:
                    submitted[info["Stage ID"]] = (int(props["streaming.sql.batchId"]), "scan")
            elif event["Event"] == "SparkListenerStageCompleted":
                info = event["Stage Info"]
                if info["Stage ID"] in submitted and "Completion Time" in info:
                    batch, kind = submitted[info["Stage ID"]]
                    seconds = (info["Completion Time"] - info["Submission Time"]) / 1000
                    took.setdefault(batch, {}).setdefault(kind, []).append(
                        (info["Stage ID"], seconds)
                    )
    out: dict[int, dict[str, float]] = {}
    for batch, kinds in took.items():
        out[batch] = dict(zip("AB", (s for _, s in sorted(kinds.get("keyed", []))), strict=False))
        if "scan" in kinds:
            out[batch]["scan"] = sum(seconds for _, seconds in kinds["scan"])
    return out
