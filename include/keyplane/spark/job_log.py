"""The routed job's log: what the job writes to it, its progress lines, followed as they
come or read backwards, and the line of a failure's tail that explains it.

The job writes one ``progress`` line per batch that read events
(:data:`~keyplane.spark.progress.PROGRESS_PREFIX`). Nothing here imports PySpark, which
takes seconds, so the command line can read the log at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from keyplane.spark.progress import PROGRESS_PREFIX, BatchProgress

if TYPE_CHECKING:
    from keyplane.settings import LogLevel

LOG_TAIL_LINES = 20

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_job_logging(level: LogLevel) -> None:
    """keyplane's own lines from ``level`` up, and other libraries' warnings, to stderr.

    The job's stderr is its log (:mod:`keyplane.spark.jobprocess`). With no
    handler, Python writes warnings only, so the lines that say which engine
    runs the stages and who reads the events would never show. kafka-python
    and py4j log every connection at INFO, so the other libraries stay at
    WARNING whatever ``level`` is.
    """
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("keyplane").setLevel(level)


class LogFollower:
    """The complete lines appended to a log since ``offset``, as they come."""

    def __init__(self, path: Path, offset: int) -> None:
        self._path = path
        self._offset = offset
        self._partial = b""

    def new_lines(self) -> list[str]:
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


def parse_progress(line: str) -> BatchProgress | None:
    """The batch a ``progress`` line of the job reports; None for any other line."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        return BatchProgress(**json.loads(line[len(PROGRESS_PREFIX) :]))
    except (ValueError, TypeError):
        return None


def last_progress(log: Path, start: int, block: int = 65_536) -> BatchProgress | None:
    """The last complete ``progress`` line after byte ``start`` of ``log``, read backwards,
    so that a log grown over days costs one block, not a full read."""
    prefix = PROGRESS_PREFIX.encode()
    try:
        handle = log.open("rb")
    except FileNotFoundError:
        return None
    with handle:
        pos = handle.seek(0, os.SEEK_END)
        carry: bytes | None = None
        while pos > start:
            step = min(block, pos - start)
            pos -= step
            handle.seek(pos)
            data = handle.read(step) + (carry or b"")
            lines = data.split(b"\n")
            if carry is None:
                lines.pop()  # text after the last newline: a line still being written
            carry = lines.pop(0) if pos > start else None
            for line in reversed(lines):
                if line.startswith(prefix):
                    parsed = parse_progress(line.decode("utf-8", errors="replace"))
                    if parsed is not None:
                        return parsed
            if carry is None:
                break
    return None


_ERROR_LINE = re.compile(r"^\S.*(Error|Exception)\b")


def last_meaningful(lines: tuple[str, ...]) -> str:
    """The line of a log tail that explains a failure: the last exception line (a Python
    traceback ends with it), else the last line."""
    if not lines:
        return "the log is empty"
    line = next((line for line in reversed(lines) if _ERROR_LINE.match(line)), lines[-1])
    line = line.strip()
    return line if len(line) <= 300 else line[:297] + "..."


def log_tail(log: Path, offset: int) -> tuple[str, ...]:
    """The last lines a run wrote to ``log`` after byte ``offset``."""
    try:
        with log.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(offset, size - 16_384))
            text = handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ()
    lines = [line for line in text.splitlines() if line.strip()]
    return tuple(lines[-LOG_TAIL_LINES:])
