"""Wiring of the distributed deployment (docker-compose.yml and deploy/).

The compose file cannot be run here, so it is checked by reading it. Each
check is a function that returns the problems it finds. It runs on the real
file, where it must find none, and on deliberately broken copies, where it
must report the break: every check is shown able to fail.

Where a real library can judge a value, it does: Airflow's Spark and Kafka
hooks resolve the connections, the job's own CLI parses the spark-submit
arguments into routed settings, keyplane's Deployment reads the Airflow
containers' environment, and the simple auth manager reads the password file
that the init service writes. Connection ids and the control key's variable
come from keyplane itself, not from copies here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from keyplane.control.signing import KEY_ENV_VAR as CONTROL_KEY_VAR
from keyplane.orchestration.deployment import KAFKA_CONN_ID, SPARK_CONN_ID
from keyplane.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENV_EXAMPLE = ROOT / "deploy" / "env.example"
PASSWORDS_SCRIPT = ROOT / "deploy" / "airflow_passwords.py"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"

KEYPLANE_DOCKERFILE = "deploy/Dockerfile"
IMAGE_PROJECT_DIR = "/opt/keyplane"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"

# The environment variables that define the DAG's connections (Airflow's
# AIRFLOW_CONN_<CONN_ID upper> convention).
KAFKA_CONN_VAR = f"AIRFLOW_CONN_{KAFKA_CONN_ID.upper()}"
SPARK_CONN_VAR = f"AIRFLOW_CONN_{SPARK_CONN_ID.upper()}"

# Stands in for .env. User and database differ from the file's defaults, so
# a value that does not come from the variable shows up as a mismatch.
SAMPLE_ENV = {
    "POSTGRES_USER": "kp_user",
    "POSTGRES_DB": "kp_db",
    "POSTGRES_PASSWORD": "pg-password-123",
    "AIRFLOW_ADMIN_USER": "ops",
    "AIRFLOW_ADMIN_PASSWORD": "admin-password-123",
    "AIRFLOW_FERNET_KEY": "fernet-key-value",
    "AIRFLOW_API_SECRET_KEY": "api-secret-value",
    "AIRFLOW_JWT_SECRET": "jwt-secret-value",
    CONTROL_KEY_VAR: "control-key-value",
}

Compose = dict[str, Any]
Check = Callable[[Compose], list[str]]


# --- compose variable interpolation ------------------------------------------

_VARIABLE = re.compile(
    r"\$\$"
    r"|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


class MissingVariableError(KeyError):
    """A ``${NAME:?message}`` variable is unset or empty."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's rules for ``$$``, ``${V}``, ``${V:-d}``, ``${V-d}``, ``${V:?e}``, ``${V?e}``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"], match["arg"]
        colon = op is not None and op.startswith(":")
        if name in env and (env[name] != "" or not colon):
            return env[name]
        if op is not None and op.endswith("?"):
            raise MissingVariableError(f"{name}: {arg}")
        if op is not None and op.endswith("-"):
            return arg
        return ""

    return _VARIABLE.sub(replace, text)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    """A fresh copy of ``node`` with every string value interpolated (no shared subtrees)."""
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, str):
        return interpolate(node, env)
    return node


def unshared(node: Any) -> Any:
    """A copy without the shared subtrees that YAML anchors create."""
    return json.loads(json.dumps(node))


# --- reading services ---------------------------------------------------------


def services(compose: Compose) -> dict[str, dict[str, Any]]:
    return compose.get("services") or {}


