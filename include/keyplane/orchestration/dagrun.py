"""One run of ``keyplane_reconfigure`` with ``airflow dags test``, watched task by task.

The demo, the DAG benchmark and the end-to-end test all run the DAG the way
docs/orchestration.md tells a user to: the ``airflow`` command, Airflow's
metadata in SQLite under ``AIRFLOW_HOME``, the connections and the
``KEYPLANE_*`` deployment variables in the environment. ``airflow dags
test`` runs every task in one process, the triggers of the deferred waits
inline (000 §3.4's replies), and records each task instance in the metadata
database as a scheduler would, so the same start, end and state columns
time a run here and in production.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from keyplane.control.signing import KEY_ENV_VAR
from keyplane.orchestration.deployment import Deployment

if TYPE_CHECKING:
    from keyplane.spark.counts_job import CountsJobSettings

DAG_ID = "keyplane_reconfigure"
_END_TASK = re.compile(r"\[DAG TEST\] end task task_id=(\S+)")
_RUN_FINISHED = re.compile(r"DagRun Finished: .*run_id=([^,]+),.*state=(\w+)")


class AirflowSetup(BaseModel):
    """Where Airflow keeps its metadata and which deployment the DAG's tasks see."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    airflow_home: Path
    dags_folder: Path
    bootstrap_servers: str
    keyplane_home: Path
    routing_store: Path
    events_topic: str
    metrics_topic: str
    control_topic: str
    spark_master: str = "local[2]"
    statistics_master: str = "local[1]"
    control_key: str | None = Field(
        default=None, repr=False, description="HMAC key shared with the job (else inherited)."
    )
    pipeline: str | None = Field(
        default=None,
        description="The job's pipeline as module:attribute (KEYPLANE_PIPELINE; else inherited).",
    )
    python_path: tuple[Path, ...] = Field(
        default=(),
        description="Folders put first on PYTHONPATH, where the pipeline's module is found.",
    )

    @classmethod
    def for_job(
        cls,
        job: CountsJobSettings,
        *,
        airflow_home: Path,
        keyplane_home: Path,
        dags_folder: Path,
        **fields: Any,
    ) -> AirflowSetup:
        """The setup whose DAG runs reconfigure ``job``: its broker, routing store and
        topics, so that the DAG's tasks and the job cannot disagree on them.

        Raises ``ValueError`` if ``job`` is not routed (no routing store to publish to).
        """
        if job.routing_store is None:
            raise ValueError("the job is not routed: its settings name no routing_store")
        return cls(
            airflow_home=airflow_home,
            dags_folder=dags_folder,
            keyplane_home=keyplane_home,
            bootstrap_servers=job.bootstrap_servers,
            routing_store=job.routing_store,
            events_topic=job.events_topic,
            metrics_topic=job.metrics_topic,
            control_topic=job.control_topic,
            **fields,
        )

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables of docs/orchestration.md ("Connections and environment")."""
        venv_bin = Path(sys.executable).parent
        env = dict(os.environ if base is None else base)
        return {
            **env,
            "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "AIRFLOW_HOME": str(self.airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
                {"conn_type": "spark", "host": self.spark_master}
            ),
            "AIRFLOW_CONN_KEYPLANE_KAFKA": json.dumps(
                {"conn_type": "kafka", "extra": {"bootstrap.servers": self.bootstrap_servers}}
            ),
            "KEYPLANE_HOME": str(self.keyplane_home),
            "KEYPLANE_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "KEYPLANE_EVENTS_TOPIC": self.events_topic,
            "KEYPLANE_METRICS_TOPIC": self.metrics_topic,
            "KEYPLANE_CONTROL_TOPIC": self.control_topic,
            "KEYPLANE_ROUTING_STORE": str(self.routing_store),
            "KEYPLANE_SPARK_MASTER": self.statistics_master,
            **({KEY_ENV_VAR: self.control_key} if self.control_key else {}),
            **({"KEYPLANE_PIPELINE": self.pipeline} if self.pipeline else {}),
            **(
                {
                    "PYTHONPATH": os.pathsep.join(
                        [*(str(path) for path in self.python_path), env.get("PYTHONPATH", "")]
                    )
                }
                if self.python_path
                else {}
            ),
        }

    def deployment(self, home: Path | None = None) -> Deployment:
        """The deployment the DAG's tasks see under :meth:`environment`.

        ``home`` gives a run of its own (its own snapshots, controller state
        and GX folder) on the same topics and store; default: this setup's.
        """
        return Deployment.under(
            self.keyplane_home if home is None else home,
            bootstrap_servers=self.bootstrap_servers,
            events_topic=self.events_topic,
            metrics_topic=self.metrics_topic,
            control_topic=self.control_topic,
            routing_store=self.routing_store,
            pipeline=self.pipeline,
        )


@dataclass(frozen=True)
class TaskRecord:
    """One task instance as Airflow recorded it (``task_instance`` table)."""

    task_id: str
    state: str | None
    start: str | None
    end: str | None
    duration_s: float | None
    try_number: int


@dataclass(frozen=True)
class DagRunRecord:
    """How a run ended: its id and state, each task instance, and the command's output."""

    run_id: str
    state: str
    returncode: int
    tasks: list[TaskRecord]
    output: str

    def task(self, task_id: str) -> TaskRecord:
        """The task instance ``task_id`` (``KeyError`` if the run has none)."""
        for record in self.tasks:
            if record.task_id == task_id:
                return record
        raise KeyError(task_id)


