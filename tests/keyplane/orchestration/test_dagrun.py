"""How ``airflow dags test`` runs are set up: the environment and the deployment agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.orchestration.dagrun import AirflowSetup
from keyplane.orchestration.deployment import Deployment
from keyplane.testing import routed_job_settings


def setup_in(tmp_path: Path) -> AirflowSetup:
    return AirflowSetup(
        airflow_home=tmp_path / "airflow",
        dags_folder=tmp_path / "dags",
        bootstrap_servers="127.0.0.1:19092",
        keyplane_home=tmp_path / "keyplane",
        routing_store=tmp_path / "store",
        events_topic="orders",
        metrics_topic="orders.metrics",
        control_topic="orders.control",
    )


def test_the_setup_deployment_is_the_one_tasks_read_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = setup_in(tmp_path.resolve())
    for name, value in setup.environment({}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KEYPLANE_STATISTICS_DIR", raising=False)

    assert setup.deployment() == Deployment.from_environment()


def test_a_deployment_of_its_own_keeps_topics_and_store_and_moves_state_folders(
    tmp_path: Path,
) -> None:
    setup = setup_in(tmp_path)
    own = setup.deployment(home=tmp_path / "alone")

    shared = setup.deployment()
    assert (own.events_topic, own.metrics_topic, own.control_topic, own.routing_store) == (
        shared.events_topic,
        shared.metrics_topic,
        shared.control_topic,
        shared.routing_store,
    )
    assert {own.snapshots, own.controller_state, own.gx_root} == {
        tmp_path / "alone" / "statistics",
        tmp_path / "alone" / "controller.json",
        tmp_path / "alone" / "gx",
    }


def test_the_setup_for_a_job_reconfigures_that_jobs_broker_store_and_topics(
    tmp_path: Path,
) -> None:
    job = routed_job_settings(
        "127.0.0.1:19092", "orders", tmp_path, parallelism=4, batch=100, trigger="1 second"
    )
    setup = AirflowSetup.for_job(
        job,
        airflow_home=tmp_path / "airflow",
        keyplane_home=tmp_path / "keyplane",
        dags_folder=tmp_path / "dags",
        statistics_master="local[2]",
    )

    deployment = setup.deployment()
    assert setup.bootstrap_servers == "127.0.0.1:19092"
    assert setup.routing_store == tmp_path / "routing"
    assert (deployment.events_topic, deployment.metrics_topic, deployment.control_topic) == (
        "orders",
        "orders.metrics",
        "orders.control",
    )
    assert setup.statistics_master == "local[2]"


def test_the_setup_for_a_job_that_is_not_routed_is_refused(tmp_path: Path) -> None:
    job = routed_job_settings(
        "127.0.0.1:19092",
        "orders",
        tmp_path,
        parallelism=4,
        batch=100,
        trigger="1 second",
        routing_store=None,
    )

    with pytest.raises(ValueError, match="not routed"):
        AirflowSetup.for_job(
            job,
            airflow_home=tmp_path / "airflow",
            keyplane_home=tmp_path / "keyplane",
            dags_folder=tmp_path / "dags",
        )