def env_of(service: Mapping[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        pairs = (item.split("=", 1) for item in raw)
        return {pair[0]: pair[1] if len(pair) > 1 else "" for pair in pairs}
    return {key: "" if value is None else str(value) for key, value in raw.items()}


def tokens_of(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(item) for item in value]


def command_of(service: Mapping[str, Any]) -> list[str]:
    return tokens_of(service.get("command"))


def all_command_text(service: Mapping[str, Any]) -> str:
    """Entrypoint, command and healthcheck of a service as one string."""
    parts = tokens_of(service.get("entrypoint")) + command_of(service)
    parts += tokens_of((service.get("healthcheck") or {}).get("test"))
    return " ".join(parts)


def option_values(tokens: list[str], flag: str) -> list[str]:
    """Values of ``flag VALUE`` and ``flag=VALUE`` in a token list."""
    values = []
    for i, token in enumerate(tokens):
        if token == flag and i + 1 < len(tokens):
            values.append(tokens[i + 1])
        elif token.startswith(flag + "="):
            values.append(token.split("=", 1)[1])
    return values


def is_keyplane(service: Mapping[str, Any]) -> bool:
    build = service.get("build")
    return isinstance(build, dict) and build.get("dockerfile") == KEYPLANE_DOCKERFILE


def is_airflow(service: Mapping[str, Any]) -> bool:
    return any(key.startswith("AIRFLOW__") for key in env_of(service))


def dns_names(name: str, service: Mapping[str, Any]) -> set[str]:
    """Names under which other containers reach a service."""
    return {name} | ({service["hostname"]} if service.get("hostname") else set())


def mounts(service: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short or long syntax."""
    found = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            found.append((str(entry.get("source", "")), str(entry.get("target", ""))))
        else:
            parts = str(entry).split(":")
            found.append((parts[0], parts[1]) if len(parts) > 1 else ("", parts[0]))
    return found


def is_named_volume(source: str) -> bool:
    return bool(source) and not source.startswith(("/", ".", "~", "$"))


def mount_holding(service: Mapping[str, Any], path: str) -> tuple[str, str] | None:
    """The mount whose target contains ``path`` (the deepest one)."""
    holding = [
        (source, target)
        for source, target in mounts(service)
        if path == target or path.startswith(target.rstrip("/") + "/")
    ]
    return max(holding, key=lambda mount: len(mount[1])) if holding else None


def services_running(compose: Compose, needle: str) -> list[str]:
    return [name for name, svc in services(compose).items() if needle in command_of(svc)]


def truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


# --- Kafka ---------------------------------------------------------------------


def kafka_services(compose: Compose) -> dict[str, dict[str, Any]]:
    return {
        name: svc for name, svc in services(compose).items() if "KAFKA_PROCESS_ROLES" in env_of(svc)
    }


def listener_map(spec: str) -> dict[str, str]:
    """``NAME://host:port,...`` as {NAME: 'host:port'}."""
    result = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, _, address = entry.partition("://")
        result[name] = address
    return result


def advertised_plaintext(compose: Compose) -> str | None:
    for svc in kafka_services(compose).values():
        address = listener_map(env_of(svc).get("KAFKA_ADVERTISED_LISTENERS", "")).get("PLAINTEXT")
        if address:
            return address
    return None


def check_kafka_kraft(compose: Compose) -> list[str]:
    problems: list[str] = []
    kafkas = kafka_services(compose)
    if not kafkas:
        return ["no Kafka service (KAFKA_PROCESS_ROLES) found"]
    brokers = sum("broker" in env_of(s)["KAFKA_PROCESS_ROLES"] for s in kafkas.values())
    for name, svc in kafkas.items():
        env = env_of(svc)
        roles = {role.strip() for role in env["KAFKA_PROCESS_ROLES"].split(",")}
        listeners = listener_map(env.get("KAFKA_LISTENERS", ""))
        advertised = listener_map(env.get("KAFKA_ADVERTISED_LISTENERS", ""))
        protocols = dict(
            entry.split(":", 1)
            for entry in env.get("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "").split(",")
            if ":" in entry
        )
        controller_names = [
            c.strip() for c in env.get("KAFKA_CONTROLLER_LISTENER_NAMES", "").split(",") if c
        ]
        if not env.get("CLUSTER_ID"):
            problems.append(f"{name}: CLUSTER_ID is required in KRaft mode")
        if not roles <= {"broker", "controller"} or not roles:
            problems.append(f"{name}: bad KAFKA_PROCESS_ROLES {sorted(roles)}")
        for listener in set(listeners) | set(advertised):
            if listener not in protocols:
                problems.append(f"{name}: listener {listener} has no security protocol")
        if not controller_names:
            problems.append(f"{name}: KAFKA_CONTROLLER_LISTENER_NAMES is not set")
        voters = {}
        for voter in env.get("KAFKA_CONTROLLER_QUORUM_VOTERS", "").split(","):
            node, _, voter_address = voter.partition("@")
            voters[node.strip()] = voter_address.strip()
        if "controller" in roles:
            address = voters.get(str(env.get("KAFKA_NODE_ID", "")))
            if address is None:
                problems.append(f"{name}: KAFKA_NODE_ID is not among the quorum voters")
            else:
                host, _, port = address.rpartition(":")
                ports = {listeners.get(c, "").rpartition(":")[2] for c in controller_names}
                if host not in dns_names(name, svc) or port not in ports:
                    problems.append(
                        f"{name}: voter {address} is not this node's controller listener"
                    )
        if "broker" in roles:
            plaintext = advertised.get("PLAINTEXT")
            if plaintext is None:
                problems.append(f"{name}: no PLAINTEXT advertised listener for other containers")
            else:
                host, _, port = plaintext.rpartition(":")
                if host not in dns_names(name, svc):
                    problems.append(f"{name}: PLAINTEXT is advertised as {host}, not the service")
                if listeners.get("PLAINTEXT", "").rpartition(":")[2] != port:
                    problems.append(f"{name}: advertised PLAINTEXT port {port} is not listened on")
            for key in (
                "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
                "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
            ):
                if int(env.get(key, "3")) > brokers:
                    problems.append(f"{name}: {key} exceeds the {brokers} broker(s)")
    return problems


def check_bootstrap_servers(compose: Compose) -> list[str]:
    """Every Kafka address a client is given is Kafka's advertised PLAINTEXT listener."""
    expected = advertised_plaintext(compose)
    if expected is None:
        return ["Kafka advertises no PLAINTEXT listener"]
    problems = []
    for name, svc in services(compose).items():
        env = env_of(svc)
        if is_keyplane(svc) and env.get("KEYPLANE_BOOTSTRAP_SERVERS") != expected:
            problems.append(
                f"{name}: KEYPLANE_BOOTSTRAP_SERVERS={env.get('KEYPLANE_BOOTSTRAP_SERVERS')}"
                f" but Kafka advertises {expected}"
            )
        if is_airflow(svc):
            raw = env.get(KAFKA_CONN_VAR)
            if raw is None:
                problems.append(f"{name}: {KAFKA_CONN_VAR} is not set")
            else:
                conn = json.loads(raw)
                servers = (conn.get("extra") or {}).get("bootstrap.servers")
                if conn.get("conn_type") != "kafka" or servers != expected:
                    problems.append(f"{name}: Airflow's Kafka connection points at {servers}")
        for servers in re.findall(r"--bootstrap-servers?[ =]+(\S+)", all_command_text(svc)):
            if servers != expected:
                problems.append(f"{name}: a command connects to {servers}, not {expected}")
    return problems


# --- Spark ---------------------------------------------------------------------


def spark_master_url(compose: Compose) -> str | None:
    for name, svc in services(compose).items():
        tokens = command_of(svc)
        if "org.apache.spark.deploy.master.Master" in tokens:
            host = (option_values(tokens, "--host") or [name])[0]
            port = (option_values(tokens, "--port") or ["7077"])[0]
            return f"spark://{host}:{port}"
    return None


def job_service(compose: Compose) -> tuple[str, dict[str, Any]] | None:
    for name, svc in services(compose).items():
        tokens = command_of(svc)
        if tokens and tokens[0].endswith("spark-submit"):
            return name, svc
    return None


def split_submit(tokens: list[str]) -> tuple[list[str], str, list[str]]:
    """spark-submit options, the application file, and the application's arguments."""
    app = next(i for i, token in enumerate(tokens) if token.endswith(".py"))
    return tokens[1:app], tokens[app], tokens[app + 1 :]


def check_spark_cluster(compose: Compose) -> list[str]:
    """Workers, the job, keyplane and Airflow all use the master's own URL."""
    url = spark_master_url(compose)
    if url is None:
        return ["no Spark master service"]
    problems = []
    master_host = url.removeprefix("spark://").rpartition(":")[0]
    reachable = set()
    for name, svc in services(compose).items():
        if "org.apache.spark.deploy.master.Master" in command_of(svc):
            reachable = dns_names(name, svc)
    if master_host not in reachable:
        problems.append(f"the master binds to {master_host}, which other containers cannot resolve")
    workers = services_running(compose, "org.apache.spark.deploy.worker.Worker")
    if not workers:
        problems.append("no Spark worker service")
    for name in workers:
        tokens = command_of(services(compose)[name])
        target = tokens[tokens.index("org.apache.spark.deploy.worker.Worker") + 1]
        if target != url:
            problems.append(f"{name}: worker registers with {target}, master is {url}")
    for name, svc in services(compose).items():
        env = env_of(svc)
        if is_keyplane(svc) and env.get("KEYPLANE_SPARK_MASTER") != url:
            problems.append(f"{name}: KEYPLANE_SPARK_MASTER={env.get('KEYPLANE_SPARK_MASTER')}")
        if is_airflow(svc) and env.get(SPARK_CONN_VAR) != url:
            problems.append(f"{name}: {SPARK_CONN_VAR}={env.get(SPARK_CONN_VAR)}")
    job = job_service(compose)
    if job is None:
        return [*problems, "no service runs spark-submit"]
    name, svc = job
    submit, _, app_args = split_submit(command_of(svc))
    if option_values(submit, "--master") != [url]:
        problems.append(f"{name}: spark-submit --master {option_values(submit, '--master')}")
    # The job's SparkSession builder sets the master itself, overriding
    # spark-submit's, so the job's own --master must name the cluster too.
    if option_values(app_args, "--master") != [url]:
        problems.append(f"{name}: the job's --master is {option_values(app_args, '--master')}")
    return problems


def check_streaming_job(compose: Compose, spark_version: str, scala: str) -> list[str]:
    job = job_service(compose)
    if job is None:
        return ["no service runs spark-submit"]
    name, svc = job
    submit, app, app_args = split_submit(command_of(svc))
    problems = []
    # The routed job reads Kafka through keyplane's Python source and needs
    # no connector; a connector that is added anyway must match the locked Spark.
    connector = f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{spark_version}"
    packages = [p for p in ",".join(option_values(submit, "--packages")).split(",") if p]
    for package in packages:
        if "spark-sql-kafka" in package and package != connector:
            problems.append(f"{name}: --packages {package} is not the locked Spark's {connector}")
    if not option_values(app_args, "--bootstrap-servers"):
        problems.append(f"{name}: the job has no --bootstrap-servers")
    if (
        not app.startswith(IMAGE_PROJECT_DIR + "/")
        or not (ROOT / app.removeprefix(IMAGE_PROJECT_DIR + "/")).is_file()
    ):
        problems.append(f"{name}: {app} is not a file of this repository in the image")
    confs = dict(c.split("=", 1) for c in option_values(submit, "--conf"))
    if confs.get("spark.driver.host") not in dns_names(name, svc):
        problems.append(
            f"{name}: executors cannot reach the driver at {confs.get('spark.driver.host')}"
        )
    for other in services(compose).values():
        if "org.apache.spark.deploy.master.Master" in command_of(other):
            tag = str(other.get("image", "")).rpartition(":")[2]
            if not tag.startswith(f"{spark_version}-scala{scala}-"):
                problems.append(f"the master image tag {tag} is not Spark {spark_version}/{scala}")
    return problems


def check_checkpoint_volume(compose: Compose) -> list[str]:
    """The job's checkpoint sits on one named volume, mounted alike on every worker."""
    job = job_service(compose)
    if job is None:
        return ["no service runs spark-submit"]
    name, svc = job
    _, _, app_args = split_submit(command_of(svc))
    problems = []
    for flag in ("--checkpoint", "--output"):
        paths = option_values(app_args, flag)
        if not paths:
            problems.append(f"{name}: no {flag}")
            continue
        mount = mount_holding(svc, paths[0])
        if mount is None or not is_named_volume(mount[0]):
            problems.append(f"{name}: {flag} {paths[0]} is not on a named volume")
    checkpoint = option_values(app_args, "--checkpoint")
    job_mount = mount_holding(svc, checkpoint[0]) if checkpoint else None
    if job_mount is None:
        return problems
    workers = services_running(compose, "org.apache.spark.deploy.worker.Worker")
    for worker in workers:
        if job_mount not in mounts(services(compose)[worker]):
            problems.append(
                f"{worker}: does not mount volume {job_mount[0]} at {job_mount[1]} like {name}"
            )
    return problems


# --- Airflow -------------------------------------------------------------------

SHARED_AIRFLOW_SETTINGS = (
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__CORE__EXECUTOR",
    "AIRFLOW__CORE__FERNET_KEY",
    "AIRFLOW__API__SECRET_KEY",
    "AIRFLOW__API_AUTH__JWT_SECRET",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__CORE__AUTH_MANAGER",
)


def airflow_services(compose: Compose) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services(compose).items() if is_airflow(svc)}


def check_airflow_components(compose: Compose) -> list[str]:
    """The four Airflow 3 components and an init service, sharing their settings."""
    airflow = airflow_services(compose)
    problems = []
    for component in ("api-server", "scheduler", "dag-processor", "triggerer"):
        if not [n for n, s in airflow.items() if command_of(s)[:1] == [component]]:
            problems.append(f"no Airflow {component}")
    inits = [n for n, s in airflow.items() if "airflow db migrate" in " ".join(command_of(s))]
    if not inits:
        problems.append("no init service runs `airflow db migrate`")
    for name, svc in airflow.items():
        if name in inits:
            continue
        condition = ((svc.get("depends_on") or {}).get(inits[0] if inits else "") or {}).get(
            "condition"
        )
        if condition != "service_completed_successfully":
            problems.append(f"{name}: does not wait for the init service to finish")
    for key in SHARED_AIRFLOW_SETTINGS:
        values = {name: env_of(svc).get(key, "") for name, svc in airflow.items()}
        if "" in values.values() or len(set(values.values())) != 1:
            problems.append(f"{key} is missing or differs between Airflow services: {values}")
    executors = {env_of(s).get("AIRFLOW__CORE__EXECUTOR") for s in airflow.values()}
    if executors != {"LocalExecutor"}:
        problems.append(f"executor {executors}: only LocalExecutor runs without a Celery broker")
    api = [(n, s) for n, s in airflow.items() if command_of(s)[:1] == ["api-server"]]
    for name, svc in airflow.items():
        target = urlsplit(env_of(svc).get("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", ""))
        if not api or target.hostname not in dns_names(*api[0]) or target.port != 8080:
            problems.append(f"{name}: the execution API URL does not reach the api-server")
    return problems


def check_airflow_database(compose: Compose) -> list[str]:
    """Every Airflow service's DB URL names the postgres service and its user/db."""
    postgres = [(n, s) for n, s in services(compose).items() if "POSTGRES_PASSWORD" in env_of(s)]
    if len(postgres) != 1:
        return [f"expected one postgres service, found {[n for n, _ in postgres]}"]
    pg_name, pg = postgres[0]
    pg_env = env_of(pg)
    user = pg_env.get("POSTGRES_USER", "postgres")
    database = pg_env.get("POSTGRES_DB", user)
    problems = []
    airflow = airflow_services(compose)
    if not airflow:
        problems.append("no Airflow service")
    for name, svc in airflow.items():
        url = urlsplit(env_of(svc).get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", ""))
        if url.scheme != "postgresql+psycopg2":
            problems.append(f"{name}: database URL scheme {url.scheme!r}")
        if url.hostname not in dns_names(pg_name, pg) or url.port not in (None, 5432):
            problems.append(f"{name}: database host {url.hostname}:{url.port} is not {pg_name}")
        if (url.username, url.password) != (user, pg_env.get("POSTGRES_PASSWORD")):
            problems.append(f"{name}: database credentials are not {pg_name}'s")
        if url.path.lstrip("/") != database:
            problems.append(f"{name}: database {url.path.lstrip('/')!r} is not {database!r}")
        if (
            name != pg_name
            and (svc.get("depends_on") or {}).get(pg_name, {}).get("condition") != "service_healthy"
        ):
            problems.append(f"{name}: does not wait for a healthy {pg_name}")
    return problems


def check_airflow_auth(compose: Compose) -> list[str]:
    """Auth stays on: no all-admins mode, configured users, a persisted password file."""
    problems = []
    airflow = airflow_services(compose)
    inits = [n for n, s in airflow.items() if "airflow_passwords.py" in " ".join(command_of(s))]
    api = [n for n, s in airflow.items() if command_of(s)[:1] == ["api-server"]]
    for name, svc in airflow.items():
        env = env_of(svc)
        if truthy(env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "false")):
            problems.append(f"{name}: simple_auth_manager_all_admins is on (no authentication)")
        if "anonymous" in env.get("AIRFLOW__API__AUTH_BACKENDS", ""):
            problems.append(f"{name}: anonymous API access")
        if "SimpleAuthManager" in env.get("AIRFLOW__CORE__AUTH_MANAGER", "SimpleAuthManager"):
            if not env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"):
                problems.append(f"{name}: no users configured for the simple auth manager")
            passwords = env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", "")
            if not passwords:
                problems.append(f"{name}: no simple_auth_manager_passwords_file")
            elif name in inits + api:
                mount = mount_holding(svc, passwords)
                if mount is None or not is_named_volume(mount[0]):
                    problems.append(f"{name}: the password file {passwords} is not on a volume")
    if not inits:
        problems.append("no init service writes the admin password from the environment")
    return problems


# --- the routed job and its control plane ---------------------------------------


def controller_services(compose: Compose) -> dict[str, dict[str, Any]]:
    """Services that act on the job's routing: every Airflow service and the keyplane CLI."""
    found = dict(airflow_services(compose))
    for name, svc in services(compose).items():
        if is_keyplane(svc) and command_of(svc)[:1] == ["keyplane"]:
            found[name] = svc
    return found


def job_settings(compose: Compose) -> tuple[str, Any, list[str]]:
    """The job service, its arguments parsed by the job's own ``parse_settings``, and errors."""
    from pydantic import ValidationError

    from keyplane.spark.counts_job import parse_settings

    job = job_service(compose)
    if job is None:
        return "", None, ["no service runs spark-submit"]
    name, svc = job
    _, _, app_args = split_submit(command_of(svc))
    try:
        return name, parse_settings(app_args), []
    except SystemExit:
        return name, None, [f"{name}: the job's command line does not parse: {app_args}"]
    except ValidationError as exc:
        messages = "; ".join(str(error["msg"]) for error in exc.errors())
        return name, None, [f"{name}: the job's settings are invalid: {messages}"]


def setting_in(env: Mapping[str, str], field: str) -> str:
    """A :class:`keyplane.settings.Settings` field as a container with ``env`` reads it."""
    value = env.get(f"KEYPLANE_{field.upper()}")
    if value is not None:
        return value
    return str(Settings.model_fields[field].default)


def routing_store_in(name: str, compose: Compose, env: Mapping[str, str]) -> Path:
    """The store a controller service uses: ``Deployment`` for Airflow, ``Settings`` for the CLI."""
    home = Path(setting_in(env, "home"))
    if name in airflow_services(compose) and env.get("KEYPLANE_ROUTING_STORE"):
        return Path(env["KEYPLANE_ROUTING_STORE"])
    return home / "configs"


def check_routed_job(compose: Compose) -> list[str]:
    """The routed job on the Python source, with the topics and store its controllers use."""
    name, settings, problems = job_settings(compose)
    if settings is None:
        return problems
    submit, _, app_args = split_submit(command_of(services(compose)[name]))
    if settings.routing_store is None:
        problems.append(f"{name}: the job has no --routing-store, so it is not the routed job")
    source = option_values(app_args, "--source")
    if source not in (["python"], ["jvm"]):
        problems.append(
            f"{name}: --source {source}: the routed job reads its events through keyplane's "
            "Python Kafka source (python) or Spark's connector (jvm)"
        )
    jars = ",".join(option_values(submit, "--jars"))
    if source == ["jvm"] and "spark-sql-kafka-0-10" not in jars:
        problems.append(f"{name}: --source jvm without Spark's Kafka connector in --jars")
    for other, svc in controller_services(compose).items():
        env = env_of(svc)
        for field in ("events_topic", "control_topic", "metrics_topic"):
            theirs, ours = setting_in(env, field), getattr(settings, field)
            if theirs != ours:
                problems.append(f"{other}: {field} is {theirs!r}, the job's is {ours!r}")
        store = routing_store_in(other, compose, env)
        if settings.routing_store is not None and store != settings.routing_store:
            problems.append(
                f"{other}: uses the configuration store {store}, the job {settings.routing_store}"
            )
    if not controller_services(compose):
        problems.append("no Airflow or CLI service controls the job")
    return problems


def check_shared_config_store(compose: Compose) -> list[str]:
    """The store and the controller state are one named volume, mounted alike everywhere.

    The driver and the executors read routing tables by version, Airflow's
    tasks write new versions and the controller state, the dashboard and the
    CLI read both.
    """
    name, settings, problems = job_settings(compose)
    if settings is None or settings.routing_store is None:
        return [*problems, f"{name or 'the job'}: no configuration store to share"]
    store = str(settings.routing_store)
    mount = mount_holding(services(compose)[name], store)
    if mount is None or not is_named_volume(mount[0]):
        return [f"{name}: the configuration store {store} is not on a named volume"]
    sharers = services_running(compose, WORKER_CLASS) + list(controller_services(compose))
    if not services_running(compose, WORKER_CLASS):
        problems.append("no Spark worker service")
    for other in sharers:
        svc = services(compose)[other]
        if mount not in mounts(svc):
            problems.append(
                f"{other}: does not mount volume {mount[0]} at {mount[1]} like {name}, "
                f"where the configuration store {store} is"
            )
    for other, svc in controller_services(compose).items():
        state = Path(setting_in(env_of(svc), "home")) / "controller.json"
        if mount_holding(svc, str(state)) != mount:
            problems.append(f"{other}: the controller state {state} is not on volume {mount[0]}")
    return problems


REQUIRED_REFERENCE = re.compile(r"^\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*):\?[^}]*\}$")


def check_control_key(raw: Compose) -> list[str]:
    """Run on the raw file: the job's driver and the controllers read the one key from .env."""
    problems = []
    job = job_service(raw)
    holders = ([job[0]] if job else []) + list(controller_services(raw))
    if job is None:
        problems.append("no service runs spark-submit")
    sources = {}
    for name in holders:
        value = env_of(services(raw)[name]).get(CONTROL_KEY_VAR)
        if value is None:
            problems.append(f"{name}: no {CONTROL_KEY_VAR}, so it cannot sign or verify")
        elif (match := REQUIRED_REFERENCE.match(value)) is None:
            problems.append(f"{name}: {CONTROL_KEY_VAR} is not a required variable from .env")
        else:
            sources[name] = match["name"]
    if len(set(sources.values())) > 1:
        problems.append(f"{CONTROL_KEY_VAR} comes from different .env variables: {sources}")
    for worker in services_running(raw, WORKER_CLASS):
        if CONTROL_KEY_VAR in env_of(services(raw)[worker]):
            problems.append(f"{worker}: holds {CONTROL_KEY_VAR}, but executors never sign")
    return problems


def check_airflow_connections(compose: Compose) -> list[str]:
    """Airflow defines exactly the connections keyplane's DAG asks for."""
    wanted = {KAFKA_CONN_VAR: KAFKA_CONN_ID, SPARK_CONN_VAR: SPARK_CONN_ID}
    problems = []
    for name, svc in airflow_services(compose).items():
        env = env_of(svc)
        for var, conn_id in wanted.items():
            if var not in env:
                problems.append(f"{name}: {var} is not set (connection {conn_id!r})")
        for var in env:
            if var.startswith("AIRFLOW_CONN_") and var not in wanted:
                problems.append(
                    f"{name}: {var} is not a connection keyplane uses ({sorted(wanted.values())})"
                )
    return problems


def check_dashboard(compose: Compose) -> list[str]:
    """The api-server (the plugin) reads the Data Docs where the tasks write them."""
    airflow = airflow_services(compose)
    api = [(n, s) for n, s in airflow.items() if command_of(s)[:1] == ["api-server"]]
    if not api:
        return ["no Airflow api-server serves the dashboard"]
    name, svc = api[0]
    # Deployment.gx_root and keyplane.orchestration.quality.default_gx_root: $KEYPLANE_HOME/gx;
    # the site is keyplane.dashboard.timeline.DashboardPaths.data_docs.
    gx_root = Path(setting_in(env_of(svc), "home")) / "gx"
    docs = str(gx_root / "gx" / "uncommitted" / "data_docs" / "local_site")
    mount = mount_holding(svc, docs)
    if mount is None or not is_named_volume(mount[0]):
        return [f"{name}: the Data Docs {docs} are not on a named volume"]
    problems = []
    for other, other_svc in airflow.items():
        theirs = Path(setting_in(env_of(other_svc), "home")) / "gx"
        if theirs != gx_root:
            problems.append(f"{other}: the GX project is {theirs}, the api-server reads {gx_root}")
        elif mount_holding(other_svc, docs) != mount:
            problems.append(
                f"{other}: writes the Data Docs {docs} outside volume {mount[0]} at {mount[1]}, "
                f"which {name} serves"
            )
    return problems


def check_spark_cores(compose: Compose) -> list[str]:
    """The streaming job leaves cores for the DAG's statistics job on the cluster."""
    total = 0
    for worker in services_running(compose, WORKER_CLASS):
        svc = services(compose)[worker]
        replicas = int((svc.get("deploy") or {}).get("replicas", 1))
        cores = option_values(command_of(svc), "--cores")
        total += replicas * int(cores[0]) if cores else 0
    job = job_service(compose)
    if job is None:
        return ["no service runs spark-submit"]
    name, svc = job
    submit, _, _ = split_submit(command_of(svc))
    confs = dict(c.split("=", 1) for c in option_values(submit, "--conf"))
    if "spark.cores.max" not in confs:
        return [f"{name}: no spark.cores.max, so the job takes every core of the cluster"]
    job_cores = int(confs["spark.cores.max"])
    batch_cores = total
    for master in services_running(compose, "org.apache.spark.deploy.master.Master"):
        opts = env_of(services(compose)[master]).get("SPARK_MASTER_OPTS", "")
        if found := re.search(r"-Dspark\.deploy\.defaultCores=(\d+)", opts):
            batch_cores = int(found.group(1))
    if job_cores + batch_cores > total:
        return [
            f"the job's {job_cores} cores and {batch_cores} for other applications exceed "
            f"the workers' {total} cores: the statistics job can wait forever"
        ]
    return []


# --- secrets, dependencies, volumes, keys ------------------------------------

SECRET_NAME = re.compile(r"^(?!.*_(FILE|PATH)$).*(PASSWORD|SECRET|FERNET|TOKEN|_KEY$)")
REQUIRED_VARIABLE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*:\?[^}]*\}$")


def environments(compose: Compose) -> Iterator[tuple[str, dict[str, str]]]:
    for name, node in compose.items():
        if name.startswith("x-") and isinstance(node, dict):
            if "environment" in node:
                yield name, env_of(node)
            elif name.endswith("-env"):
                yield name, env_of({"environment": node})
    for name, svc in services(compose).items():
        yield name, env_of(svc)


def check_no_literal_secrets(raw: Compose) -> list[str]:
    """Secrets are required variables (``${NAME:?...}``), never literals or defaults."""
    problems = []
    for where, env in environments(raw):
        for key, value in env.items():
            if SECRET_NAME.search(key) and not REQUIRED_VARIABLE.match(value):
                problems.append(f"{where}: {key} is not a required variable")
            for url in re.findall(r"[a-z0-9+.-]+://\S+", value):
                password = urlsplit(interpolate(url, _Placeholders())).password
                if password is not None and not re.search(
                    r"://[^/@]*:\$\{[A-Za-z_][A-Za-z0-9_]*:\?[^}]*\}@", url
                ):
                    problems.append(f"{where}: {key} embeds a literal password")
            for field, secret in json_secrets(value):
                if not REQUIRED_VARIABLE.match(secret):
                    problems.append(f"{where}: {key} holds a literal {field}")
    return problems


def json_secrets(value: str) -> Iterator[tuple[str, str]]:
    """(field, value) of the secret-looking fields of a JSON connection value."""
    if not value.lstrip().startswith("{"):
        return
    stack: list[Any] = [json.loads(value)]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for field, item in items:
            if isinstance(item, dict | list):
                stack.append(item)
            elif re.search(r"password|secret|token", str(field), flags=re.IGNORECASE):
                yield str(field), str(item)


class _Placeholders(dict[str, str]):
    """Interpolates every variable to a placeholder (to parse URLs containing variables)."""

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: str) -> str:
        return "x"