def airflow_command() -> str:
    """The ``airflow`` of this interpreter's environment."""
    return str(Path(sys.executable).parent / "airflow")


def migrate_database(setup: AirflowSetup, env: Mapping[str, str] | None = None) -> None:
    """Create or upgrade the metadata database (``airflow db migrate``, idempotent): SQLite
    under the setup's home, or the database that ``env`` names (default: the setup's)."""
    setup.airflow_home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [airflow_command(), "db", "migrate"],
        env=setup.environment() if env is None else dict(env),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{(done.stdout + done.stderr)[-3000:]}")


def task_instances(setup: AirflowSetup, run_id: str, dag_id: str = DAG_ID) -> list[TaskRecord]:
    """The run's task instances, in the order they started, read from the metadata database."""
    database = setup.airflow_home / "airflow.db"
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30)) as connection:
        rows = connection.execute(
            "SELECT task_id, state, start_date, end_date, duration, try_number "
            "FROM task_instance WHERE dag_id = ? AND run_id = ? "
            "ORDER BY start_date IS NULL, start_date",
            (dag_id, run_id),
        ).fetchall()
    return [TaskRecord(*row) for row in rows]


def dag_test(
    setup: AirflowSetup,
    conf: Mapping[str, Any],
    *,
    log: Path,
    on_task: Callable[[TaskRecord], None] | None = None,
    timeout_s: float = 1800,
    dag_id: str = DAG_ID,
    logical_date: str | None = None,
    mark_success_pattern: str | None = None,
) -> DagRunRecord:
    """``airflow dags test DAG_ID -c CONF``; ``on_task`` sees each task as it ends.

    The command's output goes to ``log``. A run whose tasks fail (a rollback
    reports itself as a failure) is returned, not raised: its state says so.
    After ``timeout_s`` the command is killed and the run ends as it stands.
    ``logical_date`` fixes the run's date (and so its id), and tasks matching
    ``mark_success_pattern`` are marked successful without running.
    """
    dated = [] if logical_date is None else [logical_date]
    command = [airflow_command(), "dags", "test", dag_id, *dated, "-c", json.dumps(dict(conf))]
    if mark_success_pattern is not None:
        command += ["--mark-success-pattern", mark_success_pattern]
    lines: list[str] = []
    run_id, state = "", "unknown"
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            env=setup.environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert process.stdout is not None
        watchdog = threading.Timer(timeout_s, process.kill)
        watchdog.start()
        try:
            for line in process.stdout:
                out.write(line)
                lines.append(line)
                finished = _RUN_FINISHED.search(line)
                if finished:
                    run_id, state = finished.group(1), finished.group(2)
                ended = _END_TASK.search(line)
                if ended and on_task is not None:
                    run_id = run_id or _run_id_of(lines, dag_id)
                    record = _find(setup, run_id, ended.group(1), dag_id)
                    if record is not None:
                        on_task(record)
            returncode = process.wait()
        finally:
            watchdog.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
    run_id = run_id or _run_id_of(lines, dag_id)
    if not run_id:
        raise RuntimeError(f"airflow dags test did not start a run; see {log}")
    return DagRunRecord(
        run_id=run_id,
        state=state,
        returncode=returncode,
        tasks=task_instances(setup, run_id, dag_id),
        output="".join(lines),
    )


def _run_id_of(lines: list[str], dag_id: str = DAG_ID) -> str:
    in_task_instance = re.compile(r"<TaskInstance: " + re.escape(dag_id) + r"\.\S+ (\S+) \[")
    for line in lines:
        found = in_task_instance.search(line)
        if found:
            return found.group(1)
    return ""


def _find(
    setup: AirflowSetup, run_id: str, task_id: str, dag_id: str = DAG_ID
) -> TaskRecord | None:
    if not run_id:
        return None
    for record in task_instances(setup, run_id, dag_id):
        if record.task_id == task_id:
            return record
    return None
