"""A Spark standalone cluster from the installed PySpark's own classes.

The master runs on this machine; each worker runs ``spark-class
org.apache.spark.deploy.worker.Worker`` with ``worker_cores`` cores and
``worker_memory``, in its network namespace when the links are shaped
(:mod:`keyplane.stack.network`). The master gives an application that does
not set ``spark.cores.max`` at most ``batch_cores`` cores
(``spark.deploy.defaultCores``), and the routed job's driver reads
``spark.cores.max`` = ``job_cores`` from a ``spark-defaults.conf`` of its
own (:func:`job_conf_dir`), as ``docker-compose.yml`` sets both.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from keyplane.stack.config import StackConfig
from keyplane.stack.network import Network
from keyplane.stack.piece import Health, Processes, wait_until_up

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def spark_home() -> Path:
    """The installed PySpark, which holds the full Spark distribution (``bin/``, ``jars/``)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def job_conf_dir(home: Path, config: StackConfig) -> Path:
    """A ``SPARK_CONF_DIR`` for the routed job's driver: the cores it holds."""
    folder = home / "spark" / "job-conf"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spark-defaults.conf").write_text(f"spark.cores.max {config.job_cores}\n")
    return folder


def master_state(ui_url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The master's ``/json`` (its status and workers), or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{ui_url}/json", timeout=timeout_s) as reply:
            state = json.loads(reply.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def alive_workers(state: dict[str, Any] | None) -> int:
    if state is None:
        return 0
    return sum(1 for worker in state.get("workers", []) if worker.get("state") == "ALIVE")


def _environment(bind: str, folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": bind,
        "SPARK_LOCAL_DIRS": str(folder / "tmp"),
        "SPARK_LOG_DIR": str(folder),
        "SPARK_NO_DAEMONIZE": "1",
    }


class SparkMaster:
    name = "spark-master"

    def __init__(self, home: Path, config: StackConfig, network: Network) -> None:
        self.folder = home / "spark"
        self.processes = Processes(home / "pids")
        self.host = config.address(0) if network.shaped else "127.0.0.1"
        self.config = config

    @property
    def url(self) -> str:
        return f"spark://{self.host}:{self.config.spark_master_port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.config.spark_ui_port}"

    @property
    def log(self) -> Path:
        return self.folder / "master.log"

    def up(self) -> None:
        if self.processes.running(self.name) is None:
            command = [
                str(spark_home() / "bin" / "spark-class"),
                MASTER_CLASS,
                "--host",
                self.host,
                "--port",
                str(self.config.spark_master_port),
                "--webui-port",
                str(self.config.spark_ui_port),
            ]
            env = _environment(self.host, self.folder)
            env["SPARK_MASTER_OPTS"] = f"-Dspark.deploy.defaultCores={self.config.batch_cores}"
            env["SPARK_DAEMON_MEMORY"] = "512m"
            (self.folder / "tmp").mkdir(parents=True, exist_ok=True)
            self.processes.start(self.name, command, self.log, env)
        wait_until_up(
            self,
            90.0,
            exited=lambda: (
                f"spark-master exited; see {self.log}"
                if self.processes.running(self.name) is None
                else None
            ),
            timed_out=lambda: f"spark-master did not answer at {self.ui_url}/json; see {self.log}",
        )

    def down(self) -> bool:
        return self.processes.stop(self.name)

    def health(self) -> Health:
        state = master_state(self.ui_url)
        up = state is not None and state.get("status") == "ALIVE"
        detail = f"ALIVE, UI {self.ui_url}" if up else f"no ALIVE master; log {self.log}"
        return Health(piece=self.name, up=up, url=self.url, detail=detail)


class SparkWorkers:
    """The workers, one process each, healthy when the master counts them all ALIVE."""

    name = "spark-workers"

    def __init__(self, home: Path, config: StackConfig, network: Network, master: SparkMaster):
        self.folder = home / "spark"
        self.processes = Processes(home / "pids")
        self.config = config
        self.network = network
        self.master = master

    @property
    def log(self) -> Path:
        return self.folder / "worker-1.log"

    def _host(self, index: int) -> str:
        return self.config.address(index) if self.network.shaped else "127.0.0.1"

    def _command(self, index: int) -> list[str]:
        inside = (
            ["ip", "netns", "exec", self.network.namespaces[index - 1]]
            if self.network.shaped
            else []
        )
        return [
            *inside,
            str(spark_home() / "bin" / "spark-class"),
            WORKER_CLASS,
            self.master.url,
            "--host",
            self._host(index),
            "--cores",
            str(self.config.worker_cores),
            "--memory",
            self.config.worker_memory,
            "--webui-port",
            str(self.config.spark_worker_ui_port + index - 1),
            "--work-dir",
            str(self.folder / f"work-{index}"),
        ]

    def up(self) -> None:
        for index in range(1, self.config.workers + 1):
            name = f"spark-worker-{index}"
            if self.processes.running(name) is None:
                log = self.folder / f"worker-{index}.log"
                env = _environment(self._host(index), self.folder)
                env["SPARK_DAEMON_MEMORY"] = "256m"
                self.processes.start(name, self._command(index), log, env)
        wait_until_up(
            self,
            120.0,
            exited=lambda: next(
                (
                    f"spark-worker-{index} exited; see {self.folder / f'worker-{index}.log'}"
                    for index in range(1, self.config.workers + 1)
                    if self.processes.running(f"spark-worker-{index}") is None
                ),
                None,
            ),
            timed_out=lambda: (
                f"spark-workers: fewer than {self.config.workers} ALIVE at "
                f"{self.master.ui_url}/json; see {self.folder}/worker-*.log"
            ),
        )

    def down(self) -> bool:
        stopped = [
            self.processes.stop(f"spark-worker-{index}")
            for index in range(1, self.config.workers + 1)
        ]
        return any(stopped)

    def health(self) -> Health:
        alive = alive_workers(master_state(self.master.ui_url))
        wanted = self.config.workers
        return Health(
            piece=self.name,
            up=alive >= wanted,
            url=self.master.ui_url,
            detail=f"{alive}/{wanted} ALIVE, {self.config.worker_cores} core and "
            f"{self.config.worker_memory} each",
        )