def check_depends_on(compose: Compose) -> list[str]:
    problems = []
    graph: dict[str, list[str]] = {}
    for name, svc in services(compose).items():
        deps = svc.get("depends_on") or {}
        entries = {d: {} for d in deps} if isinstance(deps, list) else deps
        graph[name] = list(entries)
        for target, spec in entries.items():
            if target not in services(compose):
                problems.append(f"{name}: depends on unknown service {target}")
                continue
            condition = (spec or {}).get("condition", "service_started")
            other = services(compose)[target]
            if condition == "service_healthy" and not other.get("healthcheck"):
                problems.append(f"{name}: waits for {target} to be healthy; it has no healthcheck")
            elif condition == "service_completed_successfully" and other.get(
                "restart", "no"
            ) not in ("no", "on-failure"):
                problems.append(f"{name}: waits for {target} to finish; it restarts forever")
            elif condition not in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            ):
                problems.append(f"{name}: unknown condition {condition}")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                problems.append(f"dependency cycle: {' -> '.join([*path, nxt])}")
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in graph:
        if not state.get(node):
            visit(node, [node])
    return problems


def check_volumes(compose: Compose) -> list[str]:
    declared = set(compose.get("volumes") or {})
    used = set()
    problems = []
    for name, svc in services(compose).items():
        for source, _ in mounts(svc):
            if is_named_volume(source):
                used.add(source)
                if source not in declared:
                    problems.append(f"{name}: volume {source} is not declared")
    problems += [f"volume {v} is declared but never mounted" for v in sorted(declared - used)]
    return problems


