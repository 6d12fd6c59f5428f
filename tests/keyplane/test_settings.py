"""Process-wide settings read from ``KEYPLANE_*`` variables (pure: the environment only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from keyplane.orchestration.deployment import Deployment
from keyplane.settings import MAX_EVENT_BYTES, Settings
from keyplane.spark.counts_job import CountsJobSettings
from spark_jobs.key_statistics import parse_args


def test_the_event_size_bound_defaults_to_64_kib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEYPLANE_MAX_EVENT_BYTES", raising=False)
    assert Settings().max_event_bytes == MAX_EVENT_BYTES == 64 * 1024


def test_event_size_bound_defaults_to_the_one_every_component_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KEYPLANE_MAX_EVENT_BYTES sets the job's bound, the statistics' and the scale
    DAG's at once; a job that is not routed may run under it."""
    monkeypatch.setenv("KEYPLANE_MAX_EVENT_BYTES", "4096")
    common = {"bootstrap_servers": "127.0.0.1:1", "checkpoint": Path("/ck"), "output": Path("/o")}
    assert CountsJobSettings(**common, routing_store=Path("/store")).max_event_bytes == 4096
    assert CountsJobSettings(**common).max_event_bytes == 4096
    assert Deployment.from_environment("127.0.0.1:1").max_event_bytes == 4096
    required = ["--bootstrap-servers", "b", "--events-topic", "e", "--metrics-topic", "m"]
    args = parse_args([*required, "--snapshots", "/s", "--run-id", "r"])
    assert args.max_event_bytes == 4096
    monkeypatch.setenv("KEYPLANE_MAX_EVENT_BYTES", "0")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        CountsJobSettings(**common)
