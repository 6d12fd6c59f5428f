"""Exactly-once through a driver crash: SIGKILL mid-run, restart from the checkpoint.

200,000 events over 8 partitions, a streaming count with maxOffsetsPerTrigger
(eight batches); the driver (Python process and its JVM) is killed with
SIGKILL while batches are committing, then restarted on the same checkpoint.
Every event must be counted exactly once, compared with the generator's
ground truth.

The proof is the replay of the batches the crash interrupted, not the volume:
eight batches of 25,000 events cross the kill as one million in batches of
100,000 did, in a fifth of the producing, reading and counting. Volume is
measured by ``bench/kafka_source.py`` and exact counts over a long run by
``bench/soak.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.spark.counts_job import CountsJobSettings, job_command, read_output

pytestmark = pytest.mark.integration

N_EVENTS = 200_000
BATCH_EVENTS = 25_000


def _job(broker: str, topic: str, tmp: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = job_command(
        CountsJobSettings(
            bootstrap_servers=broker,
            events_topic=topic,
            checkpoint=tmp / "checkpoint",
            output=tmp / "output",
            pipeline="count-by-first-key",
            max_offsets_per_trigger=BATCH_EVENTS,
            trigger_interval="0 seconds",
            stop_at_offset_total=N_EVENTS,
        )
    )
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def test_sigkill_mid_run_then_restart_counts_every_event_once(
    engine_broker: str, topic_name: str, tmp_path: Path
) -> None:
    spec = ZipfEvolvingWorkload(n_keys=5_000, exponent=1.1, n_events=N_EVENTS, seed=7)
    assert produce_workload(spec, engine_broker, topic_name, partitions=8) == N_EVENTS
    log = tmp_path / "job.log"

    first = _job(engine_broker, topic_name, tmp_path, log)
    deadline = time.monotonic() + 600
    while len(list((tmp_path / "output").glob("batch-*.parquet"))) < 3:
        assert first.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "job made no progress"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    committed_before = read_output(tmp_path / "output")["count"].sum()
    assert 0 < committed_before < N_EVENTS, "the kill must land mid-run"

    second = _job(engine_broker, topic_name, tmp_path, log)
    assert second.wait(timeout=900) == 0, log.read_text()[-3000:]

    truth = expected_counts(spec)
    # This pipeline counts by field 1 only: compare stage A.
    report = compare_counts(truth[truth["stage"] == "A"], read_output(tmp_path / "output"))
    assert report.expected_events == N_EVENTS
    assert report.exact, report