SERVICE_KEYS = {
    "build", "command", "configs", "container_name", "cpus", "depends_on", "deploy",
    "entrypoint", "env_file", "environment", "expose", "extra_hosts", "healthcheck",
    "hostname", "image", "init", "labels", "logging", "mem_limit", "network_mode",
    "networks", "platform", "ports", "profiles", "pull_policy", "restart", "secrets",
    "shm_size", "stop_grace_period", "stop_signal", "tmpfs", "ulimits", "user",
    "volumes", "working_dir",
}  # fmt: skip
TOP_LEVEL_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets", "include"}


def check_known_keys(compose: Compose) -> list[str]:
    problems = [
        f"unknown top-level key {key}"
        for key in compose
        if key not in TOP_LEVEL_KEYS and not key.startswith("x-")
    ]
    for name, svc in services(compose).items():
        problems += [
            f"{name}: unknown key {key}"
            for key in svc
            if key not in SERVICE_KEYS and not key.startswith("x-")
        ]
    return problems


def image_problem(image: str) -> str | None:
    if "@sha256:" in image:
        return None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return f"{image} has no tag"
    if tag == "latest":
        return f"{image} uses latest"
    return None


def check_images_pinned(compose: Compose) -> list[str]:
    problems = []
    for name, svc in services(compose).items():
        if "image" not in svc and "build" not in svc:
            problems.append(f"{name}: neither image nor build")
        elif "image" in svc and (problem := image_problem(str(svc["image"]))):
            problems.append(f"{name}: {problem}")
    return problems


def check_keyplane_containers(compose: Compose) -> list[str]:
    """Every keyplane-image container knows its state directory and has the image's build."""
    problems = []
    for name, svc in services(compose).items():
        if not is_keyplane(svc):
            continue
        env = env_of(svc)
        home = env.get("KEYPLANE_HOME", "")
        mount = mount_holding(svc, home) if home else None
        if mount is None or not is_named_volume(mount[0]):
            problems.append(f"{name}: KEYPLANE_HOME {home!r} is not on a named volume")
        if str(svc.get("build", {}).get("context")) != ".":
            problems.append(f"{name}: the keyplane image must build from the repository root")
    return problems


HEALTHCHECKS = {
    "postgres": "pg_isready",
    "kafka": "/opt/kafka/bin/kafka-broker-api-versions.sh --bootstrap-server kafka:9092",
    "airflow-apiserver": "curl --fail http://localhost:8080/api/v2/version",
    "airflow-scheduler": "curl --fail http://localhost:8974/health",
    "airflow-dag-processor": "airflow jobs check --job-type DagProcessorJob",
    "airflow-triggerer": "airflow jobs check --job-type TriggererJob",
}
"""Each long-running service's documented health check: the images' own examples
(the Airflow 3 compose file's, the apache/kafka and postgres images')."""

CLUSTER_ID = re.compile(r"[A-Za-z0-9_-]{22}")
"""A KRaft cluster id: a UUID in URL-safe base64 without padding, 22 characters."""


def check_healthchecks(compose: Compose) -> list[str]:
    """Services that others wait for (``service_healthy``) are checked as their images
    document; the scheduler's health server answers only when it is turned on."""
    problems = []
    for name, wanted in HEALTHCHECKS.items():
        test = ((services(compose).get(name) or {}).get("healthcheck") or {}).get("test", [])
        command = " ".join(tokens_of(test[1:] if test[:1] in (["CMD"], ["CMD-SHELL"]) else test))
        if wanted not in command:
            problems.append(f"{name}: health check {command!r} does not run {wanted!r}")
    scheduler = env_of(services(compose).get("airflow-scheduler") or {})
    if not truthy(scheduler.get("AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK", "")):
        problems.append(
            "airflow-scheduler: its health server is off, so :8974/health never answers"
        )
    for name, kafka in kafka_services(compose).items():
        if not CLUSTER_ID.fullmatch(env_of(kafka).get("CLUSTER_ID", "")):
            problems.append(f"{name}: CLUSTER_ID is not a 22-character base64 id")
    return problems


