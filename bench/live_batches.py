"""The routed job on a live topic: Spark's batches without input, off (keyplane) and on.

On a checkpoint whose stage A runs in event-time mode, as earlier versions
of keyplane wrote them and as this bench starts its own (a new checkpoint
has no time mode and no watermark, ``keyplane.spark.watermark``), after a
batch that moves the watermark on Spark runs one more batch, with no input, unless
``spark.sql.streaming.noDataMicroBatches.enabled`` is false; keyplane sets
it false because neither stage keeps a timer
(``keyplane.spark.counts_job._no_batches_without_data``). While the
watermark followed the events' times it moved after every batch, and
Spark's default doubled the batches; it now follows one time on every row
(``keyplane.spark.watermark``) and moves once in a checkpoint's life, so
the default adds one batch per checkpoint. Here the routed
job reads a topic that a sender fills chunk by chunk, as a live topic
fills, once as keyplane runs it and once with the setting true in the
Spark configuration (``spark-defaults.conf``, as a user would set it),
taking turns. The sender starts once the job's first batch is done. Each
run's batches after the first are read from its metrics topic, one record
per batch: how many ran, how many read no events, how long they took in
all, and how long each chunk waited, from the broker's acknowledgement to
the end of the batch that finished reading it.

    python bench/live_batches.py [--chunks 30] [--chunk-events 1000] [--pause 2.0]
                                 [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _harness import (
    percentile,
    private_broker,
    read_topic,
    routed_on_backlog,
    run_job,
    spark_conf_env,
)
from _output import emit

from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import TopicError, ensure_topic, high_watermarks
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.counts_job import NO_DATA_BATCHES_KEY

P = 4
VARIANTS: dict[str, dict[str, str]] = {
    "keyplane: a batch only for new input": {},
    "Spark's default: a batch without input when the watermark moves": {
        NO_DATA_BATCHES_KEY: "true"
    },
}


def send_chunk(bootstrap: str, topic: str, chunk: int, events: int) -> None:
    spec = ZipfEvolvingWorkload(n_keys=2_000, exponent=0.8, n_events=events, seed=chunk)
    produce_workload(spec, bootstrap, topic, partitions=2)


def send_live(
    bootstrap: str, topic: str, metrics_topic: str, args: argparse.Namespace, sent: list[float]
) -> None:
    """Chunks 1.. of the topic, ``--pause`` apart, once the job's first batch (chunk 0) is
    done; ``sent`` receives the time each chunk was acknowledged (epoch seconds)."""
    deadline = time.monotonic() + 300
    while not _published(bootstrap, metrics_topic):
        if time.monotonic() > deadline:
            raise TimeoutError("the job ran no batch in 300 s")
        time.sleep(0.5)
    # A random part of each pause spreads the chunks over the trigger's interval: with
    # fixed pauses they arrive at one phase of it, and that phase, not the setting,
    # would decide how long they wait. Every run draws the same pauses.
    jitter = random.Random(0)
    for chunk in range(1, args.chunks):
        send_chunk(bootstrap, topic, chunk, args.chunk_events)
        sent.append(time.time())
        time.sleep(args.pause + jitter.random())


def _published(bootstrap: str, topic: str) -> bool:
    try:
        return sum(high_watermarks(bootstrap, topic).values()) > 0
    except TopicError:  # the job has not created it yet
        return False


def one_run(bootstrap: str, work: Path, args: argparse.Namespace, conf: dict[str, str]) -> dict:
    """One live run of the routed job; its batches as its metrics topic reports them."""
    topic = f"live-{work.name}"
    store = work / "routing"
    save(RoutingConfig.all_hash(P, OPERATORS), store)
    ensure_topic(bootstrap, topic, 2)
    total = args.chunks * args.chunk_events
    settings = routed_on_backlog(
        bootstrap, topic, work, store, parallelism=P, batch=100_000, events=total
    ).model_copy(update={"new_checkpoint_time_mode": "EventTime"})
    send_chunk(bootstrap, topic, 0, args.chunk_events)
    sent: list[float] = []
    sender = threading.Thread(
        target=send_live, args=(bootstrap, topic, settings.metrics_topic, args, sent)
    )
    sender.start()
    run_job(settings, spark_conf_env(work / "conf", conf) if conf else None)
    sender.join()
    records: list[dict[str, Any]] = read_topic(bootstrap, settings.metrics_topic)
    batches = {r["batch_id"]: r for r in records}
    read = sum(r["rows"] for r in batches.values())
    if read != total:
        raise RuntimeError(f"{work.name}: the job read {read} events of {total}")
    latencies = chunk_latencies(list(batches.values()), sent, args.chunk_events)
    del batches[min(batches)]  # the first starts the JVM and reads chunk 0
    return {
        "batches": len(batches),
        "empty": sum(1 for r in batches.values() if r["rows"] == 0),
        "seconds": sum(r["duration_ms"] for r in batches.values()) / 1000,
        "latencies": latencies,
    }


def chunk_latencies(records: list[dict[str, Any]], sent: list[float], events: int) -> list[float]:
    """Seconds from each chunk's acknowledgement to the end of the batch that finished reading
    it: chunk i (from 1) is read once the batches have read (i + 1) chunks' events."""
    ends: list[tuple[int, float]] = []
    read = 0
    for r in sorted(records, key=lambda r: r["batch_id"]):
        read += r["rows"]
        started = datetime.fromisoformat(r["started_at"]).timestamp()
        ends.append((read, started + r["duration_ms"] / 1000))
    return [
        next(end for total, end in ends if total >= (chunk + 2) * events) - at
        for chunk, at in enumerate(sent)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=30)
    parser.add_argument("--chunk-events", type=int, default=1_000)
    parser.add_argument(
        "--pause", type=float, default=2.0, help="seconds between chunks, plus 0-1 s at random"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    with private_broker() as (bootstrap, tmp):
        for repeat in range(args.repeats):
            for i, (variant, conf) in enumerate(VARIANTS.items()):
                runs[variant].append(one_run(bootstrap, tmp / f"r{repeat}v{i}", args, conf))
                print(variant, runs[variant][-1], flush=True)
    summed = {v: sum(r["seconds"] for r in rs) for v, rs in runs.items()}
    waits = {v: [w for r in rs for w in r["latencies"]] for v, rs in runs.items()}
    keyplane, spark_default = VARIANTS
    lines = [
        f"events: {args.chunks} chunks of {args.chunk_events:,} zipf-evolving events, "
        f"{args.pause:g}-{args.pause + 1:g} s apart, into a 2-partition topic; "
        f"the routed job ({P} instances, local[2], 1-second trigger) reads them live; "
        f"{args.repeats} run(s) of each setting, taking turns; every event read once",
        "",
        "| setting | batches (runs) | of them without events | summed batch s (runs) "
        "| chunk to counted, median s | p90 s |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {variant} | {', '.join(str(r['batches']) for r in rs)} "
            f"| {', '.join(str(r['empty']) for r in rs)} "
            f"| {summed[variant]:.1f} ({', '.join(format(r['seconds'], '.1f') for r in rs)}) "
            f"| {statistics.median(waits[variant]):.2f} | {percentile(waits[variant], 90):.2f} |"
            for variant, rs in runs.items()
        ),
        "",
        f"summed batch time, Spark's default / keyplane: "
        f"**{summed[spark_default] / summed[keyplane]:.2f}×**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
