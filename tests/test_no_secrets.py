"""No secret in the repository, and no documented Airflow mode with authentication off.

Every secret of a deployment comes from the environment (``.env`` for
Compose, ``KEYPLANE_CONTROL_KEY`` for the control messages' HMAC key): a key
committed once stays in the history for good, and whoever holds the control
key can rewrite the running job's routing (000 §3.4). So the tracked files
are scanned for private keys, cloud and service tokens, and secrets written
as literals in configuration files, and the scan is itself tested on planted
samples so that it can fail.

Airflow's simple auth manager can make every visitor an admin
(``simple_auth_manager_all_admins``); no file that tells a user how to run
Airflow — the Compose file, the docs, the scripts, the code that builds the
DAG's environment — may turn that on.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CONFIG_SUFFIXES = frozenset(
    {".yml", ".yaml", ".ini", ".cfg", ".toml", ".conf", ".properties", ".json", ".env"}
)
"""Files where ``name: value`` / ``name = value`` assigns a setting."""

TOKEN_PATTERNS: dict[str, re.Pattern[str]] = {
    "private key": re.compile(r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY(?: BLOCK)?-----"),
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "AWS secret access key": re.compile(
        r"(?i)aws_secret_access_key\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}\b"
    ),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "Slack token": re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),
    "Google API key": re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"),
}

SECRET_SETTING = re.compile(
    r"(?i)^\s*[\"']?(?P<name>[\w.-]*(?:password|passwd|secret|token|api[_-]?key|"
    r"control[_-]?key)[\w.-]*)[\"']?\s*[:=]\s*(?P<value>.*?)\s*$"
)
NOT_A_VALUE = re.compile(
    r"""^(?:
        |["']{2}                     # empty
        |["']?\$\{[^}]+\}["']?       # ${VAR}, ${VAR:?message}: taken from the environment
        |["']?\$[A-Z_][A-Z0-9_]*["']?  # $VAR
        |\*[\w-]+                    # a YAML alias of such a value
        |&[\w-]+\s.*                 # a YAML anchor: its value is checked on its own
        |["']?(?:false|true|null|none)["']?  # a flag, not a secret
    )$""",
    re.VERBOSE | re.IGNORECASE,
)
NAMES_OF_NON_SECRETS = re.compile(r"(?i)(?:_file|_path|_dir|_length|_env|_var|_conn_id|_id)$")
"""Settings that name where a secret comes from, or bound one, rather than hold it."""


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}"


def scan_text(path: str, text: str) -> list[Finding]:
    """Every secret-looking token in ``text``, and, in configuration files, every secret
    setting whose value is a literal rather than a reference to the environment."""
    findings: list[Finding] = []
    is_config = Path(path).suffix in CONFIG_SUFFIXES or Path(path).name.startswith(".env")
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in TOKEN_PATTERNS.items():
            if pattern.search(line):
                findings.append(Finding(path, number, kind))
        if not is_config or line.lstrip().startswith("#"):
            continue
        setting = SECRET_SETTING.match(line)
        if setting is None or NAMES_OF_NON_SECRETS.search(setting["name"]):
            continue
        value = setting["value"].split(" #")[0].strip().rstrip(",")
        if not NOT_A_VALUE.match(value):
            findings.append(Finding(path, number, f"literal secret in setting {setting['name']}"))
    return findings


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no tracked files to scan")
    return [name for name in listed.stdout.decode().split("\0") if name]


def _text(name: str) -> str | None:
    path = REPO / name
    if not path.is_file():
        return None
    raw = path.read_bytes()
    if b"\0" in raw[:8192]:
        return None
    return raw.decode("utf-8", "replace")


def test_the_scanner_finds_each_kind_of_planted_secret_pure() -> None:
    # Assembled at run time, so that this file holds no secret-looking literal itself.
    begin = "-----BEGIN " + "RSA PRIVATE KEY-----"
    samples = {
        "id_rsa": begin + "\nMIIEpAIBAAKCAQEA\n",
        "notes.md": "key id " + "AKIA" + "ABCDEFGHIJKLMNOP",
        "aws.ini": "aws_secret_access_key = " + "a1B2" * 10,
        "ci.sh": "export T=" + "ghp_" + "x" * 36,
        "hook.txt": "xoxb-" + "1234567890-abcdef",
        "maps.js": "const k = 'AIza" + "B" * 35 + "'",
        "compose.yml": "    POSTGRES_PASSWORD: " + "hunter2hunter2",
        "airflow.cfg": "secret_key = " + "s3cr3t",
        ".env": "KEYPLANE_CONTROL_KEY=" + "0123abcd" * 8,
    }
    found = {path: scan_text(path, text) for path, text in samples.items()}
    assert {path for path, hits in found.items() if hits} == set(samples), found
    assert [hit.kind for hit in found["id_rsa"]] == ["private key"]


def test_references_to_the_environment_are_not_secrets_pure() -> None:
    clean = "\n".join(
        [
            'POSTGRES_PASSWORD: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD in .env}"',
            "KEYPLANE_CONTROL_KEY: *control-key",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE: /var/lib/airflow/passwords.json",
            "KEYPLANE_CONTROL_KEY=",
            "# password: only a comment",
        ]
    )
    assert scan_text("docker-compose.yml", clean) == []


def test_tracked_files_hold_no_secrets() -> None:
    findings = [
        finding
        for name in tracked_files()
        if (text := _text(name)) is not None
        for finding in scan_text(name, text)
    ]
    assert findings == [], "\n".join(str(f) for f in findings)


ALL_ADMINS_ON = re.compile(
    r"(?i)simple_auth_manager_all_admins[\"']?\s*[:=]\s*[\"']?(?:true|1|yes|on)\b"
)


def test_no_documented_airflow_mode_makes_every_user_an_admin() -> None:
    """Compose, the docs, the scripts and the code never switch the simple auth manager's
    all-admins mode on (the Compose file sets it off explicitly)."""
    documented = [
        name
        for name in tracked_files()
        if not name.startswith("tests/") and (_text(name) or "").strip()
    ]
    on = [
        f"{name}:{number}"
        for name in documented
        for number, line in enumerate((_text(name) or "").splitlines(), start=1)
        if ALL_ADMINS_ON.search(line)
    ]
    assert on == [], on
    compose = _text("docker-compose.yml") or ""
    assert re.search(r"SIMPLE_AUTH_MANAGER_ALL_ADMINS:\s*\"false\"", compose), (
        "the Compose deployment sets all-admins off explicitly"
    )


def test_the_dag_runs_environment_keeps_auth_on() -> None:
    """``airflow dags test`` / ``airflow standalone`` as docs/orchestration.md runs them."""
    from keyplane.orchestration.dagrun import AirflowSetup

    env = AirflowSetup(
        airflow_home=REPO / "var" / "airflow",
        dags_folder=REPO / "dags",
        bootstrap_servers="127.0.0.1:19092",
        keyplane_home=REPO / "var",
        routing_store=REPO / "var" / "configs",
        events_topic="keyplane.events",
        metrics_topic="keyplane.metrics",
        control_topic="keyplane.control",
    ).environment(base={})
    assert env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "false").lower() == "false"
    assert not any(ALL_ADMINS_ON.search(f"{name}={value}") for name, value in env.items())
