"""The dashboard in a real Airflow, seen by a real browser.

``airflow standalone`` runs with the repository's ``plugins/`` folder, SQLite
and the simple auth manager with authentication on. The test logs in as the
generated admin (password from the standalone password file, token from
``POST /auth/token``), then drives headless Chromium over the DevTools
protocol: the token goes into the UI's session cookie, as the login page
would set it, and the browser opens the dashboard both on its own and inside
the Airflow UI (the external view's iframe). It fails when the version
timeline is missing a version or any plot does not load as a real image.
Screenshots are kept under ``artifacts/dashboard/`` (the path is printed).

Skipped when Chromium is not installed (Debian: ``apt-get install chromium``;
``make test`` installs it), except in CI, where ``KEYPLANE_REQUIRE_BROWSER``
turns the skip into a failure.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from dashboard_home import HOT_KEY, MeteredProtocolJob, P, PreparedHome

from keyplane.control.operators import OPERATORS
from keyplane.dashboard.assets import remote_assets
from keyplane.orchestration import run_records
from keyplane.testing import free_port, paired_tuple_counts, write_statistics_snapshot

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STARTUP_TIMEOUT_S = 180


@dataclass(frozen=True)
class Airflow:
    base: str
    home: Path


@pytest.fixture(scope="module")
def airflow(
    prepared_home: PreparedHome, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Airflow]:
    """``airflow standalone`` with the keyplane plugin and DAGs, its API server on a free port.

    The DAGs are paused, as Airflow creates them, until a trigger unpauses one."""
    home = tmp_path_factory.mktemp("airflow_home")
    port = free_port()
    venv_bin = Path(sys.executable).parent
    env = {
        **os.environ,
        **prepared_home.environment(),
        "AIRFLOW_HOME": str(home),
        # SQLite with a 60 s busy timeout: under load the scheduler, the API server and
        # the task processes contend for the one file, and the default 5 s ends the
        # scheduler with "database is locked".
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}?timeout=60",
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__LAZY_LOAD_PLUGINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    log_path = home / "standalone.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(venv_bin / "airflow"), "standalone"],
            env=env,
            cwd=home,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"airflow standalone exited:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:]
                pytest.fail(f"airflow did not answer in {STARTUP_TIMEOUT_S} s:\n{tail}")
            time.sleep(1)
        yield Airflow(base, home)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _admin_token(base: str, airflow_home: Path) -> str:
    passwords = json.loads(
        (airflow_home / "simple_auth_manager_passwords.json.generated").read_text()
    )
    response = httpx.post(
        f"{base}/auth/token",
        json={"username": "admin", "password": passwords["admin"]},
        timeout=10,
    )
    assert response.status_code in (200, 201), response.text
    return str(response.json()["access_token"])


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        # No keepalive and no receive bound: the browser's events pile up while a test
        # waits minutes for a DAG run, and a bounded queue would stop reading the socket,
        # pongs included, and end the connection.
        self._socket = connect(
            url, max_size=64 * 1024 * 1024, open_timeout=10, ping_interval=None, max_queue=None
        )
        self._ids = itertools.count(1)

    def call(self, method: str, timeout_s: float = 30, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def open(self, url: str, ready: str, timeout_s: float = 30) -> None:
        """Navigate and wait until the JavaScript expression ``ready`` is true."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(ready):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: {ready} never became true")
            time.sleep(0.25)

    def screenshot(self, path: Path, full_page: bool = True) -> int:
        result = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=full_page)
        data = base64.b64decode(result["data"])
        path.write_bytes(data)
        return len(data)

    def close(self) -> None:
        self._socket.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    if CHROMIUM is None:
        message = "Chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("KEYPLANE_REQUIRE_BROWSER"):
            pytest.fail(message + "; CI requires it (scripts/install-browser)")
        pytest.skip(message)
    port = free_port()
    process = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1400,1000",
            f"--user-data-dir={tmp_path / 'chromium'}",
            f"--remote-debugging-port={port}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        pages: list[dict[str, Any]] = []
        while not pages:
            try:
                listed = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                pages = [p for p in listed if p.get("type") == "page"]
            except (OSError, httpx.HTTPError, ValueError):
                pass
            if not pages:
                if time.monotonic() > deadline:
                    pytest.fail("Chromium's DevTools endpoint did not come up")
                time.sleep(0.3)
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        tools.call("Page.enable")
        tools.call("Network.enable")
        yield tools
        tools.close()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


