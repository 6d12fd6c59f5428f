"""Task logs an operator can read: a real ``airflow dags test`` of ``keyplane_scale``
(dry run) against the embedded broker.

``decide`` reads the metrics topic with kafka-python, whose INFO lines
(connections, fetches) used to bury the task's own; they are silenced, and the
task's last line states what it decided.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dag_setups import dag_setup

from keyplane.orchestration import dagrun

pytestmark = pytest.mark.integration


def test_a_scale_dry_run_logs_its_decision_last_and_no_kafka_client_info(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    setup = dag_setup(tmp_path, bootstrap_servers=broker, topic_prefix=f"{topic_name}-")
    dagrun.migrate_database(setup)

    run = dagrun.dag_test(
        setup,
        {"dry_run": True},
        log=tmp_path / "airflow.log",
        timeout_s=600,
        dag_id="keyplane_scale",
    )

    assert run.state == "success", run.output[-3000:]
    assert run.task("decide").state == "success"
    lines = run.output.splitlines()
    kafka_info = [line for line in lines if "[info" in line and "[kafka." in line]
    assert kafka_info == [], kafka_info[:5]
    decide_lines = [line for line in lines if "scale decision:" in line]
    assert len(decide_lines) == 1 and "dry run" in decide_lines[0], run.output[-3000:]
