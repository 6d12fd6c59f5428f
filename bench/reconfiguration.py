"""A live reconfiguration that moves 10k keys: how many micro-batches it takes, what it costs.

The routed job runs on a backlog, so every batch takes ``--batch`` events and
a batch's duration is the job's cost for them. After ``--warmup-batches``
batches (3 by default; a JVM keeps compiling the job's code for tens of
batches) the
controller rolls out v2, which moves ``--moved-keys`` stage-A keys and every
stage-B key to other instances. Three rollouts, side by side in one run,
each on a job of its own over the same topic:

* ``together`` (keyplane's rollout): PREPARE → ACK → PROPAGATE A, PROPAGATE B
  → MIGRATED A, MIGRATED B → DONE; both stages switch in one batch;
* ``one-by-one`` (paper 000 §3.4's order): PROPAGATE B only after MIGRATED A;
* ``in waves``: the same moves as a chain of versions that each move at most
  ``--max-moves-per-wave`` keys (:mod:`keyplane.routing.waves`), each rolled out
  ``together``, one after the other.

One more job reads the same topic with no rollout: the baseline. Every job
reads the same events in batch *n* (same backlog, same ``--batch``), so a
batch of a rollout and the same batch of the baseline differ only by the
rollout's work. The jobs run one at a time; with ``--repeats``, each run
starts with another of them, so that no job always runs first.

Reported per order:

* micro-batches from the job's (first) ACK to its (last) MIGRATED for B (the
  batch ids the job stamps on its replies), plus the batch that applies DONE;
* the throughput dip (goal ≤ 10 %) over the switch and install batches, the
  two that move state, and over all batches from the ACK to MIGRATED(B):
  one minus the baseline's summed durations of those batches over the
  rollout's. Then the same, with each job's pace taken out: two processes
  running the same batches differ by up to a fifth before any rollout (JIT
  and GC luck), so the rollout's seconds are scaled by how fast its job ran
  the batches before the ACK against the baseline's
  (a difference in differences); and once more with the pace of all the
  batches outside the rollout, before the ACK and after DONE, which a long
  rollout (waves) needs: three batches before the ACK judge a job's pace
  poorly. Routing on v2 after DONE may cost a job 1–3 % a batch, which
  this pace counts as the job's own. Also, as this bench measured before it had
  a baseline, against the mean of the rollout job's own batches before the
  ACK, which mixes in how batch costs drift over a run (the first batches
  warm the JVM up);
* the seconds the switch and install batches took beyond the baseline's
  (what the moves cost, whatever the batch size), and how they split over
  the Spark stages that read the source and run A and B, from each job's
  Spark event log, and the rest of the batch, split in turn by the phases
  of Spark's progress report that the job's metrics records carry
  (``phases_ms``): asking for offsets, planning, the driver's share of
  ``addBatch`` (what it took beyond the stages: scheduling, the sink), the
  offset and commit logs, and what no phase accounts for;
* every batch from the last one before the ACK to the first after MIGRATED,
  with the baseline's duration of the same batch.

    python bench/reconfiguration.py [--events 500000] [--moved-keys 10000]
        [--max-moves-per-wave 2600] [--warmup-batches 3] [--orders ...] [--repeats 3]
        [--broker embedded|kafka] [--source python|jvm]
        [--out FILE]

``--source jvm`` has Spark's Kafka connector read the events and route them in
the JVM (:mod:`keyplane.spark.connector_events`), on Apache Kafka only.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from _harness import (
    batch_stage_seconds,
    event_log_env,
    private_broker,
    read_topic,
    routed_on_backlog,
)
from _output import emit, load_average

from keyplane.control.controller import Controller
from keyplane.control.controller_protocol import Reconfiguration
from keyplane.control.operators import OPERATORS
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.migration_topic import count_moved_states
from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.routing.routedkeys import spark_partition
from keyplane.routing.waves import split_into_waves
from keyplane.spark.counts_job import job_command, read_output
from keyplane.testing import moved_off_hash_config, stage_keys_by_count

P = 4
Order = Literal["together", "one-by-one", "in waves"]
ORDERS: tuple[Order, ...] = ("together", "one-by-one", "in waves")
TIMEOUT_S = 300
PARTS = ("scan", "A", "B")
"""The Spark stages of a batch (bench/_harness.batch_stage_seconds)."""
DRIVER_PARTS = ("offsets", "planning", "addBatch beyond the stages", "logs", "other")
"""The rest of a batch, by Spark's phases (its metrics record's ``phases_ms``)."""
_PHASE_PARTS = {
    "latestOffset": "offsets",
    "getBatch": "offsets",
    "queryPlanning": "planning",
    "walCommit": "logs",
    "commitOffsets": "logs",
}


def roll_out(controller: Controller, order: Order, waves: Sequence[int]) -> list[Reconfiguration]:
    """Roll v2 out in ``order`` (the controller's own rollout, the paper's, or the
    controller's rollout of each version of ``waves`` in turn); each rollout's record."""
    done: list[Reconfiguration] = []

    def finished() -> None:
        assert controller.state is not None and controller.state.last is not None
        done.append(controller.state.last)

    if order == "one-by-one":
        controller.prepare(2)
        controller.wait_ack(TIMEOUT_S)
        for operator in OPERATORS:
            controller.propagate(operator)
            controller.wait_migrated(operator, TIMEOUT_S)
        controller.done()
        finished()
        return done
    for version in waves if order == "in waves" else (2,):
        controller.rollout(version, timeout_s=TIMEOUT_S)
        finished()
    return done


@dataclass(frozen=True)
class JobRun:
    """One job's run over the backlog, as :func:`run_on_backlog` observed it."""

    metrics: list[dict[str, Any]]
    """The job's metrics records, one per batch."""
    rollouts: list[Reconfiguration]
    """The controller's rollouts, in order (several for waves); none for the no-rollout job."""
    wall_s: float
    """The rollout's wall time; 0 for the no-rollout job."""
    moved_states: int
    exact: bool
    stages: dict[int, dict[str, float]]
    """Per batch, the seconds of the Spark stages that read the source and run A and B."""


def run_on_backlog(
    name: str,
    bootstrap: str,
    tmp: Path,
    store: Path,
    args: argparse.Namespace,
    truth: Any,
    order: Order | None,
    waves: Sequence[int] = (),
) -> JobRun:
    """Run one job over the whole backlog; after ``args.warmup_batches`` batches roll v2 out
    in ``order`` (if any)."""
    work = tmp / name
    settings = routed_on_backlog(
        bootstrap,
        "reconf",
        work,
        store,
        parallelism=P,
        batch=args.batch,
        events=args.events,
        source=args.source,
    )
    work.mkdir(parents=True)
    log = (work / "job.log").open("w")
    job = subprocess.Popen(
        job_command(settings),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=event_log_env(work / "events"),
    )
    rollouts: list[Reconfiguration] = []
    wall = 0.0
    if order is not None:
        while len(list((work / "out").glob("batch-*.parquet"))) < args.warmup_batches:
            if job.poll() is not None:
                raise RuntimeError((work / "job.log").read_text()[-3000:])
            time.sleep(0.2)
        started = time.monotonic()
        with ControlChannel(bootstrap, settings.control_topic) as channel:
            controller = Controller(channel, work / "controller.json", store)
            rollouts = roll_out(controller, order, waves)
            wall = time.monotonic() - started
    if job.wait(timeout=1800) != 0:
        raise RuntimeError((work / "job.log").read_text()[-3000:])
    return JobRun(
        metrics=read_topic(bootstrap, settings.metrics_topic),
        rollouts=rollouts,
        wall_s=wall,
        moved_states=count_moved_states(bootstrap, settings.migration_topic),
        exact=compare_counts(truth, read_output(work / "out")).exact,
        stages=batch_stage_seconds(work / "events"),
    )


def batch_seconds(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Each batch's duration, by batch id, from the job's metrics records."""
    return {m["plan"]: m["duration_ms"] / 1000 for m in metrics if m["rows"]}


def summed(seconds: dict[int, float], batches: list[int]) -> float:
    """The summed duration of ``batches``."""
    return sum(seconds[b] for b in batches)


def dip(baseline_s: float, rollout_s: float) -> str:
    """The throughput lost when the same events took ``rollout_s`` instead of ``baseline_s``."""
    return f"{1 - baseline_s / rollout_s:.0%}"


def extra_by_part(
    rollout: JobRun, baseline: JobRun, batches: list[int], extra_s: float
) -> dict[str, float]:
    """``extra_s``, the seconds ``batches`` took in ``rollout`` beyond ``baseline``, by part
    of the batch: reading the source, stage A, stage B, and the rest (planning, the sink,
    commits)."""
    out = {
        part: sum(rollout.stages[b][part] - baseline.stages[b][part] for b in batches)
        for part in PARTS
    }
    out["rest"] = extra_s - sum(out.values())
    return out


def driver_parts(
    metrics: list[dict[str, Any]], stages: dict[int, dict[str, float]]
) -> dict[int, dict[str, float]]:
    """Per batch, the seconds outside the stages of :data:`PARTS`, by :data:`DRIVER_PARTS`.

    ``addBatch`` runs the batch's Spark jobs and the sink, so what it took
    beyond the stages is the driver's share of it (scheduling, the sink's
    own work); ``other`` is what no phase accounts for. The parts add up to
    the batch's duration less its stages.
    """
    out: dict[int, dict[str, float]] = {}
    for m in metrics:
        if not m["rows"]:
            continue  # a batch with no rows repeats the last plan (batch_seconds)
        parts = dict.fromkeys(DRIVER_PARTS, 0.0)
        phases = m.get("phases_ms", {})
        for phase, part in _PHASE_PARTS.items():
            parts[part] += phases.get(phase, 0) / 1000
        stage_s = sum(stages.get(m["plan"], {}).get(part, 0.0) for part in PARTS)
        parts["addBatch beyond the stages"] = phases.get("addBatch", 0) / 1000 - stage_s
        parts["other"] = m["duration_ms"] / 1000 - stage_s - sum(parts.values())
        out[m["plan"]] = parts
    return out


def extra_by_driver_part(
    rollout: dict[int, dict[str, float]], baseline: dict[int, dict[str, float]], batches: list[int]
) -> dict[str, float]:
    """What ``batches`` took in ``rollout`` beyond ``baseline`` outside the stages, by part
    (both :func:`driver_parts`)."""
    return {
        part: sum(rollout[b][part] - baseline[b][part] for b in batches) for part in DRIVER_PARTS
    }


def measure(job: JobRun, no_rollout: JobRun) -> dict[str, Any]:
    """What ``job``'s rollout cost against ``no_rollout``, the same batches without one."""
    metrics = job.metrics
    baseline = batch_seconds(no_rollout.metrics)
    acks = [r.ack.batch_id for r in job.rollouts if r.ack is not None]
    assert acks and None not in acks, f"a rollout has no ACK batch: {job.rollouts}"
    acked = min(b for b in acks if b is not None)
    # Per operator, the batch of each rollout's MIGRATED: its install batch.
    installs = {
        op: sorted(
            b
            for r in job.rollouts
            if op in r.migrated and (b := r.migrated[op].batch_id) is not None
        )
        for op in OPERATORS
    }
    migrated = installs["B"][-1]
    switches = {b - 1 for op in installs for b in installs[op]}
    seconds = batch_seconds(metrics)
    before_ids = [b for b in seconds if 0 < b < acked]
    before = [seconds[b] for b in before_ids]
    pace = summed(baseline, before_ids) / summed(seconds, before_ids)
    # Outside the rollout: before the ACK, and after the batch that applies DONE.
    outside = [b for b in seconds if b in baseline and (0 < b < acked or b > migrated + 1)]
    pace_outside = summed(baseline, outside) / summed(seconds, outside)
    during = list(range(acked, migrated + 1))
    moving = sorted(switches | {b for op in installs for b in installs[op]})
    sums_moving = (summed(seconds, moving), summed(baseline, moving))
    sums_during = (summed(seconds, during), summed(baseline, during))

    def role(batch: int) -> str:
        roles = ["ACK"] if batch in acks else []
        roles += [f"{op} switch" for op in installs if batch + 1 in installs[op]]
        roles += [f"{op} install" for op in installs if batch in installs[op]]
        return ", ".join(roles)

    def parts(stages: dict[int, dict[str, float]], batch: int) -> str:
        return " / ".join(f"{stages.get(batch, {}).get(part, 0.0):.2f}" for part in PARTS)

    beyond = "addBatch beyond the stages"
    own_driver = driver_parts(metrics, job.stages)
    base_driver = driver_parts(no_rollout.metrics, no_rollout.stages)
    batches = [
        f"| {m['plan']} | {role(m['plan'])} | "
        f"{', '.join(f'{op} v{v}' for op, v in sorted(m['versions'].items()))} | "
        f"{m['rows']:,} | {m['duration_ms'] / 1000:.1f} | {baseline[m['plan']]:.1f} | "
        f"{parts(job.stages, m['plan'])} | {parts(no_rollout.stages, m['plan'])} | "
        f"{own_driver[m['plan']][beyond]:.2f} / {base_driver[m['plan']][beyond]:.2f} | "
        f"{m['moved_states']:,} |"
        for m in metrics
        # A record with no rows is a batch Spark ran only to advance the watermark
        # after the backlog's end: it repeats the last plan, and has no baseline.
        if acked - 1 <= m["plan"] <= migrated + 1 and m["rows"]
    ]
    return {
        "batches": migrated - acked + 1,
        "wall": job.wall_s,
        "moved": job.moved_states,
        "before": statistics.mean(before),
        "during": statistics.mean(seconds[b] for b in during),
        "moving": statistics.mean(seconds[b] for b in moving),
        # (rollout, baseline) summed seconds of the same batches.
        "sums_during": sums_during,
        "sums_moving": sums_moving,
        # The same, the rollout's seconds at the baseline's pace before the ACK.
        "paced_moving": (sums_moving[0] * pace, sums_moving[1]),
        "paced_during": (sums_during[0] * pace, sums_during[1]),
        "pace": pace,
        "pace_outside": pace_outside,
        "paced_outside_moving": (sums_moving[0] * pace_outside, sums_moving[1]),
        "paced_outside_during": (sums_during[0] * pace_outside, sums_during[1]),
        "exact": job.exact,
        "parts": extra_by_part(job, no_rollout, moving, sums_moving[0] - sums_moving[1]),
        "driver_parts": extra_by_driver_part(own_driver, base_driver, moving),
        "table": batches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 25 batches: room for the waves' 12 batches after the first 3.
    parser.add_argument("--events", type=int, default=500_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--moved-keys", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument(
        "--max-moves-per-wave",
        type=int,
        default=2_600,
        help="the most keys a wave of the `in waves` rollout moves",
    )
    parser.add_argument(
        "--orders", nargs="+", choices=ORDERS, default=list(ORDERS), help="rollout orders to run"
    )
    parser.add_argument(
        "--warmup-batches",
        type=int,
        default=3,
        help="batches each job runs before the rollout starts",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of the jobs")
    parser.add_argument(
        "--broker",
        choices=("embedded", "kafka"),
        default="embedded",
        help="the embedded broker, or Apache Kafka (one KRaft node)",
    )
    parser.add_argument(
        "--source",
        choices=("python", "jvm"),
        default="python",
        help="who reads the events: keyplane's source, or Spark's connector (Apache Kafka)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.source == "jvm" and args.broker != "kafka":
        parser.error("--source jvm reads through Spark's connector: run it with --broker kafka")

    spec = ZipfEvolvingWorkload(
        n_events=args.events, n_keys=args.keys, exponent=0.6, shifts=(0.9,), seed=12
    )
    truth = expected_counts(spec)
    a_keys, b_keys = stage_keys_by_count(truth)
    moved_a = a_keys[: args.moved_keys]

    v1 = RoutingConfig.all_hash(P, OPERATORS)
    v2 = moved_off_hash_config(2, {"A": moved_a, "B": b_keys}, P)
    # The same target as v2, in waves numbered from 3 (the first a child of v1).
    waves = split_into_waves(
        v1, v2.model_copy(update={"version": 3}), spark_partition, args.max_moves_per_wave
    )
    # The warm-up batches before the first ACK, 3 per wave, the DONE batch and one to spare.
    needed = args.warmup_batches + 3 * len(waves) + 2
    if "in waves" in args.orders and args.events // args.batch < needed:
        parser.error(
            f"--events {args.events} gives {args.events // args.batch} batches of {args.batch}; "
            f"{len(waves)} waves need {needed}: raise --events, or --max-moves-per-wave, "
            "or leave 'in waves' out of --orders"
        )
    loads = [load_average()]
    with private_broker(args.broker) as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "reconf", partitions=8)
        store = tmp / "store"
        save(v1, store)
        save(v2, store)
        for wave in waves:
            save(wave, store)
        baselines_exact = []
        results: dict[Order, list[dict[str, Any]]] = {order: [] for order in args.orders}
        jobs: list[Order | None] = [None, *args.orders]
        for run in range(args.repeats):
            # Each run starts with another job, so no job always runs first.
            shift = run % len(jobs)
            ran: dict[Order | None, JobRun] = {}
            for order in jobs[shift:] + jobs[:shift]:
                name = "no-rollout" if order is None else order.replace(" ", "-")
                ran[order] = run_on_backlog(
                    f"{name}-{run}",
                    bootstrap,
                    tmp,
                    store,
                    args,
                    truth,
                    order,
                    [wave.version for wave in waves],
                )
            loads.append(load_average())
            baselines_exact.append(ran[None].exact)
            for order in args.orders:
                results[order].append(measure(ran[order], ran[None]))

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(results[order]) for order in args.orders) + " |"

    def runs(value: Any) -> Any:
        """A cell: the value of each run, separated by slashes."""
        return lambda rs: " / ".join(value(r) for r in rs)

    def pooled(name: str) -> Any:
        """A cell: the dip over all runs' batches, then each run's in parentheses."""

        def cell(rs: list[dict[str, Any]]) -> str:
            total = dip(sum(r[name][1] for r in rs), sum(r[name][0] for r in rs))
            each = ", ".join(dip(r[name][1], r[name][0]) for r in rs)
            return f"**{total}**" if len(rs) == 1 else f"**{total}** ({each})"

        return cell

    def per_thousand_moved(rs: list[dict[str, Any]]) -> str:
        """A cell: the extra ms of the switch and install batches per 1,000 moved states."""
        each = [
            1000 * (r["sums_moving"][0] - r["sums_moving"][1]) / r["moved"] * 1000
            for r in rs
            if r["moved"]
        ]
        if not each:
            return "no state moved"
        runs_ = ", ".join(f"{ms:+.0f}" for ms in each)
        return f"**{statistics.median(each):+.0f}** ({min(each):+.0f} to {max(each):+.0f}); {runs_}"

    lines = [
        f"events: {args.events:,} zipf-evolving ({args.keys:,} keys, s = 0.6), "
        f"{args.batch:,} per batch, {P} instances, local[2]; v2 moves {len(moved_a):,} stage-A "
        f"keys and {len(b_keys)} stage-B keys; {args.repeats} run(s) of the "
        f"{1 + len(args.orders)} jobs on "
        + ("Apache Kafka (one KRaft node)" if args.broker == "kafka" else "the embedded broker")
        + (
            f"; in waves: {len(waves)} waves of at most {args.max_moves_per_wave:,} moved keys"
            if "in waves" in args.orders
            else ""
        )
        + " (cells with several values: one per run)",
        "load average (1, 5, 15 min) before the runs and after each run: " + " | ".join(loads),
        "",
        "| measure | " + " | ".join(args.orders) + " |",
        "|---|" + "---:|" * len(args.orders),
        row(
            "micro-batches ACK → MIGRATED(B) (+1 applies DONE)",
            runs(lambda r: f"{r['batches']} (+1)"),
        ),
        row("rollout wall time, s", runs(lambda r: f"{r['wall']:.1f}")),
        row("states moved (through the migration topic)", runs(lambda r: f"{r['moved']:,}")),
        row(
            "throughput dip, switch and install batches, vs the same batches without a rollout",
            pooled("sums_moving"),
        ),
        row(
            "throughput dip, ACK → MIGRATED(B), vs the same batches without a rollout",
            pooled("sums_during"),
        ),
        row(
            "the rollout job's pace before the ACK, against the baseline's (1.00: as fast)",
            runs(lambda r: f"{r['pace']:.2f}"),
        ),
        row(
            "throughput dip, switch and install batches, vs the same batches without a "
            "rollout, each job at its own pace before the ACK",
            pooled("paced_moving"),
        ),
        row(
            "throughput dip, ACK → MIGRATED(B), vs the same batches without a rollout, "
            "each job at its own pace before the ACK",
            pooled("paced_during"),
        ),
        row(
            "the rollout job's pace outside the rollout (before the ACK, after DONE), "
            "against the baseline's",
            runs(lambda r: f"{r['pace_outside']:.2f}"),
        ),
        row(
            "throughput dip, switch and install batches, each job at its own pace outside "
            "the rollout",
            pooled("paced_outside_moving"),
        ),
        row(
            "throughput dip, ACK → MIGRATED(B), each job at its own pace outside the rollout",
            pooled("paced_outside_during"),
        ),
        row(
            "seconds the switch and install batches took beyond the same batches without "
            "a rollout (the moves' cost, whatever the batch size)",
            runs(lambda r: f"{r['sums_moving'][0] - r['sums_moving'][1]:+.1f}"),
        ),
        row(
            "the moves' cost in milliseconds per 1,000 moved keys: median (min–max); runs",
            per_thousand_moved,
        ),
        row(
            "of which reading the source ; stage A ; stage B ; the rest (Spark's event log)",
            runs(lambda r: " ; ".join(f"{r['parts'][p]:+.2f}" for p in (*PARTS, "rest"))),
        ),
        row(
            "of which the rest: " + " ; ".join(DRIVER_PARTS) + " (Spark's progress reports)",
            runs(lambda r: " ; ".join(f"{r['driver_parts'][p]:+.2f}" for p in DRIVER_PARTS)),
        ),
        row(
            "throughput dip, switch and install batches, vs the batches before the ACK",
            runs(lambda r: dip(r["before"], r["moving"])),
        ),
        row(
            "throughput dip, ACK → MIGRATED(B), vs the batches before the ACK",
            runs(lambda r: dip(r["before"], r["during"])),
        ),
        row("counts exact", runs(lambda r: str(r["exact"]))),
        "",
        f"The no-rollout jobs' counts exact: {' / '.join(map(str, baselines_exact))}.",
    ]
    for order in args.orders:
        lines += [
            "",
            f"{order}, first run:",
            "",
            "| batch | rollout | routing | rows | batch s | baseline s "
            "| source / A / B s | baseline's | addBatch beyond the stages s, rollout / baseline "
            "| states moved out |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *results[order][0]["table"],
        ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
