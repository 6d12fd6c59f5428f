"""Detached background processes that outlive the command that started them.

``keyplane broker start`` and ``keyplane job start`` return while their
process keeps running, and the matching ``stop`` comes later, often from
another shell. So each command records its process in a pid file under
``KEYPLANE_HOME``, and these helpers launch such a process, tell whether a
recorded pid is still that process, and stop it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

POLL_S = 0.05


def alive(pid: int, command: Sequence[str] | None = None) -> bool:
    """Whether ``pid`` is running; a zombie counts as gone.

    With ``command``, the process must also still run exactly that command
    line. A pid file outlives its process (a crash, a reboot), and the kernel
    reuses pids: without this check, ``stop`` would signal whatever unrelated
    process now holds the number. Where ``/proc`` cannot be read the command
    is not checked.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists; /proc still tells what it runs
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return True
    if stat.split(") ", 1)[-1][:1] == "Z":
        return False
    if command is None:
        return True
    return [os.fsdecode(arg) for arg in cmdline.split(b"\0")[:-1]] == list(command)


class RecordedProcess(Protocol):
    """What a keyplane state file records of its process: enough to tell it from a stranger."""

    @property
    def pid(self) -> int: ...

    @property
    def command(self) -> Sequence[str]: ...


R = TypeVar("R", bound=RecordedProcess)


def live_or_removed(path: Path, record: R | None) -> tuple[R | None, R | None]:
    """(running, stale): ``record`` if its process still runs its command, else its file removed.

    Every state file of a detached process (the broker's, the S3 server's,
    the job's) is judged the same way. A record without a command line (an
    older keyplane wrote it) cannot tell its process from one that reused the
    pid, so it is stale too: stopping a stranger would be worse than leaving
    an old process for the user to stop. The stale record is returned so the
    caller can say what it removed (:func:`stale_reason`).
    """
    if record is None:
        return None, None
    if record.command and alive(record.pid, record.command):
        return record, None
    path.unlink(missing_ok=True)
    return None, record


def inspect_state_file(
    path: Path, record: R | None, what: str
) -> tuple[R | None, StaleFile | None]:
    """:func:`live_or_removed`, the stale record reported as the removed file and why its
    pid is not ``what`` (``"the broker"``)."""
    running, stale = live_or_removed(path, record)
    if stale is None:
        return running, None
    return None, StaleFile(path, stale.pid, stale_reason(stale, what))


def stale_reason(record: RecordedProcess, what: str) -> str:
    """Why ``record``'s pid is not ``what`` (``"the broker"``), for the line that names
    the removed file."""
    if not alive(record.pid):
        return "its process had died"
    if not record.command:
        return (
            "it records no command line (an older keyplane wrote it), so that process may not "
            f"be {what}; if it is, stop it with `kill {record.pid}`"
        )
    return "that pid now runs another program, which was left alone"


@dataclass(frozen=True)
class StaleFile:
    """A state file that a status check removed, because its pid is not the process it records."""

    path: Path
    pid: int
    reason: str

    def describe(self) -> str:
        return f"removed the stale pid file {self.path} of pid {self.pid}: {self.reason}"


def session_commands(session: int) -> list[list[str]]:
    """The command lines of the live processes of session ``session`` (Linux ``/proc``).

    A process started by :func:`start_detached` leads a session of its own,
    and everything it starts (a JVM, and the JVM's Python workers) stays in
    it, so this lists the whole tree even after processes were re-parented.
    Empty where ``/proc`` cannot be read.
    """
    found: list[list[str]] = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[-1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if len(fields) > 3 and fields[0] != "Z" and fields[3] == str(session):
            found.append([os.fsdecode(arg) for arg in cmdline.split(b"\0")[:-1]])
    return found


def start_detached(
    command: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Launch ``command`` in a session of its own, stdout and stderr appended to ``log``.

    The new session keeps the process out of the starting terminal's process
    group, so Ctrl-C or closing that terminal does not reach it, and gives it
    a process group of its own that :func:`stop_detached` can kill whole.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=True,
        )


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def stop_detached(pid: int, timeout_s: float, *, terminate_group: bool = True) -> bool:
    """SIGTERM, up to ``timeout_s`` to exit, then SIGKILL to the whole process group.

    Returns True when the process exited on SIGTERM, False when it had to be
    killed. ``terminate_group=False`` sends SIGTERM to the leader alone, for
    a process that stops its own children in order (a PySpark driver stops
    its query before its JVM; a SIGTERM to the group would reach the JVM
    first). The SIGKILL always goes to the group, so nothing outlives a
    process that did not stop.
    """
    try:
        if terminate_group:
            os.killpg(pid, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    if _wait_gone(pid, timeout_s):
        return True
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    _wait_gone(pid, 5.0)
    return False


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old file or the new one,
    never half of one, and a crash leaves one of the two on disk.

    ``status`` in another shell may read a pid file while it is written, and a
    retried Airflow task must find the controller's state as it was last saved.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with staging.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
