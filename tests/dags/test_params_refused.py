"""Params the running job cannot take fail the first task of a real Airflow run, at once.

``airflow dags test`` of ``keyplane_reconfigure`` with a parallelism above the
job's state partitions: ``statistics_args`` reads the active version from the
store and refuses before ``collect_statistics`` (Spark) starts, with one try
only (AirflowFailException is never retried), and no task after it runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dag_setups import dag_setup

from keyplane.orchestration import dagrun
from keyplane.routing import config as config_store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_a_parallelism_above_the_state_partitions_fails_the_first_task_without_retries(
    tmp_path: Path,
) -> None:
    setup = dag_setup(tmp_path)
    dagrun.migrate_database(setup)

    run = dagrun.dag_test(setup, {"parallelism": 8}, log=tmp_path / "airflow.log", timeout_s=600)

    assert run.state == "failed", run.output[-3000:]
    first = run.task("statistics_args")
    assert first.state == "failed" and first.try_number == 1
    assert "parallelism 8 is more than the job's 4 state partitions" in run.output
    assert run.task("collect_statistics").state == "upstream_failed"
    assert config_store.stored_versions(setup.routing_store) == [1]


def test_an_operator_that_is_no_stage_of_a_three_stage_pipeline_fails_the_first_task(
    tmp_path: Path,
) -> None:
    """KEYPLANE_PIPELINE alone points both the DAG's shape and its checks at the
    clickstream example: a Param naming a stage it does not have is refused at once."""
    stages = ("sessions", "users", "categories")
    setup = dag_setup(
        tmp_path,
        stages=stages,
        pipeline="examples.clickstream.pipeline:clicks",
        python_path=(REPO,),
    )
    assert setup.deployment().operators == stages
    dagrun.migrate_database(setup)

    run = dagrun.dag_test(
        setup, {"operators": ["users", "A"]}, log=tmp_path / "airflow.log", timeout_s=600
    )

    assert run.state == "failed", run.output[-3000:]
    first = run.task("statistics_args")
    assert first.state == "failed" and first.try_number == 1
    assert (
        "operator(s) 'A' are not stages of the pipeline; its stages are sessions, users, "
        "categories" in run.output
    )
    assert run.task("collect_statistics").state == "upstream_failed"
    assert run.task("await_migrated_categories").state == "upstream_failed"
