"""PostgreSQL from the distribution's packages: Airflow's metadata database.

A cluster of its own under the stack's home (``initdb``), served on loopback
by ``pg_ctl``, with a database and a user for Airflow whose password is
generated once and kept beside the cluster (owner-only). PostgreSQL refuses
to run as root, so as root the cluster belongs to the ``postgres`` system
user, which the package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path

from keyplane.stack.piece import Health, StackError, euid_is_root

DATABASE = "airflow"
USER = "airflow"
SYSTEM_USER = "postgres"


def server_binaries() -> Path:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``: the newest installed major."""
    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(found) / "pg_ctl").is_file():
            return Path(found)
    on_path = shutil.which("pg_ctl")
    if on_path is not None:
        return Path(on_path).resolve().parent
    raise StackError(
        "postgres: the PostgreSQL server is not installed (apt-get install postgresql)"
    )


class PostgresPiece:
    name = "postgres"

    def __init__(self, home: Path, port: int) -> None:
        self.folder = home / "postgres"
        self.data = self.folder / "data"
        self.sockets = self.folder / "run"
        self.port = port

    @property
    def log(self) -> Path:
        return self.folder / "postgres.log"

    @property
    def password_file(self) -> Path:
        return self.folder / "airflow_password"

    def url(self) -> str:
        """The SQLAlchemy URL of Airflow's database."""
        password = self.password_file.read_text().strip()
        return f"postgresql+psycopg2://{USER}:{password}@127.0.0.1:{self.port}/{DATABASE}"

    def _as_owner(self, command: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL tool as the cluster's owner (``postgres`` when this is root)."""
        prefix: list[str] = []
        if euid_is_root():
            prefix = [
                "setpriv",
                f"--reuid={SYSTEM_USER}",
                f"--regid={SYSTEM_USER}",
                "--init-groups",
            ]
        done = subprocess.run(
            [*prefix, *command], capture_output=True, text=True, check=False, cwd="/"
        )
        if check and done.returncode != 0:
            output = (done.stdout + done.stderr).strip().splitlines()
            last = output[-1] if output else f"exit {done.returncode}"
            raise StackError(f"postgres: `{Path(command[0]).name}` failed: {last}; see {self.log}")
        return done

    def _prepare(self, binaries: Path) -> None:
        """``initdb`` on the first ``up``; the folders owned by the cluster's owner."""
        self.sockets.mkdir(parents=True, exist_ok=True)
        self.log.touch()
        if euid_is_root():
            owner = pwd.getpwnam(SYSTEM_USER)
            for path in (self.folder, self.sockets, self.log):
                os.chown(path, owner.pw_uid, owner.pw_gid)
            if self._as_owner(["test", "-w", str(self.folder)], check=False).returncode != 0:
                raise StackError(
                    f"postgres: the {SYSTEM_USER} user cannot reach {self.folder} (a parent "
                    "folder is not searchable by others); choose a KEYPLANE_HOME it can reach"
                )
        if (self.data / "PG_VERSION").is_file():
            return
        self._as_owner(
            [
                str(binaries / "initdb"),
                "-D",
                str(self.data),
                "--auth-local=peer",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--no-instructions",
            ]
        )

    def _running(self, binaries: Path) -> bool:
        if not (self.data / "PG_VERSION").is_file():
            return False
        status = self._as_owner([str(binaries / "pg_ctl"), "status", "-D", str(self.data)], False)
        return status.returncode == 0

    def _psql(self, sql: str) -> str:
        return self._as_owner(
            [
                "psql",
                "-h",
                str(self.sockets),
                "-p",
                str(self.port),
                "-d",
                "postgres",
                "-tAc",
                sql,
            ]
        ).stdout.strip()

    def _create_airflow_database(self) -> None:
        if not self.password_file.is_file():
            self.password_file.touch(mode=0o600)
            self.password_file.write_text(secrets.token_urlsafe(24))
        password = self.password_file.read_text().strip()
        if self._psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{USER}'") != "1":
            self._psql(f"CREATE ROLE {USER} LOGIN PASSWORD '{password}'")
        if self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'") != "1":
            self._psql(f"CREATE DATABASE {DATABASE} OWNER {USER}")

    def up(self) -> None:
        binaries = server_binaries()
        self._prepare(binaries)
        if not self._running(binaries):
            options = (
                f"-p {self.port} -c listen_addresses=127.0.0.1 "
                f"-c unix_socket_directories={self.sockets}"
            )
            self._as_owner(
                [
                    str(binaries / "pg_ctl"),
                    "start",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    options,
                ]
            )
        self._create_airflow_database()
        health = self.health()
        if not health.up:
            raise StackError(f"postgres did not come up: {health.detail}")

    def down(self) -> bool:
        binaries = server_binaries()
        if not self._running(binaries):
            return False
        self._as_owner([str(binaries / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w"])
        return True

    def health(self) -> Health:
        """``pg_isready``, then a query as Airflow's user over TCP, as Airflow connects."""
        url = f"postgresql://127.0.0.1:{self.port}/{DATABASE}"
        ready = subprocess.run(
            ["pg_isready", "-h", "127.0.0.1", "-p", str(self.port), "-t", "2"],
            capture_output=True,
            text=True,
            check=False,
        )
        if ready.returncode != 0:
            return Health(piece=self.name, up=False, url=url, detail=f"not ready; log {self.log}")
        import psycopg2

        try:
            password = self.password_file.read_text().strip()
            with (
                psycopg2.connect(
                    host="127.0.0.1",
                    port=self.port,
                    dbname=DATABASE,
                    user=USER,
                    password=password,
                    connect_timeout=3,
                ) as connection,
                connection.cursor() as cursor,
            ):
                cursor.execute("SELECT current_database()")
                row = cursor.fetchone()
            connection.close()
        except (OSError, psycopg2.Error) as error:
            detail = (
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            )
            return Health(piece=self.name, up=False, url=url, detail=f"{detail}; log {self.log}")
        up = row is not None and row[0] == DATABASE
        return Health(piece=self.name, up=up, url=url, detail="answers queries as airflow")
