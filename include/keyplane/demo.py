"""The main job: broker, routed streaming job and the reconfiguration DAG, end to end.

One command shows the whole control loop of paper 000 on one machine:

1. the embedded broker starts (unless Kafka is configured) and the routed
   job (:mod:`keyplane.spark.counts_job` with a routing store) starts on an
   all-hash v1, in its own process;
2. the first half of the workload arrives as a backlog, so the job's
   batches run at capacity on v1 ("before");
3. ``airflow dags test keyplane_reconfigure`` (Airflow on SQLite under
   ``$KEYPLANE_HOME/airflow``) collects statistics with Spark, plans METIS
   tables and FISH hot keys (000 §3.3, 001 §4), validates and backtests
   them, and rolls the new version out live (000 §3.4) while small chunks of
   the workload keep arriving, so the new version has batches to verify;
4. the second half arrives as a backlog on the new version ("after");
5. once every event is committed, the summary compares before and after
   (locality, imbalance, rows/s, lag), describes the migration and checks
   every count against the generator's ground truth.

Each run has its own topics, checkpoint, configuration store and controller
state under ``$KEYPLANE_HOME/demo/<run-id>/``, so the command can be repeated.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd
from tqdm import tqdm

from keyplane import config as config_store
from keyplane.batchmetrics import BatchMetrics
from keyplane.config import RoutingConfig
from keyplane.kafka.admin import check_topic_name, ensure_topic, high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.migration_topic import count_moved_states
from keyplane.kafka.producer import WorkloadTrickle, check_workload_options, produce_workload
from keyplane.operators import OPERATORS
from keyplane.orchestration import dagrun, planning, tasks
from keyplane.orchestration.deployment import Deployment
from keyplane.progressbars import progress_bar
from keyplane.settings import Settings
from keyplane.signing import KEY_ENV_VAR
from keyplane.spark.counts_job import (
    PROGRESS_PREFIX,
    BatchProgress,
    CountsJobSettings,
    job_command,
    read_output,
)
from keyplane.testing import routed_job_topics
from keyplane.verification import CountReport, compare_counts, expected_counts_of
from keyplane.workloads import WorkloadSpec

Echo = Callable[[str], None]

REPO = Path(__file__).resolve().parents[2]
TRICKLE_EVENTS = 1_000
TRICKLE_PAUSE_S = 2.0
"""Chunks while the DAG runs: enough for its verify batches, few enough that the job keeps
up even on a busy machine."""


@dataclass(frozen=True)
class Phase:
    """What the job measured on one version: full batches only when there are any."""

    version: int
    batches: int
    rows: int
    rows_per_s: float | None
    lag: float | None
    locality: float | None
    imbalance: dict[str, float]


@dataclass(frozen=True)
class Migration:
    """The rollout the DAG ran, as the controller recorded it."""

    version: int
    parent: int
    states_moved: int
    batches: int | None
    seconds: float | None
    predicted_locality: tuple[float, float]
    moved_share: float


@dataclass(frozen=True)
class DemoResult:
    events: int
    batches: list[BatchProgress]
    report: CountReport
    wall_s: float
    dag: dagrun.DagRunRecord
    decision: str
    before: Phase | None
    after: Phase | None
    migration: Migration | None

    @property
    def succeeded(self) -> bool:
        return self.report.exact and self.dag.state == "success"


class _Follower(threading.Thread):
    """Reads the job's progress lines, echoes each batch, keeps the rest in its log."""

    def __init__(self, job: subprocess.Popen[str], log: TextIO, echo: Echo) -> None:
        super().__init__(daemon=True)
        self.job, self.log, self.echo = job, log, echo
        self.batches: list[BatchProgress] = []

    @property
    def committed(self) -> int:
        return self.batches[-1].committed if self.batches else 0

    def run(self) -> None:
        assert self.job.stdout is not None
        for line in self.job.stdout:
            if not line.startswith(PROGRESS_PREFIX):
                self.log.write(line)
                continue
            p = BatchProgress(**json.loads(line[len(PROGRESS_PREFIX) :]))
            self.batches.append(p)
            if p.rows:
                self.echo(
                    f"batch {p.batch_id:>4} | {p.rows:>7,} rows | {p.rows_per_s:>8,.0f} rows/s | "
                    f"{p.duration_ms / 1000:>5.1f} s | lag {p.lag:>8,} | "
                    f"committed {p.committed:>9,}"
                )


