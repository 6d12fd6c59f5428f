"""Scale-out on the shaped stack: Stela's ETP choice of stage vs round-robin (paper 003 §5).

Paper 003 adds a machine to a running job and gives it to the operators
that raise the sinks' throughput most: the congested ones with the highest
effective throughput percentage (ETP, §4.2, §5.2). Here the machines are
Spark executors and the operators the pipeline's two keyed stages. Stage B
runs :class:`_costly_aggregate.CostlyCount` (``--tuple-work`` PBKDF2 rounds
per tuple, in the Python stages), so B is the bottleneck by its aggregate's
cost; stage A runs the reference count.

The job runs on the stack's pieces (:func:`stack_locality.shaped_stack`:
Apache Kafka, a Spark standalone master, workers of one core each in
network namespaces behind ``tc``-shaped links; every piece on loopback when
this process may not make namespaces, which the output says). Every worker
is up; the job may hold them all (``spark.cores.max``) but starts on one
fewer (``KEYPLANE_EXECUTORS_INITIAL``, as on ``keyplane stack up``), so one
worker stays idle: room for one more executor.

Each round runs two variants, one after the other (their order alternates
from round to round), each its own job on its own topic, from the same
starting state: v1 routes both stages by hash over 2 of 4 state partitions,
and the same events arrive, chunk by chunk, so that the job always has
``--backlog`` micro-batches waiting (its throughput is its capacity). Each
variant measures the steady throughput of ``--measure`` batches, then runs
the scale DAG (``airflow dags test keyplane_scale``, action ``out``,
``executors`` on): the decision, one more executor, the chosen stage grown
by one active instance by the live migration, the check of the first
batches on the new version. Then ``--measure`` batches more are measured.

* ``etp``: the DAG's own decision, Stela's (003 §5.2.2): the congested stage
  with the highest projected ETP; nothing else is given.
* ``round-robin``: the DAG is told the stage (its ``operator`` Param):
  stages grow in chain order, one per scale-out, starting at the first; from
  the starting state, that is stage A (:func:`round_robin_stage`).

Reported per variant: throughput before and after, the gain, the seconds
from the decision (its record's write time) to the new executor's
registration and to the first batch whose metrics name a task on it (the
metrics' ``host:executor`` labels, the record's arrival time on the metrics
topic), and whether every count is exact once the job has read every event.
The job runs with ``spark.locality.wait`` 0: Spark otherwise keeps each
state partition's task on the executor that loaded its store for as long as
that wait, longer than these batches' tasks, and no task would reach the new
executor (docs/orchestration.md, "Scaling").

    python bench/scale_out.py [--repeats 5] [--batch 1000] [--tuple-work 4000]
        [--measure 5] [--backlog 3] [--out FILE]
    python bench/scale_out.py --quick
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import engines
import locality_shuffle
from _costly_aggregate import SPEC as COSTLY_SPEC
from _harness import spark_conf_env
from _output import emit, load_average
from hot_key_split import costly_env
from stack_locality import Cluster, bench_stack, ratio_cell, shaped_stack, verdict

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import WorkloadTrickle
from keyplane.orchestration import dagrun, rollout_steps, run_records, scale_steps
from keyplane.orchestration.verification_steps import read_timed_metrics
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload, WorkloadSpec
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.settings import Settings
from keyplane.spark.counts_job import BatchProgress, job_command, read_output
from keyplane.spark.executors import executor_ids
from keyplane.spark.job_log import last_progress, parse_progress
from keyplane.stack.config import stack_home
from keyplane.testing import routed_job_settings, wait_while_job_runs

Variant = Literal["etp", "round-robin"]
VARIANTS: tuple[Variant, ...] = ("etp", "round-robin")
P = 4
"""State partitions of each stage, fixed when the job starts."""
START_ACTIVE = (0, 1)
"""Active instances of each stage on v1: room to grow on both."""
GOAL = 1.4
"""Throughput after the scale-out, ETP / round-robin: at least (paper 003 reports +45–120 %)."""
REPO = Path(__file__).resolve().parents[1]


def round_robin_stage(stages: Sequence[str], grown: int) -> str:
    """The stage a round-robin scale-out grows after ``grown`` earlier scale-outs: the
    stages in chain order, one each time, starting again at the first after the last."""
    if not stages:
        raise ValueError("round-robin needs at least one stage")
    if grown < 0:
        raise ValueError(f"grown must be at least 0, got {grown}")
    return stages[grown % len(stages)]


def phase_rate(batches: Sequence[BatchProgress]) -> float:
    """Rows per second over ``batches``: their rows over their summed durations."""
    seconds = sum(b.duration_ms for b in batches) / 1000
    if not batches or seconds <= 0:
        raise ValueError("no timed batches to measure a rate on")
    return sum(b.rows for b in batches) / seconds


def first_batch_on(
    timed: Sequence[tuple[BatchMetrics, float]], executor: str, since: float
) -> float | None:
    """Seconds from ``since`` to the arrival of the first metrics record at or after it whose
    batch ran an instance's task on ``executor``; None when none did."""
    for record, at in sorted(timed, key=lambda item: item[1]):
        if at < since:
            continue
        labels = {label for instances in record.executors.values() for label in instances.values()}
        if executor in executor_ids(labels):
            return at - since
    return None