DASHBOARD_READY = (
    "document.body.dataset.loaded !== undefined && "
    "document.querySelectorAll('.heatmap canvas').length > 0 && "
    "document.querySelectorAll('#chart-locality canvas').length > 0"
)


def _rendered_dashboard(browser: DevTools) -> dict[str, Any]:
    """What the page shows once drawn: versions, rollout steps, heatmaps, charts."""
    return dict(
        browser.evaluate(
            """(() => ({
  active: document.getElementById('active-version').textContent,
  live: document.getElementById('live').textContent,
  rows: Array.from(document.querySelectorAll('#timeline tr.version-row'))
    .map(r => r.dataset.version),
  steps: Array.from(document.querySelectorAll('#rollout-steps li.step')).map(
    s => [s.dataset.step, s.dataset.stage || null, s.classList.contains('done')]),
  rollout: (document.getElementById('rollout-summary') || {}).textContent,
  heatmaps: Array.from(document.querySelectorAll('.heatmap')).map(h => [h.dataset.stage,
    !!h.querySelector('canvas') && h.querySelector('canvas').width > 300]),
  charts: Array.from(document.querySelectorAll('.chart canvas')).length,
  note: document.getElementById('metrics-note').textContent,
  health: document.getElementById('health-state').textContent,
  hot: document.querySelectorAll('#hot-keys tr.hot-key').length,
  moved: document.querySelectorAll('#moved-keys tr.moved-key').length,
  routing: document.querySelectorAll('.routing-stage').length,
  quality: document.querySelectorAll('#quality-table tr.quality-row').length,
  docs: Array.from(document.querySelectorAll('a.data-docs')).map(a => a.href),
  problems: Array.from(document.querySelectorAll('.problem')).map(p => p.textContent),
}))()"""
        )
    )


