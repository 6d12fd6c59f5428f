"""What the plugin's routes call: the state document, one Data Docs file.

Kept here, not in the plugin, so that everything a route returns is built and
tested without Airflow; the plugin only maps URLs to these methods, adds
Airflow's authentication and reads the failed runs from Airflow's database.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.dashboard.assets import offline_data_doc, static_file
from keyplane.dashboard.metrics import CachedMetrics, MetricsRead, active_instances, summaries
from keyplane.dashboard.timeline import DashboardPaths, load_dashboard
from keyplane.dashboard.view import FailedRun, JobFacts, document, job_health

FactsReader = Callable[[MetricsRead], JobFacts]
"""Asks the job's process, checkpoint and topics what the health panel shows."""


def no_facts(metrics: MetricsRead) -> JobFacts:
    """Nothing known about the job but its metrics (a server that cannot see it)."""
    return JobFacts(None, None, None, None)


class DashboardService:
    """The dashboard of one deployment: its stored records and its metrics topic."""

    def __init__(
        self, paths: DashboardPaths, metrics: CachedMetrics, facts: FactsReader = no_facts
    ) -> None:
        self.paths = paths
        self.metrics = metrics
        self.facts = facts
        self._facts: tuple[MetricsRead, JobFacts] | None = None

    def _job_facts(self, read: MetricsRead) -> JobFacts:
        """The job's facts, asked once per metrics read: a refresh within the metrics
        cache's lifetime costs no Kafka round trip."""
        if self._facts is None or self._facts[0] is not read:
            self._facts = (read, self.facts(read))
        return self._facts[1]

    @classmethod
    def from_environment(cls) -> DashboardService:
        """The deployment the ``KEYPLANE_*`` variables describe (as the DAG reads them)."""
        from keyplane.settings import Settings

        settings = Settings()
        return cls(
            DashboardPaths.from_environment(),
            CachedMetrics(settings.resolved_bootstrap_servers(), settings.metrics_topic),
            lambda read: job_facts(settings, read),
        )

    def _active(self, records: Sequence[BatchMetrics]) -> dict[int, dict[str, tuple[int, ...]]]:
        """The active instances of every version the records ran on."""
        versions = {v for r in records for v in r.versions.values()}
        return active_instances(self.paths.routing_store, versions)

    def state(
        self, failed: Sequence[FailedRun] | None = None, now: datetime | None = None
    ) -> dict[str, Any]:
        """The page's JSON document; ``failed`` are the failed DAG runs (None: not known)."""
        read = self.metrics.get()
        active = self._active(read.records)
        dashboard = load_dashboard(self.paths, read.records)
        now = now or datetime.now(UTC)
        return document(
            dashboard,
            read,
            summaries(read.records, active),
            active=active,
            controller=dashboard.controller,
            configs=dashboard.configs,
            weights=dashboard.weights,
            validations=dashboard.validations,
            health=job_health(self._job_facts(read), read, now),
            failed=failed,
            generated_at=now,
            metrics_topic=self.metrics.topic,
            has_data_docs=(self.paths.data_docs / "index.html").is_file(),
        )

    def data_doc(self, relative: str) -> Path | None:
        """The Data Docs file at ``relative``, or None if absent or outside the site.

        Resolving and checking containment refuses ``..`` and symlinks that
        leave the site, so the route cannot serve arbitrary files. A path the
        OS cannot take (a NUL byte, a name too long) names no file either: it
        is not found rather than a server error.
        """
        return static_file(relative, self.paths.data_docs)

    def data_doc_page(self, relative: str) -> str | None:
        """An HTML page of the Data Docs with its CDN assets served from here.

        The page is served at ``<prefix>/data-docs/<relative>`` and the
        libraries at ``<prefix>/static/vendor/``; the URL between them is
        relative, so the site works under any prefix or proxy.
        """
        target = self.data_doc(relative)
        if target is None:
            return None
        depth = len(target.relative_to(self.paths.data_docs.resolve()).parts) - 1
        html = target.read_text(encoding="utf-8", errors="replace")
        return offline_data_doc(html, depth, "../" * (depth + 1) + "static/vendor/")


def job_facts(settings: Any, read: MetricsRead) -> JobFacts:
    """The job's process, its checkpoint's offsets, the events' ends and the dead letters.

    Kafka is asked only when the metrics read found it answering, so a
    stopped broker costs the page no second timeout.
    """
    from kafka.errors import KafkaError

    from keyplane.kafka.admin import (
        TopicError,
        earliest_offsets,
        high_watermarks,
        partitions_of,
    )
    from keyplane.spark.job_checkpoint import last_committed_batch
    from keyplane.spark.jobprocess import JobProcess

    try:
        job = JobProcess(settings)
        running: bool | None = job.running() is not None
        committed = last_committed_batch(job.checkpoint, settings.events_topic)
    except (OSError, ValueError, RuntimeError):
        running, committed = None, None
    ends: dict[int, int] | None = None
    dead: int | None = None
    if read.available:
        bootstrap = settings.resolved_bootstrap_servers()
        # A topic that does not exist is known in a second, not the default ten.
        try:
            parts = partitions_of(bootstrap, settings.events_topic, timeout_s=1.0)
            ends = high_watermarks(bootstrap, settings.events_topic, parts)
        except (KafkaError, TopicError, OSError):
            ends = None
        try:
            parts = partitions_of(bootstrap, settings.dead_letter_topic, timeout_s=1.0)
            last = high_watermarks(bootstrap, settings.dead_letter_topic, parts)
            first = earliest_offsets(bootstrap, settings.dead_letter_topic, parts)
            dead = sum(max(0, end - first.get(p, 0)) for p, end in last.items())
        except TopicError:
            dead = 0
        except (KafkaError, OSError):
            dead = None
    return JobFacts(
        process_running=running,
        end_offsets=ends,
        committed_offsets=None if committed is None else committed.offsets,
        dead_letters=dead,
    )
