"""One run of the keyplane_reconfigure DAG on 1M events: wall time, task by task.

One million events of the pairs workload (paper 000 §4.2) are in the topic
before the routed job starts; the job works through the backlog on an
all-hash v1 while ``airflow dags test keyplane_reconfigure`` (Airflow on
SQLite, the statistics job through ``spark-submit``) collects statistics over
the whole million, plans, validates, backtests, rolls the plan out live
(forced, so every run measures the rollout too) and verifies the job's first
batches on it. ``airflow dags test`` runs the tasks a scheduled run runs, in
the same order, and records each task instance in the metadata database;
the table is read from there (start, end, duration).

With ``--pace R`` the events arrive instead at R events/s while the job runs,
as they do before a scheduled run of a job that keeps up with its stream;
the DAG run starts once the million is in the topic, and events keep
arriving at the same rate until it ends.

Goal: the statistics job (``collect_statistics``) on 1M events in ≤ 60 s.
The job is timed twice: once in the DAG run, where it shares the 2 cores
with the routed job working through its backlog (the worst case: a job that
catches up), and once on its own before the routed job starts, the same
``spark-submit`` command on the same million (a cluster gives the two
their own executors; a job that keeps up with its input leaves the cores
mostly free between batches).

    python bench/dag_run.py [--events 1000000] [--keys 10000] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
from _harness import private_broker
from _output import emit

from keyplane.algorithms.statistics import StatisticsSettings, list_snapshots
from keyplane.control.operators import OPERATORS
from keyplane.control.signing import KEY_ENV_VAR
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.producer import produce_workload
from keyplane.orchestration import dagrun
from keyplane.orchestration.statistics_steps import statistics_job_args
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.counts_job import CountsJobSettings, job_command
from keyplane.testing import routed_job_topics

P = 4
REPO = Path(__file__).resolve().parents[1]


def statistics_alone(setup: dagrun.AirflowSetup, tmp: Path) -> tuple[float, str]:
    """Wall time of the statistics job's ``spark-submit`` on the whole topic, and its summary.

    The arguments are the ones ``collect_statistics`` passes with the default
    statistics settings (the DAG's Params default to them), for a run of its
    own with its own snapshot folder.
    """
    deployment = setup.deployment(home=tmp / "alone")
    defaults = StatisticsSettings()
    spark_submit = Path(sys.executable).with_name("spark-submit")
    command = [
        str(spark_submit),
        "--master",
        "local[2]",
        str(REPO / "spark_jobs" / "key_statistics.py"),
        *statistics_job_args(
            deployment,
            "alone",
            decay=defaults.decay,
            holdout_fraction=defaults.holdout_fraction,
        ),
    ]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=setup.environment())
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"the statistics job failed:\n{done.stderr[-3000:]}")
    summary = [line for line in done.stdout.splitlines() if line.startswith("statistics: read")]
    print(f"statistics job on its own: {elapsed:.1f} s", flush=True)
    return elapsed, summary[0] if summary else "(no summary line)"


class _Stopped(Exception):
    """Raised from the producer's progress callback to end a paced stream."""


def produce_paced(
    spec: PairsWorkload, bootstrap: str, topic: str, rate: float, stop: threading.Event
) -> None:
    """``spec`` at ``rate`` events/s, ending early (and quietly) once ``stop`` is set."""

    def check(_: int) -> None:
        if stop.is_set():
            raise _Stopped

    try:
        produce_workload(spec, bootstrap, topic, partitions=8, rate=rate, on_progress=check)
    except _Stopped:
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument(
        "--pace", type=float, help="events/s while the job runs (default: a backlog first)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = PairsWorkload(n_events=args.events, n_keys=args.keys, locality=0.8, seed=21)
    stop = threading.Event()
    with private_broker() as (bootstrap, tmp):
        topic = "dagrun"
        started = time.monotonic()
        if args.pace is None:
            produce_workload(spec, bootstrap, topic, partitions=8)
            arrival = f"produced in {time.monotonic() - started:.0f} s before the job started"
        else:
            ensure_topic(bootstrap, topic, 8)
            arrival = f"arriving at {args.pace:,.0f} events/s while the job runs"
        store = tmp / "store"
        save(RoutingConfig.all_hash(P, OPERATORS), store)
        topics = routed_job_topics(topic)
        settings = CountsJobSettings(
            bootstrap_servers=bootstrap,
            events_topic=topic,
            checkpoint=tmp / "ck",
            output=tmp / "out",
            shuffle_partitions=P,
            max_offsets_per_trigger=args.batch,
            routing_store=store,
            routing_version=1,
            **topics,
        )
        setup = dagrun.AirflowSetup.for_job(
            settings,
            airflow_home=tmp / "airflow",
            keyplane_home=tmp / "keyplane",
            dags_folder=REPO / "dags",
            statistics_master="local[2]",
            control_key=os.environ[KEY_ENV_VAR],
        )
        dagrun.migrate_database(setup)
        ensure_topic(bootstrap, topics["metrics_topic"], 1)
        alone = statistics_alone(setup, tmp) if args.pace is None else None
        log = (tmp / "job.log").open("w")
        job = subprocess.Popen(job_command(settings), stdout=log, stderr=subprocess.STDOUT)
        paced = None
        if args.pace is not None:
            # The million, then as many again at the same pace: the stream
            # goes on while the DAG runs, until ``stop``.
            ongoing = spec.model_copy(update={"n_events": 2 * args.events})
            paced = threading.Thread(
                target=produce_paced, args=(ongoing, bootstrap, topic, args.pace, stop), daemon=True
            )
            paced.start()
        try:
            while (
                sum(high_watermarks(bootstrap, topic).values()) < args.events
                or sum(high_watermarks(bootstrap, topics["metrics_topic"]).values()) < 2
            ):
                if job.poll() is not None:
                    raise RuntimeError((tmp / "job.log").read_text()[-3000:])
                time.sleep(0.5)
            run = dagrun.dag_test(
                setup,
                {"force": True, "verify_batches": 3, "reply_timeout_s": 900},
                log=tmp / "airflow.log",
                on_task=lambda t: print(f"{t.task_id:<36} {t.state} {t.duration_s}"),
            )
            (manifest,) = list_snapshots(tmp / "keyplane" / "statistics")
        finally:
            stop.set()
            if paced is not None:
                paced.join(timeout=60)
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=300)
            log.close()

    ran = [t for t in run.tasks if t.start is not None and t.state != "skipped"]
    first = min(pd.Timestamp(t.start) for t in ran)
    last = max(pd.Timestamp(t.end) for t in ran if t.end is not None)
    stats_s = run.task("collect_statistics").duration_s or 0.0
    whole_s = (last - first).total_seconds()
    # The job's own line, without the logger's suffix Airflow appends.
    inside = [
        line[line.index("statistics: read") :].split(" [airflow")[0]
        for line in run.output.splitlines()
        if "statistics: read" in line
    ]
    lines = [
        f"events: {args.events:,} pairs ({args.keys:,} keys, locality 0.8) in 8 partitions, "
        f"{arrival}; the routed job ({P} instances, at most {args.batch:,} per "
        f"batch, local[2]); statistics window {manifest.n_events:,} events",
        "",
        "| task | state | start (s) | duration (s) |",
        "|---|---|---:|---:|",
        *[
            f"| `{t.task_id}` | {t.state} | {(pd.Timestamp(t.start) - first).total_seconds():.1f} "
            f"| {t.duration_s or 0.0:.1f} |"
            for t in ran
        ],
        "",
        f"statistics job (`collect_statistics`, spark-submit, local[2]): **{stats_s:.1f} s** "
        f"(goal ≤ 60 s: {'met' if stats_s <= 60 else 'not met'})",
        *[f"inside the statistics job, after its session started: {line}" for line in inside[:1]],
        *[
            f"the same statistics job on its own (spark-submit, local[2], no routed job "
            f"running): **{alone[0]:.1f} s** (goal ≤ 60 s: "
            f"{'met' if alone[0] <= 60 else 'not met'}); inside: {alone[1]}"
            for alone in ([] if alone is None else [alone])
        ],
        f"whole DAG run, first task start → last task end: **{whole_s:.1f} s**; "
        f"the run ended **{run.state}**",
    ]
    emit("\n".join(lines), args.out)
    if run.state != "success":
        # The table still shows where the time went; the tail says why the run failed.
        sys.stderr.write(f"the run ended {run.state}:\n{run.output[-4000:]}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
