"""Airflow's API server, scheduler, dag processor and triggerer on the stack's PostgreSQL.

The same components, environment and sizes as ``keyplane airflow``
(:class:`~keyplane.orchestration.localairflow.LocalAirflow`), with the
metadata in PostgreSQL and each component recorded, so that ``up`` returns
and a later ``down`` stops them. Healthy when the API server reports the
metadatabase, the scheduler, the dag processor and the triggerer healthy.
"""

from __future__ import annotations

from pathlib import Path

from keyplane.orchestration.localairflow import (
    COMPONENTS,
    LocalAirflow,
    component_health,
    start,
)
from keyplane.stack.piece import Health, Processes, StackError, wait_until_up

REPORTED = ("metadatabase", "scheduler", "dag_processor", "triggerer")


class AirflowPiece:
    name = "airflow"

    def __init__(self, home: Path, local: LocalAirflow) -> None:
        self.local = local
        self.processes = Processes(home / "pids")

    @property
    def log(self) -> Path:
        return self.local.setup.airflow_home / "logs" / "components"

    def _recorded(self) -> dict[str, bool]:
        return {name: self.processes.running(f"airflow-{name}") is not None for name in COMPONENTS}

    def up(self, timeout_s: float = 300.0) -> None:
        if self.local.database_url is None:
            raise StackError("airflow: no database URL (PostgreSQL has not made Airflow's user)")
        if not all(self._recorded().values()):
            self.down()
            try:
                running = start(self.local)
            except RuntimeError as error:
                last = str(error).strip().splitlines()[-1]
                raise StackError(f"airflow: the database migration failed: {last}") from None
            commands = self.local.commands()
            for name, process in running.processes.items():
                self.processes.record(
                    f"airflow-{name}", process.pid, commands[name], running.logs[name]
                )
        wait_until_up(
            self,
            timeout_s,
            exited=lambda: next(
                (
                    f"airflow {name} exited; see {self.log / f'{name}.log'}"
                    for name, up in self._recorded().items()
                    if not up
                ),
                None,
            ),
            timed_out=lambda: (
                f"airflow did not report healthy at {self.local.url}/api/v2/monitor/health "
                f"within {timeout_s:.0f} s ({self.health().detail}); see {self.log}"
            ),
            poll_s=2.0,
        )

    def down(self) -> bool:
        stopped = [self.processes.stop(f"airflow-{name}") for name in COMPONENTS]
        return any(stopped)

    def health(self) -> Health:
        report = component_health(self.local.url)
        unhealthy = [name for name in REPORTED if report.get(name) != "healthy"]
        if not report:
            detail = f"the API server does not answer; logs in {self.log}"
        elif unhealthy:
            detail = "not healthy: " + ", ".join(
                f"{n} {report.get(n, 'absent')}" for n in unhealthy
            )
        else:
            detail = "metadatabase, scheduler, dag processor, triggerer healthy"
        return Health(
            piece=self.name, up=bool(report) and not unhealthy, url=self.local.url, detail=detail
        )
