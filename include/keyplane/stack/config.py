"""The stack's sizes, ports and link shaping: one frozen object, from ``KEYPLANE_STACK_*``.

Sized for a machine of 2 cores: four workers of 1 core and 1 GiB each. The
routed job starts on 2 executors (``job_executors_initial``) and may hold 3
(``spark.cores.max``), so a ``keyplane_scale`` run can add one live; any
other application gets at most 1 (``spark.deploy.defaultCores``), so the
reconfiguration run's statistics job never waits for the streaming job,
which never ends, even once it has grown. Airflow's LocalExecutor has 4 task
slots. The ports are those that ``docker-compose.yml`` publishes on its host.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class StackConfig(BaseSettings):
    """Everything ``keyplane stack up`` starts, and where."""

    model_config = SettingsConfigDict(env_prefix="KEYPLANE_STACK_", frozen=True)

    kafka_port: int = Field(default=29092, ge=1, le=65535)
    kafka_external_port: int = Field(
        default=29093,
        ge=1,
        le=65535,
        description="Kafka's listener on the bridge, for executors on hosts of their own.",
    )
    topic_partitions: int = Field(
        default=8, ge=1, description="Partitions of the events and results topics."
    )
    spark_master_port: int = Field(default=7077, ge=1, le=65535)
    spark_ui_port: int = Field(default=8090, ge=1, le=65535)
    spark_worker_ui_port: int = Field(
        default=8091, ge=1, le=65535, description="The first worker's UI; the next ones follow."
    )
    workers: int = Field(default=4, ge=1, le=50)
    worker_cores: int = Field(default=1, ge=1)
    worker_memory: str = Field(default="1g", pattern=r"^[1-9][0-9]*[mg]$")
    job_cores: int = Field(
        default=3,
        ge=1,
        description="The most cores the routed job holds (spark.cores.max), executors added "
        "by keyplane_scale included.",
    )
    job_executors_initial: int | None = Field(
        default=2,
        ge=1,
        description="Executors the routed job starts on (KEYPLANE_EXECUTORS_INITIAL); the "
        "cores up to job_cores stay free for keyplane_scale to add executors. None: every "
        "core up to job_cores.",
    )
    batch_cores: int = Field(
        default=1,
        ge=1,
        description="The most cores any other application gets (spark.deploy.defaultCores): "
        "the reconfiguration run's statistics job.",
    )
    postgres_port: int = Field(default=5432, ge=1, le=65535)
    airflow_port: int = Field(default=8080, ge=1, le=65535)
    airflow_parallelism: int = Field(default=4, ge=1)
    shaping: Literal["auto", "off"] = Field(
        default="auto",
        description="'auto': the workers in network namespaces behind shaped links when this "
        "process may create them; 'off': every piece on loopback.",
    )
    link_rate: str = Field(default="1gbit", pattern=r"^[1-9][0-9]*(kbit|mbit|gbit)$")
    link_delay_ms: float = Field(default=0.5, ge=0.0, le=1000.0)
    subnet: str = Field(
        default="10.55.0.0/24", description="The bridge's network; the bridge takes .1."
    )

    @model_validator(mode="after")
    def _cores_for_both(self) -> StackConfig:
        offered = self.workers * self.worker_cores
        if self.job_cores + self.batch_cores > offered:
            raise ValueError(
                f"job_cores {self.job_cores} + batch_cores {self.batch_cores} exceed the "
                f"workers' {offered} cores ({self.workers} workers of {self.worker_cores}): "
                "the statistics job would wait forever once the job has grown"
            )
        initial = self.job_executors_initial
        if initial is not None and initial * self.worker_cores > self.job_cores:
            raise ValueError(
                f"job_executors_initial {initial} executors of {self.worker_cores} core(s) "
                f"need more than job_cores {self.job_cores}: the job could never start on them"
            )
        return self

    @field_validator("job_executors_initial", mode="before")
    @classmethod
    def _blank_is_every_core(cls, value: object) -> object:
        """``KEYPLANE_STACK_JOB_EXECUTORS_INITIAL=`` (empty): every core up to job_cores."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("subnet")
    @classmethod
    def _a_small_network(cls, value: str) -> str:
        network = ipaddress.IPv4Network(value)
        if network.num_addresses < 64:
            raise ValueError(f"{value} is too small for the bridge and the workers")
        return str(network)

    def address(self, index: int) -> str:
        """The bridge's address (0), or a host's on it (1, 2, ...)."""
        network = ipaddress.IPv4Network(self.subnet)
        return str(network.network_address + (1 if index == 0 else 10 + index))

    @property
    def prefix_length(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen


def stack_home(keyplane_home: Path) -> Path:
    """Logs, pids and data of every piece: ``$KEYPLANE_HOME/stack``."""
    return keyplane_home.resolve() / "stack"
