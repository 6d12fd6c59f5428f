"""Lifecycle of a local Apache Kafka broker: one KRaft node, broker and controller in one JVM.

The embedded broker (:mod:`keyplane.kafka.broker`) starts in a tenth of a
second, so it stays the default; this one is the real thing, for the tests
and runs that must hold against the semantics Apache Kafka enforces
(transactions, idempotent producers, topic creation, retention).

Apache Kafka is installed from Maven Central by ``scripts/install-jars``
(``make bootstrap`` runs it) into ``.tools/kafka-<version>/libs``, or wherever
``KEYPLANE_KAFKA_HOME`` points, and runs as ``java -cp libs/* kafka.Kafka``
on a ``server.properties`` written under the keyplane home. Its log
directories live there too, under ``<home>/kafka/logs``, so records and
committed offsets survive a restart or a crash, and the first start formats
them (``kafka.tools.StorageTool format``).

The broker shares the embedded broker's pid file, ``<home>/broker.json``
(:class:`~keyplane.kafka.broker.BrokerState`), so one home runs one broker
of either engine, and ``keyplane broker stop`` stops whichever runs.
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from keyplane.kafka.broker import (
    BrokerError,
    BrokerState,
    answers_kafka,
    port_is_free,
    refuse_to_start,
)
from keyplane.kafka.security import _jaas_quoted
from keyplane.util.processes import (
    StaleFile,
    inspect_state_file,
    live_or_removed,
    start_detached,
    stop_detached,
    write_atomically,
)
from keyplane.util.statefiles import read_model_file

KAFKA_VERSION = "4.4.0"
"""The Apache Kafka that ``deploy/kafka/pom.xml`` pins (its ``kafka.version``)."""
KAFKA_HOME_ENV = "KEYPLANE_KAFKA_HOME"
MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
HEAP = "-Xmx1g"
"""Apache Kafka's own scripts give the broker 1 GiB; a single test node needs no more."""