def starting_config() -> RoutingConfig:
    """v1: every stage hashed over :data:`START_ACTIVE` of :data:`P` state partitions."""
    hashed = RoutingConfig.all_hash(P, OPERATORS)
    return hashed.model_copy(
        update={
            "operators": {
                name: OperatorRouting.model_validate(
                    {**routing.model_dump(mode="json"), "active_instances": list(START_ACTIVE)}
                )
                for name, routing in hashed.operators.items()
            }
        }
    )


@dataclass(frozen=True)
class Outcome:
    """One variant's run."""

    variant: Variant
    stage: str
    reason: str
    before: float
    after: float
    executor_s: float
    first_batch_s: float | None
    dag_s: float
    exact: bool
    lost: float
    duplicated: float


def _progress(log: Path) -> list[BatchProgress]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [p for p in map(parse_progress, lines) if p is not None]


def _wait(
    condition: Callable[[], bool], what: str, job: subprocess.Popen[bytes], log: Path, t: float
) -> None:
    wait_while_job_runs(condition, what, job, log, timeout_s=t, poll_s=0.5)


def run_variant(
    cluster: Cluster,
    args: argparse.Namespace,
    tmp: Path,
    airflow_home: Path,
    run: str,
    variant: Variant,
    seed: int,
) -> Outcome:
    """One job from v1 on its own topic: measure, scale out by ``variant``'s choice, measure."""
    assert cluster.workers is not None
    work = tmp / f"{variant}-{run}"
    work.mkdir(parents=True)
    topic = f"scale-{run}-{variant}"
    partitions = locality_shuffle.fresh_topic(cluster.bootstrap, topic, P)
    executors = cluster.workers.config.workers
    settings = routed_job_settings(
        cluster.bootstrap,
        topic,
        work,
        parallelism=P,
        batch=args.batch,
        trigger="1 second",
        version=1,
        master=cluster.master,
        stage_b_aggregate=COSTLY_SPEC,
        executors_initial=executors - 1,
    )
    assert settings.routing_store is not None
    config_store.save(starting_config(), settings.routing_store)
    costly = costly_env(args.tuple_work)
    env = (
        spark_conf_env(
            work / "spark-conf",
            {
                "spark.cores.max": str(executors),
                "spark.executor.cores": "1",
                "spark.executor.memory": cluster.workers.config.worker_memory,
                "spark.driver.host": cluster.driver_host,
                "spark.locality.wait": "0",
                # Executors start from their worker's environment, not the driver's.
                **{f"spark.executorEnv.{name}": value for name, value in costly.items()},
            },
        )
        | {"SPARK_LOCAL_IP": cluster.driver_host}
        | costly
    )
    log = work / "job.log"

    def waiting() -> int:
        last = last_progress(log, 0)
        return sum(s.n_events for s in trickle.specs) - (last.committed if last else 0)

    def chunk(i: int) -> WorkloadSpec:
        while waiting() >= args.backlog * args.batch and not trickle.stop.is_set():
            time.sleep(0.2)
        return PairsWorkload(
            n_keys=args.keys, locality=0.9, n_events=args.batch, seed=seed * 10_000 + i
        )

    trickle = WorkloadTrickle(chunk, cluster.bootstrap, topic, partitions=partitions, pause_s=0)
    setup = dagrun.AirflowSetup.for_job(
        settings,
        airflow_home=airflow_home,
        keyplane_home=work / "keyplane-home",
        dags_folder=REPO / "dags",
    )
    if not (airflow_home / "airflow.db").exists():
        dagrun.migrate_database(setup)
    job: subprocess.Popen[bytes] | None = None
    try:
        trickle.start()
        with log.open("ab") as out:
            job = subprocess.Popen(
                job_command(settings),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait(lambda: "executors pinned at" in log.read_text(), "the pin", job, log, 600)
        pinned = log.read_text().split("executors pinned at", 1)[1].split()[0]
        if int(pinned) != executors - 1:
            raise RuntimeError(f"the job pinned {pinned} executors, not {executors - 1}")
        mark = len(_progress(log))
        _wait(lambda: len(_progress(log)) > mark + args.measure, "batches", job, log, 900)
        before = _progress(log)[mark + 1 : mark + 1 + args.measure]

        conf: dict[str, object] = {
            "action": "out",
            "executors": True,
            "alpha": args.alpha,
            "reply_timeout_s": 180,
        }
        if variant == "round-robin":
            conf["operator"] = round_robin_stage(OPERATORS, 0)
        started = time.monotonic()
        record = dagrun.dag_test(
            setup, conf, log=work / "airflow.log", dag_id="keyplane_scale", timeout_s=1200
        )
        dag_s = time.monotonic() - started
        if record.state != "success":
            raise RuntimeError(
                f"keyplane_scale ended {record.state} ({variant}); see {work / 'airflow.log'}:\n"
                + record.output[-3000:]
            )
        folder = run_records.scale_folder(setup.deployment(), record.run_id)
        decision = json.loads((folder / scale_steps.DECISION).read_text())
        decided_at = (folder / scale_steps.DECISION).stat().st_mtime
        added = json.loads((folder / scale_steps.EXECUTORS).read_text())

        mark = len(_progress(log))
        _wait(lambda: len(_progress(log)) > mark + args.measure, "batches", job, log, 900)
        after = _progress(log)[mark + 1 : mark + 1 + args.measure]

        deployment = setup.deployment()
        end = rollout_steps.metrics_end(deployment)
        timed = read_timed_metrics(deployment, dict.fromkeys(end, 0), end)
        first = first_batch_on(timed, str(added["executor"]), decided_at)

        specs = trickle.finish()
        total = sum(s.n_events for s in specs)

        def counted() -> bool:
            frame = read_output(settings.output)
            return all(
                int(frame.loc[frame["stage"] == name, "count"].sum()) >= total for name in OPERATORS
            )

        _wait(counted, "every event counted", job, log, 900)
        report = compare_counts(expected_counts_of(specs), read_output(settings.output))
        return Outcome(
            variant=variant,
            stage=str(decision["operator"]),
            reason=str(decision["reason"]),
            before=phase_rate(before),
            after=phase_rate(after),
            executor_s=float(added["seconds_from_decision"]),
            first_batch_s=first,
            dag_s=dag_s,
            exact=report.exact,
            lost=float(report.lost),
            duplicated=float(report.duplicated),
        )
    finally:
        trickle.stop.set()
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(timeout=120)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()


def report(
    outcomes: dict[Variant, list[Outcome]], cluster: Cluster, args: argparse.Namespace, took: float
) -> str:
    """The results as markdown: one table of the variants, the ratio and the goal; marked
    PARTIAL while fewer than ``args.repeats`` rounds have run."""
    done = min(len(runs) for runs in outcomes.values())
    partial = (
        []
        if done == args.repeats
        else [f"**PARTIAL: {done} of {args.repeats} rounds ran; the rest did not.**", ""]
    )
    ratio, ratio_txt = ratio_cell(
        [o.after for o in outcomes["etp"]], [o.after for o in outcomes["round-robin"]]
    )
    gain_ratio, gain_txt = ratio_cell(
        [o.after / o.before for o in outcomes["etp"]],
        [o.after / o.before for o in outcomes["round-robin"]],
    )

    def cell(values: list[float], fmt: str) -> str:
        return engines.spread_cell(values, fmt) if values else "none"

    rows = []
    for v in VARIANTS:
        runs = outcomes[v]
        stages = ", ".join(sorted({o.stage for o in runs}))
        firsts = [o.first_batch_s for o in runs if o.first_batch_s is not None]
        rows.append(
            f"| {v} | {stages} | {cell([o.before for o in runs], ',.0f')} "
            f"| {cell([o.after for o in runs], ',.0f')} "
            f"| {cell([o.after / o.before for o in runs], '.2f')}× "
            f"| {cell([o.executor_s for o in runs], '.1f')} "
            f"| {cell(firsts, '.1f')} ({len(firsts)} of {len(runs)}) "
            f"| {cell([o.dag_s for o in runs], '.0f')} "
            f"| {stack_exact(runs)} |"
        )
    return "\n".join(
        [
            f"## Scale-out on the stack: ETP vs round-robin choice of stage ({cluster.master}, "
            f"Kafka at {cluster.bootstrap})",
            "",
            cluster.shaping,
            "",
            *partial,
            f"{done} rounds, the two variants taking turns (order alternating); median "
            f"(min–max) over the rounds; ratios are per round; {took:,.0f} s in all; load "
            f"average at the end {load_average()}",
            "",
            f"Pipeline A → B over {P} state partitions, both stages active on "
            f"{len(START_ACTIVE)} at the start (v1, hash); stage B runs CostlyCount "
            f"({args.tuple_work:,} PBKDF2 rounds per tuple), A the reference count. Pairs events "
            f"({args.keys} keys, L = 0.9), {args.batch:,} a micro-batch (trigger 1 s), the job "
            f"kept {args.backlog} batches behind. The job starts on "
            f"{cluster.workers.config.workers - 1 if cluster.workers else '?'} executors of 1 "
            "core with room for one more (KEYPLANE_EXECUTORS_INITIAL; every worker is up). "
            "Throughput: rows/s over "
            f"{args.measure} batches before the scale run and {args.measure} after it (each "
            "phase starts with the batch after the one in flight). Scale run: `airflow dags "
            f"test keyplane_scale` with action out, executors on, alpha {args.alpha}, the other "
            "Params at their defaults. etp: the DAG's own choice (the congested stage with the "
            "highest projected ETP, 003 §5.2.2); round-robin: stages grown in chain order one "
            "per scale-out starting at the first, from this starting state stage A (the "
            "`operator` Param). spark.locality.wait 0 (not the default 3 s): without it Spark "
            "keeps each state partition's task on the executor that loaded its store, and no "
            "task would reach the new executor within these batches.",
            "",
            "| variant | stage grown | rows/s before | rows/s after | after / before "
            "| s decision → executor registered | s decision → first batch on it "
            "| s scale run | counts, round by round |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
            *rows,
            "",
            f"throughput after, etp / round-robin, per round: {ratio_txt}; gain (after / before), "
            f"etp / round-robin: {gain_txt}",
            "",
            "rounds (stage grown: rows/s before → after, s decision → first batch on the new "
            "executor): "
            + "; ".join(
                f"{v} "
                + ", ".join(
                    f"{o.stage}: {o.before:,.0f} → {o.after:,.0f}, "
                    + (f"{o.first_batch_s:.1f} s" if o.first_batch_s is not None else "none")
                    for o in outcomes[v]
                )
                for v in VARIANTS
            ),
            "",
            "etp decisions: " + "; ".join(sorted({o.reason for o in outcomes["etp"]})),
            "",
            "| goal | measured | verdict |",
            "|---|---:|---|",
            f"| throughput after, etp / round-robin: at least {GOAL}× | {ratio:.2f}× "
            f"| {verdict(ratio, GOAL, 'at least')} |",
            "",
            f"(gain ratio {gain_ratio:.2f}×)",
        ]
    )


def stack_exact(runs: Sequence[Outcome]) -> str:
    """Each run's count check: ``exact``, or what it lost and duplicated."""
    return "; ".join(
        "exact" if o.exact else f"{o.lost:,.0f} lost, {o.duplicated:,.0f} duplicated" for o in runs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--tuple-work", type=int, default=4_000)
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--measure", type=int, default=5)
    parser.add_argument("--backlog", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 batches a phase")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.measure = 1, 3
    for name in ("repeats", "batch", "tuple_work", "keys", "measure", "backlog"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    config = bench_stack()
    if config.workers < 2:
        parser.error("the stack needs at least 2 workers: one for the job, one to add")
    # A stop (SIGTERM) unwinds like Ctrl-C, so the job, the workers and the network go down.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    outcomes: dict[Variant, list[Outcome]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        home = stack_home(Settings().home) / "scale-bench"
        with shaped_stack(config, home) as cluster:
            print(cluster.shaping, flush=True)
            name = locality_shuffle.run_name()
            for r in range(args.repeats):
                order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    outcome = run_variant(
                        cluster, args, tmp, tmp / "airflow", f"{name}-{r}", variant, seed=r
                    )
                    outcomes[variant].append(outcome)
                    print(
                        f"round {r + 1}/{args.repeats} {variant}: grew {outcome.stage}, "
                        f"{outcome.before:,.0f} → {outcome.after:,.0f} rows/s, executor "
                        f"{outcome.executor_s:.1f} s, first batch on it "
                        f"{outcome.first_batch_s} s, scale run {outcome.dag_s:.0f} s, "
                        f"exact {outcome.exact}; load average {load_average()}",
                        flush=True,
                    )
                # Each round's results as they stand, so that a run stopped early keeps them.
                emit(report(outcomes, cluster, args, time.monotonic() - started), args.out)


if __name__ == "__main__":
    main()
