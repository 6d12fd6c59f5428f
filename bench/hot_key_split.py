"""Hot-key splitting vs hash routing on a stream whose hottest key carries over half the load.

Under hash routing the instance that owns the hottest key is the straggler of
every micro-batch (paper 001 §1): the batch lasts as long as that one task.
Three variants run the routed job on the same topic, one after the other;
only the starting configuration differs:

* ``hash``: hash routing, no table, no hot keys;
* ``split``: the hottest key of each stage split over all instances by hand
  (001 §4.1.2, partial counts merged exactly downstream), the rest hashed;
* ``planned``: what the reconfiguration DAG would publish after seeing the
  first batch of events: a statistics snapshot of them, then
  :func:`keyplane.orchestration.planning.plan_configuration` (METIS tables
  under α, FISH hot keys with their d instances, 000 §3.3 and 001 §4.1.2).

The stream is stationary Zipf, so a configuration chosen up front stays
right for the whole run.

Reported: p50/p99 micro-batch duration; p99 wall time of the Spark stage
that runs each keyed stage, from Spark's event log (a stage lasts as long as
its slowest task, so this is where the straggler shows; the rest of a batch,
reading and parsing the events and writing the results, is not keyed);
steady throughput; and max/avg tuples per instance of both stages over the
run (from the job's metrics topic). Goals: p99 with splitting ≤ 0.6 × hash;
max/avg ≤ 1.2 with splitting.

With ``--tuple-work ROUNDS`` stage A runs :class:`_costly_aggregate.CostlyCount`,
which does a fixed amount of CPU work on every tuple, as paper 001 models an
operator (§3, Observation 2); the stages then run in Python. With
``--repeats N`` the three variants take turns N times; batch times are pooled
over the runs and the ratios are also given per run. Every run's counts are
checked against the workload's ground truth.

    python bench/hot_key_split.py [--events 200000] [--exponent 2.0] [--forward pairs|tuples]
        [--tuple-work ROUNDS] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from _costly_aggregate import SPEC as COSTLY_SPEC
from _costly_aggregate import WORK_ENV, micros_per_tuple
from _harness import (
    batch_stage_seconds,
    event_log_env,
    percentile,
    planned_version,
    private_broker,
    read_topic,
    run_job,
    steady_rate,
)
from _output import emit

from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.reference.events import FORWARD_MODES
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.spark.counts_job import CountsJobSettings, read_output
from keyplane.testing import routed_job_topics

P = 4
VARIANTS = ("hash", "split", "planned")


def planned_config(spec: ZipfEvolvingWorkload, seen: int, alpha: float) -> RoutingConfig:
    """The DAG's plan from a snapshot of the first ``seen`` events, as version 1."""
    plan = planned_version(spec, seen, alpha, P)
    return RoutingConfig(version=1, created_by="initial", operators=plan.operators)


def initial_config(variant: str, hot_a: str, hot_b: str) -> RoutingConfig:
    everywhere = tuple(range(P))
    hot = {"A": {hot_a: everywhere}, "B": {hot_b: everywhere}} if variant == "split" else {}
    return RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            name: OperatorRouting(parallelism=P, hot_keys=hot.get(name, {})) for name in OPERATORS
        },
    )


def costly_env(rounds: int) -> dict[str, str]:
    """What the job needs to load :class:`CostlyCount`: its module on the path, its rounds.

    Spark's Python workers inherit ``PYTHONPATH`` from the driver, so the
    stage's tasks import it as the driver does.
    """
    if rounds <= 0:
        return {}
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, WORK_ENV: str(rounds)}


@dataclass(frozen=True)
class Run:
    """One job's run of one variant: its steady batches, loads and exactness."""

    durations: list[float]
    """Each steady batch's duration, s (every batch but the first)."""
    stages: list[dict[str, float]]
    """Each steady batch's Spark stage wall times, s, by part (``A``, ``B``)."""
    rate: float
    load: dict[str, Counter[str]]
    """Tuples per instance over the run, per stage (the metrics topic)."""
    exact: bool


def run_variant(
    work: Path,
    bootstrap: str,
    config: RoutingConfig,
    truth: pd.DataFrame,
    args: argparse.Namespace,
) -> Run:
    """The routed job over the whole topic, starting on ``config``."""
    save(config, work / "store")
    topics = routed_job_topics(work.name)
    progress = run_job(
        CountsJobSettings(
            bootstrap_servers=bootstrap,
            events_topic="hot",
            checkpoint=work / "ck",
            output=work / "out",
            shuffle_partitions=P,
            max_offsets_per_trigger=args.batch,
            stop_at_offset_total=args.events,
            routing_store=work / "store",
            forward=args.forward,
            stage_a_aggregate=COSTLY_SPEC if args.tuple_work > 0 else None,
            **topics,
        ),
        env=event_log_env(work / "events") | costly_env(args.tuple_work),
    )
    stage_s = batch_stage_seconds(work / "events")
    load: dict[str, Counter[str]] = {"A": Counter(), "B": Counter()}
    for record in read_topic(bootstrap, topics["metrics_topic"]):
        for stage, counter in load.items():
            counter.update(record["load"][stage])
    steady = progress[1:] or progress
    return Run(
        durations=[p["duration_ms"] / 1000 for p in steady],
        stages=[stage_s[p["batch_id"]] for p in steady if p["batch_id"] in stage_s],
        rate=steady_rate(progress),
        load=load,
        exact=compare_counts(truth, read_output(work / "out")).exact,
    )


