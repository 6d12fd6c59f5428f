"""The keyplane dashboard in the Airflow UI (Airflow 3 plugin).

A FastAPI app mounted at ``/keyplane`` serves the page (static HTML and
JavaScript that draw with ECharts, all from this server), its JSON state and
the Great Expectations Data Docs; an external view puts it in the UI's
navigation (shown in an iframe under ``/plugin/keyplane``). Everything it
shows is built by :mod:`keyplane.dashboard` from stored results; this file
wires routes and reads the failed runs of keyplane's DAGs from Airflow's
database, which the API server already holds a session to.

Airflow does not protect plugin apps by itself, so every route requires an
Airflow user allowed to view plugins: the UI's session cookie (sent along by
the iframe) or a bearer token from ``POST /auth/token``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
from airflow.api_fastapi.core_api.security import requires_access_view
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from keyplane.dashboard.assets import STATIC, static_file
from keyplane.dashboard.service import DashboardService
from keyplane.dashboard.view import FailedRun

URL_PREFIX = "/keyplane"
DAG_IDS = ("keyplane_reconfigure", "keyplane_scale")
FAILED_RUNS = 20
"""Failed runs listed: the newest ones, enough to see a pattern."""
NO_STORE = {"Cache-Control": "no-store"}


@cache
def _service() -> DashboardService:
    return DashboardService.from_environment()


require_viewer = requires_access_view(AccessView.PLUGINS)
"""Who may see the dashboard: users allowed to view plugins."""

app = FastAPI(title="keyplane dashboard", dependencies=[Depends(require_viewer)])


def failed_runs() -> list[FailedRun] | None:
    """The newest failed runs of keyplane's DAGs and their failed tasks; None if unreadable."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with create_session() as session:
            runs = session.execute(
                select(DagRun.dag_id, DagRun.run_id, DagRun.start_date, DagRun.end_date)
                .where(DagRun.dag_id.in_(DAG_IDS), DagRun.state == DagRunState.FAILED)
                .order_by(DagRun.end_date.desc())
                .limit(FAILED_RUNS)
            ).all()
            tasks: dict[tuple[str, str], list[tuple[str, int]]] = {}
            if runs:
                rows = session.execute(
                    select(
                        TaskInstance.dag_id,
                        TaskInstance.run_id,
                        TaskInstance.task_id,
                        TaskInstance.map_index,
                    ).where(
                        TaskInstance.dag_id.in_(DAG_IDS),
                        TaskInstance.run_id.in_([r.run_id for r in runs]),
                        TaskInstance.state == TaskInstanceState.FAILED,
                    )
                ).all()
                for row in rows:
                    tasks.setdefault((row.dag_id, row.run_id), []).append(
                        (row.task_id, row.map_index)
                    )
    except SQLAlchemyError:
        return None
    return [
        FailedRun(
            r.dag_id,
            r.run_id,
            r.start_date,
            r.end_date,
            tuple(sorted(tasks.get((r.dag_id, r.run_id), []))),
        )
        for r in runs
    ]


@app.get("/", response_class=HTMLResponse)
def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=NO_STORE)


@app.get("/api/state")
def state() -> dict[str, Any]:
    return _service().state(failed_runs())


@app.get("/data-docs/{path:path}")
def data_docs(path: str) -> Response:
    if not path:
        return RedirectResponse("index.html")
    if path.endswith(".html"):
        html = _service().data_doc_page(path)
        if html is not None:
            return HTMLResponse(html)
    target = _service().data_doc(path)
    if target is None:
        raise HTTPException(status_code=404, detail="no such Data Docs page")
    return FileResponse(target)


@app.get("/static/{path:path}")
def static(path: str) -> FileResponse:
    target = static_file(path)
    if target is None:
        raise HTTPException(status_code=404, detail="no such file")
    return FileResponse(target)


class KeyplanePlugin(AirflowPlugin):
    """Registers the app and its navigation entry.

    ``AirflowPlugin`` declares these as plain class-level lists, so they are
    overridden the same way (hence the RUF012 exemptions).
    """

    name = "keyplane"
    fastapi_apps = [  # noqa: RUF012
        {"app": app, "url_prefix": URL_PREFIX, "name": "keyplane dashboard"}
    ]
    external_views = [  # noqa: RUF012
        {
            "name": "keyplane",
            "href": "keyplane/",
            "url_route": "keyplane",
            "destination": "nav",
            "category": "browse",
        }
    ]
