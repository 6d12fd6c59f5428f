"""The local S3 server behind the embedded broker's durable storage.

tansu keeps its log segments, watermarks and consumer-group offsets in one of
two stores: ``memory://``, which is lost whenever the broker process ends, and
``s3://``, an object store that outlives it. On a laptop or in CI there is no
object store, so keyplane runs ``localbucket`` (a small S3-compatible server
from PyPI that keeps each bucket as a folder on disk) under the broker's home.
Because the objects are files, the broker's data survive a restart of the
broker, of this server, or of both (``keyplane broker stop`` then ``start``).

The server is a detached process like the broker; its pid, port and data
folder live in ``<home>/s3-server.json``.
"""

from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from keyplane.util.processes import (
    StaleFile,
    inspect_state_file,
    start_detached,
    stop_detached,
    write_atomically,
)
from keyplane.util.statefiles import read_model_file


class ObjectStoreError(RuntimeError):
    """The local S3 server could not be started or used; the message says why."""


class LocalS3State(BaseModel):
    """The state file: the server's process, the command it runs, its port and data folder.

    A pid of 1 or less is refused, as in the broker's pid file
    (:class:`keyplane.kafka.broker.BrokerState`): ``stop`` signals the pid's
    process group.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int = Field(gt=1)
    port: int = Field(ge=1, le=65535)
    data: str
    log: str
    command: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_s3(endpoint: str, timeout_s: float = 1.0) -> bool:
    """True when ListBuckets (``GET /``) succeeds: the server is up and serving."""
    try:
        with urllib.request.urlopen(f"{endpoint}/", timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def create_bucket(endpoint: str, bucket: str, timeout_s: float = 5.0) -> None:
    """Create ``bucket`` on a server that checks no credentials; an existing bucket is fine.

    Unsigned on purpose: only the local server is addressed this way. A real
    S3 or MinIO endpoint needs its bucket created by its owner.
    """
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as error:
        if error.code == 409:  # BucketAlreadyOwnedByYou: a restart over existing data
            return
        raise ObjectStoreError(
            f"creating bucket {bucket!r} at {endpoint} failed: {error}"
        ) from error
    except (urllib.error.URLError, OSError) as error:
        raise ObjectStoreError(f"S3 server at {endpoint} did not answer: {error}") from error


class LocalS3Server:
    """Start, reuse, stop and inspect the local S3 server recorded under ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.data = self.home / "s3"
        self.state_file = self.home / "s3-server.json"

    def status(self) -> LocalS3State | None:
        """The running server's state, or None. A stale state file is removed (:meth:`inspect`)."""
        running, _ = self.inspect()
        return running

    def inspect(self) -> tuple[LocalS3State | None, StaleFile | None]:
        """(running, stale): the running server's state, or its state file removed as stale.

        Judged as the broker's pid file is (:func:`keyplane.util.processes.live_or_removed`):
        a file without a command line cannot tell its server from a process
        that reused the pid, so it is neither reused nor stopped.
        """
        return inspect_state_file(self.state_file, self._read_state(), "the S3 server")

    def _read_state(self) -> LocalS3State | None:
        return read_model_file(
            self.state_file,
            LocalS3State,
            what="an S3 server state file",
            fix="if no S3 server is running, remove it",
            error=ObjectStoreError,
        )

    def ensure_running(self, timeout_s: float = 20.0) -> LocalS3State:
        """The running server, started first when none is.

        Reusing a live server matters after a broker crash: ``keyplane broker
        start`` then brings the broker back onto the objects it left.
        """
        running = self.status()
        if running is not None:
            return running
        self.data.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        log = self.home / "s3-server.log"
        command = [
            sys.executable,
            "-m",
            "localbucket",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            str(self.data),
        ]
        proc = start_detached(command, log)
        state = LocalS3State(
            pid=proc.pid, port=port, data=str(self.data), log=str(log), command=tuple(command)
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ObjectStoreError(f"S3 server exited with code {proc.returncode}; see {log}")
            if _answers_s3(state.endpoint):
                write_atomically(self.state_file, state.model_dump_json())
                return state
            time.sleep(0.1)
        proc.kill()
        raise ObjectStoreError(f"S3 server did not answer within {timeout_s:.0f} s; see {log}")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the server, keeping its data folder; False when none was running."""
        state = self.status()
        if state is None:
            return False
        stop_detached(state.pid, timeout_s)
        self.state_file.unlink(missing_ok=True)
        return True