def run_demo(
    spec: WorkloadSpec,
    settings: Settings,
    *,
    rate: float | None = 20_000,
    partitions: int = 8,
    max_offsets_per_trigger: int = 20_000,
    instances: int = 4,
    dag_conf: dict[str, Any] | None = None,
    echo: Echo = tqdm.write,
) -> DemoResult:
    """Run the main job on ``spec`` (half before, half after the reconfiguration).

    Every option is checked before anything starts: a bad one found later
    would leave the demo's broker running and a half-made run directory
    behind. Everything after the checks runs inside the ``try``, so whatever
    fails, the broker the demo started is stopped again.
    """
    started = time.monotonic()
    check_workload_options(rate, partitions)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    home = settings.home.resolve()
    run_dir = home / "demo" / run_id
    bootstrap = settings.resolved_bootstrap_servers()
    topic = check_topic_name(f"{settings.events_topic}.demo-{run_id}")
    topics = routed_job_topics(topic)
    store = run_dir / "configs"
    initial = RoutingConfig.all_hash(instances, OPERATORS)
    # The job and the DAG sign and check control messages with one key (keyplane.signing);
    # without a configured one, the run makes its own.
    key = os.environ.get(KEY_ENV_VAR) or secrets.token_hex(16)
    job_settings = CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic=topic,
        checkpoint=run_dir / "checkpoint",
        output=run_dir / "output",
        shuffle_partitions=instances,
        max_offsets_per_trigger=max_offsets_per_trigger,
        routing_store=store,
        routing_version=1,
        **topics,
    )
    setup = dagrun.AirflowSetup.for_job(
        job_settings,
        airflow_home=home / "airflow",
        keyplane_home=run_dir / "keyplane",
        dags_folder=REPO / "dags",
        control_key=key,
    )
    halves = [
        spec.model_copy(update={"n_events": spec.n_events // 2, "seed": spec.seed}),
        spec.model_copy(
            update={"n_events": spec.n_events - spec.n_events // 2, "seed": spec.seed + 1}
        ),
    ]
    sent: list[WorkloadSpec] = []
    trickle = WorkloadTrickle(
        lambda i: spec.model_copy(
            update={"n_events": TRICKLE_EVENTS, "seed": spec.seed + 1_000 + i}
        ),
        bootstrap,
        topic,
        partitions=partitions,
        pause_s=TRICKLE_PAUSE_S,
    )
    broker = EmbeddedBroker(
        settings.home,
        settings.broker_port,
        storage=settings.broker_storage,
        bucket=settings.broker_bucket,
    )
    own_broker = settings.bootstrap_servers is None and broker.status() is None
    job: subprocess.Popen[str] | None = None
    log_path = run_dir / "job.log"
    try:
        if own_broker:
            state = broker.start()
            echo(f"broker   started embedded broker on {state.bootstrap_servers} (pid {state.pid})")
        run_dir.mkdir(parents=True, exist_ok=True)
        config_store.save(initial, store)
        ensure_topic(bootstrap, topic, partitions)
        echo(f"topic    {topic} ({partitions} partitions), {instances} instances per operator")
        echo(f"workload {spec.kind}: {spec.n_events:,} events (two halves), seed {spec.seed}")
        echo(f"airflow  {setup.airflow_home} (SQLite): airflow db migrate")
        dagrun.migrate_database(setup)
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, KEY_ENV_VAR: key}
        with log_path.open("w") as log:
            job = subprocess.Popen(
                job_command(job_settings),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                bufsize=1,
            )
            follower = _Follower(job, log, echo)
            follower.start()
            echo("\n== before: the first half on v1 (all-hash routing)")
            _produce(halves[0], bootstrap, topic, partitions, rate)
            sent.append(halves[0])
            _wait_committed(follower, job, halves[0].n_events, log_path)

            echo("\n== reconfigure: airflow dags test keyplane_reconfigure")
            trickle.start()
            conf = {"verify_batches": 3, "reply_timeout_s": 300, **(dag_conf or {})}
            run = dagrun.dag_test(
                setup, conf, log=run_dir / "airflow.log", on_task=lambda t: echo(_task_line(t))
            )
            sent += trickle.finish()
            echo(f"dag run  {run.run_id}: {run.state}")

            echo("\n== after: the second half on the active version")
            _produce(halves[1], bootstrap, topic, partitions, rate)
            sent.append(halves[1])
            total = sum(high_watermarks(bootstrap, topic).values())
            _wait_committed(follower, job, total, log_path)
            job.send_signal(signal.SIGTERM)
            if job.wait(timeout=300) != 0:
                raise RuntimeError(f"streaming job failed (exit {job.returncode}); see {log_path}")
            follower.join(timeout=30)
        truth = expected_counts_of(sent)
        report = compare_counts(truth, read_output(run_dir / "output"))
        moved = count_moved_states(bootstrap, topics["migration_topic"])
        result = _result(
            setup.deployment(),
            run,
            report,
            follower.batches,
            full_rows=max_offsets_per_trigger,
            states_moved=moved,
            started=started,
        )
    finally:
        trickle.stop.set()
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=120)
        if own_broker and broker.stop():
            echo("broker   stopped")
    for line in summary_lines(result, run_dir):
        echo(line)
    return result


def _produce(
    spec: WorkloadSpec, bootstrap: str, topic: str, partitions: int, rate: float | None
) -> None:
    with progress_bar(total=spec.n_events, desc="produce", unit="ev", unit_scale=True) as bar:
        produce_workload(
            spec, bootstrap, topic, partitions=partitions, rate=rate, on_progress=bar.update
        )


def _wait_committed(follower: _Follower, job: subprocess.Popen[str], total: int, log: Path) -> None:
    while follower.committed < total:
        if job.poll() is not None:
            raise RuntimeError(f"streaming job exited ({job.returncode}); see {log}")
        time.sleep(0.2)


def _task_line(record: dagrun.TaskRecord) -> str:
    took = f"{record.duration_s:6.1f} s" if record.duration_s is not None else "       "
    return f"task  {record.task_id:<36} {record.state or '-':<8} {took}"


def measure_phase(records: Sequence[BatchMetrics], version: int, full_rows: int) -> Phase | None:
    """Batches with rows routed entirely on ``version``; rows/s over the full ones.

    Full batches (``full_rows`` rows, a backlog) measure the job's capacity;
    a batch of a trickle measures the arrival rate, so it only counts when
    there is no full batch.
    """
    on_version = [
        r for r in records if r.rows and r.versions and set(r.versions.values()) == {version}
    ]
    if not on_version:
        return None
    full = [r for r in on_version if r.rows >= full_rows] or on_version
    measured = planning.measure(on_version)
    imbalance = planning.measured_imbalance(on_version)
    per_operator = {op: imbalance[op] for op in OPERATORS if op in imbalance}
    return Phase(
        version=version,
        batches=len(on_version),
        rows=measured.rows,
        rows_per_s=float(np.mean([r.rows_per_s for r in full])),
        lag=float(np.mean([r.input_lag for r in full])),
        locality=measured.locality,
        imbalance=per_operator,
    )


def _result(
    deployment: Deployment,
    run: dagrun.DagRunRecord,
    report: CountReport,
    batches: list[BatchProgress],
    *,
    full_rows: int,
    states_moved: int,
    started: float,
) -> DemoResult:
    from keyplane import statistics as stats
    from keyplane.controller import ControllerFile

    folder = stats.snapshot_folder(deployment.snapshots, run.run_id)
    decision_path = folder / tasks.DECISION
    decision = (
        json.loads(decision_path.read_text())["reason"]
        if decision_path.is_file()
        else "the run stopped before deciding"
    )
    records = tasks.read_metrics(deployment, {0: 0})
    before = measure_phase(records, 1, full_rows)
    migration = None
    after = None
    if deployment.controller_state.is_file():
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        last = state.protocol.last
        if last is not None and last.finish is not None and last.finish.type == "DONE":
            after = measure_phase(records, last.version, full_rows)
            acked = last.ack.batch_id if last.ack is not None else None
            migrated = last.migrated.get(OPERATORS[-1])
            last_batch = migrated.batch_id if migrated is not None else None
            backtest = json.loads((folder / tasks.BACKTEST).read_text())
            migration = Migration(
                version=last.version,
                parent=last.base,
                states_moved=states_moved,
                batches=(
                    last_batch - acked + 1 if acked is not None and last_batch is not None else None
                ),
                seconds=_rollout_seconds(run),
                predicted_locality=(
                    float(backtest["current"]["locality"]),
                    float(backtest["new"]["locality"]),
                ),
                moved_share=float(backtest["moved_share"]),
            )
    return DemoResult(
        events=report.expected_events,
        batches=batches,
        report=report,
        wall_s=time.monotonic() - started,
        dag=run,
        decision=decision,
        before=before,
        after=after,
        migration=migration,
    )


def _rollout_seconds(run: dagrun.DagRunRecord) -> float | None:
    """From the start of ``publish`` (PREPARE) to the end of ``done`` (DONE)."""
    try:
        start, end = run.task("publish").start, run.task("done").end
    except KeyError:
        return None
    if start is None or end is None:
        return None
    return (pd.Timestamp(end) - pd.Timestamp(start)).total_seconds()


def _imbalance_of(operator: str) -> Callable[[Phase], float | None]:
    return lambda phase: phase.imbalance.get(operator)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_lines(result: DemoResult, run_dir: Path) -> list[str]:
    """The summary table: before vs after, the migration, counts vs ground truth."""
    b, a, m, r = result.before, result.after, result.migration, result.report
    # Committed offsets, not input rows: the routed source adds an evict and an
    # install row per moved state to the batches' input.
    processed = max((p.committed for p in result.batches), default=0)
    verdict = "EXACT" if r.exact else "MISMATCH"
    after_name = f"after (v{a.version})" if a is not None else "after"
    lines = [
        "",
        "summary",
        f"  {'':<34}{'before (v1)':>14}{after_name:>14}",
    ]

    def row(label: str, pick: Callable[[Phase], float | None], spec: str) -> str:
        left = _fmt(pick(b), spec) if b is not None else "-"
        right = _fmt(pick(a), spec) if a is not None else "-"
        return f"  {label:<34}{left:>14}{right:>14}"

    if m is not None:
        old, new = m.predicted_locality
        lines.append(f"  {'locality, instances (backtest)':<34}{old:>14.3f}{new:>14.3f}")
    lines += [
        row("locality, executors (measured)", lambda p: p.locality, ".3f"),
        *[row(f"imbalance max/avg, operator {op}", _imbalance_of(op), ".3f") for op in OPERATORS],
        row("rows/s (full batches, mean)", lambda p: p.rows_per_s, ",.0f"),
        row("lag (records, mean)", lambda p: p.lag, ",.0f"),
        row("batches with rows", lambda p: float(p.batches), ",.0f"),
        "",
    ]
    if m is not None:
        lines += [
            f"  migration             v{m.parent} → v{m.version}: {m.states_moved:,} states moved "
            f"({m.moved_share:.0%} of key weight), "
            f"{_fmt(None if m.batches is None else float(m.batches), '.0f')} batches ACK → "
            f"MIGRATED, {_fmt(m.seconds, '.1f')} s PREPARE → DONE",
        ]
    else:
        lines.append(f"  migration             none: {result.decision}")
    lines += [
        f"  dag run               {result.dag.run_id}: {result.dag.state}",
        f"  events                {result.events:>12,} generated, {processed:,} processed",
        f"  counts vs truth       {verdict:>12}  (lost {r.lost}, duplicated {r.duplicated})",
        f"  wall time             {result.wall_s:>12.1f} s",
        f"  run directory         {run_dir}",
    ]
    return lines
