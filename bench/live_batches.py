"""The routed job on a live topic: Spark's batches without input, off (keyplane) and on.

Stage A runs in event-time mode, so after each batch that moves the
watermark on Spark runs one more batch, with no input, unless
``spark.sql.streaming.noDataMicroBatches.enabled`` is false; keyplane sets
it false because neither stage keeps a timer
(``keyplane.spark.counts_job._no_batches_without_data``). Here the routed
job reads a topic that a sender fills chunk by chunk, as a live topic
fills, once as keyplane runs it and once with the setting true in the
Spark configuration (``spark-defaults.conf``, as a user would set it),
taking turns. The sender starts once the job's first batch is done. Each
run's batches after the first are read from its metrics topic, one record
per batch: how many ran, how many read no events, and how long they took in
all.

    python bench/live_batches.py [--chunks 30] [--chunk-events 1000] [--pause 2.0]
                                 [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

from _harness import private_broker, read_topic, routed_on_backlog, run_job, spark_conf_env
from _output import emit

from keyplane.config import RoutingConfig, save
from keyplane.kafka.admin import TopicError, ensure_topic, high_watermarks
from keyplane.kafka.producer import produce_workload
from keyplane.spark.counts_job import NO_DATA_BATCHES_KEY
from keyplane.workloads import ZipfEvolvingWorkload

P = 4
VARIANTS: dict[str, dict[str, str]] = {
    "keyplane: a batch only for new input": {},
    "Spark's default: a batch without input after each": {NO_DATA_BATCHES_KEY: "true"},
}


def send_chunk(bootstrap: str, topic: str, chunk: int, events: int) -> None:
    spec = ZipfEvolvingWorkload(n_keys=2_000, exponent=0.8, n_events=events, seed=chunk)
    produce_workload(spec, bootstrap, topic, partitions=2)


def send_live(bootstrap: str, topic: str, metrics_topic: str, args: argparse.Namespace) -> None:
    """Chunks 1.. of the topic, ``--pause`` apart, once the job's first batch (chunk 0) is done."""
    deadline = time.monotonic() + 300
    while not _published(bootstrap, metrics_topic):
        if time.monotonic() > deadline:
            raise TimeoutError("the job ran no batch in 300 s")
        time.sleep(0.5)
    for chunk in range(1, args.chunks):
        send_chunk(bootstrap, topic, chunk, args.chunk_events)
        time.sleep(args.pause)


def _published(bootstrap: str, topic: str) -> bool:
    try:
        return sum(high_watermarks(bootstrap, topic).values()) > 0
    except TopicError:  # the job has not created it yet
        return False


def one_run(bootstrap: str, work: Path, args: argparse.Namespace, conf: dict[str, str]) -> dict:
    """One live run of the routed job; its batches as its metrics topic reports them."""
    topic = f"live-{work.name}"
    store = work / "routing"
    save(RoutingConfig.all_hash(P, ("A", "B")), store)
    ensure_topic(bootstrap, topic, 2)
    total = args.chunks * args.chunk_events
    settings = routed_on_backlog(
        bootstrap, topic, work, store, parallelism=P, batch=100_000, events=total
    )
    send_chunk(bootstrap, topic, 0, args.chunk_events)
    sender = threading.Thread(
        target=send_live, args=(bootstrap, topic, settings.metrics_topic, args)
    )
    sender.start()
    run_job(settings, spark_conf_env(work / "conf", conf) if conf else None)
    sender.join()
    records: list[dict[str, Any]] = read_topic(bootstrap, settings.metrics_topic)
    batches = {r["batch_id"]: r for r in records}
    read = sum(r["rows"] for r in batches.values())
    if read != total:
        raise RuntimeError(f"{work.name}: the job read {read} events of {total}")
    del batches[min(batches)]  # the first starts the JVM and reads chunk 0
    return {
        "batches": len(batches),
        "empty": sum(1 for r in batches.values() if r["rows"] == 0),
        "seconds": sum(r["duration_ms"] for r in batches.values()) / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=30)
    parser.add_argument("--chunk-events", type=int, default=1_000)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between chunks")
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
    keyplane, spark_default = VARIANTS
    lines = [
        f"events: {args.chunks} chunks of {args.chunk_events:,} zipf-evolving events, "
        f"{args.pause:g} s apart, into a 2-partition topic; the routed job ({P} instances, "
        f"local[2], 1-second trigger) reads them live; {args.repeats} run(s) of each "
        "setting, taking turns; every event read once",
        "",
        "| setting | batches (runs) | of them without events | summed batch s (runs) |",
        "|---|---:|---:|---:|",
        *(
            f"| {variant} | {', '.join(str(r['batches']) for r in rs)} "
            f"| {', '.join(str(r['empty']) for r in rs)} "
            f"| {summed[variant]:.1f} ({', '.join(format(r['seconds'], '.1f') for r in rs)}) |"
            for variant, rs in runs.items()
        ),
        "",
        f"summed batch time, Spark's default / keyplane: "
        f"**{summed[spark_default] / summed[keyplane]:.2f}×**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
