"""The routed job's driver time per micro-batch against the keys a batch updates, on Apache Kafka.

The routed job's sink, at its default writer ``auto``, gathers a small batch
on the driver and splits a large one: the tasks of the batch's last stage
write the output file's parts and the protocol records, the driver adds up
one summary row per task and renames the file into place. Whatever the
driver still did per updated key would show here as driver time that grows
with the keys a batch updates. For each size N (default 10,000,
100,000 and 1,000,000), a topic of ``--batches`` × N pairs events over 10 N
keys, read N events a batch, so each batch updates about 0.95 N keys of each
stage. The job is the routed job as ``keyplane job start`` runs it (all-hash
v1, stages in the JVM), 4 instances, ``local[2]``.

A batch's **driver time** is its duration less the wall time of its Spark
stages that read the source, run the two keyed stages and write the output (from Spark's event
log, :func:`_harness.batch_stage_seconds`); it is split by Spark's phases as
``bench/reconfiguration.py`` splits it (:func:`reconfiguration.driver_parts`),
``addBatch beyond the stages`` being the sink's own work. Updated keys are the
rows of the batch's output file (partial counts of both stages). The first
batch of each run (start-up) is left out. Goal: the driver time per batch
stays within 1.5× from 10,000 to 1,000,000 updated keys.

    python bench/driver_keys.py [--keys 10000 100000 1000000] [--batches 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _harness import (
    batch_stage_seconds,
    event_log_env,
    private_broker,
    read_topic,
    routed_on_backlog,
    run_job,
)
from _output import emit
from reconfiguration import driver_parts

from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.util.parquet_files import parquet_rows

P = 4
SPREAD = 10
"""Keys in each field per event of a batch: N events over 10 N keys update about 0.95 N."""
BEYOND = "addBatch beyond the stages"


def measure(bootstrap: str, tmp: Path, n: int, batches: int) -> list[dict[str, float]]:
    """One run of the routed job over ``batches`` batches of ``n`` events; per steady batch,
    its updated keys, duration, stage time, driver time and the sink's share of it."""
    topic = f"keys-{n}"
    spec = PairsWorkload(n_events=n * batches, n_keys=SPREAD * n, relabel_b=True, seed=5)
    produce_workload(spec, bootstrap, topic, partitions=8)
    work = tmp / topic
    store = work / "store"
    save(RoutingConfig.all_hash(P, OPERATORS), store)
    settings = routed_on_backlog(
        bootstrap, topic, work, store, parallelism=P, batch=n, events=n * batches
    )
    run_job(settings, event_log_env(work / "events"))
    metrics = [m for m in read_topic(bootstrap, settings.metrics_topic) if m["rows"]]
    if any(m["plan"] != m["batch_id"] for m in metrics):
        raise RuntimeError("a batch's plan is not its id: the run restarted")
    stages = batch_stage_seconds(work / "events")
    parts = driver_parts(metrics, stages)
    out = []
    for m in sorted(metrics, key=lambda m: m["batch_id"])[1:]:
        b = m["batch_id"]
        output = work / "out" / f"batch-{b:08d}.parquet"
        duration = m["duration_ms"] / 1000
        driver = sum(parts[b].values())
        out.append(
            {
                "keys": parquet_rows(output),
                "rows": m["rows"],
                "batch_s": duration,
                "stages_s": duration - driver,
                "driver_s": driver,
                "sink_s": parts[b][BEYOND],
            }
        )
    return out


def med(rows: list[dict[str, float]], field: str) -> float:
    return statistics.median(r[field] for r in rows)


def report(results: dict[int, list[dict[str, float]] | str], batches: int) -> str:
    """The result table of the sizes measured so far."""
    lines = [
        f"Apache Kafka (one KRaft node), routed job (all-hash v1, JVM stages), {P} instances, "
        f"local[2]; per size, {batches} batches of N pairs events over {SPREAD} N keys, the "
        "first left out; medians over the steady batches",
        "",
        "| events a batch | updated keys a batch | batch s | stages s | driver s | "
        "of it the sink (addBatch beyond the stages) s | driver ms per 1,000 keys |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    measured: dict[int, float] = {}
    for n, rows in results.items():
        if isinstance(rows, str):
            lines.append(f"| {n:,} | failed: {rows} | | | | | |")
            continue
        measured[n] = med(rows, "driver_s")
        lines.append(
            f"| {n:,} | {med(rows, 'keys'):,.0f} | {med(rows, 'batch_s'):.2f} | "
            f"{med(rows, 'stages_s'):.2f} | {measured[n]:.2f} | {med(rows, 'sink_s'):.2f} | "
            f"{1e6 * measured[n] / med(rows, 'keys'):.2f} |"
        )
    if len(measured) >= 2:
        low, high = min(measured), max(measured)
        lines += [
            "",
            f"driver time per batch at {high:,} / at {low:,} events a batch: "
            f"**{measured[high] / measured[low]:.2f}×** (goal ≤ 1.5×)",
        ]
    lines += [
        "",
        "each batch: "
        + "; ".join(
            f"{n:,}: " + ", ".join(f"{r['keys']:,.0f} keys {r['driver_s']:.2f} s" for r in rows)
            for n, rows in results.items()
            if not isinstance(rows, str)
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument(
        "--batches", type=int, default=3, help="batches per run, the first left out"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.batches < 2:
        parser.error("--batches must be at least 2: the first batch is left out")

    results: dict[int, list[dict[str, float]] | str] = {}
    with private_broker("kafka") as (bootstrap, tmp):
        for n in sorted(args.keys):
            try:
                results[n] = measure(bootstrap, tmp, n, args.batches)
            except RuntimeError as error:
                results[n] = str(error).splitlines()[0]
            print(f"{n:,} events a batch: {results[n]}", flush=True)
            if args.out is not None:  # what is measured so far, should a larger size not end
                args.out.write_text(report(results, args.batches) + "\n")
    emit(report(results, args.batches), args.out)


if __name__ == "__main__":
    main()
