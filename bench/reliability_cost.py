"""The cost of reliability (paper 002): the routed job with each delivery mechanism on and off.

Paper 002 §IV measures what Storm's acking costs: every tuple produces acker
messages, which can be over half of the network traffic. keyplane's
guarantees come from other mechanisms, and each has a price of its own; this
benchmark runs the routed job over the same backlog once per variant, each
in its own process, one after the other in one run, and reports steady
throughput and the p50/p99 micro-batch duration next to the baseline's:

* ``baseline``: keyplane's defaults: idempotent producers with ``acks=all``,
  a checkpoint every ``--batch`` events (one micro-batch), the control protocol
  read at every batch boundary, results sent to a results topic;
* ``idempotence off``: ``acks=all``, no producer ids or sequence numbers;
* ``acks=1``: the leader's ack only (idempotence off, as Kafka requires);
* ``checkpoint every batch/4``: four times as many checkpoints. Structured
  Streaming writes the offset log before a batch, and the commit log and
  each state store's changes after it, so a checkpoint is a micro-batch: its
  interval is the trigger interval, or, on a backlog as here, the batch cap
  (``maxOffsetsPerTrigger``). ``minBatchesToRetain`` and the state store's
  maintenance interval only decide how long old versions are kept and when
  they are deleted, in the background, so they change disk use, not the cost
  per batch;
* ``no control protocol``: the unrouted two-stage job: no control-topic read
  at batch boundaries, no ACK/MIGRATED replies, no metrics records, no
  hand-off rows (it also drops the routing itself, so it is an upper bound
  of the protocol's cost).

It then sizes and places keyplane's system tasks with the OPW/IQ planner
(:func:`keyplane.algorithms.placement.plan_system_tasks`, 002 §V) for the distributed
deployment, and measures their share of the job's messages.

    python bench/reliability_cost.py [--events 60000] [--batch 20000] [--parallel] [--out FILE]

``--parallel`` runs the five variants at the same time: on a machine whose
load changes from minute to minute, that keeps the conditions the same for
all of them (the ratios), at the price of lower absolute rates.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import percentile, private_broker, read_topic, run_job, steady_rate
from _output import emit

from keyplane.algorithms.placement import plan_system_tasks
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import routed_job_topics

BATCH = 20_000
SYSTEM_TASKS = ("metrics emitter", "control listener", "ack collector")
DEPLOYMENT = {
    "keyplane-job": ["driver"],
    "spark-worker-1": ["executor-1"],
    "spark-worker-2": ["executor-2"],
}
"""docker-compose.yml: the driver's container and two standalone workers, one executor each."""
PLACEABLE = {"keyplane-job": ["driver"]}
"""Where keyplane's system tasks can run at all: a query's source planning and its listeners
run in its one driver, and Spark schedules executor tasks without keyplane's say."""


@dataclass(frozen=True)
class Variant:
    name: str
    routed: bool = True
    acks: str = "all"
    idempotent: bool = True
    checkpoints_per_batch: int = 1


def variants(batch: int) -> tuple[Variant, ...]:
    return (
        Variant("baseline"),
        Variant("idempotence off", idempotent=False),
        Variant("acks=1", acks="1", idempotent=False),
        Variant(f"checkpoint every {batch // 4:,}", checkpoints_per_batch=4),
        Variant("no control protocol", routed=False),
    )


def settings(
    bootstrap: str, tmp: Path, variant: Variant, total: int, batch: int
) -> CountsJobSettings:
    tag = variant.name.replace(" ", "-").replace(",", "").replace("=", "")
    return CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic="reliability",
        results_topic=f"{tag}.results",
        checkpoint=tmp / f"ck-{tag}",
        output=tmp / f"out-{tag}",
        max_offsets_per_trigger=batch // variant.checkpoints_per_batch,
        stop_at_offset_total=total,
        producer_acks=variant.acks,
        producer_idempotent=variant.idempotent,
        routing_store=tmp / "store" if variant.routed else None,
        **(routed_job_topics(tag) if variant.routed else {}),
    )


