"""Wiring of the distributed deployment (docker-compose.yml and deploy/).

The compose file cannot be run here, so it is checked by reading it. Each
check is a function that returns the problems it finds. It runs on the real
file, where it must find none, and on deliberately broken copies, where it
must report the break: every check is shown able to fail.

Where a real library can judge a value, it does: Airflow's Spark and Kafka
hooks resolve the connections, the job's own CLI parses the spark-submit
arguments, and the simple auth manager reads the password file that the init
service writes.
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

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENV_EXAMPLE = ROOT / "deploy" / "env.example"
PASSWORDS_SCRIPT = ROOT / "deploy" / "airflow_passwords.py"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"

KEYPLANE_DOCKERFILE = "deploy/Dockerfile"
IMAGE_PROJECT_DIR = "/opt/keyplane"

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
            node, _, address = voter.partition("@")
            voters[node.strip()] = address.strip()
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
            raw = env.get("AIRFLOW_CONN_KAFKA_DEFAULT")
            if raw is None:
                problems.append(f"{name}: AIRFLOW_CONN_KAFKA_DEFAULT is not set")
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
        if is_airflow(svc) and env.get("AIRFLOW_CONN_SPARK_DEFAULT") != url:
            problems.append(
                f"{name}: AIRFLOW_CONN_SPARK_DEFAULT={env.get('AIRFLOW_CONN_SPARK_DEFAULT')}"
            )
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
    connector = f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{spark_version}"
    packages = ",".join(option_values(submit, "--packages")).split(",")
    if connector not in packages:
        problems.append(f"{name}: --packages {packages} lacks {connector}")
    if option_values(app_args, "--source") != ["jvm"]:
        problems.append(f"{name}: the job does not read Kafka through the JVM connector")
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


ALL_CHECKS: dict[str, Check] = {
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


def replace_token(compose: Compose, name: str, old: str, new: str, nth: int = 0) -> None:
    command = svc(compose, name)["command"]
    index = [i for i, token in enumerate(command) if token == old][nth]
    command[index] = new


# --- the real file passes every check -----------------------------------------


@pytest.mark.parametrize("check", list(ALL_CHECKS), ids=list(ALL_CHECKS))
def test_compose_file_passes(check: str, resolved: Compose) -> None:
    assert ALL_CHECKS[check](resolved) == []


def test_compose_file_has_no_literal_secrets(raw: Compose) -> None:
    assert check_no_literal_secrets(unshared(raw)) == []


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


def test_compose_refuses_to_start_without_each_secret(raw: Compose) -> None:
    for secret in ("POSTGRES_PASSWORD", "AIRFLOW_ADMIN_PASSWORD", "AIRFLOW_JWT_SECRET"):
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
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", env["AIRFLOW_CONN_SPARK_DEFAULT"])
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", env["AIRFLOW_CONN_KAFKA_DEFAULT"])
    from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    hook = SparkSubmitHook(conn_id="spark_default")
    assert hook._connection["master"] == spark_master_url(resolved) == "spark://spark-master:7077"
    kafka = KafkaBaseHook.get_connection("kafka_default")
    assert kafka.conn_type == "kafka"
    assert kafka.extra_dejson["bootstrap.servers"] == advertised_plaintext(resolved)


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
    assert settings.source == "jvm"
    assert settings.master == "spark://spark-master:7077"
    assert settings.bootstrap_servers == "kafka:9092"
    assert settings.checkpoint == Path("/var/lib/keyplane/checkpoints/running-counts")


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
                "AIRFLOW_CONN_KAFKA_DEFAULT",
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
            lambda c: set_env(
                c, "airflow-triggerer", "AIRFLOW_CONN_SPARK_DEFAULT", "spark://master:7077"
            ),
            "airflow-triggerer: AIRFLOW_CONN_SPARK_DEFAULT=spark://master:7077",
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
            lambda c: replace_token(
                c,
                "keyplane-job",
                "org.apache.spark:spark-sql-kafka-0-10_2.13:4.3.0",
                "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.1",
            ),
            "lacks org.apache.spark:spark-sql-kafka-0-10_2.13:4.3.0",
        ),
        (lambda c: replace_token(c, "keyplane-job", "jvm", "python"), "JVM connector"),
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
    ids=["connector-version", "python-source", "missing-script", "driver-host", "master-image"],
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
            lambda c: [
                set_env(
                    c,
                    n,
                    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
                    "http://localhost:8080/execution/",
                )
                for n in airflow_services(c)
            ],
            "the execution API URL does not reach the api-server",
        ),
        (
            lambda c: [
                set_env(c, n, "AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
                for n in airflow_services(c)
            ],
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
                "AIRFLOW_CONN_KAFKA_DEFAULT",
                json.dumps({"conn_type": "kafka", "extra": {"sasl.password": "p"}}),
            ),
            "airflow-scheduler: AIRFLOW_CONN_KAFKA_DEFAULT holds a literal sasl.password",
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
    set_env(compose, "airflow-scheduler", "AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(conn))
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
