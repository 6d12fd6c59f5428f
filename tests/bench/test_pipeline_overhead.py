"""The overhead bench's job settings: one engine each, nothing shared between runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from keyplane.spark.counts_job import job_command, parse_settings


def test_each_run_is_the_routed_job_on_its_engine_with_state_and_topics_of_its_own(
    bench_module: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    bench = bench_module("pipeline_overhead")
    runs = [
        bench.settings("localhost:9092", tmp_path, engine, 25_000, 100_000, run)
        for run in range(2)
        for engine in bench.VARIANTS
    ]
    assert [s.stage_engine for s in runs] == ["chain", "python", "jvm"] * 2
    for field in ("checkpoint", "output", "routing_store", "control_topic", "migration_topic"):
        assert len({getattr(s, field) for s in runs}) == len(runs), field
    assert {(s.events_topic, s.max_offsets_per_trigger, s.stop_at_offset_total) for s in runs} == {
        (bench.TOPIC, 25_000, 100_000)
    }
    # What the job process is given is what the bench meant: the command parses back.
    for s in runs:
        assert parse_settings(job_command(s)[3:]) == s
