"""What the plugin's routes call: the page, one plot, one Data Docs file.

Kept here, not in the plugin, so that everything a route returns is built and
tested without Airflow; the plugin only maps URLs to these methods and adds
Airflow's authentication.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.dashboard.metrics import (
    CachedMetrics,
    active_instances,
    points,
    summaries,
)
from keyplane.dashboard.page import render_page
from keyplane.dashboard.plots import PLOTS, PlotName, render_png
from keyplane.dashboard.timeline import DashboardPaths, load_dashboard


class DashboardService:
    """The dashboard of one deployment: its stored records and its metrics topic."""

    def __init__(self, paths: DashboardPaths, metrics: CachedMetrics) -> None:
        self.paths = paths
        self.metrics = metrics

    @classmethod
    def from_environment(cls) -> DashboardService:
        """The deployment the ``KEYPLANE_*`` variables describe (as the DAG reads them)."""
        from keyplane.settings import Settings

        settings = Settings()
        return cls(
            DashboardPaths.from_environment(),
            CachedMetrics(settings.resolved_bootstrap_servers(), settings.metrics_topic),
        )

    def _active(self, records: Sequence[BatchMetrics]) -> dict[int, dict[str, tuple[int, ...]]]:
        """The active instances of every version the records ran on."""
        versions = {v for r in records for v in r.versions.values()}
        return active_instances(self.paths.routing_store, versions)

    def page(self) -> str:
        read = self.metrics.get()
        return render_page(
            load_dashboard(self.paths, read.records),
            read,
            summaries(read.records, self._active(read.records)),
            generated_at=datetime.now(UTC),
            metrics_topic=self.metrics.topic,
            has_data_docs=(self.paths.data_docs / "index.html").is_file(),
        )

    def plot(self, name: str) -> bytes | None:
        """The PNG of plot ``name``; None for an unknown name."""
        if name not in PLOTS:
            return None
        records = self.metrics.get().records
        return render_png(cast(PlotName, name), points(records, self._active(records)))

    def data_doc(self, relative: str) -> Path | None:
        """The Data Docs file at ``relative``, or None if absent or outside the site.

        Resolving and checking containment refuses ``..`` and symlinks that
        leave the site, so the route cannot serve arbitrary files. A path the
        OS cannot take (a NUL byte, a name too long) names no file either: it
        is not found rather than a server error.
        """
        try:
            root = self.paths.data_docs.resolve()
            target = (root / relative).resolve()
            if not target.is_relative_to(root) or not target.is_file():
                return None
        except (OSError, ValueError):
            return None
        return target