def test_dashboard_shows_timeline_rollout_and_heatmaps_in_airflow(
    airflow: Airflow, prepared_home: PreparedHome, browser: DevTools
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    base = airflow.base

    # Authentication is on: no token, no page and no data.
    for route in ("/keyplane/", "/keyplane/api/state"):
        anonymous = httpx.get(f"{base}{route}", timeout=10)
        assert anonymous.status_code in (401, 403), (route, anonymous.status_code)

    token = _admin_token(base, airflow.home)
    headers = {"Authorization": f"Bearer {token}"}
    state = httpx.get(f"{base}/keyplane/api/state", headers=headers, timeout=30).json()
    assert [v["version"] for v in state["versions"]] == [2, 1]
    assert state["metrics"]["available"], state["metrics"]
    assert [h["stage"] for h in state["heatmaps"]] == list(OPERATORS)
    assert all(len(h["cells"]) == prepared_home.batches * P for h in state["heatmaps"])
    assert state["rollout"]["state"] == "done" and state["rollout"]["version"] == 2
    assert state["failed_runs"] == []
    page = httpx.get(f"{base}/keyplane/", headers=headers, timeout=30)
    assert page.status_code == 200 and remote_assets(page.text) == []

    # The browser: the UI's session cookie, then the page alone and inside the UI.
    # Every request that would leave this machine is blocked: the page must not need one.
    browser.call("Network.setBlockedURLs", urls=["https://*", "http://cdn*", "*unpkg.com*"])
    browser.call("Network.setCookie", name="_token", value=token, url=base, path="/")
    browser.open(f"{base}/keyplane/", DASHBOARD_READY)
    shown = _rendered_dashboard(browser)
    assert shown["active"] == "v2" and shown["rows"] == ["2", "1"], shown
    steps = [tuple(step) for step in shown["steps"]]
    assert steps == [
        ("PREPARE", None, True),
        ("ACK", None, True),
        *[(kind, op, True) for op in OPERATORS for kind in ("PROPAGATE", "MIGRATED")],
        ("DONE", None, True),
    ], steps
    assert shown["heatmaps"] == [[op, True] for op in OPERATORS], shown["heatmaps"]
    assert shown["charts"] >= 5 and shown["routing"] == len(OPERATORS)
    assert f"{prepared_home.batches} batches with rows in the range" in shown["note"], shown
    # No job process runs in the prepared home: the version is the last known, not live.
    assert (shown["health"], shown["live"]) == ("down", "last known: job down"), shown
    assert shown["hot"] >= 1 and shown["moved"] >= 1 and shown["quality"] >= 1
    assert shown["docs"], "no Data Docs link"
    alone = ARTIFACTS / "dashboard.png"
    assert browser.screenshot(alone) > 50_000

    # The Data Docs, served with their libraries from here: styled, and the index
    # table filled by bootstrap-table, with the internet out of reach.
    index = httpx.get(f"{base}/keyplane/data-docs/index.html", headers=headers, timeout=10)
    assert index.status_code == 200 and remote_assets(index.text) == []
    browser.open(
        f"{base}/keyplane/data-docs/index.html",
        "document.readyState === 'complete' && !!window.jQuery && "
        "document.querySelectorAll('table tbody tr').length > 0",
    )
    assert browser.evaluate("getComputedStyle(document.body).fontFamily") != "", "unstyled"
    browser.screenshot(ARTIFACTS / "data-docs.png", full_page=False)
    doc_page = httpx.get(shown["docs"][0], headers=headers, timeout=10)
    assert doc_page.status_code == 200 and remote_assets(doc_page.text) == []

    browser.call(
        "Emulation.setDeviceMetricsOverride",
        width=1400,
        height=1000,
        deviceScaleFactor=1,
        mobile=False,
    )
    browser.open(
        f"{base}/plugin/keyplane",
        "(() => { const f = document.querySelector('iframe');"
        " const d = f && f.contentDocument;"
        " return !!(d && d.body && d.body.dataset.loaded !== undefined"
        " && d.querySelectorAll('.heatmap canvas').length > 0); })()",
        timeout_s=45,
    )
    in_ui = ARTIFACTS / "dashboard-in-airflow.png"
    browser.screenshot(in_ui, full_page=False)
    print(f"\nscreenshots: {alone} {in_ui}")

    # The navigation entry: the UI lists it under Browse, from the plugins endpoint.
    plugins = httpx.get(f"{base}/api/v2/plugins", headers=headers, timeout=10).json()
    views = [v for p in plugins["plugins"] if p["name"] == "keyplane" for v in p["external_views"]]
    assert [v["url_route"] for v in views] == ["keyplane"], plugins
    browser.evaluate(
        "Array.from(document.querySelectorAll('button'))"
        ".find(b => b.textContent.trim() === 'Browse').click()"
    )
    deadline = time.monotonic() + 10
    while not browser.evaluate(
        "Array.from(document.querySelectorAll('[role=menuitem], a'))"
        ".some(e => e.textContent.trim() === 'keyplane')"
    ):
        assert time.monotonic() < deadline, "the Browse menu has no keyplane entry"
        time.sleep(0.25)


FLOW_TIMEOUT_S = 420
"""Longest wait for one step of the run (a shared CI machine may be slow)."""


def _api(airflow: Airflow, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"{airflow.base}/api/v2", headers={"Authorization": f"Bearer {token}"}, timeout=60
    )


def _wait(what: str, check: Any, timeout_s: float = FLOW_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(1)


def _task_states(api: httpx.Client, run_path: str) -> dict[str, str | None]:
    listed = api.get(f"{run_path}/taskInstances")
    if listed.status_code != 200:
        return {}
    return {t["task_id"]: t["state"] for t in listed.json()["task_instances"]}


def _click(browser: DevTools, selector: str, text: str | None = None) -> None:
    found = browser.evaluate(
        f"""(() => {{ const all = Array.from(document.querySelectorAll({json.dumps(selector)}));
  const want = {json.dumps(text)};
  const e = all.find(e => want === null || e.textContent.trim() === want);
  if (!e) return false; e.scrollIntoView({{block: 'center'}}); e.click(); return true; }})()"""
    )
    assert found, f"no {selector} {text or ''} to click"


def _type(browser: DevTools, selector: str, text: str) -> None:
    """Type into a field as a person does: focus, select what is there, type, Tab away."""
    focused = browser.evaluate(
        f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
  if (!e) return false; e.scrollIntoView({{block: 'center'}});
  e.focus(); e.select(); return true; }})()"""
    )
    assert focused, f"no field {selector}"
    browser.call("Input.insertText", text=text)
    for kind in ("keyDown", "keyUp"):
        browser.call(
            "Input.dispatchKeyEvent", type=kind, key="Tab", code="Tab", windowsVirtualKeyCode=9
        )


def test_a_run_triggered_in_the_form_and_approved_in_the_ui_rolls_out_to_the_dashboard(
    airflow: Airflow, prepared_home: PreparedHome, browser: DevTools
) -> None:
    """The operator's path: the trigger form with ``require_approval`` on, the run's
    Required action approved in the UI, the run succeeds, the dashboard shows the version.

    Only Spark is stood in for. As soon as the run exists, its statistics snapshot is
    written and ``collect_statistics`` (spark-submit) is marked successful through the
    REST API; the
    schedule's own run, which the form's "unpause on trigger" starts, is marked
    failed for the same reason. A :class:`MeteredProtocolJob` answers the rollout
    and writes the new version's metrics. Everything else is the real DAG: GX
    validations, the METIS/FISH plan, backtest, decision, Airflow's approval
    operator, the controller over the embedded broker, verify.
    """
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    deployment = prepared_home.deployment
    token = _admin_token(airflow.base, airflow.home)
    api = _api(airflow, token)
    browser.call("Network.setCookie", name="_token", value=token, url=airflow.base, path="/")
    started = time.monotonic()

    with MeteredProtocolJob(prepared_home, active_version=2):
        # 1. The trigger form: approval and force on, alpha typed.
        browser.open(
            f"{airflow.base}/dags/{run_records.RECONFIGURE_DAG_ID}",
            "Array.from(document.querySelectorAll('button'))"
            ".some(b => b.textContent.trim() === 'Trigger')",
            timeout_s=60,
        )
        _click(browser, "button", "Trigger")
        _wait(
            "the trigger form",
            lambda: browser.evaluate("!!document.querySelector('input[name=element_alpha]')"),
            30,
        )
        for name in ("require_approval", "force"):
            _click(browser, f"label[id='switch:element_{name}']")
            checked = f"document.querySelector('input[name=element_{name}]').checked"
            assert browser.evaluate(checked), name
        _type(browser, "input[name=element_alpha]", "1.1")
        browser.evaluate(
            "document.querySelector(\"label[id='switch:element_force']\")"
            ".scrollIntoView({block: 'start'})"
        )
        browser.screenshot(ARTIFACTS / "flow-1-trigger-form.png", full_page=False)
        _click(browser, "[role=dialog] button", "Trigger")

        # Spark's step stands in: the run's snapshot, then collect_statistics marked done.
        runs_path = f"/dags/{run_records.RECONFIGURE_DAG_ID}/dagRuns"

        def manual_run() -> dict[str, Any] | None:
            listed = api.get(runs_path).json()["dag_runs"]
            return next((r for r in listed if r["run_type"] == "manual"), None)

        run = _wait("the triggered run", manual_run, 60)
        run_id = run["dag_run_id"]
        run_path = f"{runs_path}/{quote(run_id, safe='')}"
        assert run["conf"]["require_approval"] is True and run["conf"]["force"] is True, run
        assert run["conf"]["alpha"] == 1.1, run
        write_statistics_snapshot(
            deployment.snapshots, run_id, paired_tuple_counts(48, 11, {HOT_KEY: 30})
        )

        def mark_collected() -> httpx.Response | None:
            """The task marked successful; None to try again when Airflow's SQLite was
            locked by a concurrent writer (a timeout, or a 500 after the lock's 60 s).
            Marking a task successful twice is the same as once."""
            try:
                response = api.patch(
                    f"{run_path}/taskInstances/collect_statistics", json={"new_state": "success"}
                )
            except httpx.ReadTimeout:
                return None
            return None if response.status_code >= 500 else response

        marked = _wait("collect_statistics marked successful", mark_collected, 300)
        assert marked.status_code == 200, marked.text

        def schedules_run_failed() -> bool:
            """The schedule's run, started by the unpause, cannot collect statistics
            without Spark and would hold the DAG's one active run: failed at once.
            True once it exists and is failed (the scheduler may create it late)."""
            failed = False
            try:
                for other in api.get(runs_path).json()["dag_runs"]:
                    if other["run_type"] != "scheduled":
                        continue
                    if other["state"] in ("queued", "running"):
                        other_path = f"{runs_path}/{quote(other['dag_run_id'], safe='')}"
                        api.patch(other_path, json={"state": "failed"})
                    failed = failed or other["state"] == "failed"
            except httpx.ReadTimeout:
                return False  # Airflow's SQLite was busy: the calls are idempotent
            return failed

        def awaiting_approval() -> dict[str, str | None] | None:
            try:
                schedules_run_failed()
                states = _task_states(api, run_path)
            except httpx.ReadTimeout:
                # Airflow's SQLite database was busy past the client's timeout: the
                # calls are idempotent, and the next poll makes them again.
                return None
            return states if states.get("approve_rollout") == "awaiting_input" else None

        # 2. The run plans, validates, backtests, decides, then waits for a person.
        states = _wait("approve_rollout awaiting input", awaiting_approval)
        assert states["decide"] == "success" and states["publish"] is None, states
        browser.open(
            f"{airflow.base}/dags/{run_records.RECONFIGURE_DAG_ID}/runs/{quote(run_id, safe='')}"
            "/tasks/approve_rollout/required_actions",
            "Array.from(document.querySelectorAll('button'))"
            ".some(b => b.textContent.trim() === 'Approve')",
            timeout_s=60,
        )
        body = browser.evaluate("document.body.innerText")
        assert "Roll out v" in body and "keys moved" in body, body[:2000]
        browser.screenshot(ARTIFACTS / "flow-2-approval.png", full_page=False)
        _click(browser, "button", "Approve")

        # 3. Approved: the rollout runs against the job and the run succeeds.
        _wait(
            "the run's success",
            lambda: api.get(run_path).json()["state"] in ("success", "failed"),
        )
        final = _task_states(api, run_path)
        state = api.get(run_path).json()["state"]
        assert state == "success", final
        assert final["approve_rollout"] == final["done"] == final["verify"] == "success", final
        browser.open(
            f"{airflow.base}/dags/{run_records.RECONFIGURE_DAG_ID}/runs/{quote(run_id, safe='')}",
            "document.body.innerText.includes('approve_rollout')",
            timeout_s=60,
        )
        browser.screenshot(ARTIFACTS / "flow-3-run-succeeded.png", full_page=False)
        flow_s = time.monotonic() - started

        # The schedule's run is failed before the dashboard is read, however late the
        # scheduler created it.
        _wait("the schedule's run marked failed", schedules_run_failed, 120)
        # 4. The dashboard: the new version active, its rollout's steps, its heatmaps.
        published = run_records.read_record(
            run_records.run_folder(deployment, run_records.RECONFIGURE_DAG_ID, run_id)
            / run_records.PROPOSAL,
            "p",
        )["version"]
        browser.open(
            f"{airflow.base}/keyplane/",
            DASHBOARD_READY
            + f" && document.getElementById('active-version').textContent === 'v{published}'"
            " && document.querySelectorAll('#rollout-steps li.step.done').length > 0",
            timeout_s=60,
        )
        shown = _rendered_dashboard(browser)
        assert shown["rows"][0] == str(published), shown
        assert shown["rollout"].startswith(f"v2 → v{published}: done"), shown["rollout"]
        assert all(done for _, _, done in shown["steps"]), shown["steps"]
        assert [s[0] for s in shown["steps"]][-1] == "DONE"
        assert shown["heatmaps"] == [[op, True] for op in OPERATORS], shown
        new_version_cells = browser.evaluate(
            "fetch('api/state').then(r => r.json()).then(s => s.heatmaps.map(h =>"
            f" h.batches.filter(b => b.version === {published}).length))"
        )
        assert all(count > 0 for count in new_version_cells), new_version_cells
        # The schedule's run, marked failed above, is listed with a link to it in the UI.
        failed = browser.evaluate(
            "Array.from(document.querySelectorAll('#failed-runs a.run'))"
            ".map(a => a.getAttribute('href'))"
        )
        assert failed and all(
            href.startswith(f"/dags/{run_records.RECONFIGURE_DAG_ID}/runs/scheduled__")
            for href in failed
        ), failed
        browser.screenshot(ARTIFACTS / "flow-4-dashboard.png")
    print(f"\ntrigger → approval → success in {flow_s:.0f} s; screenshots in {ARTIFACTS}")
