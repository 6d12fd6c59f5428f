"""Write the password file of Airflow's simple auth manager from the environment.

The api-server reads user passwords from ``[core] simple_auth_manager_passwords_file``
and, for a configured user missing from that file, generates a random password
and prints it to the log. The deployment's init service runs this script after
``airflow db migrate`` so the admin password comes from ``.env`` instead.

Environment:

* ``AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE``: the file to write.
* ``AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS``: ``user:role[,user:role...]``.
* ``AIRFLOW_ADMIN_USER``: must be one of those users.
* ``AIRFLOW_ADMIN_PASSWORD``: at least ``MIN_PASSWORD_LENGTH`` characters.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

MIN_PASSWORD_LENGTH = 12


class PasswordFileError(ValueError):
    """The environment does not describe a usable admin account."""


def configured_users(spec: str) -> list[str]:
    """User names of a ``simple_auth_manager_users`` value."""
    return [entry.split(":")[0].strip() for entry in spec.split(",") if entry.strip()]


def write_password_file(env: Mapping[str, str]) -> Path:
    """Write ``{admin: password}`` with mode 0600, replacing any previous file."""
    path_value = env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", "")
    if not path_value:
        raise PasswordFileError("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE is not set")
    user = env.get("AIRFLOW_ADMIN_USER", "")
    users = configured_users(env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", ""))
    if user not in users:
        raise PasswordFileError(
            f"AIRFLOW_ADMIN_USER {user!r} is not among the configured users {users}"
        )
    password = env.get("AIRFLOW_ADMIN_PASSWORD", "")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise PasswordFileError(
            f"AIRFLOW_ADMIN_PASSWORD must have at least {MIN_PASSWORD_LENGTH} characters"
        )
    path = Path(path_value)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({user: password}) + "\n")
    tmp.replace(path)
    return path


def main() -> int:
    try:
        path = write_password_file(os.environ)
    except PasswordFileError as exc:
        print(f"airflow_passwords: {exc}", file=sys.stderr)
        return 2
    print(f"airflow_passwords: wrote the password of {os.environ['AIRFLOW_ADMIN_USER']} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
