"""A job started with fewer executors than it may hold leaves the rest free on the master.

A real Spark standalone master and three workers of 1 core, from the
stack's own pieces; an application that may hold 3 cores
(``spark.cores.max``) starts with 2 executors
(:func:`keyplane.spark.executors.start_with_executors`). The master, not the
driver, must then report 2 executors for it and 1 core free, and keep it so:
nothing grants the application the third core by itself. The driver runs in
a process of its own, so no SparkContext of this test session is reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from keyplane.stack.config import StackConfig
from keyplane.stack.network import Network
from keyplane.stack.spark import SparkMaster, SparkWorkers, master_state
from keyplane.testing import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DRIVER = """
import json, sys, time
from keyplane.spark.executors import registered_executors, start_with_executors
from keyplane.spark.session import build_session

spark = build_session("keyplane-initial-executors", sys.argv[1], extra={"spark.cores.max": "3"})
kept = start_with_executors(spark.sparkContext, 2, wait_s=180.0)
print(json.dumps({"kept": kept}), flush=True)
time.sleep(15)
print(json.dumps({"later": registered_executors(spark.sparkContext)}), flush=True)
sys.stdin.read()
spark.stop()
"""


def _application(state: dict[str, Any] | None) -> dict[str, Any]:
    (app,) = [a for a in (state or {}).get("activeapps", []) if a.get("state") == "RUNNING"]
    return dict(app)


@pytest.mark.timeout(600)
def test_the_job_starts_with_its_initial_executors_while_the_master_keeps_a_core_free(
    tmp_path: Path,
) -> None:
    config = StackConfig(
        workers=3,
        worker_cores=1,
        # The master and workers only; the driver below sets its own spark.cores.max.
        job_cores=2,
        batch_cores=1,
        shaping="off",
        spark_master_port=free_port(),
        spark_ui_port=free_port(),
        spark_worker_ui_port=free_port(),
    )
    unshaped = Network(shaped=False, reason="a test on loopback")
    master = SparkMaster(tmp_path / "stack", config, unshaped)
    workers = SparkWorkers(tmp_path / "stack", config, unshaped, master)
    driver: subprocess.Popen[str] | None = None
    try:
        master.up()
        workers.up()
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, master.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
        )
        assert driver.stdout is not None
        kept = json.loads(driver.stdout.readline() or "{}").get("kept")
        assert kept is not None and len(kept) == 2, kept
        later = json.loads(driver.stdout.readline() or "{}").get("later")
        assert later == kept
        deadline = time.monotonic() + 30
        state = master_state(master.ui_url)
        while _application(state).get("cores") != 2 and time.monotonic() < deadline:
            time.sleep(1.0)
            state = master_state(master.ui_url)
        assert _application(state)["cores"] == 2, state
        assert sum(w["coresfree"] for w in state["workers"] if w["state"] == "ALIVE") == 1
    finally:
        if driver is not None:
            driver.communicate(input="", timeout=120)
        workers.down()
        master.down()