_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
logger.kafka-request.name = kafka.request.logger
logger.kafka-request.level = warn
"""


def kafka_install_dir() -> Path:
    """The installation: ``KEYPLANE_KAFKA_HOME``, else the checkout's ``.tools/kafka-<version>``."""
    given = os.environ.get(KAFKA_HOME_ENV)
    if given:
        return Path(given)
    return Path(__file__).resolve().parents[3] / ".tools" / f"kafka-{KAFKA_VERSION}"


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` or ``java`` on the PATH; a one-line error when neither exists."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise BrokerError(
            "Apache Kafka needs Java 17 or later: no java on PATH or in JAVA_HOME "
            "(install openjdk-17-jdk-headless)"
        )
    return found


def kafka_classpath(install: Path | None = None) -> str:
    """The ``-cp`` of the installed jars; a one-line error naming the fix when they are absent.

    ``scripts/install-jars`` moves a folder into place only once its jars
    loaded, so a folder with the broker's jar is a complete one (as is an
    Apache Kafka distribution's).
    """
    libs = (install or kafka_install_dir()) / "libs"
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise BrokerError(
            f"Apache Kafka {KAFKA_VERSION} is not installed in {libs.parent}: run "
            f"scripts/install-jars (make bootstrap does), or set {KAFKA_HOME_ENV} to an "
            "installation with its jars in libs/"
        )
    return f"{libs}/*"


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding, as Kafka's ``Uuid``."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


def server_properties(
    port: int, controller_port: int, log_dir: Path, sasl_plain: SaslPlainListener | None = None
) -> str:
    """A combined broker and controller on loopback, replication factors of one node.

    The controller's quorum is the one static voter, this node, so its
    listener may move to another free port from one start to the next. The
    first group rebalance starts at once rather than after Kafka's default
    three seconds: a single consumer joins each group here. ``sasl_plain``
    adds a ``SASL_PLAINTEXT`` listener that accepts its users (mechanism
    PLAIN) beside the ``PLAINTEXT`` one, which the broker's own health
    check and its inter-broker traffic keep using.
    """
    listeners = [f"PLAINTEXT://127.0.0.1:{port}"]
    protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
    sasl_lines: list[str] = []
    if sasl_plain is not None:
        listeners.append(f"SASL_PLAINTEXT://127.0.0.1:{sasl_plain.port}")
        protocols.append("SASL_PLAINTEXT:SASL_PLAINTEXT")
        users = " ".join(
            f"user_{name}={_jaas_quoted(password)}" for name, password in sasl_plain.users.items()
        )
        jaas = f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"
        # A properties file reads a backslash as an escape: the JAAS line's own escapes
        # (a quote in a password) must reach the JAAS parser as written.
        sasl_lines = [
            "sasl.enabled.mechanisms=PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config=" + jaas.replace("\\", "\\\\"),
        ]
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
            f"listeners={','.join(listeners)},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners={','.join(listeners)}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            f"listener.security.protocol.map={','.join(protocols)}",
            *sasl_lines,
            f"log.dirs={log_dir}",
            "num.partitions=1",
            "offsets.topic.replication.factor=1",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            "",
        ]
    )


@dataclass(frozen=True)
class SaslPlainListener:
    """A ``SASL_PLAINTEXT`` listener on loopback ``port`` whose PLAIN users are ``users``.

    For testing clients against authentication as a production cluster
    enforces it; the passwords are written into ``server.properties``
    (readable by its owner only), as Apache Kafka's static PLAIN users are.
    """

    port: int
    users: Mapping[str, str]

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise BrokerError(f"SASL port {self.port} is not one of 1..65535")
        if not self.users:
            raise BrokerError("a SASL/PLAIN listener needs at least one user")
        for name in self.users:
            if not name or not name.replace("-", "").replace("_", "").isalnum():
                raise BrokerError(f"SASL user {name!r}: letters, digits, '-' and '_' only")

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApacheKafkaBroker:
    """Start, stop and inspect the Apache Kafka broker recorded under ``home``.

    The same interface as :class:`~keyplane.kafka.broker.EmbeddedBroker`:
    ``start`` returns once the broker answers Kafka requests, ``status`` and
    ``inspect`` read the pid file, ``stop`` stops the process group.
    """

    def __init__(
        self,
        home: Path,
        port: int = 19092,
        install: Path | None = None,
        sasl_plain: SaslPlainListener | None = None,
    ) -> None:
        if not 1 <= port <= 65535:
            raise BrokerError(f"port {port} is not one of 1..65535")
        self.home = Path(home)
        self.port = port
        self.sasl_plain = sasl_plain
        self.install = install or kafka_install_dir()
        self.state_file = self.home / "broker.json"
        self.kafka_dir = self.home / "kafka"
        self.log_dir = self.kafka_dir / "logs"

    def storage_engine(self) -> str:
        """Where the records live, as a URL like the embedded broker's ``memory://``/``s3://``."""
        return self.log_dir.resolve().as_uri()

    def status(self) -> BrokerState | None:
        """The running broker's state, or None. A stale pid file is removed."""
        running, _ = live_or_removed(self.state_file, self._read_state())
        return running

    def inspect(self) -> tuple[BrokerState | None, list[StaleFile]]:
        """(running, stale): the running broker's state, and the pid file removed as stale."""
        running, stale = inspect_state_file(self.state_file, self._read_state(), "the broker")
        return running, [] if stale is None else [stale]

    def _read_state(self) -> BrokerState | None:
        return read_model_file(
            self.state_file,
            BrokerState,
            what="a broker pid file",
            fix="if no broker is running, remove it",
            error=BrokerError,
        )

    def _format_once(self, java: str, classpath: str, properties: Path, log: Path) -> None:
        """Format the log directories on the first start; a formatted one is kept as it is."""
        if (self.log_dir / "meta.properties").is_file():
            return
        command = [
            java,
            "-cp",
            classpath,
            f"-Dlog4j2.configurationFile={self.kafka_dir / 'log4j2.properties'}",
            STORAGE_TOOL,
            "format",
            "--cluster-id",
            new_cluster_id(),
            "--config",
            str(properties),
        ]
        with log.open("ab") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            raise BrokerError(
                f"formatting Apache Kafka's log directory {self.log_dir} failed "
                f"(exit {done.returncode}); see {log}"
            )

    def start(self, timeout_s: float = 90.0) -> BrokerState:
        """Write the configuration, format on first use, start the JVM and wait until it answers.

        The JVM takes a few seconds to start, and longer on a busy machine,
        hence the longer default wait than the embedded broker's.
        """
        refuse_to_start(self.status(), self.port)
        if self.sasl_plain is not None and not port_is_free(self.sasl_plain.port):
            raise BrokerError(f"SASL port {self.sasl_plain.port} is taken by another process")
        java = java_binary()
        classpath = kafka_classpath(self.install)
        # Owner-only: server.properties may hold the SASL users' passwords.
        self.kafka_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.kafka_dir.chmod(0o700)
        self.log_dir.mkdir(exist_ok=True)
        properties = self.kafka_dir / "server.properties"
        controller_port = _free_loopback_port()
        write_atomically(
            properties,
            server_properties(self.port, controller_port, self.log_dir, self.sasl_plain),
        )
        write_atomically(self.kafka_dir / "log4j2.properties", _LOG4J2)
        log = self.home / "broker.log"
        self._format_once(java, classpath, properties, log)
        cmd = [
            java,
            HEAP,
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.kafka_dir / 'log4j2.properties'}",
            "-cp",
            classpath,
            MAIN_CLASS,
            str(properties),
        ]
        proc = start_detached(cmd, log)
        state = BrokerState(
            pid=proc.pid,
            port=self.port,
            storage=self.storage_engine(),
            log=str(log),
            command=tuple(cmd),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(f"Apache Kafka exited with code {proc.returncode}; see {log}")
            if answers_kafka(state.bootstrap_servers, timeout_s=1.0):
                write_atomically(self.state_file, state.model_dump_json())
                return state
            time.sleep(0.2)
        stop_detached(proc.pid, 5.0)
        raise BrokerError(f"Apache Kafka did not answer within {timeout_s:.0f} s; see {log}")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker (a controlled shutdown on SIGTERM); False when none ran.

        The log directories stay, so the next ``start`` finds every record and
        committed offset.
        """
        state = self.status()
        if state is None:
            return False
        stop_detached(state.pid, timeout_s)
        self.state_file.unlink(missing_ok=True)
        return True