ALL_CHECKS: dict[str, Check] = {
    "healthchecks": check_healthchecks,
    "kafka_kraft": check_kafka_kraft,
    "bootstrap_servers": check_bootstrap_servers,
    "spark_cluster": check_spark_cluster,
    "checkpoint_volume": check_checkpoint_volume,
    "airflow_components": check_airflow_components,
    "airflow_database": check_airflow_database,
    "airflow_auth": check_airflow_auth,
    "depends_on": check_depends_on,
    "volumes": check_volumes,
    "known_keys": check_known_keys,
    "images_pinned": check_images_pinned,
    "keyplane_containers": check_keyplane_containers,
    "routed_job": check_routed_job,
    "shared_config_store": check_shared_config_store,
    "airflow_connections": check_airflow_connections,
    "dashboard": check_dashboard,
    "spark_cores": check_spark_cores,
}


def check_variables_documented(text: str, env_example: str, doc: str) -> list[str]:
    """Every variable the compose file reads is in env.example; required ones also in the doc."""
    problems = []
    listed = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", env_example, flags=re.MULTILINE))
    content = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for match in re.finditer(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?", content):
        name, op = match.group(1), match.group(2) or ""
        if name not in listed:
            problems.append(f"{name} is not in deploy/env.example")
        if op.endswith("?") and f"`{name}`" not in doc:
            problems.append(f"{name} is required but docs/deploy.md does not describe it")
    return problems


def check_dockerfile(text: str, airflow_version: str, python: str) -> list[str]:
    """Base images are pinned, and the Airflow base matches the locked Airflow and Python."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE))
    problems = []
    bases = [
        interpolate(base, args) for base in re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    ]
    for base in bases:
        if base not in stages and (problem := image_problem(base)):
            problems.append(f"FROM {problem}")
    airflow_bases = [b for b in bases if b.startswith("apache/airflow:")]
    wanted = f"apache/airflow:{airflow_version}-python{python}"
    if airflow_bases != [wanted]:
        problems.append(f"Airflow base {airflow_bases} is not {wanted}")
    installs = [line for line in text.splitlines() if "uv pip install" in line and " -r " in line]
    if not installs or any("--no-deps" not in line for line in installs):
        problems.append(
            "the locked requirements are installed without --no-deps: resolving again "
            "brings back pyspark-client, which the lock keeps out"
        )
    return problems


def check_jvm_stages(compose: Compose, dockerfile: str) -> list[str]:
    """The image builds the JVM stages' jar (a JDK, ``python -m keyplane.spark.jvm --out``),
    names it in KEYPLANE_JVM_JAR, and the job's spark-submit loads it with ``--jars``."""
    problems = []
    if "openjdk-17-jdk" not in dockerfile:
        problems.append("the image installs no JDK: the JVM stages cannot be compiled")
    built = re.findall(r"python -m keyplane\.spark\.jvm --out (\S+)", dockerfile)
    named = re.findall(r"KEYPLANE_JVM_JAR=(\S+)", dockerfile)
    if len(built) != 1 or named != built:
        problems.append(f"the image builds {built} but names {named} in KEYPLANE_JVM_JAR")
    job = job_service(compose)
    if job is None:
        return [*problems, "no service runs spark-submit"]
    name, svc = job
    submit, _, _ = split_submit(command_of(svc))
    jars = [jar for value in option_values(submit, "--jars") for jar in value.split(",")]
    if not built or built[0] not in jars:
        problems.append(f"{name}: spark-submit --jars {jars} does not load {built}")
    return problems


# --- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def raw() -> Compose:
    parsed: Compose = yaml.safe_load(COMPOSE_FILE.read_text())
    return parsed


@pytest.fixture
def resolved(raw: Compose) -> Compose:
    """The compose file as compose sees it with SAMPLE_ENV as .env; a fresh copy per test."""
    copy: Compose = resolve(raw, SAMPLE_ENV)
    return copy


def spark_version() -> str:
    return version("pyspark")


def scala_binary_version() -> str:
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    for jar in jars.glob("scala-library-*.jar"):
        if match := re.fullmatch(r"scala-library-(\d+\.\d+)\.\d+\.jar", jar.name):
            return match.group(1)
    raise AssertionError("no scala-library jar in pyspark")


def svc(compose: Compose, name: str) -> dict[str, Any]:
    return services(compose)[name]


def set_env(compose: Compose, name: str, key: str, value: str) -> None:
    svc(compose, name)["environment"][key] = value


def set_airflow_env(compose: Compose, key: str, value: str) -> None:
    for name in airflow_services(compose):
        set_env(compose, name, key, value)


def replace_token(compose: Compose, name: str, old: str, new: str, nth: int = 0) -> None:
    command = svc(compose, name)["command"]
    index = [i for i, token in enumerate(command) if token == old][nth]
    command[index] = new


def remove_option(compose: Compose, name: str, flag: str, value: str | None = None) -> None:
    """Drop ``flag`` and its value (the one equal to ``value``, if given) from a command."""
    command = svc(compose, name)["command"]
    index = next(
        i
        for i, token in enumerate(command)
        if token == flag and (value is None or command[i + 1] == value)
    )
    del command[index : index + 2]


def insert_tokens(compose: Compose, name: str, before: str, tokens: list[str]) -> None:
    command = svc(compose, name)["command"]
    index = command.index(before)
    command[index:index] = tokens


# --- the real file passes every check -----------------------------------------


@pytest.mark.parametrize("check", list(ALL_CHECKS), ids=list(ALL_CHECKS))
def test_compose_file_passes(check: str, resolved: Compose) -> None:
    assert ALL_CHECKS[check](resolved) == []


def test_compose_file_has_no_literal_secrets(raw: Compose) -> None:
    assert check_no_literal_secrets(unshared(raw)) == []


def test_control_key_comes_from_env(raw: Compose) -> None:
    assert check_control_key(unshared(raw)) == []


def test_streaming_job_matches_the_locked_spark(resolved: Compose) -> None:
    assert spark_version() == "4.3.0"
    assert check_streaming_job(resolved, spark_version(), scala_binary_version()) == []


def test_variables_are_documented() -> None:
    problems = check_variables_documented(
        COMPOSE_FILE.read_text(), ENV_EXAMPLE.read_text(), DEPLOY_DOC.read_text()
    )
    assert problems == []


def test_dockerfile_pins_the_locked_airflow_and_python() -> None:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert check_dockerfile(DOCKERFILE.read_text(), version("apache-airflow"), python) == []


def test_the_job_loads_the_jvm_stages_the_image_builds(resolved: Compose) -> None:
    dockerfile = DOCKERFILE.read_text()
    assert check_jvm_stages(resolved, dockerfile) == []
    name, _ = job_service(resolved) or ("", {})
    remove_option(resolved, name, "--jars")
    assert check_jvm_stages(resolved, dockerfile) == [
        f"{name}: spark-submit --jars [] does not load ['/opt/keyplane/jars/keyplane-stages.jar']"
    ]
    jre = dockerfile.replace("openjdk-17-jdk-headless", "openjdk-17-jre-headless")
    assert "the image installs no JDK" in check_jvm_stages(resolved, jre)[0]


def test_compose_refuses_to_start_without_each_secret(raw: Compose) -> None:
    for secret in (
        "POSTGRES_PASSWORD",
        "AIRFLOW_ADMIN_PASSWORD",
        "AIRFLOW_JWT_SECRET",
        CONTROL_KEY_VAR,
    ):
        env = {k: v for k, v in SAMPLE_ENV.items() if k != secret}
        with pytest.raises(MissingVariableError, match=secret):
            resolve(raw, env)
        with pytest.raises(MissingVariableError, match=secret):
            resolve(raw, {**env, secret: ""})


def test_database_defaults_agree_when_env_sets_only_secrets(raw: Compose) -> None:
    minimal = {k: v for k, v in SAMPLE_ENV.items() if k not in {"POSTGRES_USER", "POSTGRES_DB"}}
    compose = resolve(raw, minimal)
    assert env_of(svc(compose, "postgres"))["POSTGRES_USER"] == "airflow"
    assert check_airflow_database(compose) == []


# --- real libraries judge the values ------------------------------------------


def test_airflow_resolves_the_compose_connections(
    resolved: Compose, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if "airflow" not in sys.modules:
        monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    env = env_of(svc(resolved, "airflow-scheduler"))
    monkeypatch.setenv(SPARK_CONN_VAR, env[SPARK_CONN_VAR])
    monkeypatch.setenv(KAFKA_CONN_VAR, env[KAFKA_CONN_VAR])
    from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from keyplane.orchestration.deployment import kafka_bootstrap_from_connection

    hook = SparkSubmitHook(conn_id=SPARK_CONN_ID)
    assert hook._connection["master"] == spark_master_url(resolved) == "spark://spark-master:7077"
    kafka = KafkaBaseHook.get_connection(KAFKA_CONN_ID)
    assert kafka.conn_type == "kafka"
    assert kafka.extra_dejson["bootstrap.servers"] == advertised_plaintext(resolved)
    # What the DAG's tasks call to find Kafka.
    assert kafka_bootstrap_from_connection() == advertised_plaintext(resolved) == "kafka:9092"


def test_job_cli_accepts_the_compose_arguments(
    resolved: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keyplane.spark import counts_job

    captured: list[counts_job.CountsJobSettings] = []

    def record(settings: counts_job.CountsJobSettings, **_callbacks: object) -> list[Any]:
        captured.append(settings)
        return []

    monkeypatch.setattr(counts_job, "run_counts_job", record)
    job = job_service(resolved)
    assert job is not None
    _, _, app_args = split_submit(command_of(job[1]))
    assert counts_job.main(app_args) == 0
    (settings,) = captured
    assert settings.source == "python"
    assert settings.routing_store == Path("/var/lib/keyplane/home/configs")
    assert settings.master == "spark://spark-master:7077"
    assert settings.bootstrap_servers == "kafka:9092"
    assert settings.checkpoint == Path("/var/lib/keyplane/checkpoints/running-counts")
    assert settings.shuffle_partitions == 4
    assert (settings.control_topic, settings.migration_topic) == (
        "keyplane.control",
        "keyplane.migration",
    )
    assert (settings.metrics_topic, settings.dead_letter_topic) == (
        "keyplane.metrics",
        "keyplane.dead-letter",
    )


@pytest.mark.parametrize("service", ["airflow-scheduler", "airflow-triggerer", "airflow-apiserver"])
def test_deployment_reads_what_the_job_uses(
    resolved: Compose, monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    """keyplane's own Deployment, in an Airflow container's environment, finds the job's store."""
    from keyplane.dashboard.timeline import DashboardPaths
    from keyplane.orchestration.deployment import Deployment
    from keyplane.orchestration.quality import default_gx_root

    for key in list(os.environ):
        if key.startswith("KEYPLANE_"):
            monkeypatch.delenv(key)
    airflow = svc(resolved, service)
    for key, value in env_of(airflow).items():
        if key.startswith("KEYPLANE_"):
            monkeypatch.setenv(key, value)
    name, settings, problems = job_settings(resolved)
    assert problems == []
    deployment = Deployment.from_environment()
    assert deployment.routing_store == settings.routing_store
    assert deployment.bootstrap_servers == settings.bootstrap_servers
    assert deployment.events_topic == settings.events_topic
    assert deployment.control_topic == settings.control_topic
    assert deployment.metrics_topic == settings.metrics_topic
    assert deployment.max_event_bytes == settings.max_event_bytes
    store_mount = mount_holding(svc(resolved, name), str(settings.routing_store))
    assert mount_holding(airflow, str(deployment.controller_state)) == store_mount
    assert default_gx_root() == deployment.gx_root
    docs = DashboardPaths.from_environment().data_docs
    assert mount_holding(airflow, str(docs)) == ("gx-data-docs", str(deployment.gx_root))


def run_password_script(env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PASSWORDS_SCRIPT)],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def init_env(resolved: Compose, passwords: Path) -> dict[str, str]:
    env = env_of(svc(resolved, "airflow-init"))
    env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] = str(passwords)
    return env


def test_init_writes_the_password_the_auth_manager_reads(
    resolved: Compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords = tmp_path / "auth" / "passwords.json"
    env = init_env(resolved, passwords)
    result = run_password_script(env)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(passwords.stat().st_mode) == 0o600
    if "airflow" not in sys.modules:
        monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    for key in (
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS",
    ):
        monkeypatch.setenv(key, env[key])
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    assert [u.username for u in SimpleAuthManager.get_users()] == ["ops"]
    assert [u.role for u in SimpleAuthManager.get_users()] == ["admin"]
    assert SimpleAuthManager.get_passwords() == {"ops": "admin-password-123"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"AIRFLOW_ADMIN_USER": "someone-else"}, "not among the configured users"),
        ({"AIRFLOW_ADMIN_PASSWORD": "short"}, "at least 12 characters"),
    ],
    ids=["unknown-user", "short-password"],
)
def test_password_script_rejects_broken_environment(
    resolved: Compose, tmp_path: Path, change: dict[str, str], message: str
) -> None:
    passwords = tmp_path / "passwords.json"
    result = run_password_script({**init_env(resolved, passwords), **change})
    assert result.returncode == 2
    assert message in result.stderr
    assert not passwords.exists()


