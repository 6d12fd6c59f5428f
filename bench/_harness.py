"""What every streaming benchmark needs: a private broker, the job as a process, its reports.

Benchmarks run the job exactly as users do (``python -m keyplane.spark.counts_job``,
:func:`keyplane.spark.counts_job.job_command`), each variant in its own
process on the same topic, one after the other in the same run, so that
their ratio is measured on the same machine state.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.spark.counts_job import CountsJobSettings, job_command
from keyplane.spark.progress import PROGRESS_PREFIX
from keyplane.testing import free_port

# Control messages are signed; a benchmark run signs with a key of its own.
os.environ.setdefault("KEYPLANE_CONTROL_KEY", secrets.token_hex(16))


@contextmanager
def private_broker() -> Iterator[tuple[str, Path]]:
    """An embedded broker on a free port and a scratch directory, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        broker = EmbeddedBroker(tmp / "broker", free_port())
        bootstrap = broker.start().bootstrap_servers
        try:
            yield bootstrap, tmp
        finally:
            broker.stop()


def run_job(settings: CountsJobSettings, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run the job to its stop condition; return its ``progress`` reports."""
    done = subprocess.run(job_command(settings), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"job failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [
        json.loads(line[len(PROGRESS_PREFIX) :])
        for line in done.stdout.splitlines()
        if line.startswith(PROGRESS_PREFIX)
    ]


def read_topic(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Every JSON record of partition 0 of ``topic``, in order."""
    end = high_watermarks(bootstrap, topic).get(0, 0)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        records: list[dict[str, Any]] = []
        while len(records) < end:
            batch = consumer.poll(timeout_ms=1000).get(tp, [])
            records += [json.loads(r.value) for r in batch]
        return records
    finally:
        consumer.close()


def steady_rate(progress: list[dict[str, Any]]) -> float:
    """Rows per second over every batch but the first (JVM and worker start-up)."""
    rest = progress[1:] or progress
    seconds = sum(p["duration_ms"] for p in rest) / 1000
    return sum(p["rows"] for p in rest) / seconds if seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100), linear interpolation; needs at least one value."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def emit(text: str, out: Path | None) -> None:
    """Print the result table and, with ``--out``, keep it as a file."""
    print(text)
    if out is not None:
        out.write_text(text + "\n")
