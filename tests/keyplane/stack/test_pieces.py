"""The stack's pure parts and its process records, on real processes; no piece is started."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from keyplane.cli import main
from keyplane.stack.config import StackConfig
from keyplane.stack.network import Network
from keyplane.stack.piece import Processes, StackError, start_time


def test_pure_config_places_the_bridge_and_one_address_per_worker() -> None:
    config = StackConfig(subnet="10.77.0.0/24")
    assert config.address(0) == "10.77.0.1"
    assert [config.address(i) for i in (1, 2, 3)] == ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
    assert config.prefix_length == 24
    assert config.job_cores + config.batch_cores <= config.workers * config.worker_cores


def test_pure_config_refuses_a_subnet_too_small_and_cores_the_workers_lack() -> None:
    with pytest.raises(ValidationError, match="too small"):
        StackConfig(subnet="10.77.0.0/28")
    with pytest.raises(ValidationError, match="statistics job would wait"):
        StackConfig(workers=2, job_cores=2, batch_cores=1)


def test_pure_config_default_starts_the_job_with_room_for_one_added_executor() -> None:
    config = StackConfig()
    offered = config.workers * config.worker_cores
    assert config.job_executors_initial is not None
    assert config.job_executors_initial * config.worker_cores < config.job_cores
    assert config.job_cores + config.batch_cores <= offered


def test_pure_config_refuses_more_initial_executors_than_the_job_may_hold() -> None:
    with pytest.raises(ValidationError, match="job_executors_initial 3 executors of 1 core"):
        StackConfig(job_executors_initial=3, job_cores=2)
    with pytest.raises(ValidationError, match=r"\(3 workers of 1\)"):
        StackConfig(workers=3, job_cores=3, batch_cores=1)
    assert StackConfig(job_executors_initial=None).job_executors_initial is None


def test_pure_config_empty_initial_executors_means_every_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KEYPLANE_STACK_JOB_EXECUTORS_INITIAL", "")
    assert StackConfig().job_executors_initial is None
    monkeypatch.setenv("KEYPLANE_STACK_JOB_EXECUTORS_INITIAL", "1")
    assert StackConfig().job_executors_initial == 1


def test_pure_network_says_why_it_is_unshaped_or_what_shaping_lacks() -> None:
    unshaped = Network(shaped=False, reason="making network namespaces needs root")
    assert unshaped.describe() == (
        "unshaped, all on loopback: making network namespaces needs root"
    )
    shaped = Network(
        shaped=True,
        bridge="kps-br0",
        namespaces=("kps-w1", "kps-w2"),
        shaping="1gbit, 0.5ms delay (netem)",
    )
    assert shaped.describe() == "2 worker hosts on kps-br0, each link 1gbit, 0.5ms delay (netem)"


def test_bad_stack_setting_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    monkeypatch.setenv("KEYPLANE_STACK_WORKERS", "0")
    assert main(["stack", "status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "workers" in err, err


def test_records_stop_the_recorded_process_and_never_one_that_reuses_its_pid(
    tmp_path: Path,
) -> None:
    processes = Processes(tmp_path / "pids")
    record = processes.start("sleeper", ["sleep", "60"], tmp_path / "sleeper.log")
    assert processes.running("sleeper") == record
    # A record whose start time is not the pid's names another process: stale, not signalled.
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        forged = record.model_copy(update={"pid": other.pid, "started": record.started - 1})
        (tmp_path / "pids" / "forged.json").write_text(forged.model_dump_json())
        assert processes.running("forged") is None
        assert not processes.stop("forged")
        assert other.poll() is None and start_time(other.pid) is not None
    finally:
        other.kill()
        other.wait()
    assert processes.stop("sleeper")
    deadline = time.monotonic() + 10
    while start_time(record.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert start_time(record.pid) is None
    assert processes.names() == []


def test_a_process_that_exits_at_once_is_reported_with_its_log(tmp_path: Path) -> None:
    processes = Processes(tmp_path / "pids")
    log = tmp_path / "gone.log"
    exited = subprocess.Popen(["true"])
    exited.wait()
    with pytest.raises(StackError, match=f"gone exited as soon as it started; see {log}"):
        processes.record("gone", exited.pid, ["true"], log)
