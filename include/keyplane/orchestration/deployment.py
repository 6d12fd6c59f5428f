"""Where the reconfiguration DAG finds the job's topics and keyplane's state.

Everything comes from the environment, as for the rest of keyplane
(:class:`keyplane.settings.Settings`, prefix ``KEYPLANE_``), so the same DAG
runs against the embedded broker in a test and against Apache Kafka in
production. Airflow connections take precedence where they exist:
``keyplane_kafka`` (``AIRFLOW_CONN_KEYPLANE_KAFKA``, the Kafka provider's
``{"conn_type": "kafka", "extra": {"bootstrap.servers": "host:port"}}``)
gives the bootstrap servers; ``spark_default`` is read by
``SparkSubmitOperator`` itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypedDict

from pydantic import BaseModel, ConfigDict, Field, model_validator

from keyplane.control.operators import stage_names
from keyplane.settings import MAX_EVENT_BYTES, BootstrapServers, Settings


class RoutedJobTopics(TypedDict):
    """The topics of one routed job besides its events (keywords of ``CountsJobSettings``)."""

    control_topic: str
    migration_topic: str
    metrics_topic: str
    dead_letter_topic: str


def routed_job_topics(prefix: str) -> RoutedJobTopics:
    """Control, migration, metrics and dead-letter topics of one routed job's own.

    Keyword arguments for :class:`~keyplane.spark.counts_job.CountsJobSettings`,
    so that jobs sharing a broker (tests, benchmark variants) never read each
    other's protocol messages or moved state.
    """
    return RoutedJobTopics(
        control_topic=f"{prefix}.control",
        migration_topic=f"{prefix}.migration",
        metrics_topic=f"{prefix}.metrics",
        dead_letter_topic=f"{prefix}.dead-letter",
    )


KAFKA_CONN_ID = "keyplane_kafka"
SPARK_CONN_ID = "spark_default"


class Deployment(BaseModel):
    """The running job's topics and the state folders the DAG's steps share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    home: Path
    bootstrap_servers: BootstrapServers
    events_topic: str
    metrics_topic: str
    control_topic: str
    routing_store: Path
    snapshots: Path
    controller_state: Path
    gx_root: Path
    pipeline: str = ""
    """The managed job's pipeline as ``module:attribute`` (default ``KEYPLANE_PIPELINE``)."""
    operators: tuple[str, ...] = ()
    """The pipeline's stages, upstream first (default: read from ``pipeline``)."""
    max_event_bytes: int = Field(default=MAX_EVENT_BYTES, ge=1)
    """The job's bound on one event's record: a larger one is not counted."""
    unpublished_versions_kept: int = Field(default=20, ge=0)
    """Versions planned but not published that the store keeps (older ones are pruned)."""

    @model_validator(mode="before")
    @classmethod
    def _stages_of_the_pipeline(cls, data: Any) -> Any:
        """The configured pipeline, and its stages, unless given."""
        if isinstance(data, dict):
            spec = data.get("pipeline") or Settings().pipeline
            data = {**data, "pipeline": spec}
            if not data.get("operators"):
                data["operators"] = stage_names(spec)
        return data

    @classmethod
    def from_environment(cls, bootstrap_servers: str | None = None) -> Deployment:
        """The deployment the ``KEYPLANE_*`` variables describe.

        ``KEYPLANE_ROUTING_STORE`` and ``KEYPLANE_STATISTICS_DIR`` override the
        store and the snapshot folder (default ``$KEYPLANE_HOME/configs`` and
        ``$KEYPLANE_HOME/statistics``); the controller's state file is
        ``$KEYPLANE_HOME/controller.json``, the one ``keyplane config
        publish`` uses, so the CLI and the DAG see the same rollout.
        """
        settings = Settings()
        home = settings.home.resolve()
        store = os.environ.get("KEYPLANE_ROUTING_STORE")
        snapshots = os.environ.get("KEYPLANE_STATISTICS_DIR")
        return cls.under(
            home,
            bootstrap_servers=bootstrap_servers or settings.resolved_bootstrap_servers(),
            events_topic=settings.events_topic,
            metrics_topic=settings.metrics_topic,
            control_topic=settings.control_topic,
            routing_store=Path(store).resolve() if store else home / "configs",
            snapshots=Path(snapshots).resolve() if snapshots else None,
            max_event_bytes=settings.max_event_bytes,
            unpublished_versions_kept=settings.unpublished_versions_kept,
            pipeline=settings.pipeline,
        )

    @classmethod
    def under(
        cls,
        home: Path,
        *,
        bootstrap_servers: str,
        events_topic: str,
        metrics_topic: str,
        control_topic: str,
        routing_store: Path,
        snapshots: Path | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        unpublished_versions_kept: int = 20,
        pipeline: str | None = None,
    ) -> Deployment:
        """The deployment whose state folders lie under ``home``: the one layout.

        Snapshots in ``home/statistics`` unless given, the controller's state
        in ``home/controller.json`` (the file ``keyplane config publish``
        uses), the GX project in ``home/gx``.
        """
        return cls(
            home=home,
            bootstrap_servers=bootstrap_servers,
            events_topic=events_topic,
            metrics_topic=metrics_topic,
            control_topic=control_topic,
            routing_store=routing_store,
            snapshots=home / "statistics" if snapshots is None else snapshots,
            controller_state=home / "controller.json",
            gx_root=home / "gx",
            max_event_bytes=max_event_bytes,
            unpublished_versions_kept=unpublished_versions_kept,
            pipeline=pipeline or "",
        )


def kafka_bootstrap_from_connection(conn_id: str = KAFKA_CONN_ID) -> str | None:
    """Bootstrap servers of the Airflow connection ``conn_id``, or None if it is not defined.

    Reads the Kafka provider's ``bootstrap.servers`` extra, else ``host:port``.
    Only called inside tasks: a connection lookup at parse time would hit the
    metadata database on every parse.
    """
    from airflow.sdk import BaseHook

    try:
        connection = BaseHook.get_connection(conn_id)
    except Exception:
        return None
    extra = connection.extra_dejson or {}
    servers = extra.get("bootstrap.servers")
    if servers:
        return str(servers)
    if connection.host:
        return f"{connection.host}:{connection.port}" if connection.port else connection.host
    return None


def deployment() -> Deployment:
    """The deployment a task runs against: the Kafka connection, else the environment."""
    return Deployment.from_environment(kafka_bootstrap_from_connection())
