"""A job told to stop at an offset total reports every batch it ran.

With a backlog the next batch starts as soon as one commits, so the batch
that crosses the stop total is usually followed by one more that is already
running when the job decides to stop; the job lets it finish
(``stop_between_batches``). Its records are committed and counted, so its
progress line must be printed too: the progress lines are what ``keyplane
job status``, the demo and the benchmarks count a run by.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.spark.counts_job import (
    PROGRESS_PREFIX,
    CountsJobSettings,
    job_command,
    read_output,
)

pytestmark = pytest.mark.integration


def test_every_batch_the_job_ran_has_a_progress_line_up_to_the_last(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    spec = ZipfEvolvingWorkload(n_keys=500, n_events=12_000, seed=5)
    assert produce_workload(spec, broker, topic_name, partitions=2) == spec.n_events
    settings = CountsJobSettings(
        bootstrap_servers=broker,
        events_topic=topic_name,
        checkpoint=tmp_path / "checkpoint",
        output=tmp_path / "output",
        pipeline="count-by-first-key",
        max_offsets_per_trigger=2_000,
        trigger_interval="0 seconds",
        stop_at_offset_total=4_000,
    )
    done = subprocess.run(job_command(settings), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    progress = [
        json.loads(line[len(PROGRESS_PREFIX) :])
        for line in done.stdout.splitlines()
        if line.startswith(PROGRESS_PREFIX)
    ]

    counted = int(read_output(settings.output)["count"].sum())
    assert counted >= 4_000
    assert [p["batch_id"] for p in progress] == list(range(len(progress)))
    assert sum(p["rows"] for p in progress) == counted
    assert progress[-1]["committed"] == counted
