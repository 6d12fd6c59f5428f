"""The stack in order: network, Kafka, Spark, PostgreSQL, Airflow, the job.

``up`` brings each piece up in that order, skipping what already answers,
and stops at the first that does not come up with its one-line error;
``down`` stops them in reverse and removes the network it made; ``status``
probes each.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from keyplane.orchestration.dagrun import AirflowSetup
from keyplane.orchestration.localairflow import LocalAirflow, project_folders
from keyplane.settings import Settings
from keyplane.stack import network
from keyplane.stack.airflow import AirflowPiece
from keyplane.stack.config import StackConfig, stack_home
from keyplane.stack.job import JobPiece
from keyplane.stack.kafka import KafkaPiece
from keyplane.stack.network import Network
from keyplane.stack.piece import Health, Piece, StackError
from keyplane.stack.postgres import PostgresPiece
from keyplane.stack.spark import SparkMaster, SparkWorkers, job_conf_dir

CONTROL_KEY_ENV = "KEYPLANE_CONTROL_KEY"


class Stack:
    """Every piece of the stack of ``settings.home``, as ``config`` sizes it."""

    def __init__(self, settings: Settings, config: StackConfig, with_job: bool = True) -> None:
        self.home = stack_home(settings.home)
        self.config = config
        self.with_job = with_job
        self.network_file = self.home / "network.json"
        self.settings = settings

    def network(self) -> Network:
        """The network ``up`` made, if it did."""
        made = network.read(self.network_file)
        if made is not None:
            return made
        return Network(shaped=False, reason="none made (the stack is down)")

    def control_key(self) -> str:
        """The key that signs control messages between Airflow's tasks and the job."""
        path = self.home / "control_key"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(32))
        return path.read_text().strip()

    def pieces(self, made: Network, starting: bool = False) -> list[Piece]:
        """The pieces on ``made``; ``starting`` writes what only ``up`` needs (the control
        key, the job's Spark configuration), so that ``status`` and ``down`` write nothing."""
        config, home = self.config, self.home
        bridge = config.address(0)
        external = (bridge, config.kafka_external_port) if made.shaped else None
        topics = (self.settings.events_topic, self.settings.results_topic)
        kafka = KafkaPiece(home, config.kafka_port, external, topics, config.topic_partitions)
        master = SparkMaster(home, config, made)
        workers = SparkWorkers(home, config, made, master)
        postgres = PostgresPiece(home, config.postgres_port)
        keyplane_home = self.settings.home.resolve()
        job_settings = self.settings.model_copy(
            update={
                "bootstrap_servers": kafka.bootstrap_servers,
                "spark_master": master.url,
                "executors_initial": config.job_executors_initial,
            }
        )
        driver_environment = {
            CONTROL_KEY_ENV: self.control_key() if starting else "",
            "SPARK_LOCAL_IP": bridge if made.shaped else "127.0.0.1",
        }
        job_environment = {
            **driver_environment,
            "SPARK_CONF_DIR": str(job_conf_dir(home, config) if starting else ""),
        }
        dags, plugins = project_folders()
        local = LocalAirflow(
            setup=AirflowSetup(
                airflow_home=home / "airflow",
                dags_folder=dags,
                bootstrap_servers=kafka.bootstrap_servers,
                keyplane_home=keyplane_home,
                routing_store=self.settings.config_store.resolve(),
                events_topic=self.settings.events_topic,
                metrics_topic=self.settings.metrics_topic,
                control_topic=self.settings.control_topic,
                spark_master=master.url,
                control_key=driver_environment[CONTROL_KEY_ENV],
            ),
            plugins_folder=plugins,
            port=config.airflow_port,
            parallelism=config.airflow_parallelism,
            database_url=postgres.url() if postgres.password_file.is_file() else None,
            extra_environment=(("SPARK_LOCAL_IP", driver_environment["SPARK_LOCAL_IP"]),),
        )
        pieces: list[Piece] = [kafka, master, workers, postgres, AirflowPiece(home, local)]
        if self.with_job:
            pieces.append(JobPiece(job_settings, master.ui_url, job_environment))
        return pieces

    def up(self, echo: Callable[[str], None]) -> list[Health]:
        self.home.mkdir(parents=True, exist_ok=True)
        made = network.read(self.network_file)
        if made is None:
            made = network.make(self.config, self.network_file)
        echo(f"network: {made.describe()}")
        healths: list[Health] = []
        # Airflow's database URL exists once PostgreSQL made its user: build the pieces
        # again after it, so Airflow never falls back to SQLite.
        for index in range(len(self.pieces(made, starting=True))):
            piece = self.pieces(made, starting=True)[index]
            echo(f"{piece.name}: starting")
            piece.up()
            health = piece.health()
            healths.append(health)
            echo(f"{piece.name}: up at {health.url} ({health.detail})")
        return healths

    def down(self, echo: Callable[[str], None]) -> None:
        """Stop every piece, in reverse order, and remove the network; a piece that cannot be
        stopped does not keep the others running. Raises the first failure at the end."""
        made = network.read(self.network_file) or self.network()
        failures: list[StackError] = []
        for piece in reversed(self.pieces(made)):
            try:
                stopped = piece.down()
            except StackError as failure:
                failures.append(failure)
                echo(f"{piece.name}: not stopped: {failure}")
                continue
            echo(f"{piece.name}: {'stopped' if stopped else 'was not running'}")
        removed = network.remove(self.network_file)
        if removed:
            echo(f"network: removed {', '.join(removed)}")
        if failures:
            raise failures[0]

    def status(self) -> tuple[Network, list[Health]]:
        made = self.network()
        return made, [piece.health() for piece in self.pieces(made)]
