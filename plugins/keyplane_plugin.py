"""The keyplane dashboard in the Airflow UI (Airflow 3 plugin).

A FastAPI app mounted at ``/keyplane`` serves the page, its plots and the
Great Expectations Data Docs; an external view puts it in the UI's navigation
(shown in an iframe under ``/plugin/keyplane``). Everything it shows is built
by :mod:`keyplane.dashboard` from stored results, so this file only wires
routes.

Airflow does not protect plugin apps by itself, so every route requires an
Airflow user allowed to view plugins: the UI's session cookie (sent along by
the iframe) or a bearer token from ``POST /auth/token``.
"""

from __future__ import annotations

from functools import cache

from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
from airflow.api_fastapi.core_api.security import requires_access_view
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from keyplane.dashboard.service import DashboardService

URL_PREFIX = "/keyplane"


@cache
def _service() -> DashboardService:
    return DashboardService.from_environment()


require_viewer = requires_access_view(AccessView.PLUGINS)
"""Who may see the dashboard: users allowed to view plugins."""

app = FastAPI(title="keyplane dashboard", dependencies=[Depends(require_viewer)])


@app.get("/", response_class=HTMLResponse)
def page() -> HTMLResponse:
    return HTMLResponse(_service().page(), headers={"Cache-Control": "no-store"})


@app.get("/plots/{name}.png")
def plot(name: str) -> Response:
    png = _service().plot(name)
    if png is None:
        raise HTTPException(status_code=404, detail=f"no plot {name!r}")
    return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})


@app.get("/data-docs/{path:path}")
def data_docs(path: str) -> Response:
    if not path:
        return RedirectResponse("index.html")
    target = _service().data_doc(path)
    if target is None:
        raise HTTPException(status_code=404, detail="no such Data Docs page")
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
