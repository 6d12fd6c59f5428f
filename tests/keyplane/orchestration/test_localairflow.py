"""``keyplane airflow``'s settings: sizes for a small machine, the project's folders, one
secret per Airflow home. The processes themselves run in tests/dags/test_event_driven.py."""

from __future__ import annotations

from pathlib import Path

from keyplane.cli.parser import build_parser
from keyplane.orchestration.dagrun import AirflowSetup
from keyplane.orchestration.localairflow import COMPONENTS, LocalAirflow, project_folders

REPO = Path(__file__).resolve().parents[3]


def _local(tmp_path: Path) -> LocalAirflow:
    return LocalAirflow(
        setup=AirflowSetup(
            airflow_home=tmp_path / "airflow",
            dags_folder=REPO / "dags",
            bootstrap_servers="127.0.0.1:19092",
            keyplane_home=tmp_path,
            routing_store=tmp_path / "configs",
            events_topic="e",
            metrics_topic="m",
            control_topic="c",
        ),
        plugins_folder=REPO / "plugins",
        port=18080,
        parallelism=3,
    )


def test_pure_environment_runs_the_projects_dags_and_plugin_with_small_parallelism(
    tmp_path: Path,
) -> None:
    local = _local(tmp_path)
    env = local.environment({})
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__CORE__PARALLELISM"] == "3"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(REPO / "dags")
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(REPO / "plugins")
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18080/execution/"
    assert env["KEYPLANE_METRICS_TOPIC"] == "m"
    secret = env["AIRFLOW__API_AUTH__JWT_SECRET"]
    assert len(secret) >= 32 and local.environment({})["AIRFLOW__API_AUTH__JWT_SECRET"] == secret
    assert (tmp_path / "airflow" / "jwt_secret").stat().st_mode & 0o077 == 0
    assert set(local.commands()) == set(COMPONENTS)
    assert "http://127.0.0.1:18080" in local.login_lines()[0]


def test_pure_cli_parses_the_airflow_command_and_finds_the_project() -> None:
    args = build_parser().parse_args(["airflow", "--port", "9090", "--parallelism", "2"])
    assert (args.port, args.parallelism) == (9090, 2)
    assert project_folders() == (REPO / "dags", REPO / "plugins")
