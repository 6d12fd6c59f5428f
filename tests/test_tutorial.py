"""The tutorial runs as written: docs/guides/your-own-pipeline.md, top to bottom.

Its ``python`` blocks that start with ``# path`` are written to that path and
its ``bash`` blocks run in one shell, in a scratch folder that links the
repository's ``.venv``, ``examples`` and ``dags`` (the page says "from the
repository root"). The test then checks what the page promises: version 2
active after the DAG run, and results at the sink that equal the answers
computed here, independently, from the events the producer wrote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from examples.clickstream.produce import page_views
from keyplane.testing import free_port

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs/guides/your-own-pipeline.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(PAGE.read_text())]


def expected(events: list[dict]) -> dict[tuple[str, str], object]:
    """Each stage's answer per key, from the events alone (no keyplane code)."""
    frame = pd.json_normalize(events)
    answers: dict[tuple[str, str], object] = {}
    for session, dwell in frame.groupby("session_id")["dwell_ms"].sum().items():
        answers[("sessions", str(session))] = int(dwell)
    for user, cats in frame.groupby("user_id")["page.category"].nunique().items():
        answers[("users", str(user))] = int(cats)
    for category, users in frame.groupby("page.category")["user_id"]:
        ranked = sorted(Counter(users).items(), key=lambda item: (-item[1], item[0]))[:3]
        answers[("categories", str(category))] = [[u, n] for u, n in ranked]
    return answers


def test_the_tutorial_runs_as_written_and_its_results_are_exact(tmp_path: Path) -> None:
    for name in (".venv", "examples", "dags", "plugins"):
        (tmp_path / name).symlink_to(REPO / name)
    script = ["set -euo pipefail"]
    for language, text in blocks():
        first = text.splitlines()[0] if text.strip() else ""
        if language == "python" and first.startswith("# "):
            path = tmp_path / first[2:].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif language == "bash":
            script.append(text)
    port = free_port()
    env = {
        **os.environ,
        "KEYPLANE_BROKER_PORT": str(port),
        "KEYPLANE_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}",
    }
    for name in [k for k in env if k.startswith("AIRFLOW") or k == "KEYPLANE_HOME"]:
        env.pop(name)
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    subprocess.run(
        ["bash", "-c", ".venv/bin/keyplane job stop; .venv/bin/keyplane broker stop"],
        cwd=tmp_path, env={**env, "KEYPLANE_HOME": str(tmp_path / "var/tutorial")},
        capture_output=True, timeout=120,
    )  # fmt: skip
    dag_log = tmp_path / "var/tutorial/dag.log"
    failed = (
        [line for line in dag_log.read_text().splitlines() if "ERROR" in line or "rror:" in line]
        if dag_log.exists()
        else []
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + "\n".join(failed[-20:])
    assert re.search(r"v2\b.*active", done.stdout), done.stdout[-2000:]
    rows = pd.read_parquet(tmp_path / "var/tutorial/results")
    latest = rows.sort_values("batch_id").groupby(["stage", "key"]).tail(1)
    got = {(s, k): json.loads(r) for s, k, r in latest[["stage", "key", "result"]].values}
    events = list(page_views(5_000, seed=7)) + list(page_views(5_000, seed=8))
    assert got == expected(events)
