"""How long the routed job takes from its process start to its first committed batches.

Every restart of the job pays this: a driver crash, ``keyplane job start``,
and each of the eight restarts of the driver-fault test (which is why that
test is the suite's longest). The job is started as users start it, on a
backlog, and the times are read from Spark's own checkpoint: when the offset
log holds batch N (planned) and when the commit log does (committed). The
first batch is where PySpark starts its Python workers and the state stores
are created; the batches after it show the warm cost for comparison.

    python bench/cold_start.py [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

from _harness import private_broker
from _output import emit

from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import routed_job_topics, start_job_process, wait_while_job_runs

BATCHES = 3
MARKS = [(log, batch) for batch in range(BATCHES) for log in ("offsets", "commits")]


def one_start(bootstrap: str, tmp: Path, index: int, timeout_s: float = 600.0) -> dict[str, float]:
    """Seconds from the job's spawn to each entry of :data:`MARKS` in its checkpoint."""
    topic = f"events-{index}"
    produce_workload(
        ZipfEvolvingWorkload(n_keys=200, n_events=2_000, seed=index), bootstrap, topic, partitions=2
    )
    store = tmp / f"routing-{index}"
    save(RoutingConfig.all_hash(4, OPERATORS), store)
    checkpoint = tmp / f"checkpoint-{index}"
    settings = CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic=topic,
        checkpoint=checkpoint,
        output=tmp / f"output-{index}",
        shuffle_partitions=4,
        max_offsets_per_trigger=500,
        trigger_interval="0 seconds",
        routing_store=store,
        routing_version=1,
        **routed_job_topics(topic),
    )
    seen: dict[str, float] = {}

    def all_marks_seen() -> bool:
        for log, batch in MARKS:
            name = f"{log} {batch}"
            if name not in seen and (checkpoint / log / str(batch)).exists():
                seen[name] = time.monotonic() - started
        return len(seen) == len(MARKS)

    started = time.monotonic()
    job = start_job_process(settings, tmp / f"job-{index}.log")
    try:
        wait_while_job_runs(
            all_marks_seen,
            f"batch {BATCHES - 1}",
            job,
            tmp / f"job-{index}.log",
            timeout_s=timeout_s,
            poll_s=0.05,
        )
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    with private_broker() as (bootstrap, tmp):
        for index in range(args.repeats):
            runs.append(one_start(bootstrap, tmp, index))
            print(
                f"start {index + 1}/{args.repeats}: "
                + ", ".join(f"{k} {v:.1f} s" for k, v in runs[-1].items()),
                flush=True,
            )
    lines = [
        f"Routed job, 2 partitions, 500 events per batch, {args.repeats} starts, "
        "each on a fresh checkpoint.",
        "",
        "| from spawn to | median s | min s | max s |",
        "|---|---|---|---|",
    ]
    for log, batch in MARKS:
        name = f"{log} {batch}"
        values = [run[name] for run in runs]
        what = "planned" if log == "offsets" else "committed"
        median = statistics.median(values)
        lines.append(
            f"| batch {batch} {what} | {median:.1f} | {min(values):.1f} | {max(values):.1f} |"
        )
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
