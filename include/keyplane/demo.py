"""The main job: broker, routed streaming job and the reconfiguration DAG, end to end.

One command shows the whole control loop of paper 000 on one machine:

1. the embedded broker starts (unless Kafka is configured) and the routed
   job (:mod:`keyplane.spark.counts_job` with a routing store) starts on an
   all-hash v1, in its own process, on two executors (``local-cluster``), so
   that where a key's stage-B state lives decides whether its tuples cross
   the network (000 §2);
2. a warm-up share of the workload warms the JVM and is not measured; then
   the first half of the rest arrives as a backlog, so the job's batches run
   at capacity on v1 ("before");
3. ``airflow dags test keyplane_reconfigure`` (Airflow on SQLite under
   ``$KEYPLANE_HOME/airflow``) collects statistics with Spark, plans METIS
   tables and FISH hot keys (000 §3.3, 001 §4), validates and backtests
   them, and rolls the new version out live (000 §3.4) while small chunks of
   the workload keep arriving, so the new version has batches to verify;
4. the second half arrives as a backlog on the new version ("after");
5. once every event is committed, the summary compares before and after
   like with like: the same number of full batches (so the same number of
   events) on each version, both on a warm JVM. It prints the measured
   executor locality, balance and rows/s of each, the gain or that there was
   none, the migration, and every count checked against the generator's
   ground truth.

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

import pandas as pd
from tqdm import tqdm

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.operators import stage_names
from keyplane.control.signing import KEY_ENV_VAR
from keyplane.kafka.admin import check_topic_name, ensure_topic, high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.migration_topic import count_moved_states
from keyplane.kafka.producer import WorkloadTrickle, check_workload_options, produce_workload
from keyplane.orchestration import dagrun, planning, run_records, verification_steps
from keyplane.orchestration.deployment import Deployment, routed_job_topics
from keyplane.reference.verification import CountReport, compare_counts, expected_counts_of
from keyplane.reference.workloads import WorkloadSpec
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.settings import Settings
from keyplane.spark.counts_job import (
    PROGRESS_PREFIX,
    BatchProgress,
    CountsJobSettings,
    job_command,
    read_output,
)
from keyplane.util.progressbars import progress_bar

Echo = Callable[[str], None]

REPO = Path(__file__).resolve().parents[2]
DEMO_MASTER = "local-cluster[2,1,1024]"
"""Two executors: with one, every tuple stays on its executor and routing cannot pay."""
WARMUP_BATCHES = 5
"""Full batches' worth of events that warm the JVMs before anything is measured."""
GAIN_THRESHOLD = 0.05
"""A rows/s ratio within this of 1 is reported as no gain: one run is not a benchmark."""
LOCALITY_THRESHOLD = 0.05
"""Executor locality that moved less than this did not change: a rows/s difference
without it is the machine's (JIT, other load), not the routing's."""
TRICKLE_EVENTS = 1_000
TRICKLE_PAUSE_S = 2.0
"""Chunks while the DAG runs: enough for its verify batches, few enough that the job keeps
up even on a busy machine."""


