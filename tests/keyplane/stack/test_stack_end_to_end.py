"""``keyplane stack up``, then events, a scheduled reconfiguration, ``keyplane stack down``.

The real stack, as a user starts it: Apache Kafka, the Spark standalone
master and its 3 workers (in network namespaces behind shaped links when the
test runs as root), PostgreSQL, Airflow's four components on it, and the
routed job on the master. Events go to the job's topic and the job's counts
must equal the workload's truth exactly; ``keyplane_reconfigure`` is unpaused
and the run its timetable creates (run type ``scheduled``, not a manual or
``dags test`` run) must succeed, as Airflow's REST API reports it, while
events keep flowing; the counts must still be exact after its live rollout.
``down`` must leave no process of the stack and none of its namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import CountReport, compare_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload
from keyplane.settings import Settings
from keyplane.spark.counts_job import read_output
from keyplane.stack import network
from keyplane.stack.config import StackConfig
from keyplane.stack.kafka import KafkaPiece
from keyplane.stack.postgres import server_binaries
from keyplane.stack.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.stack]

KEYPLANE = str(Path(sys.executable).parent / "keyplane")
DAG_ID = "keyplane_reconfigure"


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

    def unpause(self, dag_id: str) -> None:
        assert (
            self._call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})["is_paused"]
            is False
        )

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"])

    def failed_tasks(self, dag_id: str, run_id: str) -> list[str]:
        tasks = self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return [t["task_id"] for t in tasks["task_instances"] if t["state"] == "failed"]


def _wait_exact(truth_specs: list[PairsWorkload], output: Path, timeout_s: float) -> CountReport:
    truth = expected_counts_of(truth_specs)
    deadline = time.monotonic() + timeout_s
    report = compare_counts(truth, read_output(output))
    while not report.exact and time.monotonic() < deadline:
        time.sleep(2.0)
        report = compare_counts(truth, read_output(output))
    return report


# A fresh home migrates Airflow's database and formats Kafka; on a busy machine of 2 cores the
# whole flow takes minutes beyond the suite's default timeout.
@pytest.mark.timeout(1500)
def test_stack_up_counts_exact_a_scheduled_reconfigure_succeeds_and_down_leaves_nothing(
    home: Path,
) -> None:
    config = StackConfig()
    stack = Stack(Settings(home=home), config)
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
        kafka = next(p for p in stack.pieces(made) if isinstance(p, KafkaPiece))
        bootstrap, topic = kafka.bootstrap_servers, Settings().events_topic
        output = home / "job" / "output"

        first = PairsWorkload(n_events=20_000, n_keys=200, locality=0.8, seed=11)
        produce_workload(first, bootstrap, topic, partitions=config.topic_partitions)
        report = _wait_exact([first], output, timeout_s=180)
        assert report.exact, report

        airflow = Airflow(
            f"http://127.0.0.1:{config.airflow_port}",
            home / "stack" / "airflow" / "simple_auth_manager_passwords.json.generated",
        )
        assert airflow.runs(DAG_ID) == []
        airflow.unpause(DAG_ID)
        # Events keep flowing during the run: its rollout and verification wait for batches.
        sent: list[PairsWorkload] = [first]
        done = threading.Event()

        def trickle() -> None:
            seed = 100
            while not done.is_set() and seed < 1_000:
                spec = PairsWorkload(n_events=1_000, n_keys=200, locality=0.8, seed=seed)
                produce_workload(
                    spec, bootstrap, topic, partitions=config.topic_partitions, rate=500
                )
                sent.append(spec)
                seed += 1

        producer = threading.Thread(target=trickle, daemon=True)
        producer.start()
        deadline = time.monotonic() + 600
        run: dict[str, Any] | None = None
        try:
            while time.monotonic() < deadline:
                runs = airflow.runs(DAG_ID)
                assert all(r["run_type"] == "scheduled" for r in runs), runs
                if runs and runs[0]["state"] in ("success", "failed"):
                    run = runs[0]
                    break
                time.sleep(5.0)
        finally:
            done.set()
            producer.join(timeout=30)
        assert run is not None, f"no scheduled run of {DAG_ID} ended within 600 s"
        assert run["state"] == "success", airflow.failed_tasks(DAG_ID, run["dag_run_id"])

        report = _wait_exact(sent, output, timeout_s=180)
        assert report.exact, report
        assert report.expected_events == sum(spec.n_events for spec in sent)
        print(f"stack up in {up_s:.0f} s; {report.expected_events:,} events counted exactly")
    finally:
        down = _keyplane(home, "stack", "down", timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert _stack_processes(home) == []
    assert network.left_over() == []