# --- every check rejects a broken copy ------------------------------------------


def problems_after(check: Check, compose: Compose, mutate: Callable[[Compose], None]) -> str:
    mutate(compose)
    return "\n".join(check(compose))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: set_env(c, "kafka", "KAFKA_NODE_ID", "2"), "not among the quorum voters"),
        (
            lambda c: set_env(c, "kafka", "KAFKA_CONTROLLER_QUORUM_VOTERS", "1@kafka:9094"),
            "not this node's controller listener",
        ),
        (
            lambda c: set_env(
                c, "kafka", "KAFKA_ADVERTISED_LISTENERS", "PLAINTEXT://localhost:9092"
            ),
            "advertised as localhost",
        ),
        (
            lambda c: set_env(
                c, "kafka", "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "PLAINTEXT:PLAINTEXT"
            ),
            "CONTROLLER has no security protocol",
        ),
        (lambda c: set_env(c, "kafka", "CLUSTER_ID", ""), "CLUSTER_ID"),
        (
            lambda c: svc(c, "kafka")["environment"].pop("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"),
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR exceeds",
        ),
    ],
    ids=["node-id", "voter-port", "advertised-host", "protocol-map", "cluster-id", "offsets-rf"],
)
def test_kafka_kraft_check_rejects_broken_config(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_kafka_kraft, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: set_env(c, "spark-worker", "KEYPLANE_BOOTSTRAP_SERVERS", "localhost:9092"),
            "spark-worker: KEYPLANE_BOOTSTRAP_SERVERS=localhost:9092",
        ),
        (
            lambda c: svc(c, "keyplane-job")["environment"].pop("KEYPLANE_BOOTSTRAP_SERVERS"),
            "keyplane-job: KEYPLANE_BOOTSTRAP_SERVERS=None",
        ),
        (
            lambda c: set_env(
                c,
                "airflow-scheduler",
                KAFKA_CONN_VAR,
                json.dumps({"conn_type": "kafka", "extra": {"bootstrap.servers": "kafka:29092"}}),
            ),
            "airflow-scheduler: Airflow's Kafka connection points at kafka:29092",
        ),
        (
            lambda c: replace_token(c, "keyplane-job", "kafka:9092", "broker:9092"),
            "keyplane-job: a command connects to broker:9092",
        ),
        (
            lambda c: set_env(c, "kafka", "KAFKA_ADVERTISED_LISTENERS", "PLAINTEXT://kafka:9093"),
            "but Kafka advertises kafka:9093",
        ),
    ],
    ids=["worker-env", "job-env-missing", "airflow-connection", "spark-submit-arg", "advertised"],
)
def test_bootstrap_check_rejects_broken_addresses(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_bootstrap_servers, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: replace_token(
                c, "spark-worker", "spark://spark-master:7077", "spark://spark-master:7078"
            ),
            "worker registers with spark://spark-master:7078",
        ),
        (
            lambda c: replace_token(
                c, "keyplane-job", "spark://spark-master:7077", "local[2]", nth=1
            ),
            "the job's --master is ['local[2]']",
        ),
        (
            lambda c: replace_token(c, "keyplane-job", "spark://spark-master:7077", "yarn", nth=0),
            "spark-submit --master ['yarn']",
        ),
        (
            lambda c: set_env(c, "airflow-triggerer", SPARK_CONN_VAR, "spark://master:7077"),
            f"airflow-triggerer: {SPARK_CONN_VAR}=spark://master:7077",
        ),
        (
            lambda c: replace_token(c, "spark-master", "spark-master", "0.0.0.0"),
            "which other containers cannot resolve",
        ),
    ],
    ids=["worker-port", "job-master", "submit-master", "airflow-connection", "master-host"],
)
def test_spark_cluster_check_rejects_broken_master_urls(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_spark_cluster, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: insert_tokens(
                c,
                "keyplane-job",
                "--conf",
                ["--packages", "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.1"],
            ),
            "is not the locked Spark's org.apache.spark:spark-sql-kafka-0-10_2.13:4.3.0",
        ),
        (
            lambda c: replace_token(
                c,
                "keyplane-job",
                "/opt/keyplane/spark_jobs/running_counts.py",
                "/opt/keyplane/jobs/counts.py",
            ),
            "is not a file of this repository",
        ),
        (
            lambda c: replace_token(
                c, "keyplane-job", "spark.driver.host=keyplane-job", "spark.driver.host=localhost"
            ),
            "executors cannot reach the driver at localhost",
        ),
        (
            lambda c: svc(c, "spark-master").update(
                image="apache/spark:4.1.2-scala2.13-java17-ubuntu"
            ),
            "is not Spark 4.3.0",
        ),
    ],
    ids=["connector-version", "missing-script", "driver-host", "master-image"],
)
def test_streaming_job_check_rejects_broken_job(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    mutate(resolved)
    assert message in "\n".join(check_streaming_job(resolved, "4.3.0", "2.13"))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "spark-worker").update(
                volumes=[
                    "keyplane-checkpoints:/checkpoints",
                    "keyplane-home:/var/lib/keyplane/home",
                ]
            ),
            "spark-worker: does not mount volume keyplane-checkpoints at /var/lib/keyplane/",
        ),
        (
            lambda c: svc(c, "keyplane-job")["volumes"].remove(
                "keyplane-checkpoints:/var/lib/keyplane/checkpoints"
            ),
            "--checkpoint /var/lib/keyplane/checkpoints/running-counts is not on a named volume",
        ),
        (
            lambda c: svc(c, "keyplane-job").update(
                volumes=[
                    "./checkpoints:/var/lib/keyplane/checkpoints",
                    "keyplane-home:/var/lib/keyplane/home",
                ]
            ),
            "is not on a named volume",
        ),
    ],
    ids=["worker-path", "job-unmounted", "bind-mount"],
)
def test_checkpoint_check_rejects_broken_mounts(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_checkpoint_volume, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: set_env(
                c,
                "airflow-scheduler",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                "postgresql+psycopg2://kp_user:pg-password-123@db:5432/kp_db",
            ),
            "airflow-scheduler: database host db:5432 is not postgres",
        ),
        (
            lambda c: set_env(c, "postgres", "POSTGRES_USER", "someone"),
            "airflow-apiserver: database credentials are not postgres's",
        ),
        (
            lambda c: set_env(c, "postgres", "POSTGRES_DB", "other"),
            "airflow-triggerer: database 'kp_db' is not 'other'",
        ),
        (
            lambda c: set_env(
                c,
                "airflow-init",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                "sqlite:////opt/airflow/airflow.db",
            ),
            "airflow-init: database URL scheme 'sqlite'",
        ),
        (
            lambda c: svc(c, "airflow-dag-processor")["depends_on"].pop("postgres"),
            "airflow-dag-processor: does not wait for a healthy postgres",
        ),
    ],
    ids=["host", "user", "database", "sqlite", "no-wait"],
)
def test_airflow_database_check_rejects_broken_urls(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_airflow_database, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: set_env(c, "airflow-scheduler", "AIRFLOW__API_AUTH__JWT_SECRET", "other"),
            "AIRFLOW__API_AUTH__JWT_SECRET is missing or differs",
        ),
        (
            lambda c: svc(c, "airflow-triggerer")["environment"].pop("AIRFLOW__CORE__FERNET_KEY"),
            "AIRFLOW__CORE__FERNET_KEY is missing or differs",
        ),
        (lambda c: services(c).pop("airflow-dag-processor"), "no Airflow dag-processor"),
        (
            lambda c: svc(c, "airflow-scheduler")["depends_on"].pop("airflow-init"),
            "airflow-scheduler: does not wait for the init service",
        ),
        (
            lambda c: set_airflow_env(
                c, "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://localhost:8080/execution/"
            ),
            "the execution API URL does not reach the api-server",
        ),
        (
            lambda c: set_airflow_env(c, "AIRFLOW__CORE__EXECUTOR", "CeleryExecutor"),
            "only LocalExecutor runs without a Celery broker",
        ),
    ],
    ids=[
        "jwt-differs",
        "fernet-missing",
        "no-dag-processor",
        "no-init-wait",
        "execution-api",
        "celery",
    ],
)
def test_airflow_components_check_rejects_broken_settings(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_airflow_components, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: set_env(
                c, "airflow-apiserver", "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "True"
            ),
            "airflow-apiserver: simple_auth_manager_all_admins is on",
        ),
        (
            lambda c: svc(c, "airflow-apiserver")["environment"].pop(
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
            ),
            "airflow-apiserver: no simple_auth_manager_passwords_file",
        ),
        (
            lambda c: svc(c, "airflow-apiserver").update(volumes=[]),
            "airflow-apiserver: the password file /var/lib/keyplane/airflow-auth/passwords.json",
        ),
        (
            lambda c: svc(c, "airflow-init").update(command=["bash", "-c", "airflow db migrate"]),
            "no init service writes the admin password",
        ),
    ],
    ids=["all-admins", "no-password-file", "password-file-not-persisted", "no-password-writer"],
)
def test_airflow_auth_check_rejects_broken_auth(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_airflow_auth, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: c["x-airflow-common"]["environment"].update(
                AIRFLOW__API_AUTH__JWT_SECRET="hunter2"
            ),
            "x-airflow-common: AIRFLOW__API_AUTH__JWT_SECRET is not a required variable",
        ),
        (
            lambda c: set_env(c, "postgres", "POSTGRES_PASSWORD", "${POSTGRES_PASSWORD:-airflow}"),
            "postgres: POSTGRES_PASSWORD is not a required variable",
        ),
        (
            lambda c: set_env(
                c,
                "airflow-scheduler",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                "postgresql+psycopg2://airflow:airflow@postgres/airflow",
            ),
            "airflow-scheduler: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN embeds a literal password",
        ),
        (
            lambda c: set_env(
                c,
                "airflow-scheduler",
                KAFKA_CONN_VAR,
                json.dumps({"conn_type": "kafka", "extra": {"sasl.password": "p"}}),
            ),
            f"airflow-scheduler: {KAFKA_CONN_VAR} holds a literal sasl.password",
        ),
    ],
    ids=["literal-jwt", "default-password", "url-password", "connection-password"],
)
def test_secrets_check_rejects_broken_literals(
    raw: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_no_literal_secrets, unshared(raw), mutate)


