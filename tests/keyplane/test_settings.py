"""Process-wide settings read from ``KEYPLANE_*`` variables (pure: the environment only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from keyplane.orchestration.deployment import Deployment
from keyplane.settings import MAX_EVENT_BYTES, Settings
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.util.validation_errors import first_problem
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


@pytest.mark.parametrize(
    "servers", ["kafka:9092", "127.0.0.1:1,broker-2.example:65535", "[::1]:9092", " a:1 , b_2:2 "]
)
def test_bootstrap_servers_are_host_port_lists_with_ipv6_in_brackets(
    monkeypatch: pytest.MonkeyPatch, servers: str
) -> None:
    monkeypatch.setenv("KEYPLANE_BOOTSTRAP_SERVERS", servers)
    assert Settings().resolved_bootstrap_servers() == servers


def test_an_empty_bootstrap_variable_means_the_embedded_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KEYPLANE_BOOTSTRAP_SERVERS", " ")
    monkeypatch.setenv("KEYPLANE_BROKER_PORT", "19999")
    assert Settings().resolved_bootstrap_servers() == "127.0.0.1:19999"


NOT_HOST_PORT = "is not host:port (an IPv6 address as [address]:port)"


@pytest.mark.parametrize(
    ("servers", "problem"),
    [
        ("h:x", f"'h:x' {NOT_HOST_PORT}"),
        ("a:b:c", f"'a:b:c' {NOT_HOST_PORT}"),
        ("h:", f"'h:' {NOT_HOST_PORT}"),
        ("kafka", f"'kafka' {NOT_HOST_PORT}"),
        ("::1:9092", f"'::1:9092' {NOT_HOST_PORT}"),
        ("a:1,", f"'' in 'a:1,' {NOT_HOST_PORT}"),
        ("a:1,b:0", "'b:0' in 'a:1,b:0' has port 0, not one of 1..65535"),
        ("h:65536", "'h:65536' has port 65536, not one of 1..65535"),
        ("[zz]:1", "'[zz]:1' has 'zz' in brackets, which is not an IPv6 address"),
    ],
)
def test_malformed_bootstrap_servers_are_refused_in_one_line_wherever_they_enter(
    monkeypatch: pytest.MonkeyPatch, servers: str, problem: str
) -> None:
    """The environment, the Airflow connection (Deployment) and the job's command line
    check the list alike; before, a Kafka client failed on it with a bare int() error."""
    monkeypatch.setenv("KEYPLANE_BOOTSTRAP_SERVERS", servers)
    with pytest.raises(ValidationError) as from_environment:
        Settings()
    monkeypatch.delenv("KEYPLANE_BOOTSTRAP_SERVERS")
    with pytest.raises(ValidationError) as from_connection:
        Deployment.under(
            Path("/h"),
            bootstrap_servers=servers,
            events_topic="e",
            metrics_topic="m",
            control_topic="c",
            routing_store=Path("/s"),
        )
    with pytest.raises(ValidationError) as from_job_flags:
        CountsJobSettings(bootstrap_servers=servers, checkpoint=Path("/ck"), output=Path("/o"))

    for refused in (from_environment, from_connection, from_job_flags):
        assert first_problem(refused.value) == f"bootstrap_servers: Value error, {problem}"
