"""``keyplane airflow``: Airflow's components on this project's DAGs and dashboard plugin."""

from __future__ import annotations

import argparse
from pathlib import Path

from keyplane.cli.errors import CliError
from keyplane.settings import Settings


def cmd_airflow(settings: Settings, args: argparse.Namespace) -> int:
    """Airflow's UI, scheduler, dag processor and triggerer on this project's DAGs and plugin."""
    from keyplane.orchestration.dagrun import AirflowSetup
    from keyplane.orchestration.localairflow import LocalAirflow, project_folders, serve

    dags: Path | None = args.dags_folder
    plugins: Path | None = args.plugins_folder
    if dags is None or plugins is None:
        try:
            found = project_folders()
        except FileNotFoundError as missing:
            raise CliError(str(missing)) from None
        dags, plugins = dags or found[0], plugins or found[1]
    home = settings.home.resolve()
    local = LocalAirflow(
        setup=AirflowSetup(
            airflow_home=home / "airflow",
            dags_folder=dags.resolve(),
            bootstrap_servers=settings.resolved_bootstrap_servers(),
            keyplane_home=home,
            routing_store=settings.config_store.resolve(),
            events_topic=settings.events_topic,
            metrics_topic=settings.metrics_topic,
            control_topic=settings.control_topic,
            spark_master=settings.spark_master,
        ),
        plugins_folder=plugins.resolve(),
        port=args.port,
        parallelism=args.parallelism,
    )
    print(f"starting Airflow in {local.setup.airflow_home} (parallelism {local.parallelism})")
    return serve(local)
