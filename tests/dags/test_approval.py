"""The approval gate in a real Airflow run: rejected, nothing is published.

``airflow dags test keyplane_reconfigure`` with ``require_approval``: the
statistics are a snapshot written beforehand (``statistics_args`` and
``collect_statistics`` are marked successful, so no Spark and no broker are
needed), the run plans, validates with Great Expectations, backtests and
decides to publish, and ``approve_rollout`` (Airflow's human-in-the-loop
ApprovalOperator) waits. The test answers as the UI's Required actions do,
through Airflow's metadata database (the write the REST API's
``PATCH .../hitlDetails`` makes): Reject. The rollout tasks are skipped, the
run succeeds, the version is marked not published with who rejected it, and
no control message was ever sent (no controller state).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from dag_setups import dag_setup

from keyplane.orchestration import dagrun, decision_steps, rollout_steps, run_records
from keyplane.routing import config as config_store
from keyplane.testing import paired_tuple_counts, write_statistics_snapshot

pytestmark = pytest.mark.integration


_RESPOND = """
import sys
from sqlalchemy import select
from airflow._shared.timezones import timezone
from airflow.models.hitl import HITLDetail
from airflow.models.taskinstance import TaskInstance
from airflow.models.trigger import handle_event_submit
from airflow.triggers.base import TriggerEvent
from airflow.utils.session import create_session
from airflow.utils.state import TaskInstanceState

dag_id, run_id, task_id, option, user = sys.argv[1:6]
with create_session() as session:
    ti = session.scalars(
        select(TaskInstance).where(
            TaskInstance.dag_id == dag_id,
            TaskInstance.run_id == run_id,
            TaskInstance.task_id == task_id,
        )
    ).one()
    if ti.state != TaskInstanceState.AWAITING_INPUT:
        print("not awaiting:", ti.state)
        sys.exit(3)
    detail = session.get(HITLDetail, ti.id)
    detail.responded_by = {"id": user, "name": user}
    detail.responded_at = timezone.utcnow()
    detail.chosen_options = [option]
    detail.params_input = {}
    session.add(detail)
    handle_event_submit(
        TriggerEvent(detail.as_resume_event_payload()), task_instance=ti, session=session
    )
print("answered", option)
"""


def _run_id(setup: dagrun.AirflowSetup) -> str | None:
    """The id of the DAG's run once ``airflow dags test`` created it."""
    database = setup.airflow_home / "airflow.db"
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30)) as db:
        row = db.execute("SELECT run_id FROM dag_run WHERE dag_id = ?", (dagrun.DAG_ID,)).fetchone()
    return None if row is None else str(row[0])


def _stand_in_and_answer(
    setup: dagrun.AirflowSetup, option: str, user: str, stop: threading.Event
) -> list[str]:
    """Write the run's statistics snapshot as soon as the run exists (in place of the
    Spark job, marked successful), then answer the approval request once asked."""
    answers: list[str] = []

    def work() -> None:
        run_id = None
        while run_id is None and not stop.is_set():
            run_id = _run_id(setup)
            time.sleep(0.2)
        if run_id is None:
            return
        snapshots = setup.deployment().snapshots
        write_statistics_snapshot(snapshots, run_id, paired_tuple_counts(60, 3))
        answers.append(run_id)
        while not stop.is_set():
            command = [sys.executable, "-c", _RESPOND, dagrun.DAG_ID, run_id]
            done = subprocess.run(
                [*command, "approve_rollout", option, user],
                env=setup.environment(),
                capture_output=True,
                text=True,
            )
            if done.returncode == 0:
                answers.append(done.stdout.strip())
                return
            time.sleep(2)

    threading.Thread(target=work, daemon=True).start()
    return answers


def test_a_rejected_rollout_ends_the_run_cleanly_with_nothing_published(tmp_path: Path) -> None:
    setup = dag_setup(tmp_path)
    store = setup.routing_store
    deployment = setup.deployment()
    dagrun.migrate_database(setup)
    stop = threading.Event()
    answers = _stand_in_and_answer(setup, "Reject", "ops-oncall", stop)
    try:
        run = dagrun.dag_test(
            setup,
            {"require_approval": True, "min_total_count": 1_000, "alpha": 1.1},
            log=tmp_path / "airflow.log",
            timeout_s=900,
            mark_success_pattern="statistics_args|collect_statistics",
        )
    finally:
        stop.set()

    assert answers == [run.run_id, "answered Reject"], run.output[-3000:]
    run_id = run.run_id
    assert run.state == "success", run.output[-3000:]
    assert run.task("decide").state == "success"
    assert run.task("approve_rollout").state == "success"
    for skipped in ("roll_out_waves", "publish", "await_ack", "done", "verify"):
        assert run.task(skipped).state == "skipped", skipped
    proposal = run_records.read_record(
        run_records.run_folder(deployment, dagrun.DAG_ID, run_id) / run_records.PROPOSAL, "p"
    )
    marked = config_store.not_published(store)
    assert marked[proposal["version"]]["reason"] == "rejected by ops-oncall"
    assert not deployment.controller_state.exists()
    with pytest.raises(run_records.Refused, match="rejected by ops-oncall"):
        rollout_steps.publish(deployment, run_id)
    summary = decision_steps.approval_summary(deployment, run_id)
    assert f"Roll out v{proposal['version']}?" in summary["subject"]
    assert "keys moved" in summary["body"] and "migration cost" in summary["body"]