def test_secrets_check_accepts_secrets_passed_as_required_variables(raw: Compose) -> None:
    compose = unshared(raw)
    sasl = {"sasl.username": "keyplane", "sasl.password": "${KAFKA_SASL_PASSWORD:?set it}"}
    conn = {"conn_type": "kafka", "extra": {"bootstrap.servers": "kafka:9092", **sasl}}
    set_env(compose, "airflow-scheduler", KAFKA_CONN_VAR, json.dumps(conn))
    assert check_no_literal_secrets(compose) == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "keyplane-job")["depends_on"].update(
                kafak={"condition": "service_started"}
            ),
            "keyplane-job: depends on unknown service kafak",
        ),
        (
            lambda c: svc(c, "spark-master").pop("healthcheck"),
            "waits for spark-master to be healthy; it has no healthcheck",
        ),
        (
            lambda c: svc(c, "kafka-init").update(restart="always"),
            "waits for kafka-init to finish; it restarts forever",
        ),
        (
            lambda c: svc(c, "spark-master").update(
                depends_on={"keyplane-job": {"condition": "service_started"}}
            ),
            "dependency cycle",
        ),
    ],
    ids=["unknown-service", "no-healthcheck", "restarting-one-shot", "cycle"],
)
def test_depends_on_check_rejects_broken_dependencies(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_depends_on, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "kafka").update(image="apache/kafka:latest"),
            "kafka: apache/kafka:latest uses latest",
        ),
        (lambda c: svc(c, "postgres").update(image="postgres"), "postgres: postgres has no tag"),
        (
            lambda c: svc(c, "spark-master").update(image="registry:5000/spark"),
            "registry:5000/spark has no tag",
        ),
        (lambda c: svc(c, "kafka-init").pop("image"), "kafka-init: neither image nor build"),
    ],
    ids=["latest", "untagged", "registry-port", "no-image"],
)
def test_images_check_rejects_broken_tags(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_images_pinned, resolved, mutate)


@pytest.mark.parametrize(
    ("check", "mutate", "message"),
    [
        (
            check_volumes,
            lambda c: svc(c, "postgres").update(volumes=["pg-data:/var/lib/postgresql/data"]),
            "postgres: volume pg-data is not declared",
        ),
        (check_volumes, lambda c: c["volumes"].update({"unused": None}), "unused is declared"),
        (
            check_known_keys,
            lambda c: svc(c, "kafka").update(enviroment={}),
            "kafka: unknown key enviroment",
        ),
        (check_known_keys, lambda c: c.update(service={}), "unknown top-level key service"),
        (
            check_keyplane_containers,
            lambda c: set_env(c, "spark-worker", "KEYPLANE_HOME", "/tmp/keyplane"),
            "spark-worker: KEYPLANE_HOME '/tmp/keyplane' is not on a named volume",
        ),
    ],
    ids=[
        "undeclared-volume",
        "unused-volume",
        "misspelt-key",
        "misspelt-top-level",
        "home-unmounted",
    ],
)
def test_structure_checks_reject_broken_files(
    resolved: Compose, check: Check, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check, resolved, mutate)


def test_variables_check_rejects_broken_documentation() -> None:
    text = COMPOSE_FILE.read_text() + '\nx-sasl: "${KAFKA_SASL_PASSWORD:?set it}"\n'
    problems = check_variables_documented(text, ENV_EXAMPLE.read_text(), DEPLOY_DOC.read_text())
    assert "KAFKA_SASL_PASSWORD is not in deploy/env.example" in problems
    assert "KAFKA_SASL_PASSWORD is required but docs/deploy.md does not describe it" in problems


