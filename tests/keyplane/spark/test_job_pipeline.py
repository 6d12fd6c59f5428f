"""``keyplane job start --pipeline``: the job's pipeline, checked in one line before a launch.

No broker runs here: each refusal comes before Kafka is asked, so before any
process starts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyplane.aggregates import RunningCount, ValueCounts
from keyplane.cli import main as cli_main
from keyplane.pipeline import PipelineError
from keyplane.reference.pipeline import counts
from keyplane.settings import Settings
from keyplane.spark.counts_job import CountsJobSettings, job_command, parse_settings
from keyplane.spark.jobprocess import JobProcess
from keyplane.spark.pipeline_frames import record_pipeline
from keyplane.testing import free_port

THREE_STAGES = """
from keyplane import KafkaSource, ParquetSink, Pipeline, Stage

def three():
    return Pipeline(
        "three",
        KafkaSource("clicks", "user_id STRING, session_id STRING, page STRUCT<c: STRING>"),
        (Stage("sessions", "session_id"), Stage("users", "user_id"), Stage("pages", "page.c")),
        ParquetSink("out"),
    )

not_one = 3
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A keyplane home and a working directory holding the module ``user_pipelines``."""
    (tmp_path / "user_pipelines.py").write_text(THREE_STAGES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the working directory
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KEYPLANE_BROKER_PORT", str(free_port()))
    yield tmp_path / "home"
    sys.modules.pop("user_pipelines", None)


def test_a_pipeline_that_cannot_load_is_one_line_and_starts_nothing(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = cli_main(["job", "start", "--pipeline", "user_pipelines:nope"])
    missing_err = capsys.readouterr().err
    not_one = cli_main(["job", "start", "--pipeline", "user_pipelines:not_one"])
    not_one_err = capsys.readouterr().err

    assert missing == not_one == 2
    assert missing_err == "keyplane: pipeline 'user_pipelines:nope': user_pipelines has no 'nope'\n"
    assert not_one_err == (
        "keyplane: pipeline 'user_pipelines:not_one' is a int, not a keyplane Pipeline\n"
    )
    assert not (home / "job").exists()


def test_a_three_stage_pipeline_on_the_reference_engine_is_refused_in_one_line(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        ["job", "start", "--pipeline", "user_pipelines:three", "--stage-engine", "python"]
    )
    err = capsys.readouterr().err

    assert code == 2
    assert err == (
        "keyplane: stage engine 'python' runs the reference pipeline's two stages only, not "
        "pipeline 'three' (sessions, users, pages); use --stage-engine chain or auto\n"
    )
    assert not (home / "job" / "job.pid").exists()


def test_a_three_stage_pipeline_passes_the_checks_before_the_launch(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no broker, the start gets as far as asking Kafka: the pipeline itself is fine."""
    code = cli_main(["job", "start", "--pipeline", "user_pipelines:three", "--timeout", "5"])
    err = capsys.readouterr().err

    assert code == 2
    assert "pipeline" not in err and "Kafka" in err, err
    assert not (home / "job" / "job.pid").exists()


def test_a_checkpoint_refuses_the_pipeline_with_another_aggregate_before_a_launch(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint ran the reference pipeline (running counts); a start with stage A's
    aggregate changed says so, naming the stage and both aggregates."""
    record_pipeline(home / "job" / "checkpoint", counts())

    code = cli_main(["job", "start", "--stage-a-aggregate", "keyplane.aggregates:ValueCounts"])
    err = capsys.readouterr().err

    assert code == 2
    assert "keyplane: pipeline 'counts' differs from the one checkpoint" in err
    assert (
        "stage 'A': aggregate 'keyplane.aggregates:RunningCount' became "
        "'keyplane.aggregates:ValueCounts'"
    ) in err
    assert not (home / "job" / "job.pid").exists()


def test_the_job_runs_the_reference_pipeline_with_the_aggregates_its_flags_name_pure(
    tmp_path: Path,
) -> None:
    """The default pipeline is the reference one; a stage flag replaces that stage's aggregate;
    the pipeline travels on the job's command line."""
    base = {
        "bootstrap_servers": "127.0.0.1:1",
        "checkpoint": tmp_path / "ck",
        "output": tmp_path / "out",
        "routing_store": tmp_path / "store",
    }
    default = CountsJobSettings.model_validate(base)
    flagged = CountsJobSettings.model_validate(
        {
            **base,
            "pipeline": "keyplane.reference.pipeline:counts",
            "stage_b_aggregate": "keyplane.aggregates:ValueCounts",
        }
    )

    assert default.job_pipeline().fingerprint() == counts().fingerprint()
    assert [type(s.aggregate) for s in flagged.job_pipeline().stages] == [RunningCount, ValueCounts]
    assert parse_settings(job_command(flagged)[3:]).pipeline == "keyplane.reference.pipeline:counts"
    with pytest.raises(ValueError, match="a pipeline needs the routed job"):
        CountsJobSettings.model_validate(
            {**base, "routing_store": None, "pipeline": "keyplane.reference.pipeline:counts"}
        )


REFERENCE_SHAPED = """
from keyplane import KafkaSource, ParquetSink, Pipeline, Stage
from keyplane.reference.pipeline import EVENT_SCHEMA

mine = Pipeline(
    "mine",
    KafkaSource("my-events", EVENT_SCHEMA),
    (Stage("A", "a", value="b"), Stage("B", "b", value="a")),
    ParquetSink("results"),
)
"""


def test_a_named_pipeline_sets_the_topic_the_job_reads_and_a_mismatch_is_refused(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The managed job reads the named pipeline's topic (and ``status`` measures lag there);
    a job set to read another topic than its pipeline's is refused in one line."""
    (tmp_path / "user_pipelines.py").write_text(THREE_STAGES + REFERENCE_SHAPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = JobProcess(Settings(home=home), pipeline="user_pipelines:mine")
    settings = job.job_settings()

    assert (job.events_topic, settings.events_topic) == ("my-events", "my-events")
    assert settings.job_pipeline().name == "mine"
    other = settings.model_copy(update={"events_topic": "keyplane.events"})
    with pytest.raises(PipelineError, match=r"reads \['my-events'\], but the job is set to read"):
        other.job_pipeline()
    default = JobProcess(Settings(home=home, events_topic="configured"))
    assert (default.pipeline, default.events_topic) == (None, "configured")
