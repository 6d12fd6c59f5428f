"""``keyplane job start --stage-engine``: where the routed job's stages run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keyplane.cli.job import _job_process
from keyplane.cli.parser import build_parser
from keyplane.settings import Settings
from keyplane.spark.counts_job import job_command, parse_settings
from keyplane.spark.job_checks import check_checkpoint_engine
from keyplane.spark.job_record import JobError
from keyplane.spark.jobprocess import JobProcess
from keyplane.spark.routed_counts import record_engine


def _command(home: Path, *flags: str) -> list[str]:
    args = build_parser().parse_args(["job", "start", *flags])
    return job_command(_job_process(Settings(home=home), args).job_settings())


@pytest.mark.parametrize("engine", ["jvm", "python"])
def test_job_start_passes_the_stage_engine_to_the_job(tmp_path: Path, engine: str) -> None:
    command = _command(tmp_path, "--stage-engine", engine)
    assert f"--stage-engine={engine}" in command
    assert parse_settings(command[3:]).stage_engine == engine
    # auto, the default, stays the job's own default.
    assert not any(arg.startswith("--stage-engine") for arg in _command(tmp_path))


def test_job_start_refuses_an_unknown_stage_engine_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keyplane.cli", "job", "start", "--stage-engine", "c++"],
        capture_output=True,
        text=True,
        env={**os.environ, "KEYPLANE_HOME": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 2
    assert "argument --stage-engine: invalid choice: 'c++'" in result.stderr
    assert not (tmp_path / "job" / "job.pid").exists()


def test_a_checkpoint_keeps_its_engine_and_another_is_refused_before_the_job_starts(
    tmp_path: Path,
) -> None:
    job = JobProcess(Settings(home=tmp_path), stage_engine="python")
    record_engine(job.checkpoint, "jvm")
    with pytest.raises(JobError, match=r"written by the .jvm. stages.*--stage-engine jvm"):
        check_checkpoint_engine(job.checkpoint, job.directory, job.stage_engine)
    check_checkpoint_engine(job.checkpoint, job.directory, "jvm")
    check_checkpoint_engine(job.checkpoint, job.directory, "auto")
    assert not job.pid_file.exists()
