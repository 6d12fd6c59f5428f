"""The main job: one command that shows keyplane's data path end to end.

It starts the embedded broker (unless Kafka is configured), streams a
generated workload into a fresh topic while the two-stage counting job
consumes it, prints one progress line per micro-batch (rows/s, batch
duration, lag), and ends with a summary that checks every count against the
generator's ground truth. Each run uses its own topic and checkpoint, so the
command can be repeated safely.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
from tqdm import tqdm

from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import produce_workload
from keyplane.settings import Settings
from keyplane.spark.counts_job import (
    PROGRESS_PREFIX,
    BatchProgress,
    CountsJobSettings,
    job_command,
    read_output,
)
from keyplane.verification import CountReport, compare_counts, expected_counts
from keyplane.workloads import WorkloadSpec

Echo = Callable[[str], None]


@dataclass(frozen=True)
class DemoResult:
    events: int
    batches: list[BatchProgress]
    report: CountReport
    wall_s: float


def run_demo(
    spec: WorkloadSpec,
    settings: Settings,
    *,
    rate: float | None = 20_000,
    partitions: int = 8,
    max_offsets_per_trigger: int = 20_000,
    echo: Echo = print,
) -> DemoResult:
    started = time.monotonic()
    run_id = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (settings.home / "demo" / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker(settings.home, settings.broker_port)
    own_broker = settings.bootstrap_servers is None and broker.status() is None
    if own_broker:
        state = broker.start()
        echo(f"broker   started embedded broker on {state.bootstrap_servers} (pid {state.pid})")
    bootstrap = settings.resolved_bootstrap_servers()
    topic = f"{settings.events_topic}.demo-{run_id}"
    try:
        ensure_topic(bootstrap, topic, partitions)
        echo(f"topic    {topic} ({partitions} partitions)")
        echo(f"workload {spec.kind}: {spec.n_events:,} events, seed {spec.seed}")
        log_path = run_dir / "job.log"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
        cmd = job_command(
            CountsJobSettings(
                bootstrap_servers=bootstrap,
                events_topic=topic,
                checkpoint=run_dir / "checkpoint",
                output=run_dir / "output",
                max_offsets_per_trigger=max_offsets_per_trigger,
                stop_at_offset_total=spec.n_events,
            )
        )
        with log_path.open("w") as log:
            job = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, bufsize=1
            )
            producer_error: list[BaseException] = []
            bar = tqdm(total=spec.n_events, desc="produce", unit="ev", unit_scale=True, leave=True)

            def produce() -> None:
                try:
                    produce_workload(
                        spec,
                        bootstrap,
                        topic,
                        partitions=partitions,
                        rate=rate,
                        on_progress=bar.update,
                    )
                except BaseException as exc:  # surfaced in the main thread below
                    producer_error.append(exc)
                finally:
                    bar.close()

            thread = threading.Thread(target=produce, daemon=True)
            thread.start()
            batches = _follow(job, log, echo=tqdm.write)
            thread.join()
            if producer_error:
                raise producer_error[0]
            if job.wait() != 0:
                raise RuntimeError(f"streaming job failed (exit {job.returncode}); see {log_path}")
        report = compare_counts(expected_counts(spec), read_output(run_dir / "output"))
    finally:
        if own_broker:
            broker.stop()
            echo("broker   stopped")
    result = DemoResult(spec.n_events, batches, report, time.monotonic() - started)
    for line in summary_lines(result, run_dir):
        echo(line)
    return result


def _follow(job: subprocess.Popen[str], log: TextIO, echo: Echo) -> list[BatchProgress]:
    batches: list[BatchProgress] = []
    assert job.stdout is not None
    for line in job.stdout:
        if not line.startswith(PROGRESS_PREFIX):
            log.write(line)
            continue
        p = BatchProgress(**json.loads(line[len(PROGRESS_PREFIX) :]))
        batches.append(p)
        echo(
            f"batch {p.batch_id:>4} | {p.rows:>7,} rows | {p.rows_per_s:>8,.0f} rows/s | "
            f"{p.duration_ms / 1000:>5.1f} s | lag {p.lag:>8,} | committed {p.committed:>9,}"
        )
    return batches


def summary_lines(result: DemoResult, run_dir: Path) -> list[str]:
    rows = [b.rows for b in result.batches]
    durations = np.array([b.duration_ms for b in result.batches] or [0]) / 1000
    processed = sum(rows)
    busy = float(durations.sum()) or 1.0
    r = result.report
    verdict = "EXACT" if r.exact else "MISMATCH"
    return [
        "",
        "summary",
        f"  events generated      {result.events:>12,}",
        f"  events processed      {processed:>12,}",
        f"  micro-batches         {len(result.batches):>12,}",
        f"  throughput (busy)     {processed / busy:>12,.0f} rows/s",
        f"  batch duration p50    {np.percentile(durations, 50):>12.2f} s",
        f"  batch duration p99    {np.percentile(durations, 99):>12.2f} s",
        f"  counts vs truth       {verdict:>12}  (lost {r.lost}, duplicated {r.duplicated})",
        f"  wall time             {result.wall_s:>12.1f} s",
        f"  run directory         {run_dir}",
    ]
