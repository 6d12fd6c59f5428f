"""Airflow on this machine, with keyplane's DAGs and dashboard plugin: ``keyplane airflow``.

Four processes, as Airflow 3 runs in production: the API server (the UI and
the REST API), the scheduler (with the LocalExecutor, whose workers run the
tasks), the dag processor (parses the DAG files) and the triggerer (the
rollout's deferred waits, the metrics watcher). Metadata in SQLite under
``$KEYPLANE_HOME/airflow``, or in the database that ``database_url`` names
(``keyplane stack`` runs them on PostgreSQL); the connections and ``KEYPLANE_*`` variables are
those of :class:`~keyplane.orchestration.dagrun.AirflowSetup`, so the tasks
see the same deployment as ``keyplane job`` and ``airflow dags test``.

Parallelism is small on purpose: a LocalExecutor starts a worker per slot
(``airflow standalone`` defaults to 32), and a reconfiguration run holds at
most one slot at a time besides its Spark job, which is parallel by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from keyplane.orchestration.dagrun import AirflowSetup, airflow_command, migrate_database

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
ADMIN = "admin"


@dataclass(frozen=True)
class LocalAirflow:
    """What ``keyplane airflow`` runs: the setup, where the plugin lives, and its sizes."""

    setup: AirflowSetup
    plugins_folder: Path
    port: int = 8080
    parallelism: int = 4
    host: str = "127.0.0.1"
    database_url: str | None = None
    """SQLAlchemy URL of the metadata database; None: SQLite under the Airflow home."""
    extra_environment: tuple[tuple[str, str], ...] = ()
    """More variables for every component and the tasks they run (``SPARK_LOCAL_IP``)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def passwords_file(self) -> Path:
        """Where Airflow's simple auth manager writes the generated password of ``admin``."""
        return self.setup.airflow_home / "simple_auth_manager_passwords.json.generated"

    def _jwt_secret(self) -> str:
        """One secret per Airflow home, shared by every component (the API server signs
        the workers' tokens, the others present them)."""
        path = self.setup.airflow_home / "jwt_secret"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(32))
        return path.read_text().strip()

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        database = (
            {}
            if self.database_url is None
            else {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.database_url}
        )
        return {
            **self.setup.environment(base),
            **database,
            **dict(self.extra_environment),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.plugins_folder),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(self.parallelism),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN}:admin",
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__HOST": self.host,
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": self._jwt_secret(),
            "AIRFLOW__SCHEDULER__STANDALONE_DAG_PROCESSOR": "True",
            "AIRFLOW__TRIGGERER__CAPACITY": "100",
        }

    def commands(self) -> dict[str, list[str]]:
        airflow = airflow_command()
        return {
            "api-server": [airflow, "api-server", "--port", str(self.port), "--host", self.host],
            "scheduler": [airflow, "scheduler"],
            "dag-processor": [airflow, "dag-processor"],
            "triggerer": [airflow, "triggerer"],
        }

    def login_lines(self) -> list[str]:
        return [
            f"Airflow UI: {self.url}  (keyplane dashboard: {self.url}/keyplane/)",
            f"log in as {ADMIN!r} with the password in {self.passwords_file}",
            "  (written when the API server first starts)",
            f"logs: {self.setup.airflow_home / 'logs'}; stop with Ctrl-C",
        ]


def component_health(url: str, timeout_s: float = 2.0) -> dict[str, str]:
    """Each component's status as the API server reports it (``metadatabase``,
    ``scheduler``, ``triggerer``, ``dag_processor``); empty when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=timeout_s) as reply:
            report = json.loads(reply.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return {
        name: str(part.get("status"))
        for name, part in report.items()
        if isinstance(part, dict) and "status" in part
    }


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the API server answers its health check with a healthy metadatabase."""
    try:
        with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=timeout_s) as reply:
            return b'"healthy"' in reply.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Running:
    """The started components, by name, and where each logs."""

    processes: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]

    def failed(self) -> dict[str, int]:
        """Components that exited, with their exit codes."""
        return {name: code for name, p in self.processes.items() if (code := p.poll()) is not None}

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every component's process group (it and the workers it started),
        SIGKILL what outlives ``timeout_s``."""
        for process in self.processes.values():
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for process in self.processes.values():
            _signal_group(process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[bytes], sent: signal.Signals) -> None:
    """Signal the process group a component leads (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sent)


def start(local: LocalAirflow) -> Running:
    """Migrate the metadatabase, then start the four components, each logging to a file."""
    env = local.environment()
    migrate_database(local.setup, env)
    folder = local.setup.airflow_home / "logs" / "components"
    folder.mkdir(parents=True, exist_ok=True)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    for name, command in local.commands().items():
        logs[name] = folder / f"{name}.log"
        with logs[name].open("ab") as out:
            processes[name] = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
    return Running(processes, logs)


def wait_until_up(local: LocalAirflow, running: Running, timeout_s: float = 300.0) -> str | None:
    """None once the API server answers healthy; else why not (a component exited, time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        failed = running.failed()
        if failed:
            name, code = next(iter(failed.items()))
            return f"airflow {name} exited with code {code}; see {running.logs[name]}"
        if healthy(local.url):
            return None
        time.sleep(1.0)
    return f"the API server did not answer at {local.url} within {timeout_s:.0f} s"


def serve(local: LocalAirflow, echo: Callable[[str], None] = print) -> int:
    """Run until Ctrl-C (or SIGTERM) or until a component exits; return the exit code.

    The components run in sessions of their own, so a terminal's Ctrl-C reaches
    only this process, which stops them all in order.
    """

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    running = start(local)
    try:
        problem = wait_until_up(local, running)
        if problem is not None:
            echo(problem)
            return 1
        for line in local.login_lines():
            echo(line)
        while not running.failed():
            time.sleep(1.0)
        name, code = next(iter(running.failed().items()))
        echo(f"airflow {name} exited with code {code}; see {running.logs[name]}")
        return 1
    except KeyboardInterrupt:
        echo("stopping Airflow")
        return 0
    finally:
        running.stop()


def project_folders() -> tuple[Path, Path]:
    """The DAGs and plugins folders of the project this keyplane is installed from."""
    import keyplane

    root = Path(keyplane.__file__).resolve().parents[2]
    dags, plugins = root / "dags", root / "plugins"
    if not dags.is_dir():
        raise FileNotFoundError(
            f"no dags folder at {dags}: run from a keyplane checkout or pass --dags-folder"
        )
    return dags, plugins