def run_with_one_retry(
    job: CountsJobSettings, name: str, retried: list[str]
) -> list[dict[str, Any]]:
    """Run the job; once more from its checkpoint if it failed (a Python worker that could
    not connect back in time, on a crowded machine). The retry resumes exactly where the
    last committed batch ended, so it measures the batches that are left."""
    try:
        return run_job(job)
    except RuntimeError as failure:
        print(f"{name}: {str(failure).splitlines()[-1][:200]}; retrying from the checkpoint")
        retried.append(name)
        return run_job(job)


def durations_s(progress: list[dict[str, Any]]) -> list[float]:
    """Batch durations in seconds, the first batch (JVM and worker start-up) excluded."""
    return [p["duration_ms"] / 1000 for p in (progress[1:] or progress)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=BATCH, help="events per micro-batch")
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="run the variants at the same time (a crowded machine: same conditions for all)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--raw", type=Path, help="keep every variant's batch reports as JSON")
    args = parser.parse_args()

    chosen = variants(args.batch)
    spec = ZipfEvolvingWorkload(n_events=args.events, n_keys=args.keys, exponent=0.6, seed=5)
    with private_broker() as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "reliability", partitions=8)
        results: dict[str, list[dict[str, Any]]] = {}
        system_records: dict[str, int] = {}
        retried: list[str] = []
        jobs = {v.name: settings(bootstrap, tmp, v, args.events, args.batch) for v in chosen}
        if args.parallel:
            with ThreadPoolExecutor(len(chosen)) as pool:
                running = {
                    name: pool.submit(run_with_one_retry, job, name, retried)
                    for name, job in jobs.items()
                }
                results = {name: future.result() for name, future in running.items()}
        else:
            for name, job in jobs.items():
                results[name] = run_with_one_retry(job, name, retried)
        for variant in chosen:
            job = jobs[variant.name]
            if variant.routed:
                assert job.metrics_topic and job.control_topic
                system_records[variant.name] = len(read_topic(bootstrap, job.metrics_topic)) + sum(
                    high_watermarks(bootstrap, job.control_topic).values()
                )

    if args.raw is not None:
        args.raw.write_text(json.dumps({"progress": results, "system_records": system_records}))
    base = results["baseline"]
    base_rate = steady_rate(base)
    base_p50 = percentile(durations_s(base), 50)
    rows = []
    for variant in chosen:
        progress = results[variant.name]
        rate, d = steady_rate(progress), durations_s(progress)
        p50, p99 = percentile(d, 50), percentile(d, 99)
        rows.append(
            f"| {variant.name} | {len(progress)} | {rate:,.0f} | {rate / base_rate:.2f} | "
            f"{p50:.1f} | {p99:.1f} | {p50 / base_p50:.2f} |"
        )
    opw = plan_system_tasks(DEPLOYMENT, "opw", SYSTEM_TASKS)
    iq = plan_system_tasks(DEPLOYMENT, "iq", SYSTEM_TASKS)
    placeable = plan_system_tasks(PLACEABLE, "opw", SYSTEM_TASKS)
    batches = len(base)
    lines = [
        f"events: {args.events:,} zipf-evolving ({args.keys:,} keys, s = 0.6) in 8 partitions, "
        f"{args.batch:,} per micro-batch, routed job with 4 instances, local[2], embedded broker "
        "(one node, so acks=all and acks=1 wait for the same single replica); variants run "
        + ("at the same time" if args.parallel else "one after the other"),
        "",
        "| variant | batches | steady rows/s | vs baseline | p50 batch s | p99 batch s "
        "| p50 vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"variants retried once from their checkpoint: {', '.join(retried) or 'none'}",
        "",
        f"system records of the baseline (metrics + control topic): "
        f"{system_records['baseline']:,} for {args.events:,} events in {batches} batches "
        f"({system_records['baseline'] / args.events:.2%} of the input records)",
        "",
        f"OPW/IQ planner on the distributed deployment ({', '.join(DEPLOYMENT)}): "
        f"OPW places {len(opw.instances)} replicas, one of each task per worker; "
        f"IQ places the same {len(iq.instances)} in {len(iq.dedicated_workers)} dedicated "
        f"workers ({', '.join(iq.dedicated_workers)}); where Spark lets keyplane place them "
        f"(the driver only), OPW gives {len(placeable.instances)} replicas: "
        + ", ".join(f"{i.task} on {i.worker}" for i in placeable.instances),
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
