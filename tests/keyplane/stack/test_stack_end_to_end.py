"""``keyplane stack up``, events, a scheduled reconfiguration, a live scale-out, ``stack down``.

The real stack, as a user starts it: Apache Kafka, the Spark standalone
master and its 4 workers (in network namespaces behind shaped links when the
test runs as root), PostgreSQL, Airflow's four components on it, and the
routed job on the master, started on 2 executors of the 3 it may hold.
Events go to the job's topic and the job's counts must equal the workload's
truth exactly; ``keyplane_reconfigure`` is unpaused and the run its timetable
creates (run type ``scheduled``, not a manual or ``dags test`` run) must
succeed, as Airflow's REST API reports it, while events keep flowing. Then a
``keyplane_scale`` run, triggered through the REST API, scales stage B out
from 2 to 3 active instances with ``executors`` on: the job must go from 2 to
3 executors live (its run's ``executors.json`` and the master's ``/json``),
batches must keep committing, and the counts must still be exact after both
live rollouts. ``down`` must leave no process of the stack and none of its
namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyplane.algorithms.statistics import safe_run_id
from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import WorkloadTrickle, produce_workload
from keyplane.orchestration import scale_steps
from keyplane.reference.verification import CountReport, compare_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload, WorkloadSpec
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.settings import Settings
from keyplane.spark.counts_job import read_output
from keyplane.spark.job_checkpoint import last_commit
from keyplane.stack import network
from keyplane.stack.config import StackConfig
from keyplane.stack.kafka import KafkaPiece
from keyplane.stack.postgres import server_binaries
from keyplane.stack.spark import SparkMaster, master_state
from keyplane.stack.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.stack]

KEYPLANE = str(Path(sys.executable).parent / "keyplane")
DAG_ID = "keyplane_reconfigure"
SCALE_DAG_ID = "keyplane_scale"
PARTITIONS = 4


@pytest.fixture
def home() -> Iterator[Path]:
    """A KEYPLANE_HOME that PostgreSQL's own user can reach (pytest's tmp_path is owner-only)."""
    try:
        server_binaries()
    except Exception as missing:  # the one-line StackError naming the package
        pytest.skip(str(missing))
    folder = Path(tempfile.mkdtemp(prefix="keyplane-stack-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _keyplane(home: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KEYPLANE_HOME": str(home)}
    return subprocess.run(
        [KEYPLANE, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _stack_processes(home: Path) -> list[str]:
    """Every process whose command line or environment names ``home``: the stack's."""
    marker = os.fsencode(str(home))
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker in cmdline or marker in environ:
            command = cmdline.replace(b"\0", b" ")[:160].decode(errors="replace")
            found.append(f"{proc.name}: {command}")
    return found


class Airflow:
    """Airflow's REST API as the stack's admin (simple auth manager's generated password)."""

    def __init__(self, url: str, passwords: Path) -> None:
        self.url = url
        password = json.loads(passwords.read_text())["admin"]
        token = self._call("POST", "/auth/token", {"username": "admin", "password": password})
        self.token = str(token["access_token"])

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.token}"} if hasattr(self, "token") else {}),
            },
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def pause(self, dag_id: str, paused: bool) -> None:
        reply = self._call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": paused})
        assert reply["is_paused"] is paused

    def unpause(self, dag_id: str) -> None:
        self.pause(dag_id, False)

    def trigger(self, dag_id: str, run_id: str, conf: dict[str, Any], run_after: str) -> None:
        body = {"dag_run_id": run_id, "logical_date": None, "run_after": run_after, "conf": conf}
        assert self._call("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)["dag_run_id"] == run_id

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"])

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}"))

    def wait_until_ended(self, dag_id: str, timeout_s: float, pick: Any) -> dict[str, Any] | None:
        """The run ``pick(runs)`` names once it has succeeded or failed; None at the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = pick(self.runs(dag_id))
            if run is not None and run["state"] in ("success", "failed"):
                return dict(run)
            time.sleep(5.0)
        return None

    def failed_tasks(self, dag_id: str, run_id: str) -> list[str]:
        tasks = self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return [t["task_id"] for t in tasks["task_instances"] if t["state"] == "failed"]


def _wait_exact(truth_specs: list[WorkloadSpec], output: Path, timeout_s: float) -> CountReport:
    truth = expected_counts_of(truth_specs)
    deadline = time.monotonic() + timeout_s
    report = compare_counts(truth, read_output(output))
    while not report.exact and time.monotonic() < deadline:
        time.sleep(2.0)
        report = compare_counts(truth, read_output(output))
    return report


def _seed_routing(home: Path) -> None:
    """The job's first configuration: stage B active on 2 of its 4 instances, so that a
    scale-out has an instance to add (paper 003 §5); stage A on all 4. Two, so that
    Spark's hash folds evenly onto them."""
    hashed = RoutingConfig.all_hash(PARTITIONS, OPERATORS)
    b = OperatorRouting.model_validate(
        {**hashed.operators["B"].model_dump(mode="json"), "active_instances": [0, 1]}
    )
    seeded = hashed.model_copy(update={"operators": {**hashed.operators, "B": b}})
    config_store.save(seeded, Settings(home=home).config_store)


def _job_cores(ui_url: str) -> int:
    """Cores the master has granted the running job: one per executor of 1 core."""
    state = master_state(ui_url) or {}
    (job,) = [
        app
        for app in state.get("activeapps", [])
        if app.get("state") == "RUNNING" and app.get("name") == "keyplane-running-counts"
    ]
    return int(job["cores"])


