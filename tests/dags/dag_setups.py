"""The Airflow set-up the DAG tests run ``airflow dags test`` with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keyplane.control.operators import OPERATORS
from keyplane.orchestration import dagrun
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig

REPO = Path(__file__).resolve().parents[2]

NO_BROKER = "127.0.0.1:1"
"""Nothing listens here: a run given it must end before it needs Kafka."""


def dag_setup(
    tmp_path: Path,
    *,
    bootstrap_servers: str = NO_BROKER,
    topic_prefix: str = "",
    stages: Sequence[str] = OPERATORS,
    **extra: Any,
) -> dagrun.AirflowSetup:
    """This repository's DAGs under ``tmp_path``, with a store holding the all-hash v1 of
    ``stages`` over 4 state partitions; ``extra`` goes to :class:`dagrun.AirflowSetup`."""
    store = tmp_path / "configs"
    config_store.save(RoutingConfig.all_hash(4, stages), store)
    return dagrun.AirflowSetup(
        airflow_home=tmp_path / "airflow",
        dags_folder=REPO / "dags",
        bootstrap_servers=bootstrap_servers,
        keyplane_home=tmp_path / "home",
        routing_store=store,
        events_topic=f"{topic_prefix}events",
        metrics_topic=f"{topic_prefix}metrics",
        control_topic=f"{topic_prefix}control",
        control_key="k" * 32,
        **extra,
    )