def test_dockerfile_check_rejects_a_locked_install_that_resolves_again() -> None:
    text = DOCKERFILE.read_text()
    assert '--no-deps "apache-airflow' in text
    problems = check_dockerfile(
        text.replace('--no-deps "apache-airflow', '"apache-airflow'), "3.3.2", "3.11"
    )
    assert "brings back pyspark-client" in "\n".join(problems)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "airflow-scheduler")["healthcheck"].update(
                test=["CMD", "curl", "--fail", "http://localhost:9999/nope"]
            ),
            "airflow-scheduler: health check",
        ),
        (
            lambda c: set_env(
                c, "airflow-scheduler", "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK", "false"
            ),
            "its health server is off",
        ),
        (lambda c: svc(c, "kafka")["healthcheck"].update(test=["CMD", "true"]), "kafka: health"),
        (
            lambda c: svc(c, "postgres")["healthcheck"].update(test=["CMD-SHELL", "true"]),
            "postgres: health",
        ),
        (lambda c: svc(c, "airflow-triggerer").pop("healthcheck"), "airflow-triggerer: health"),
        (lambda c: set_env(c, "kafka", "CLUSTER_ID", "x"), "22-character"),
    ],
    ids=["scheduler-url", "scheduler-off", "kafka", "postgres", "triggerer-missing", "cluster-id"],
)
def test_healthchecks_check_rejects_broken_checks(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_healthchecks, resolved, mutate)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "apache/airflow:3.3.2-python3.11",
            "apache/airflow:3.3.2-python3.12",
            "is not apache/airflow",
        ),
        ("apache/airflow:3.3.2-python3.11", "apache/airflow:latest", "uses latest"),
        ("python:3.11-slim-bookworm", "python", "python has no tag"),
    ],
    ids=["python-minor", "latest-airflow", "untagged-builder"],
)
def test_dockerfile_check_rejects_broken_bases(old: str, new: str, message: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    problems = check_dockerfile(text.replace(old, new), "3.3.2", "3.11")
    assert message in "\n".join(problems)


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$x $SET", env) == "v d  d $x v"
    with pytest.raises(MissingVariableError):
        interpolate("${EMPTY:?needed}", env)
    assert interpolate("${EMPTY?needed}", env) == ""


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: remove_option(c, "keyplane-job", "--routing-store"),
            "keyplane-job: the job has no --routing-store, so it is not the routed job",
        ),
        (
            lambda c: replace_token(c, "keyplane-job", "python", "jvm"),
            "keyplane-job: --source jvm without Spark's Kafka connector in --jars",
        ),
        (
            lambda c: remove_option(c, "keyplane-job", "--source"),
            "keyplane-job: --source []: the routed job reads its events through keyplane's",
        ),
        (
            lambda c: replace_token(c, "keyplane-job", "keyplane.control", "keyplane.ctl"),
            "airflow-triggerer: control_topic is 'keyplane.control', the job's is 'keyplane.ctl'",
        ),
        (
            lambda c: set_env(c, "airflow-apiserver", "KEYPLANE_METRICS_TOPIC", "metrics"),
            "airflow-apiserver: metrics_topic is 'metrics', the job's is 'keyplane.metrics'",
        ),
        (
            lambda c: set_env(c, "airflow-scheduler", "KEYPLANE_ROUTING_STORE", "/tmp/configs"),
            "airflow-scheduler: uses the configuration store /tmp/configs",
        ),
        (
            lambda c: set_env(c, "keyplane-cli", "KEYPLANE_HOME", "/var/lib/keyplane/other"),
            "keyplane-cli: uses the configuration store /var/lib/keyplane/other/configs",
        ),
        (
            lambda c: replace_token(c, "keyplane-job", "--shuffle-partitions", "--parallelism"),
            "keyplane-job: the job's command line does not parse",
        ),
    ],
    ids=[
        "unrouted",
        "jvm-source",
        "default-source",
        "control-topic",
        "dashboard-metrics-topic",
        "airflow-store",
        "cli-home",
        "bad-flag",
    ],
)
def test_routed_job_check_rejects_broken_jobs(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_routed_job, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "spark-worker")["volumes"].remove(
                "keyplane-home:/var/lib/keyplane/home"
            ),
            "spark-worker: does not mount volume keyplane-home at /var/lib/keyplane/home like "
            "keyplane-job",
        ),
        (
            lambda c: svc(c, "airflow-scheduler").update(
                volumes=["keyplane-home:/opt/keyplane-home", "gx-data-docs:/opt/gx"]
            ),
            "airflow-scheduler: does not mount volume keyplane-home at /var/lib/keyplane/home",
        ),
        (
            lambda c: svc(c, "airflow-triggerer")["volumes"].append(
                "controller-state:/var/lib/keyplane/home/controller.json"
            ),
            "airflow-triggerer: the controller state /var/lib/keyplane/home/controller.json is "
            "not on volume keyplane-home",
        ),
        (
            lambda c: svc(c, "keyplane-job").update(
                volumes=[
                    "./home:/var/lib/keyplane/home",
                    "keyplane-checkpoints:/var/lib/keyplane/checkpoints",
                ]
            ),
            "keyplane-job: the configuration store /var/lib/keyplane/home/configs is not on a "
            "named volume",
        ),
        (
            lambda c: remove_option(c, "keyplane-job", "--routing-store"),
            "no configuration store to share",
        ),
    ],
    ids=["worker", "airflow-path", "controller-state", "job-bind-mount", "unrouted"],
)
def test_shared_store_check_rejects_broken_mounts(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_shared_config_store, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: set_env(c, "keyplane-job", CONTROL_KEY_VAR, "0123456789abcdef"),
            f"keyplane-job: {CONTROL_KEY_VAR} is not a required variable from .env",
        ),
        (
            lambda c: set_env(c, "keyplane-job", CONTROL_KEY_VAR, "${JOB_KEY:-dev}"),
            f"keyplane-job: {CONTROL_KEY_VAR} is not a required variable from .env",
        ),
        (
            lambda c: svc(c, "airflow-triggerer")["environment"].pop(CONTROL_KEY_VAR),
            f"airflow-triggerer: no {CONTROL_KEY_VAR}, so it cannot sign or verify",
        ),
        (
            lambda c: svc(c, "keyplane-job")["environment"].pop(CONTROL_KEY_VAR),
            f"keyplane-job: no {CONTROL_KEY_VAR}",
        ),
        (
            lambda c: set_env(c, "keyplane-job", CONTROL_KEY_VAR, "${JOB_KEY:?set it}"),
            f"{CONTROL_KEY_VAR} comes from different .env variables",
        ),
        (
            lambda c: set_env(c, "spark-worker", CONTROL_KEY_VAR, "${KEYPLANE_CONTROL_KEY:?x}"),
            f"spark-worker: holds {CONTROL_KEY_VAR}, but executors never sign",
        ),
    ],
    ids=["literal", "default", "airflow-missing", "job-missing", "other-variable", "worker"],
)
def test_control_key_check_rejects_broken_keys(
    raw: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_control_key, unshared(raw), mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "airflow-scheduler")["environment"].update(
                AIRFLOW_CONN_KAFKA_DEFAULT=svc(c, "airflow-scheduler")["environment"].pop(
                    KAFKA_CONN_VAR
                )
            ),
            f"airflow-scheduler: {KAFKA_CONN_VAR} is not set (connection {KAFKA_CONN_ID!r})",
        ),
        (
            lambda c: set_env(c, "airflow-apiserver", "AIRFLOW_CONN_KAFKA_DEFAULT", "kafka://k"),
            "airflow-apiserver: AIRFLOW_CONN_KAFKA_DEFAULT is not a connection keyplane uses",
        ),
        (
            lambda c: svc(c, "airflow-triggerer")["environment"].pop(SPARK_CONN_VAR),
            f"airflow-triggerer: {SPARK_CONN_VAR} is not set (connection {SPARK_CONN_ID!r})",
        ),
    ],
    ids=["renamed-kafka", "stale-connection", "spark-missing"],
)
def test_airflow_connections_check_rejects_other_ids(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_airflow_connections, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: svc(c, "airflow-apiserver").update(
                volumes=[
                    "keyplane-home:/var/lib/keyplane/home",
                    "gx-data-docs:/var/lib/keyplane/gx-data-docs",
                ]
            ),
            "airflow-scheduler: writes the Data Docs "
            "/var/lib/keyplane/home/gx/gx/uncommitted/data_docs/local_site outside volume "
            "keyplane-home at /var/lib/keyplane/home",
        ),
        (
            lambda c: svc(c, "airflow-scheduler")["volumes"].remove(
                "gx-data-docs:/var/lib/keyplane/home/gx"
            ),
            "airflow-scheduler: writes the Data Docs",
        ),
        (
            lambda c: set_env(c, "airflow-triggerer", "KEYPLANE_HOME", "/var/lib/keyplane/h2"),
            "airflow-triggerer: the GX project is /var/lib/keyplane/h2/gx",
        ),
        (
            lambda c: svc(c, "airflow-apiserver").update(volumes=[]),
            "airflow-apiserver: the Data Docs",
        ),
        (
            lambda c: svc(c, "airflow-apiserver").update(command="webserver"),
            "no Airflow api-server serves the dashboard",
        ),
    ],
    ids=["old-path", "scheduler-unmounted", "other-home", "api-unmounted", "no-api-server"],
)
def test_dashboard_check_rejects_broken_data_docs(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_dashboard, resolved, mutate)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: replace_token(c, "keyplane-job", "spark.cores.max=3", "spark.cores.max=4"),
            "the job's 4 cores and 1 for other applications exceed the workers' 4 cores",
        ),
        (
            lambda c: svc(c, "spark-master")["environment"].pop("SPARK_MASTER_OPTS"),
            "the job's 3 cores and 4 for other applications exceed",
        ),
        (
            lambda c: remove_option(c, "keyplane-job", "--conf", "spark.cores.max=3"),
            "keyplane-job: no spark.cores.max",
        ),
        (
            lambda c: svc(c, "spark-worker")["deploy"].update(replicas=1),
            "exceed the workers' 1 cores",
        ),
    ],
    ids=["job-takes-all", "batch-uncapped", "job-uncapped", "one-worker"],
)
def test_spark_cores_check_rejects_starved_statistics_job(
    resolved: Compose, mutate: Callable[[Compose], None], message: str
) -> None:
    assert message in problems_after(check_spark_cores, resolved, mutate)


def test_compose_sizes_the_cluster_and_airflow_as_keyplane_stack_does(resolved: Compose) -> None:
    """One stack, two deployments: compose's defaults are ``keyplane stack``'s sizes."""
    from keyplane.stack.config import StackConfig

    stack = StackConfig()
    worker = services(resolved)["spark-worker"]
    command = command_of(worker)
    assert int(worker["deploy"]["replicas"]) == stack.workers
    assert option_values(command, "--cores") == [str(stack.worker_cores)]
    assert option_values(command, "--memory") == [stack.worker_memory]
    opts = env_of(services(resolved)["spark-master"])["SPARK_MASTER_OPTS"]
    assert f"-Dspark.deploy.defaultCores={stack.batch_cores}" in opts.split()
    job = job_service(resolved)
    assert job is not None
    submit, _, _ = split_submit(command_of(job[1]))
    assert f"spark.cores.max={stack.job_cores}" in option_values(submit, "--conf")
    _, _, job_args = split_submit(command_of(job[1]))
    assert option_values(job_args, "--executors-initial") == [str(stack.job_executors_initial)]
    for name in ("airflow-scheduler", "airflow-apiserver"):
        env = env_of(services(resolved)[name])
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__CORE__PARALLELISM"] == str(stack.airflow_parallelism)
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