# A fresh home migrates Airflow's database and formats Kafka; on a busy machine of 2 cores the
# whole flow takes minutes beyond the suite's default timeout.
@pytest.mark.timeout(1800)
def test_stack_up_counts_exact_reconfigure_on_schedule_scale_out_live_and_down_leaves_nothing(
    home: Path,
) -> None:
    config = StackConfig()
    assert config.job_executors_initial == 2 and config.job_cores == 3
    stack = Stack(Settings(home=home), config)
    _seed_routing(home)
    # Another stack's network on this machine is not this one's to remove (this stack then
    # runs unshaped, or refuses to start).
    others = network.left_over()
    try:
        started = time.monotonic()
        up = _keyplane(home, "stack", "up", timeout=420)
        assert up.returncode == 0, up.stdout + up.stderr
        up_s = time.monotonic() - started
        status = _keyplane(home, "stack", "status", timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        for piece in ("kafka", "spark-master", "spark-workers", "postgres", "airflow", "job"):
            assert any(line.split()[:2] == [piece, "up"] for line in status.stdout.splitlines())
        made = stack.network()
        network_line = next(
            line for line in status.stdout.splitlines() if line.startswith("network")
        )
        if made.shaped:
            assert len(made.namespaces) == config.workers
            assert set(network.left_over()) == {*made.namespaces, network.BRIDGE}
        else:
            assert "unshaped" in network_line, network_line
        pieces = stack.pieces(made)
        kafka = next(p for p in pieces if isinstance(p, KafkaPiece))
        master_ui = next(p for p in pieces if isinstance(p, SparkMaster)).ui_url
        bootstrap, topic = kafka.bootstrap_servers, Settings().events_topic
        output = home / "job" / "output"
        checkpoint = home / "job" / "checkpoint"

        first = PairsWorkload(n_events=20_000, n_keys=200, locality=0.8, seed=11)
        produce_workload(first, bootstrap, topic, partitions=config.topic_partitions)
        report = _wait_exact([first], output, timeout_s=180)
        assert report.exact, report
        # The job holds its initial executors, not every core spark.cores.max allows.
        assert _job_cores(master_ui) == config.job_executors_initial

        airflow = Airflow(
            f"http://127.0.0.1:{config.airflow_port}",
            home / "stack" / "airflow" / "simple_auth_manager_passwords.json.generated",
        )
        assert airflow.runs(DAG_ID) == []
        airflow.unpause(DAG_ID)
        # Events keep flowing during both runs: their rollouts and verifications wait for
        # batches.
        trickle = WorkloadTrickle(
            lambda i: PairsWorkload(n_events=1_000, n_keys=200, locality=0.8, seed=100 + i),
            bootstrap,
            topic,
            partitions=config.topic_partitions,
            pause_s=1.5,
        )
        trickle.start()
        sent: list[WorkloadSpec] = [first]
        try:
            run = airflow.wait_until_ended(
                DAG_ID,
                600,
                lambda runs: next((r for r in runs if r["run_type"] == "scheduled"), None),
            )
            # The job's metrics may start a run too (asset_triggered, the imbalance
            # watch); nothing else may.
            reconfigure_runs = airflow.runs(DAG_ID)
            assert {r["run_type"] for r in reconfigure_runs} <= {"scheduled", "asset_triggered"}
            assert run is not None, f"no scheduled run of {DAG_ID} ended within 600 s"
            assert run["state"] == "success", airflow.failed_tasks(DAG_ID, run["dag_run_id"])
            # No other rollout while the scale run rolls out: a paused DAG starts no run.
            airflow.pause(DAG_ID, True)

            # The scale-out, triggered as a user would. Unpausing the DAG also lets its
            # timetable create a run (one at a time); this run's run_after, the DAG's start
            # date, puts it first in the scheduler's queue.
            committed_before = last_commit(checkpoint)
            scale_run = "stack-scale-out"
            conf = {
                "action": "out",
                "operator": "B",
                "instances": 3,
                "executors": True,
                "alpha": 3.0,
                "reply_timeout_s": 180,
            }
            airflow.trigger(SCALE_DAG_ID, scale_run, conf, run_after="2026-01-01T00:00:00Z")
            airflow.unpause(SCALE_DAG_ID)
            scaled = airflow.wait_until_ended(
                SCALE_DAG_ID,
                600,
                lambda runs: next((r for r in runs if r["dag_run_id"] == scale_run), None),
            )
            # No run of the timetable's starts after it: it would scale by itself.
            airflow.pause(SCALE_DAG_ID, True)
            assert scaled is not None, f"{SCALE_DAG_ID} run {scale_run} did not end in 600 s"
            assert scaled["state"] == "success", airflow.failed_tasks(SCALE_DAG_ID, scale_run)
        finally:
            sent += trickle.finish()

        folder = home / "scale" / safe_run_id(scale_run)
        added = json.loads((folder / scale_steps.EXECUTORS).read_text())
        assert added["action"] == "add"
        assert len(added["executors_before"]) == config.job_executors_initial
        assert len(added["executors_after"]) == config.job_executors_initial + 1
        assert added["executor"] in set(added["executors_after"]) - set(added["executors_before"])
        assert _job_cores(master_ui) == config.job_cores
        committed_after = last_commit(checkpoint)
        assert committed_before is not None and committed_after is not None
        assert committed_after > committed_before

        report = _wait_exact(sent, output, timeout_s=180)
        assert report.exact, report
        assert report.expected_events == sum(spec.n_events for spec in sent)
        print(
            f"stack up in {up_s:.0f} s; executors {len(added['executors_before'])} -> "
            f"{len(added['executors_after'])}; {report.expected_events:,} events counted exactly"
        )
    finally:
        down = _keyplane(home, "stack", "down", timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert _stack_processes(home) == []
    assert network.left_over() == others