@dataclass(frozen=True)
class Phase:
    """What the job's metrics records say about the counted batches of one version."""

    version: int
    batch_ids: tuple[int, ...]
    rows: int
    seconds: float
    locality: float | None
    imbalance: dict[str, float]

    @property
    def batches(self) -> int:
        return len(self.batch_ids)

    @property
    def rows_per_s(self) -> float | None:
        return self.rows / self.seconds if self.seconds > 0 else None


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
    warmup_events: int = 0

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

    @property
    def next_batch(self) -> int:
        """The id of the next batch to come: the first of a phase that starts now."""
        return self.batches[-1].batch_id + 1 if self.batches else 0

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
    master: str = DEMO_MASTER,
    warmup_batches: int = WARMUP_BATCHES,
    dag_conf: dict[str, Any] | None = None,
    echo: Echo = tqdm.write,
) -> DemoResult:
    """Run the main job on ``spec``: a warm-up, then half before and half after the
    reconfiguration.

    Every option is checked before anything starts: a bad one found later
    would leave the demo's broker running and a half-made run directory
    behind. Everything after the checks runs inside the ``try``, so whatever
    fails, the broker the demo started is stopped again.
    """
    started = time.monotonic()
    check_workload_options(rate, partitions)
    warmup_events = warmup_batches * max_offsets_per_trigger
    if warmup_batches < 0 or spec.n_events - warmup_events < 2:
        raise ValueError(
            f"warmup_batches must be 0 or more and the workload ({spec.n_events:,} events) "
            f"at least 2 events larger than the warm-up ({warmup_events:,})"
        )
    run_id = time.strftime("%Y%m%d-%H%M%S")
    home = settings.home.resolve()
    run_dir = home / "demo" / run_id
    bootstrap = settings.resolved_bootstrap_servers()
    topic = check_topic_name(f"{settings.events_topic}.demo-{run_id}")
    topics = routed_job_topics(topic)
    store = run_dir / "configs"
    initial = RoutingConfig.all_hash(instances, stage_names())
    # The job and the DAG sign and check control messages with one key (keyplane.control.signing);
    # without a configured one, the run makes its own.
    key = os.environ.get(KEY_ENV_VAR) or secrets.token_hex(16)
    job_settings = CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic=topic,
        checkpoint=run_dir / "checkpoint",
        output=run_dir / "output",
        shuffle_partitions=instances,
        max_offsets_per_trigger=max_offsets_per_trigger,
        master=master,
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
    measured = spec.n_events - warmup_events
    warmup = spec.model_copy(update={"n_events": warmup_events, "seed": spec.seed + 2_000})
    halves = [
        spec.model_copy(update={"n_events": measured // 2, "seed": spec.seed}),
        spec.model_copy(update={"n_events": measured - measured // 2, "seed": spec.seed + 1}),
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
        echo(
            f"workload {spec.kind}: {spec.n_events:,} events ({warmup_events:,} warm-up, then "
            f"two halves), seed {spec.seed}"
        )
        echo(f"spark    {master}")
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
            if warmup.n_events:
                echo("\n== warm-up: not measured")
                _produce(warmup, bootstrap, topic, partitions, rate)
                sent.append(warmup)
                _wait_committed(follower, job, warmup.n_events, log_path)
            warm_from = follower.next_batch
            echo("\n== before: the first half on v1 (all-hash routing)")
            _produce(halves[0], bootstrap, topic, partitions, rate)
            sent.append(halves[0])
            _wait_committed(follower, job, warmup.n_events + halves[0].n_events, log_path)
            before_until = follower.next_batch

            echo("\n== reconfigure: airflow dags test keyplane_reconfigure")
            trickle.start()
            # Spark places the two stages' tasks on either executor freely, so the executor
            # locality of a few small verify batches is noise: verify judges balance and lag.
            conf = {
                "verify_batches": 3,
                "verify_locality_tolerance": 1.0,
                "reply_timeout_s": 300,
                **(dag_conf or {}),
            }
            run = dagrun.dag_test(
                setup, conf, log=run_dir / "airflow.log", on_task=lambda t: echo(_task_line(t))
            )
            sent += trickle.finish()
            echo(f"dag run  {run.run_id}: {run.state}")
            _wait_committed(
                follower, job, sum(high_watermarks(bootstrap, topic).values()), log_path
            )
            after_from = follower.next_batch

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
            before_batches=range(warm_from, before_until),
            after_from=after_from,
            states_moved=moved,
            started=started,
            warmup_events=warmup.n_events,
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


def phase_candidates(
    records: Sequence[BatchMetrics], version: int, full_rows: int, batch_ids: range
) -> list[BatchMetrics]:
    """The full batches (``full_rows`` rows, read from a backlog) routed entirely on
    ``version`` among ``batch_ids``, in order: only they measure the job's capacity. A
    batch of a trickle measures the arrival rate, and a batch before the warm-up ends,
    a cold JVM."""
    return sorted(
        (
            r
            for r in records
            if r.batch_id in batch_ids
            and r.rows >= full_rows
            and r.versions
            and set(r.versions.values()) == {version}
        ),
        key=lambda r: r.batch_id,
    )


def measure_phase(version: int, batches: Sequence[BatchMetrics]) -> Phase | None:
    """Rows/s, executor locality and balance over exactly ``batches``, from their records."""
    if not batches:
        return None
    measured = planning.measure(batches)
    imbalance = planning.measured_imbalance(batches)
    return Phase(
        version=version,
        batch_ids=tuple(r.batch_id for r in batches),
        rows=measured.rows,
        seconds=sum(r.duration_ms for r in batches) / 1000,
        locality=measured.locality,
        imbalance={op: imbalance[op] for op in stage_names() if op in imbalance},
    )


def compare_phases(
    before: Sequence[BatchMetrics], after: Sequence[BatchMetrics], versions: tuple[int, int]
) -> tuple[Phase | None, Phase | None]:
    """Like with like: ``n`` candidates of each version, ``n`` the smaller count, the ones
    nearest the reconfiguration (the last of before, the warmest; the first of after).

    Full batches all hold ``full_rows`` rows, so both phases then cover the same number of
    events; when one version has no full batch, neither is measured.
    """
    n = min(len(before), len(after))
    if n == 0:
        return None, None
    return measure_phase(versions[0], before[-n:]), measure_phase(versions[1], after[:n])


def _result(
    deployment: Deployment,
    run: dagrun.DagRunRecord,
    report: CountReport,
    batches: list[BatchProgress],
    *,
    full_rows: int,
    before_batches: range,
    after_from: int,
    states_moved: int,
    started: float,
    warmup_events: int,
) -> DemoResult:
    from keyplane.algorithms import statistics as stats
    from keyplane.control.controller import ControllerFile

    folder = stats.snapshot_folder(deployment.snapshots, run.run_id)
    decision_path = folder / run_records.DECISION
    decision = (
        json.loads(decision_path.read_text())["reason"]
        if decision_path.is_file()
        else "the run stopped before deciding"
    )
    records = verification_steps.read_metrics(deployment, {0: 0})
    before_candidates = phase_candidates(records, 1, full_rows, before_batches)
    before, _ = compare_phases(before_candidates, before_candidates, (1, 1))
    migration = None
    after = None
    if deployment.controller_state.is_file():
        state = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        last = state.protocol.last
        if last is not None and last.finish is not None and last.finish.type == "DONE":
            after_candidates = phase_candidates(
                records, last.version, full_rows, range(after_from, sys.maxsize)
            )
            before, after = compare_phases(before_candidates, after_candidates, (1, last.version))
            acked = last.ack.batch_id if last.ack is not None else None
            migrated = last.migrated.get(stage_names()[-1])
            last_batch = migrated.batch_id if migrated is not None else None
            backtest = json.loads((folder / run_records.BACKTEST).read_text())
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
        warmup_events=warmup_events,
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


def _ids(phase: Phase) -> str:
    return f"{phase.batch_ids[0]}-{phase.batch_ids[-1]}" if phase.batch_ids else "-"


def gain_line(before: Phase | None, after: Phase | None) -> str:
    """What the run measured, in one line: a gain with the locality that explains it, or
    plainly none. A faster v2 whose executor locality did not change is no routing gain."""
    if before is None or after is None or not before.rows_per_s or not after.rows_per_s:
        return "not measured: a version had no full batch after the warm-up"
    ratio = after.rows_per_s / before.rows_per_s
    rate = f"{ratio:.2f}× the rows/s of v{before.version}"
    if before.locality is None or after.locality is None:
        return f"none from routing: {rate}, with no tuples between stages to measure locality on"
    locality = f"executor locality {before.locality:.3f} → {after.locality:.3f}"
    if ratio <= 1 + GAIN_THRESHOLD:
        return f"none: {rate} (within ±{GAIN_THRESHOLD:.0%} or slower), {locality}"
    if after.locality - before.locality < LOCALITY_THRESHOLD:
        return (
            f"none from routing: {rate}, but {locality} did not rise, so the difference is "
            "the machine's (JIT, other load), not the routing's"
        )
    return f"{rate}, {locality}"


def summary_lines(result: DemoResult, run_dir: Path) -> list[str]:
    """The summary table: before vs after over the same events, the gain, the migration,
    counts vs ground truth."""
    b, a, m, r = result.before, result.after, result.migration, result.report
    # Committed offsets, not input rows: the routed source adds an evict and an
    # install row per moved state to the batches' input.
    processed = max((p.committed for p in result.batches), default=0)
    verdict = "EXACT" if r.exact else "MISMATCH"
    before_name = f"before (v{b.version})" if b is not None else "before (v1)"
    after_name = f"after (v{a.version})" if a is not None else "after"
    lines = [
        "",
        "summary",
        f"  {'':<34}{before_name:>14}{after_name:>14}",
    ]

    def row(label: str, pick: Callable[[Phase], float | None], spec: str) -> str:
        left = _fmt(pick(b), spec) if b is not None else "-"
        right = _fmt(pick(a), spec) if a is not None else "-"
        return f"  {label:<34}{left:>14}{right:>14}"

    def text_row(label: str, pick: Callable[[Phase], str]) -> str:
        left = pick(b) if b is not None else "-"
        right = pick(a) if a is not None else "-"
        return f"  {label:<34}{left:>14}{right:>14}"

    if m is not None and m.parent == 1:  # a rollback's migration has no backtest of its own
        old, new = m.predicted_locality
        lines.append(f"  {'locality, instances (backtest)':<34}{old:>14.3f}{new:>14.3f}")
    lines += [
        text_row("batches measured (ids)", _ids),
        row("rows measured", lambda p: float(p.rows), ",.0f"),
        row("seconds (sum of batch durations)", lambda p: p.seconds, ",.1f"),
        row("rows/s", lambda p: p.rows_per_s, ",.0f"),
        row("locality, executors (measured)", lambda p: p.locality, ".3f"),
        *[
            row(f"imbalance max/avg, operator {op}", _imbalance_of(op), ".3f")
            for op in stage_names()
        ],
        "",
        f"  gain                  {gain_line(b, a)}",
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
        f"  events                {result.events:>12,} generated "
        f"({result.warmup_events:,} warm-up, not measured), {processed:,} processed",
        f"  counts vs truth       {verdict:>12}  (lost {r.lost}, duplicated {r.duplicated})",
        f"  wall time             {result.wall_s:>12.1f} s",
        f"  run directory         {run_dir}",
    ]
    return lines
