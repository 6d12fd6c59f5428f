"""The routed job, submitted to the stack's standalone master: ``keyplane job start``.

:class:`~keyplane.spark.jobprocess.JobProcess` with ``spark_master`` and the
bootstrap servers pointed at the stack, and the driver bound to the address
that the executors reach (the bridge, when they run on hosts of their own).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from keyplane.settings import Settings
from keyplane.spark.job_record import JobError
from keyplane.spark.jobprocess import JobProcess
from keyplane.stack.piece import Health, StackError
from keyplane.stack.spark import master_state


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the job starts (it inherits them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class JobPiece:
    name = "job"

    def __init__(self, settings: Settings, master_ui: str, environment: Mapping[str, str]) -> None:
        self.settings = settings
        self.master_ui = master_ui
        self.environment = dict(environment)
        self.process = JobProcess(settings)

    @property
    def log(self) -> Path:
        return self.process.log

    def up(self) -> None:
        with _environment(self.environment):
            try:
                self.process.start()
            except JobError as error:
                raise StackError(f"job did not come up: {error}") from None

    def down(self) -> bool:
        try:
            return self.process.stop().outcome in ("stopped", "killed")
        except JobError as error:
            raise StackError(f"job: {error}") from None

    def health(self) -> Health:
        running = self.process.status().running is not None
        state = master_state(self.master_ui) or {}
        apps = [app for app in state.get("activeapps", []) if app.get("state") == "RUNNING"]
        up = running and bool(apps)
        detail = (
            f"running on {self.settings.spark_master} ({len(apps)} application)"
            if up
            else f"not running on the master; log {self.log}"
        )
        return Health(piece=self.name, up=up, url=self.settings.spark_master, detail=detail)
