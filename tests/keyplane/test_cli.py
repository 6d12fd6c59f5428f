"""The command line, run as a user runs it: a subprocess, real broker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from keyplane.cli import build_parser
from keyplane.kafka.admin import high_watermarks
from keyplane.testing import free_port


def _keyplane(home: Path, *args: str, port: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KEYPLANE_HOME": str(home)}
    if port is not None:
        env["KEYPLANE_BROKER_PORT"] = str(port)
    return subprocess.run(
        [sys.executable, "-m", "keyplane.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    for argv in (
        [],
        ["broker"],
        ["topic"],
        ["generate", "pairs"],
        ["generate", "zipf-evolving"],
        ["generate", "geo-tags"],
        ["demo", "geo-tags"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*argv, "--help"])
        assert exit_info.value.code == 0


def test_invalid_workload_parameter_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _keyplane(tmp_path, "generate", "pairs", "--locality", "1.5")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "keyplane: invalid locality: Input should be less than or equal to 1"
    )


@pytest.mark.integration
def test_broker_lifecycle_and_generate_through_the_cli(tmp_path: Path) -> None:
    port = free_port()
    started = _keyplane(tmp_path, "broker", "start", port=port)
    assert started.returncode == 0, started.stderr
    try:
        again = _keyplane(tmp_path, "broker", "start", port=port)
        assert again.returncode == 2 and "already running" in again.stderr
        status = _keyplane(tmp_path, "broker", "status", port=port)
        assert f"127.0.0.1:{port}" in status.stdout
        gen = _keyplane(
            tmp_path,
            "generate",
            "zipf-evolving",
            "--n-events",
            "5000",
            "--topic",
            "cli-events",
            "--partitions",
            "4",
            port=port,
        )
        assert gen.returncode == 0, gen.stderr
        assert sum(high_watermarks(f"127.0.0.1:{port}", "cli-events").values()) == 5000
    finally:
        stopped = _keyplane(tmp_path, "broker", "stop", port=port)
    assert stopped.stdout.strip() == "broker stopped"
    assert _keyplane(tmp_path, "broker", "status", port=port).returncode == 1


def test_port_taken_names_the_fix(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _keyplane(tmp_path, "broker", "start", port=port)
    assert result.returncode == 2
    assert f"port {port} is taken" in result.stderr and "--port" in result.stderr
