"""What every piece of the stack is: started idempotently, probed for real, stopped alone.

A piece records each process it starts (pid, the kernel's start time of that
pid, the log), so that ``down`` signals exactly the processes ``up`` started
and never a later process that reuses a pid.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from keyplane.util.processes import start_detached, stop_detached, write_atomically
from keyplane.util.statefiles import read_model_file


class StackError(RuntimeError):
    """A piece did not come up (or cannot be started): one line naming it and its log."""


class Health(BaseModel):
    """A piece's probe: up or not, where it answers, and what the probe saw."""

    model_config = ConfigDict(frozen=True)

    piece: str
    up: bool
    url: str
    detail: str = ""


class Piece(Protocol):
    """One part of the stack. ``up`` returns once :meth:`health` says up, or raises
    :class:`StackError`; it starts nothing that already runs. ``down`` stops what
    this piece started and returns whether anything ran."""

    name: str

    def up(self) -> None: ...

    def down(self) -> bool: ...

    def health(self) -> Health: ...

    @property
    def log(self) -> Path: ...


def wait_until_up(
    piece: Piece,
    timeout_s: float,
    *,
    exited: Callable[[], str | None],
    timed_out: Callable[[], str],
    poll_s: float = 1.0,
) -> None:
    """Return once ``piece`` is healthy; a :class:`StackError` otherwise.

    ``exited()`` names a process of the piece that died (the error, with its
    log), so a piece that cannot start fails at once rather than after the
    whole timeout; ``timed_out()`` says what did not answer in ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if piece.health().up:
            return
        died = exited()
        if died is not None:
            raise StackError(died)
        time.sleep(poll_s)
    raise StackError(timed_out())


class ProcessRecord(BaseModel):
    """One started process: its pid, the kernel's start time of that pid, its log."""

    model_config = ConfigDict(frozen=True)

    pid: int
    started: int
    command: tuple[str, ...]
    log: Path


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (field 22 of ``/proc/<pid>/stat``); None if gone
    or a zombie. With the pid it names one process for the life of the machine."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(") ", 1)[-1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


class Processes:
    """The processes a piece started, one record file each under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _file(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def record(self, name: str, pid: int, command: list[str], log: Path) -> ProcessRecord:
        started = start_time(pid)
        if started is None:
            raise StackError(f"{name} exited as soon as it started; see {log}")
        record = ProcessRecord(pid=pid, started=started, command=tuple(command), log=log)
        write_atomically(self._file(name), record.model_dump_json())
        return record

    def start(
        self, name: str, command: list[str], log: Path, env: dict[str, str] | None = None
    ) -> ProcessRecord:
        """Start ``command`` in a session of its own, logging to ``log``, and record it."""
        process = start_detached(command, log, env)
        return self.record(name, process.pid, command, log)

    def running(self, name: str) -> ProcessRecord | None:
        """The record of ``name`` if its process still runs; a stale record is removed."""
        record = read_model_file(
            self._file(name),
            ProcessRecord,
            what="a stack pid file",
            fix="remove it if nothing of the stack runs",
            error=StackError,
        )
        if record is None:
            return None
        if start_time(record.pid) != record.started:
            self._file(name).unlink(missing_ok=True)
            return None
        return record

    def stop(self, name: str, timeout_s: float = 30.0) -> bool:
        """SIGTERM the process group of ``name``, SIGKILL it after ``timeout_s``; False if
        nothing of it ran."""
        record = self.running(name)
        if record is not None:
            stop_detached(record.pid, timeout_s)
        self._file(name).unlink(missing_ok=True)
        return record is not None

    def names(self) -> list[str]:
        return sorted(path.stem for path in self.folder.glob("*.json"))


def euid_is_root() -> bool:
    return os.geteuid() == 0