def p99_stage(runs: list[Run], name: str) -> float:
    return percentile([s[name] for run in runs for s in run.stages if name in s], 99)


def pooled(runs: list[Run]) -> dict[str, Any]:
    """A variant's figures over all its runs' steady batches."""
    durations = [d for run in runs for d in run.durations]
    imbalance = {}
    for stage in OPERATORS:
        per_instance = [sum(run.load[stage].get(str(i), 0) for run in runs) for i in range(P)]
        imbalance[stage] = max(per_instance) / (sum(per_instance) / P)
    return {
        "p50": percentile(durations, 50),
        "p99": percentile(durations, 99),
        "stage_p99": {name: p99_stage(runs, name) for name in OPERATORS},
        "rate": statistics.mean(run.rate for run in runs),
        "imbalance": imbalance,
    }


def ratios(variant: str, runs: list[Run], hash_runs: list[Run]) -> str:
    """``variant`` over hash: pooled, then per run (each run against hash's of the same turn)."""

    def cell(mine: list[Run], theirs: list[Run]) -> tuple[float, float, float]:
        return (
            percentile([d for r in mine for d in r.durations], 99)
            / percentile([d for r in theirs for d in r.durations], 99),
            p99_stage(mine, "A") / p99_stage(theirs, "A"),
            statistics.mean(r.rate for r in mine) / statistics.mean(r.rate for r in theirs),
        )

    whole = cell(runs, hash_runs)
    each = [cell([mine], [theirs]) for mine, theirs in zip(runs, hash_runs, strict=True)]

    def figure(i: int) -> str:
        per_run = f" ({', '.join(f'{c[i]:.2f}' for c in each)})" if len(each) > 1 else ""
        return f"**{whole[i]:.2f}**{per_run}"

    return (
        f"{variant} / hash: p99 batch {figure(0)}, p99 stage A {figure(1)}, throughput {figure(2)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--exponent", type=float, default=2.0)
    parser.add_argument("--keys", type=int, default=5_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--alpha", type=float, default=1.1, help="the planned variant's α")
    parser.add_argument(
        "--forward",
        choices=FORWARD_MODES,
        default="pairs",
        help="what stage A sends stage B: a weight per pair and batch, or every tuple",
    )
    parser.add_argument(
        "--tuple-work",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="stage A runs a count that spends ROUNDS rounds of PBKDF2 on each tuple "
        "(bench/_costly_aggregate.py, Python stages); 0: the reference count",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of the three variants")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    costly = args.tuple_work > 0

    spec = ZipfEvolvingWorkload(
        n_events=args.events, n_keys=args.keys, exponent=args.exponent, shifts=(), seed=4
    )
    truth = expected_counts(spec)
    top = truth.sort_values("count", ascending=False).groupby("stage").head(1)
    hot = dict(zip(top["stage"], top["key"], strict=True))
    share = float(top.loc[top["stage"] == "A", "count"].iloc[0]) / args.events
    runs: dict[str, list[Run]] = {variant: [] for variant in VARIANTS}
    with private_broker() as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "hot", partitions=8)
        configs = {
            variant: (
                planned_config(spec, args.batch, args.alpha)
                if variant == "planned"
                else initial_config(variant, hot["A"], hot["B"])
            )
            for variant in VARIANTS
        }
        for run in range(args.repeats):
            for variant, config in configs.items():
                work = tmp / f"{variant}-{run}"
                runs[variant].append(run_variant(work, bootstrap, config, truth, args))
    rows = {variant: pooled(variant_runs) for variant, variant_runs in runs.items()}
    hot_keys = {
        variant: {name: len(op.hot_keys) for name, op in config.operators.items()}
        for variant, config in configs.items()
    }
    stage_a = (
        f"stage A's count spends {micros_per_tuple(args.tuple_work):,.0f} µs of CPU per tuple "
        f"({args.tuple_work:,} PBKDF2 rounds), in Python"
        if costly
        else "the reference counts, in the JVM"
    )
    lines = [
        f"events: {args.events:,} zipf-evolving (s = {args.exponent}, {args.keys:,} keys), "
        f"hottest stage-A key {share:.0%} of tuples; {args.batch:,} per batch, {P} instances, "
        f"local[2]; stage A forwards {args.forward}; {stage_a}; {args.repeats} run(s) of the "
        "three variants, taking turns; batch times pooled over the runs, ratios also per run",
        "",
        "| routing | hot keys A/B | p50 batch s | p99 batch s | p99 stage A s | p99 stage B s "
        "| steady rows/s | max/avg tuples A | max/avg tuples B | counts exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *[
            f"| {v} | {hot_keys[v]['A']}/{hot_keys[v]['B']} | {r['p50']:.2f} | {r['p99']:.2f} "
            f"| {r['stage_p99']['A']:.2f} | {r['stage_p99']['B']:.2f} "
            f"| {r['rate']:,.0f} | {r['imbalance']['A']:.2f} | {r['imbalance']['B']:.2f} "
            f"| {' / '.join(str(x.exact) for x in runs[v])} |"
            for v, r in rows.items()
        ],
        "",
        *[ratios(v, runs[v], runs["hash"]) for v in VARIANTS[1:]],
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
