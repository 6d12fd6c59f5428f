"""The command line, run as a user runs it: a subprocess, real broker."""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from keyplane.cli import main as cli_main
from keyplane.cli import topic as topic_command
from keyplane.cli.arguments import _count, _port, _rate, _seconds, _seconds_or_zero, _version
from keyplane.cli.job import _job_process
from keyplane.cli.parser import build_parser
from keyplane.cli.workloads import _spec_from_args
from keyplane.control.operators import OPERATORS
from keyplane.kafka import producer
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.settings import Settings
from keyplane.spark.counts_job import job_command, parse_settings
from keyplane.testing import ProtocolOnlyJob, free_port


def _keyplane(
    home: Path,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    own_session: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``keyplane ARGS`` in a subprocess; ``own_session`` keeps any signal it sends to
    its own process group (pid 0) away from the test run's."""
    env = {**os.environ, "KEYPLANE_HOME": str(home), **(env or {})}
    if port is not None:
        env["KEYPLANE_BROKER_PORT"] = str(port)
    return subprocess.run(
        [sys.executable, "-m", "keyplane.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        start_new_session=own_session,
    )


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The error line with which the parser refuses ``argv`` (exit 2, nothing run)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    for argv in (
        [],
        ["broker"],
        ["topic"],
        ["generate", "pairs"],
        ["generate", "zipf-evolving"],
        ["generate", "geo-tags"],
        ["demo", "geo-tags"],
        ["config", "publish"],
        ["config", "abort"],
        ["job"],
        ["job", "start"],
        ["job", "stop"],
        ["job", "status"],
        ["status"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*argv, "--help"])
        assert exit_info.value.code == 0


def test_invalid_workload_parameter_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _keyplane(tmp_path, "generate", "pairs", "--locality", "1.5")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "keyplane: invalid locality: Input should be less than or equal to 1"
    )


@pytest.mark.integration
def test_broker_lifecycle_and_generate_through_the_cli(tmp_path: Path) -> None:
    port = free_port()
    started = _keyplane(tmp_path, "broker", "start", port=port)
    assert started.returncode == 0, started.stderr
    try:
        again = _keyplane(tmp_path, "broker", "start", port=port)
        assert again.returncode == 2 and "already running" in again.stderr
        status = _keyplane(tmp_path, "broker", "status", port=port)
        assert f"127.0.0.1:{port}" in status.stdout
        gen = _keyplane(
            tmp_path,
            "generate",
            "zipf-evolving",
            "--n-events",
            "5000",
            "--topic",
            "cli-events",
            "--partitions",
            "4",
            port=port,
        )
        assert gen.returncode == 0, gen.stderr
        assert sum(high_watermarks(f"127.0.0.1:{port}", "cli-events").values()) == 5000
    finally:
        stopped = _keyplane(tmp_path, "broker", "stop", port=port)
    assert stopped.stdout.strip() == "broker stopped"
    assert _keyplane(tmp_path, "broker", "status", port=port).returncode == 1


@pytest.mark.integration
def test_broker_warns_on_memory_storage_and_refuses_memory_after_s3(tmp_path: Path) -> None:
    """Memory storage loses every topic at a stop: start and stop say so. A home whose last
    broker used s3 keeps its topics in the object store: starting it on memory by mistake is
    refused, unless asked for. And the status of another home says which home it looked at
    and that Kafka answers, as `keyplane status` does."""
    port = free_port()
    home = tmp_path / "home"
    other = tmp_path / "other"
    on_s3 = _keyplane(home, "broker", "start", "--storage", "s3", port=port)
    assert on_s3.returncode == 0, on_s3.stderr
    s3_stopped = _keyplane(home, "broker", "stop", port=port)
    refused = _keyplane(home, "broker", "start", port=port)
    on_memory = _keyplane(home, "broker", "start", "--allow-memory", port=port)
    try:
        elsewhere = _keyplane(other, "broker", "status", port=port)
        overview = _keyplane(other, "status", port=port)
    finally:
        memory_stopped = _keyplane(home, "broker", "stop", port=port)
    nowhere = _keyplane(other, "broker", "status", port=port)

    assert "warning" not in on_s3.stderr + s3_stopped.stderr
    assert refused.returncode == 2
    assert refused.stderr == (
        f"keyplane: the last broker in {home} used s3 storage, and its topics are there: start "
        "with --storage s3 (or KEYPLANE_BROKER_STORAGE=s3), or pass --allow-memory to start an "
        "empty broker on memory storage\n"
    )
    assert on_memory.returncode == 0, on_memory.stderr
    assert on_memory.stderr == (
        "warning: the broker's storage is memory: every topic and record is lost when this "
        "broker stops, and a job's checkpoint is then ahead of its topics; use --storage s3 "
        "to keep them\n"
    )
    assert memory_stopped.stdout == "broker stopped\n"
    assert memory_stopped.stderr.startswith(
        "warning: the broker's storage is memory: every topic and record is lost now, "
    )
    assert elsewhere.returncode == 0
    assert elsewhere.stdout == (
        f"broker: none started from KEYPLANE_HOME={other}, but Kafka answers at "
        f"127.0.0.1:{port} (a broker of another home, or not keyplane's)\n"
    )
    assert f"broker       up at 127.0.0.1:{port}" in overview.stdout
    assert nowhere.returncode == 1
    assert nowhere.stdout == f"broker: not running (none started from KEYPLANE_HOME={other})\n"


def test_broker_status_says_when_it_removes_a_stale_s3_server_state_file(
    tmp_path: Path, stranger: subprocess.Popen[bytes]
) -> None:
    """The S3 server's state file is judged as the broker's pid file is, and said so:
    before, it was removed without a word."""
    path = tmp_path / "s3-server.json"
    command = ["/elsewhere/python", "-m", "localbucket"]
    fields = {"pid": stranger.pid, "port": 9000, "data": str(tmp_path / "s3"), "log": "x"}
    path.write_text(json.dumps({**fields, "command": command}))

    status = _keyplane(tmp_path, "broker", "status", port=free_port())

    assert (status.returncode, status.stdout.splitlines()) == (
        1,
        [
            f"removed the stale pid file {path} of pid {stranger.pid}: that pid now runs "
            "another program, which was left alone",
            f"broker: not running (none started from KEYPLANE_HOME={tmp_path})",
        ],
    )
    assert stranger.poll() is None
    assert not path.exists()


def test_port_taken_names_the_fix(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _keyplane(tmp_path, "broker", "start", port=port)
    assert result.returncode == 2
    assert f"port {port} is taken" in result.stderr and "--port" in result.stderr


def test_broker_commands_remove_a_pid_file_of_another_program_say_so_and_leave_it_alive(
    tmp_path: Path, stranger: subprocess.Popen[bytes]
) -> None:
    """A pid file without a command line (an older keyplane's) cannot prove its pid is
    the broker, so it is stale, and the process that holds the pid is not signalled."""
    path = tmp_path / "broker.json"
    old = {"pid": stranger.pid, "port": 19092, "storage": "memory://tansu/", "log": "x"}
    removed = (
        f"removed the stale pid file {path} of pid {stranger.pid}: it records no command line "
        "(an older keyplane wrote it), so that process may not be the broker; if it is, stop "
        f"it with `kill {stranger.pid}`"
    )
    port = free_port()

    path.write_text(json.dumps(old))
    status = _keyplane(tmp_path, "broker", "status", port=port)
    path.write_text(json.dumps({**old, "command": ["/elsewhere/tansu", "broker"]}))
    stopped = _keyplane(tmp_path, "broker", "stop", port=port)

    assert (status.returncode, status.stdout.splitlines()) == (
        1,
        [removed, f"broker: not running (none started from KEYPLANE_HOME={tmp_path})"],
    )
    assert stopped.returncode == 0
    assert stopped.stdout.splitlines() == [
        f"removed the stale pid file {path} of pid {stranger.pid}: that pid now runs another "
        "program, which was left alone",
        "no broker was running",
    ]
    assert stranger.poll() is None
    assert not path.exists()


@pytest.mark.parametrize("action", ["status", "stop"])
@pytest.mark.parametrize(
    ("contents", "problem"),
    [
        ("", "file: Invalid JSON: EOF while parsing"),
        ('{"pid": 4000000}', "port: Field required"),
        ('{"pid": 0, "port": 1, "storage": "m", "log": "l"}', "pid: Input should be greater"),
        ('{"pid": -1, "port": 1, "storage": "m", "log": "l"}', "pid: Input should be greater"),
    ],
    ids=["empty", "partial", "pid-0", "pid-minus-1"],
)
def test_a_bad_broker_pid_file_is_one_line_naming_it_and_exit_2(
    tmp_path: Path, action: str, contents: str, problem: str
) -> None:
    path = tmp_path / "broker.json"
    path.write_text(contents)

    result = _keyplane(tmp_path, "broker", action, port=free_port(), own_session=True)

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"keyplane: {path} is not a broker pid file ({problem}")
    assert result.stderr.endswith("; if no broker is running, remove it\n")
    assert result.stderr.count("\n") == 1
    assert path.read_text() == contents


@pytest.mark.integration
def test_status_with_a_truncated_broker_pid_file_is_one_line_naming_it(
    tmp_path: Path, broker: str
) -> None:
    """``status`` reads the embedded broker's pid file once Kafka answers."""
    path = tmp_path / "broker.json"
    path.write_text('{"pid": 4000000}')

    result = _keyplane(tmp_path, "status", env={"KEYPLANE_BOOTSTRAP_SERVERS": broker})

    assert result.returncode == 2
    assert result.stderr == (
        f"keyplane: {path} is not a broker pid file (port: Field required); "
        "if no broker is running, remove it\n"
    )


@pytest.mark.parametrize("port", ["0", "-5", "65536", "70000", "x"])
def test_broker_port_outside_1_to_65535_is_refused(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for action in ("start", "stop", "status"):
        assert _refused(["broker", action, "--port", port], capsys) == (
            f"keyplane broker: error: argument --port: '{port}' is not a port "
            "(an integer from 1 to 65535)"
        )
    assert build_parser().parse_args(["broker", "start", "--port", "65535"]).port == 65535


def test_broker_start_on_a_port_past_65535_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    result = _keyplane(tmp_path, "broker", "start", "--port", "70000")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        "'70000' is not a port (an integer from 1 to 65535)"
    )
    assert not (tmp_path / "broker.json").exists()


@pytest.mark.parametrize(
    ("convert", "accepted", "refused", "what"),
    [
        (_version, {"1": 1, "12": 12}, ["0", "-1", "1.5", "v2"], "a version (an integer from 1)"),
        (_count, {"1": 1}, ["0", "-3", "2.0"], "a positive integer"),
        (_port, {"1": 1, "65535": 65535}, ["0", "65536"], "a port (an integer from 1 to 65535)"),
        (_rate, {"0.5": 0.5}, ["0", "-1", "nan", "inf"], "a positive number of events per second"),
        (_seconds, {"0.001": 0.001}, ["0", "-0.5", "nan"], "a positive number of seconds"),
        (_seconds_or_zero, {"0": 0.0, "2.5": 2.5}, ["-1", "nan"], "a number of seconds, 0 or more"),
    ],
    ids=["version", "count", "port", "rate", "seconds", "seconds-or-zero"],
)
def test_each_number_type_accepts_its_range_and_names_it_when_refusing(
    convert: Callable[[str], float],
    accepted: dict[str, float],
    refused: list[str],
    what: str,
) -> None:
    """The bounds of every number option, up to each end, and the one line that names
    what the option takes."""
    assert {text: convert(text) for text in accepted} == accepted
    for text in refused:
        with pytest.raises(argparse.ArgumentTypeError) as refusal:
            convert(text)
        assert str(refusal.value) == f"{text!r} is not {what}"


@pytest.mark.parametrize(
    "argv",
    [
        ["topic", "create", "t", "--partitions"],
        ["generate", "pairs", "--partitions"],
        ["demo", "pairs", "--partitions"],
        ["demo", "geo-tags", "--max-offsets-per-trigger"],
    ],
    ids=["topic", "generate", "demo", "demo-max-offsets"],
)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_count_below_1_is_refused_before_anything_runs(
    argv: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refused([*argv, value], capsys).endswith(f"'{value}' is not a positive integer")


@pytest.mark.parametrize("command", ["generate", "demo"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "fast"])
def test_a_rate_that_is_not_a_positive_finite_number_is_refused(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refused([command, "zipf-evolving", "--rate", value], capsys).endswith(
        f"argument --rate: '{value}' is not a positive number of events per second"
    )
    assert build_parser().parse_args([command, "pairs", "--rate", "2.5"]).rate == 2.5


@pytest.mark.parametrize("name", ["bad name!", "", "x" * 250, ".."])
def test_a_topic_name_kafka_refuses_is_refused_before_connecting(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = f"{name!r} is not a Kafka topic name: 1 to 249 letters, digits, '.', '_' or '-'"
    for argv in (
        ["topic", "create", name],
        ["topic", "describe", name],
        ["generate", "pairs", "--topic", name],
    ):
        assert message in _refused(argv, capsys)


def test_generate_to_an_empty_topic_name_is_exit_2_and_writes_nowhere(tmp_path: Path) -> None:
    result = _keyplane(tmp_path, "generate", "pairs", "--topic", "", port=free_port())

    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "keyplane generate pairs: error: argument --topic: '' is not a Kafka topic name: "
        "1 to 249 letters, digits, '.', '_' or '-' (and not '.' or '..')"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["pairs", "--n-keys", "9223372036854775808"],
            "n_keys: Input should be less than or equal to 10000000",
        ),
        (
            ["zipf-evolving", "--n-keys", str(10**12)],
            "n_keys: Input should be less than or equal to 10000000",
        ),
        (
            ["geo-tags", "--n-regions", "2"],
            "input: Value error, flash_regions (3, the default) must not exceed n_regions (2): "
            "lower flash_regions, or set flash_every to 0 to disable flashes",
        ),
    ],
    ids=["pairs", "zipf", "geo-tags-regions"],
)
def test_a_workload_past_its_bounds_is_one_line_before_kafka_is_asked(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    """No broker runs on the port: a check after connecting would say Kafka did not answer."""
    result = _keyplane(tmp_path, "generate", *argv, port=free_port())

    assert result.returncode == 2
    assert result.stderr == f"keyplane: invalid {message}\n"


@pytest.mark.parametrize("value", ["none", "None", "0"])
def test_flash_every_none_or_0_disables_flashes_as_the_help_says(value: str) -> None:
    parse = build_parser().parse_args
    for command in ("generate", "demo"):
        disabled = parse([command, "geo-tags", "--flash-every", value])
        assert _spec_from_args("geo-tags", disabled).flash_every is None
        assert _spec_from_args("geo-tags", parse([command, "geo-tags"])).flash_every == 250_000


def test_flash_every_that_is_neither_an_integer_nor_none_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _refused(["generate", "geo-tags", "--flash-every", "never"], capsys).endswith(
        "argument --flash-every: 'never' is not an integer or 'none'"
    )


def test_workload_options_not_given_leave_the_specs_own_defaults() -> None:
    parse = build_parser().parse_args
    given = parse(["generate", "pairs", "--no-relabel-b", "--n-keys", "7"])
    assert _spec_from_args("pairs", given) == PairsWorkload(n_keys=7, relabel_b=False)
    assert _spec_from_args("pairs", parse(["generate", "pairs"])) == PairsWorkload()
    assert "n_keys" not in vars(parse(["generate", "pairs"]))


@pytest.mark.integration
def test_topic_create_and_generate_say_when_the_topic_keeps_another_partition_count(
    tmp_path: Path, broker: str, topic_name: str
) -> None:
    env = {"KEYPLANE_BOOTSTRAP_SERVERS": broker}
    notice = (
        f"notice: topic {topic_name} already exists with 2 partitions, not {{asked}}; it keeps "
        "2 (for {asked}, delete it or choose another name)"
    )

    created = _keyplane(tmp_path, "topic", "create", topic_name, "--partitions", "2", env=env)
    again = _keyplane(tmp_path, "topic", "create", topic_name, "--partitions", "4", env=env)
    same = _keyplane(tmp_path, "topic", "create", topic_name, "--partitions", "2", env=env)
    generated = _keyplane(
        tmp_path,
        "generate",
        "pairs",
        "--n-events",
        "10",
        "--topic",
        topic_name,
        "--partitions",
        "3",
        env=env,
    )

    assert created.stdout == f"topic {topic_name}: 2 partitions\n"
    assert again.stdout.splitlines() == [
        notice.format(asked=4),
        f"topic {topic_name}: 2 partitions",
    ]
    assert same.stdout == created.stdout
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.splitlines() == [
        notice.format(asked=3),
        f"sent 10 events to {topic_name}",
    ]
    assert high_watermarks(broker, topic_name) == {0: 5, 1: 5}


# --- config publish / abort: the controller of paper 000 §3.4 ------------------------------


def _control_env(broker: str, topic: str, key: str) -> dict[str, str]:
    return {
        "KEYPLANE_BOOTSTRAP_SERVERS": broker,
        "KEYPLANE_CONTROL_TOPIC": topic,
        "KEYPLANE_CONTROL_KEY": key,
    }


def _config_file(directory: Path, store: Path, version: int) -> Path:
    """Stored ``version`` written out as the JSON file a user would publish."""
    path = directory / f"v{version}.json"
    path.write_text(config_store.load(store, version).model_dump_json(indent=2))
    return path


def _publish_in_waves(
    home: Path,
    config: config_store.RoutingConfig,
    store: Path,
    max_moves: int,
    env: dict[str, str] | None = None,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Write ``config`` out as a file and publish it in waves of at most ``max_moves``."""
    file = home / f"v{config.version}.json"
    file.write_text(config.model_dump_json())
    command = ("config", "publish", str(file), "--store", str(store), "--no-job-check")
    options = ("--max-moves-per-wave", str(max_moves), "--timeout", "60")
    return file, _keyplane(home, *command, *options, env=env)


@pytest.mark.parametrize(
    ("contents", "expected"),
    [
        (None, "cannot read {file}: No such file or directory"),
        ('{"version": 2', "{file} is not a valid routing configuration: Invalid JSON: EOF"),
        (
            '{"version": 2, "parent_version": 1, "created_by": "manual", '
            '"operators": {"A": {"parallelism": 0}}}',
            "{file} is not a valid routing configuration: operators.A.parallelism: "
            "Input should be greater than or equal to 1",
        ),
        (
            '{"version": 1, "created_by": "initial", '
            '"operators": {"A": {"parallelism": 2}, "A": {"parallelism": 3}}}',
            "{file} is not a valid routing configuration: 'A' is given twice in one object",
        ),
        (
            '{"version": 1, "created_by": "initial", "operators": {"A": {"parallelism": true}}}',
            "{file} is not a valid routing configuration: operators.A.parallelism: "
            "Value error, expected an integer, got true",
        ),
        (
            '{"version": 1, "created_by": "initial", '
            '"operators": {"A": {"parallelism": 2, "active_instances": 1}}}',
            "{file} is not a valid routing configuration: operators.A.active_instances: "
            "Input should be a valid array",
        ),
        (
            '{"version": 1, "created_by": "initial", '
            '"operators": {"A": {"parallelism": 2, "table": {"k": true}}}}',
            "{file} is not a valid routing configuration: operators.A.table.k: "
            "Value error, expected an integer, got true",
        ),
        (
            '{"version": 2, "parent_version": 1, "created_by": "manual", '
            '"operators": {"A": {"parallelism": 2}}}',
            "{file} names parent_version 1, which {store} does not hold; publish the parent "
            "first, or name a stored version",
        ),
    ],
    ids=[
        "missing",
        "not-json",
        "invalid-field",
        "repeated-name",
        "boolean",
        "scalar-active-instances",
        "boolean-instance",
        "parent-missing",
    ],
)
def test_config_publish_of_a_bad_file_is_one_line_and_exit_2(
    tmp_path: Path, contents: str | None, expected: str
) -> None:
    file = tmp_path / "routing.json"
    if contents is not None:
        file.write_text(contents)

    result = _keyplane(tmp_path, "config", "publish", str(file))

    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        "keyplane: " + expected.format(file=file, store=tmp_path / "configs")
    )
    assert not (tmp_path / "configs").exists()


def test_config_publish_refuses_a_child_of_other_operators_and_stores_nothing(
    tmp_path: Path, routing_store: Path
) -> None:
    child = config_store.load(routing_store, 3).model_dump(mode="json")
    child.update(version=4, parent_version=3)
    child["operators"] = {"C": child["operators"]["A"]}
    file = tmp_path / "other_operators.json"
    file.write_text(json.dumps(child))

    result = _keyplane(tmp_path, "config", "publish", str(file), "--store", str(routing_store))

    assert result.returncode == 2
    assert result.stderr == (
        f"keyplane: {file} cannot replace its parent v3: old and new configurations must "
        "route the same operators: ['A', 'B'] vs ['C']\n"
    )
    assert config_store.stored_versions(routing_store) == [1, 2, 3]


def test_config_publish_refuses_a_version_that_does_not_route_the_pipelines_stages(
    tmp_path: Path,
) -> None:
    """With ``KEYPLANE_PIPELINE`` naming the three-stage clickstream example, an initial
    configuration of the reference stages is refused in one line naming the stages, and
    one of the example's stages is stored."""
    repo = Path(__file__).resolve().parents[2]
    env = {
        "KEYPLANE_PIPELINE": "examples.clickstream.pipeline:clicks",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    wrong = tmp_path / "reference.json"
    wrong.write_text(config_store.RoutingConfig.all_hash(2, ("A", "B")).model_dump_json())
    store = tmp_path / "configs"

    result = _keyplane(tmp_path, "config", "publish", str(wrong), "--store", str(store), env=env)

    assert result.returncode == 2
    assert result.stderr == (
        f"keyplane: {wrong} routes operators A, B, but the pipeline "
        "examples.clickstream.pipeline:clicks has stages sessions, users, categories; "
        "nothing was stored\n"
    )
    assert not store.exists()
    right = tmp_path / "clicks.json"
    stages = ("sessions", "users", "categories")
    right.write_text(config_store.RoutingConfig.all_hash(2, stages).model_dump_json())
    stored = _keyplane(tmp_path, "config", "publish", str(right), "--store", str(store), env=env)
    assert stored.returncode == 0, stored.stderr
    assert config_store.stored_versions(store) == [1]


def test_a_store_path_that_is_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    file = tmp_path / "v1.json"
    file.write_text(config_store.RoutingConfig.all_hash(2, OPERATORS).model_dump_json())
    not_a_directory = tmp_path / "a_file"
    not_a_directory.write_text("")

    result = _keyplane(tmp_path, "config", "publish", str(file), "--store", str(not_a_directory))

    assert result.returncode == 2
    assert result.stderr == f"keyplane: File exists: {not_a_directory}\n"


def test_config_publish_stores_idempotently_and_refuses_a_changed_version(
    tmp_path: Path, routing_store: Path
) -> None:
    initial = _config_file(tmp_path, routing_store, 1)
    changed = tmp_path / "changed.json"
    config = config_store.load(routing_store, 2).model_dump(mode="json")
    config["operators"]["A"]["parallelism"] = 5
    changed.write_text(json.dumps(config))

    again = _keyplane(tmp_path, "config", "publish", str(initial), "--store", str(routing_store))
    conflict = _keyplane(tmp_path, "config", "publish", str(changed), "--store", str(routing_store))

    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"v1 already stored in {routing_store} "
        f"(checksum {config_store.checksum(routing_store, 1)[:12]})",
        "v1 is an initial configuration: start the job on it",
    ]
    assert conflict.returncode == 2
    assert conflict.stderr == (
        f"keyplane: version 2 is already stored in {routing_store} with different contents; "
        f"give {changed} a new version (the latest stored is 3)\n"
    )
    assert config_store.load(routing_store, 2).operators["A"].parallelism == 2


def test_config_abort_with_nothing_in_flight_says_so(tmp_path: Path) -> None:
    result = _keyplane(tmp_path, "config", "abort", env={"KEYPLANE_CONTROL_KEY": "k"})
    assert result.returncode == 2
    assert result.stderr == (
        "keyplane: no rollout in flight: the controller has no rollout on record in "
        f"{tmp_path / 'controller.json'}\n"
    )


@pytest.mark.integration
def test_config_publish_rolls_out_to_the_running_job_step_by_step(
    tmp_path: Path,
    broker: str,
    topic_name: str,
    control_key: str,
    routing_store: Path,
    protocol_only_job: Callable[[], ProtocolOnlyJob],
) -> None:
    job = protocol_only_job()
    file = _config_file(tmp_path, routing_store, 2)

    result = _keyplane(
        tmp_path,
        "config",
        "publish",
        str(file),
        "--store",
        str(routing_store),
        "--timeout",
        "60",
        "--no-job-check",
        env=_control_env(broker, topic_name, control_key),
    )

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"v2 already stored in {routing_store}")
    assert [line.rsplit(maxsplit=2)[0] for line in lines[1:6]] == [
        "PREPARE v2 → ACK",
        "PROPAGATE A, B",
        "await MIGRATED A",
        "await MIGRATED B",
        "DONE v2",
    ]
    assert all(line.endswith(" s") for line in lines[1:6])
    assert lines[6].startswith("v2 is active (from v1, ")
    assert job.wait_until(lambda state: state.active_version == 2)


@pytest.mark.integration
def test_config_publish_in_waves_rolls_each_wave_out_and_repeats_safely(
    tmp_path: Path,
    broker: str,
    topic_name: str,
    control_key: str,
    routing_store: Path,
    protocol_only_job: Callable[[], ProtocolOnlyJob],
) -> None:
    """v4, a child of the v1 the job runs, moves 4 keys: in waves of 2, it is stored as
    v4 and v5 and rolled out one after the other. The same command again finds v4 done and
    v5 active (as a repeated single publish does), and does not go back to v4."""
    job = protocol_only_job()
    v1 = config_store.load(routing_store, 1)
    a, b = v1.operators["A"], v1.operators["B"]
    target = v1.model_copy(
        update={
            "version": 4,
            "parent_version": 1,
            "created_by": "manual",
            "operators": {
                "A": a.model_copy(update={"table": {"eu": 1 - a.table["eu"], "us": a.table["eu"]}}),
                "B": b.model_copy(
                    update={"table": {"#spark": (b.table["#spark"] + 1) % 3, "#flink": 2}}
                ),
            },
        }
    )
    env = _control_env(broker, topic_name, control_key)

    file, first = _publish_in_waves(tmp_path, target, routing_store, 2, env)
    _, again = _publish_in_waves(tmp_path, target, routing_store, 2, env)

    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert [line.split(" (checksum")[0] for line in lines[:2]] == [
        f"v4 stored in {routing_store}",
        f"v5 stored in {routing_store}",
    ]
    assert lines[2] == (
        f"v4 of {file} rolls out from v1 in 2 wave(s): v4..v5, at most 2 moved keys each"
    )
    steps = [line.rsplit(maxsplit=2)[0] for line in lines[3:-1]]
    assert [step for step in steps if step.startswith(("PREPARE", "DONE"))] == [
        "PREPARE v4 → ACK",
        "DONE v4",
        "PREPARE v5 → ACK",
        "DONE v5",
    ]
    assert lines[-1].startswith(f"v5 is active, routing as {file} (")
    assert job.wait_until(lambda state: state.active_version == 5)
    assert config_store.load(routing_store, 5).operators == target.operators
    wave = config_store.load(routing_store, 4)
    assert wave.parent_version == 1
    moved = sum(wave.operators[name].table != v1.operators[name].table for name in OPERATORS)
    assert moved == 2  # each operator has one of its two moves in the first wave
    assert again.returncode == 0, again.stderr
    assert "PREPARE v4" not in again.stdout  # the wave the job runs past is skipped
    assert job.wait_until(lambda state: state.active_version == 5)
    assert again.stdout.splitlines()[-1].startswith(f"v5 is active, routing as {file}")


@pytest.mark.integration
def test_config_publish_in_waves_plans_from_the_version_the_job_runs(
    tmp_path: Path,
    broker: str,
    topic_name: str,
    control_key: str,
    routing_store: Path,
    protocol_only_job: Callable[[], ProtocolOnlyJob],
) -> None:
    """The job already runs v2 when v4, written as a child of v1, is published in waves of
    2: from v1 it would move 3 keys in 2 waves, but from v2 only B's "#spark" is left to
    move, so it rolls out in one wave, stored as v4 with v2 as its parent."""
    job = protocol_only_job()
    env = _control_env(broker, topic_name, control_key)
    v2 = _config_file(tmp_path, routing_store, 2)
    assert (
        _keyplane(
            tmp_path,
            "config",
            "publish",
            str(v2),
            "--store",
            str(routing_store),
            "--timeout",
            "60",
            "--no-job-check",
            env=env,
        ).returncode
        == 0
    )
    assert job.wait_until(lambda state: state.active_version == 2)
    v1, after_v2 = config_store.load(routing_store, 1), config_store.load(routing_store, 2)
    b = after_v2.operators["B"]
    target = v1.model_copy(
        update={
            "version": 4,
            "parent_version": 1,
            "created_by": "manual",
            "operators": {
                "A": after_v2.operators["A"],
                "B": b.model_copy(update={"table": {"#spark": (b.table["#spark"] + 1) % 3}}),
            },
        }
    )

    file, result = _publish_in_waves(tmp_path, target, routing_store, 2, env)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"the job runs v2, not {file}'s parent v1: the waves start from v2"
    assert lines[2] == (
        f"v4 of {file} rolls out from v2 in 1 wave(s): v4..v4, at most 2 moved keys each"
    )
    prepares = [line.rsplit(maxsplit=2)[0] for line in lines if line.startswith("PREPARE")]
    assert prepares == ["PREPARE v4 → ACK"]
    stored = config_store.load(routing_store, 4)
    assert stored.parent_version == 2
    assert stored.operators == target.operators
    assert config_store.stored_versions(routing_store) == [1, 2, 3, 4]
    assert job.wait_until(lambda state: state.active_version == 4)


def test_config_publish_in_waves_refuses_a_rescale_in_one_line(
    tmp_path: Path, routing_store: Path
) -> None:
    v1 = config_store.load(routing_store, 1)
    rescaled = v1.model_copy(
        update={
            "version": 4,
            "parent_version": 1,
            "created_by": "scale",
            "operators": {
                **v1.operators,
                "B": v1.operators["B"].model_copy(update={"parallelism": 4}),
            },
        }
    )

    file, result = _publish_in_waves(tmp_path, rescaled, routing_store, 1)

    assert result.returncode == 2
    assert result.stderr == (
        f"keyplane: cannot split {file} into waves: operators ['B'] change their instances: "
        "a rescale moves every key's hash instance at once, so it rolls out in one wave\n"
    )
    assert config_store.stored_versions(routing_store) == [1, 2, 3]


@pytest.mark.integration
def test_config_publish_without_a_job_is_refused_in_one_line_and_stores_and_sends_nothing(
    tmp_path: Path, broker: str, topic_name: str, control_key: str, routing_store: Path
) -> None:
    """No job runs in the home, nor ever wrote to the metrics topic: the version is refused
    at once, its number stays free and no PREPARE goes out, instead of waiting out the
    timeout for an ACK."""
    env = {
        **_control_env(broker, topic_name, control_key),
        "KEYPLANE_METRICS_TOPIC": f"{topic_name}.metrics",
    }
    v4 = config_store.load(routing_store, 3).model_copy(update={"version": 4, "parent_version": 3})
    file = tmp_path / "v4.json"
    file.write_text(v4.model_dump_json())

    refused = _keyplane(
        tmp_path, "config", "publish", str(file), "--store", str(routing_store), env=env
    )

    assert refused.returncode == 2
    assert refused.stderr == (
        f"keyplane: no job runs in {tmp_path}, and none has written to the metrics topic "
        f"'{topic_name}.metrics' to take v4: start it with `keyplane job start` first (nothing "
        "was stored; for a job started elsewhere, pass --no-job-check)\n"
    )
    assert config_store.stored_versions(routing_store) == [1, 2, 3]
    assert not (tmp_path / "controller.json").exists()


@pytest.mark.integration
def test_config_publish_of_the_active_version_is_a_no_op_that_says_so(
    tmp_path: Path,
    broker: str,
    topic_name: str,
    control_key: str,
    routing_store: Path,
    protocol_only_job: Callable[[], ProtocolOnlyJob],
) -> None:
    job = protocol_only_job()
    env = _control_env(broker, topic_name, control_key)
    file = _config_file(tmp_path, routing_store, 2)
    publish = ("config", "publish", str(file), "--store", str(routing_store), "--no-job-check")
    first = _keyplane(tmp_path, *publish, "--timeout", "60", env=env)
    assert first.returncode == 0, first.stderr
    assert job.wait_until(lambda state: state.active_version == 2)
    sent_before = high_watermarks(broker, topic_name)

    again = _keyplane(tmp_path, *publish, "--timeout", "60", env=env)

    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == "v2 is already active; nothing to do"
    assert high_watermarks(broker, topic_name) == sent_before, "nothing may be sent again"


@pytest.mark.integration
def test_config_publish_no_wait_sends_prepare_and_abort_cancels_it(
    tmp_path: Path, broker: str, topic_name: str, control_key: str, routing_store: Path
) -> None:
    env = _control_env(broker, topic_name, control_key)
    file = _config_file(tmp_path, routing_store, 3)
    store = ("--store", str(routing_store))

    prepared = _keyplane(
        tmp_path, "config", "publish", str(file), *store, "--no-wait", "--no-job-check", env=env
    )
    aborted = _keyplane(tmp_path, "config", "abort", *store, env=env)

    assert prepared.returncode == 0, prepared.stderr
    assert prepared.stdout.splitlines()[-1] == (
        "sent PREPARE v3; run this command again without --no-wait to follow the rollout"
    )
    assert aborted.returncode == 0, aborted.stderr
    assert aborted.stdout == "sent ABORT v3: the job goes back to v2\n"


# --- job start|stop|status and status: the job as a background process ---------------------


def _dead_pid_file(home: Path) -> int:
    """A pid file left by a job whose process has died; returns that pid."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    (home / "job").mkdir(parents=True, exist_ok=True)
    (home / "job" / "job.pid").write_text(
        json.dumps(
            {
                "pid": proc.pid,
                "command": [sys.executable, "-m", "keyplane.spark.counts_job"],
                "started_at": "2026-11-03T12:00:00Z",
                "checkpoint": str(home / "job" / "checkpoint"),
                "output": str(home / "job" / "output"),
            }
        )
    )
    return proc.pid


def test_job_stop_and_status_without_a_job_say_so(tmp_path: Path) -> None:
    port = str(free_port())
    env = {"KEYPLANE_BROKER_PORT": port}

    stopped = _keyplane(tmp_path, "job", "stop", env=env)
    status = _keyplane(tmp_path, "job", "status", env=env)

    assert (stopped.returncode, stopped.stdout) == (0, "no job was running\n")
    assert status.returncode == 1
    lines = status.stdout.splitlines()
    assert lines[0] == "job          not running"
    assert lines[1].startswith(f"metrics      unavailable: Kafka at 127.0.0.1:{port} did not")
    assert "rollout      none on record" in lines
    assert f"log          {tmp_path.resolve() / 'job' / 'job.log'}" in lines


def test_job_status_and_stop_report_a_stale_pid_file_and_remove_it(tmp_path: Path) -> None:
    env = {"KEYPLANE_BROKER_PORT": str(free_port())}
    pid_file = tmp_path / "job" / "job.pid"

    seen_by_status = _dead_pid_file(tmp_path)
    status = _keyplane(tmp_path, "job", "status", env=env)
    removed_by_status = not pid_file.exists()
    seen_by_stop = _dead_pid_file(tmp_path)
    stopped = _keyplane(tmp_path, "job", "stop", env=env)

    assert status.returncode == 1
    assert status.stdout.splitlines()[0] == (
        f"job          not running: its process (pid {seen_by_status}) had died; "
        "removed the stale pid file"
    )
    assert removed_by_status
    assert stopped.returncode == 0
    assert stopped.stdout == (
        f"no job was running; removed the stale pid file of pid {seen_by_stop} "
        "(its process had died)\n"
    )
    assert not pid_file.exists()


def test_job_start_without_kafka_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    port = free_port()
    result = _keyplane(tmp_path, "job", "start", port=port)

    assert result.returncode == 2
    assert result.stderr == (
        f"keyplane: Kafka at 127.0.0.1:{port} does not answer; start the embedded broker with "
        "`keyplane broker start` or set KEYPLANE_BOOTSTRAP_SERVERS\n"
    )
    assert not (tmp_path / "job" / "job.pid").exists()


@pytest.mark.parametrize(
    ("command", "servers"),
    [(("job", "start"), "h:x"), (("job", "status"), "a:b:c"), (("status",), "h:")],
)
def test_a_malformed_bootstrap_address_is_one_line_and_exit_2(
    tmp_path: Path, command: tuple[str, ...], servers: str
) -> None:
    result = _keyplane(tmp_path, *command, env={"KEYPLANE_BOOTSTRAP_SERVERS": servers})

    assert result.returncode == 2
    assert result.stderr == (
        f"keyplane: invalid bootstrap_servers: Value error, {servers!r} is not host:port "
        "(an IPv6 address as [address]:port)\n"
    )
    assert not (tmp_path / "job").exists()


def test_job_start_rejects_a_bad_option_value(tmp_path: Path) -> None:
    result = _keyplane(tmp_path, "job", "start", "--shuffle-partitions", "0")

    assert result.returncode == 2
    assert "'0' is not a positive integer" in result.stderr


def test_job_start_passes_the_stage_aggregates_to_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the working directory
    args = build_parser().parse_args(
        ["job", "start", "--stage-b-aggregate", "keyplane.aggregates:ValueCounts"]
    )

    job = _job_process(Settings(home=tmp_path), args)
    command = job_command(job.job_settings())

    assert job.aggregates == {"A": None, "B": "keyplane.aggregates:ValueCounts"}
    assert command[-1] == "--stage-b-aggregate=keyplane.aggregates:ValueCounts"
    assert "--stage-a-aggregate" not in _flags(command)


def _flags(command: list[str]) -> set[str]:
    """The flags a job command line sets, each ``--flag=value`` by its ``--flag``."""
    return {arg.partition("=")[0] for arg in command[3:]}


def _job_start_command(home: Path, *flags: str) -> list[str]:
    """The job's command line that ``keyplane job start FLAGS`` would run."""
    args = build_parser().parse_args(["job", "start", *flags])
    return job_command(_job_process(Settings(home=home), args).job_settings())


def test_job_start_passes_a_value_that_starts_with_a_dash_to_the_job(tmp_path: Path) -> None:
    """The job's own parser would take ``--master -x`` for two flags once it was launched."""
    command = _job_start_command(tmp_path, "--master=-x")

    assert "--master=-x" in command
    assert parse_settings(command[3:]).master == "-x"


def test_job_start_passes_the_forward_mode_to_the_job_and_refuses_an_unknown_one(
    tmp_path: Path,
) -> None:
    command = functools.partial(_job_start_command, tmp_path)
    assert command("--forward", "tuples")[-1] == "--forward=tuples"
    assert "--forward" not in _flags(command())  # the default stays the job's own default
    result = _keyplane(tmp_path, "job", "start", "--forward", "tuple")
    assert result.returncode == 2
    assert "argument --forward: invalid choice: 'tuple'" in result.stderr
    assert not (tmp_path / "job" / "job.pid").exists()


def test_job_start_passes_the_event_size_bound_to_the_job_and_refuses_zero(
    tmp_path: Path,
) -> None:
    command = functools.partial(_job_start_command, tmp_path)
    assert command("--max-event-bytes", "4096")[-1] == "--max-event-bytes=4096"
    assert "--max-event-bytes" not in _flags(command())  # the default stays the job's own
    assert parse_settings(command("--max-event-bytes", "4096")[3:]).max_event_bytes == 4096
    result = _keyplane(tmp_path, "job", "start", "--max-event-bytes", "0")
    assert result.returncode == 2
    assert "'0' is not a positive integer" in result.stderr
    assert not (tmp_path / "job" / "job.pid").exists()


def test_job_start_passes_restarts_to_the_job_and_refuses_a_negative_count(
    tmp_path: Path,
) -> None:
    command = functools.partial(_job_start_command, tmp_path)
    assert command("--restarts", "3")[-1] == "--restarts=3"
    assert command("--restarts", "3", "--restart-delay", "2")[-2:] == [
        "--restarts=3", "--restart-delay-s=2.0",
    ]  # fmt: skip
    assert "--restarts" not in _flags(command())  # the default stays the job's own default
    result = _keyplane(tmp_path, "job", "start", "--restarts", "-1")
    assert result.returncode != 0
    assert "restarts must be 0 or more, not -1" in result.stderr
    assert not (tmp_path / "job" / "job.pid").exists()


def test_job_start_accepts_a_restart_delay_of_zero_and_refuses_a_negative_one(
    tmp_path: Path,
) -> None:
    """Zero restarts a failed query at once, as the job itself allows."""
    command = _job_start_command(tmp_path, "--restarts", "1", "--restart-delay", "0")
    assert command[-1] == "--restart-delay-s=0.0"
    assert parse_settings(command[3:]).restart_delay_s == 0.0
    result = _keyplane(tmp_path, "job", "start", "--restart-delay", "-1")
    assert result.returncode == 2
    assert "argument --restart-delay: '-1' is not a number of seconds, 0 or more" in result.stderr
    assert not (tmp_path / "job" / "job.pid").exists()


def test_generate_asks_for_its_topic_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a fake admin call and a fake producer (no broker runs): the count the notice
    reports is the one the events spread over, not asked for a second time."""
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    asked: list[tuple[str, int]] = []
    sent: list[int] = []

    def ensure_topic(bootstrap: str, topic: str, partitions: int) -> int:
        asked.append((topic, partitions))
        return 2

    class Delivered:
        """A send the broker acknowledged, as kafka-python's future reports it."""

        is_done = True
        exception = None

        def failed(self) -> bool:
            return False

        def get(self, timeout: float) -> None:
            return None

    class FakeProducer:
        def send(self, topic: str, *, value: bytes, partition: int) -> Delivered:
            sent.append(partition)
            return Delivered()

        def flush(self) -> None:
            pass

        def close(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(topic_command, "ensure_topic", ensure_topic)
    monkeypatch.setattr(producer, "ensure_topic", ensure_topic)
    monkeypatch.setattr(producer, "make_producer", lambda *args, **kwargs: FakeProducer())

    code = cli_main(["generate", "pairs", "--n-events", "10", "--topic", "t", "--partitions", "3"])

    assert code == 0
    assert asked == [("t", 3)]
    assert sent == [seq % 2 for seq in range(10)]
    assert capsys.readouterr().out.splitlines() == [
        "notice: topic t already exists with 2 partitions, not 3; it keeps 2 "
        "(for 3, delete it or choose another name)",
        "sent 10 events to t",
    ]


def test_job_start_with_an_unloadable_aggregate_is_one_line_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before Kafka is even asked (none runs here), so before any process."""
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    monkeypatch.setenv("KEYPLANE_BROKER_PORT", str(free_port()))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the working directory

    missing = cli_main(["job", "start", "--stage-a-aggregate", "no_such_module:Agg"])
    missing_out = capsys.readouterr()
    not_one = cli_main(["job", "start", "--stage-b-aggregate", "keyplane.settings:Settings"])
    not_one_out = capsys.readouterr()

    assert missing == not_one == 2
    assert missing_out.err == (
        "keyplane: aggregate 'no_such_module:Agg': cannot import 'no_such_module': "
        "No module named 'no_such_module'\n"
    )
    assert not_one_out.err == (
        "keyplane: aggregate 'keyplane.settings:Settings' is not a KeyedAggregate: "
        "missing zero, add, merge, result, encode, decode\n"
    )
    assert missing_out.out == not_one_out.out == ""
    assert not (tmp_path / "job").exists()


def test_job_start_with_an_aggregate_module_that_raises_or_a_relative_name_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's module runs in the CLI: what it raises is the user's error, not a bug."""
    module = "cli_test_raising_aggregates"
    (tmp_path / f"{module}.py").write_text('raise RuntimeError("no database")\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the working directory
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path / "home"))

    raising = cli_main(["job", "start", "--stage-a-aggregate", f"{module}:Agg"])
    raising_err = capsys.readouterr().err
    relative = cli_main(["job", "start", "--stage-b-aggregate", ".rel:Agg"])
    relative_err = capsys.readouterr().err

    assert raising == relative == 2
    assert raising_err == (
        f"keyplane: aggregate '{module}:Agg': cannot import '{module}': RuntimeError: no database\n"
    )
    assert relative_err == (
        "keyplane: aggregate '.rel:Agg': '.rel' is a relative module name; name it in full\n"
    )
    assert not (tmp_path / "home" / "job").exists()


def test_job_start_finds_an_aggregate_module_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the job, run as ``python -m`` there, would; the ``keyplane`` script's import path
    lacks the directory, as does this test's. Without a signing key the start stops at
    that check, the next one after the aggregates' (none reaches Kafka)."""
    module = "cli_test_own_aggregates"
    (tmp_path / f"{module}.py").write_text("from keyplane.aggregates import ValueCounts as Mine\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KEYPLANE_CONTROL_KEY", raising=False)

    try:
        code = cli_main(["job", "start", "--stage-b-aggregate", f"{module}:Mine"])
    finally:
        sys.modules.pop(module, None)

    assert code == 2
    assert "no control-message signing key is configured" in capsys.readouterr().err
    recorded = json.loads((tmp_path / "home" / "job" / "aggregates.json").read_text())
    assert recorded == {"A": None, "B": f"{module}:Mine"}


def test_status_with_the_broker_down_names_the_fix(tmp_path: Path) -> None:
    port = free_port()
    result = _keyplane(tmp_path, "status", port=port)

    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"broker       down at 127.0.0.1:{port}: start it with `keyplane broker start`",
        "job          not running",
        "rollout      none on record",
    ]


@pytest.mark.integration
def test_status_with_the_broker_up_and_no_job(tmp_path: Path, broker: str, topic_name: str) -> None:
    env = {"KEYPLANE_BOOTSTRAP_SERVERS": broker, "KEYPLANE_METRICS_TOPIC": topic_name}

    result = _keyplane(tmp_path, "status", env=env)

    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"broker       up at {broker}",
        "job          not running",
        f"version      unknown: no record on {topic_name} yet",
        "rollout      none on record",
    ]


@pytest.mark.integration
def test_status_says_when_it_removes_a_stale_broker_pid_file(
    tmp_path: Path, broker: str, topic_name: str, stranger: subprocess.Popen[bytes]
) -> None:
    """``status`` reads the embedded broker's pid file, so it reports removing one as the
    broker commands do, and leaves the process that holds the pid alone."""
    path = tmp_path / "broker.json"
    path.write_text(
        json.dumps(
            {
                "pid": stranger.pid,
                "port": 19092,
                "storage": "memory://tansu/",
                "log": "x",
                "command": ["/elsewhere/tansu", "broker"],
            }
        )
    )
    env = {"KEYPLANE_BOOTSTRAP_SERVERS": broker, "KEYPLANE_METRICS_TOPIC": topic_name}

    result = _keyplane(tmp_path, "status", env=env)

    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"removed the stale pid file {path} of pid {stranger.pid}: that pid now runs another "
        "program, which was left alone",
        f"broker       up at {broker}",
        "job          not running",
        f"version      unknown: no record on {topic_name} yet",
        "rollout      none on record",
    ]
    assert not path.exists()
    assert stranger.poll() is None


def test_config_diff_scores_both_versions_on_the_latest_statistics(tmp_path: Path) -> None:
    """The diff ends with the expected gain the DAG's backtest would compute."""
    import pandas as pd

    from keyplane.algorithms import statistics as stats
    from keyplane.algorithms.batchmetrics import BatchMetrics
    from keyplane.routing.config import OperatorRouting, RoutingConfig
    from keyplane.routing.routedkeys import spark_partition

    n = 4
    # Pairs with b == a: a table putting each b with its a gives full locality.
    keys = [str(k) for k in range(40)]
    rows = [(k, k, holdout, 30 if holdout else 90) for k in keys for holdout in (False, True)]
    grouped = pd.DataFrame(rows, columns=["a", "b", "holdout", "n"])
    manifest, frames = stats.build_snapshot(
        run_id="manual__diff",
        grouped=stats.chain_rows(grouped, ("A", "B")),
        stages=("A", "B"),
        metrics=[BatchMetrics(batch_id=0, versions={"A": 1, "B": 1})],
        events=stats.TopicWindow(topic="e", start={0: 0}, end={0: 4800}),
        metrics_window=stats.TopicWindow(topic="m", start={0: 0}, end={0: 1}),
        previous=None,
        config=None,
        settings=stats.StatisticsSettings(),
    )
    stats.write_snapshot(tmp_path / "statistics", manifest, **frames)
    store = tmp_path / "configs"
    hashed = {"A": OperatorRouting(parallelism=n), "B": OperatorRouting(parallelism=n)}
    config_store.save(RoutingConfig(version=1, created_by="initial", operators=hashed), store)
    together = {k: spark_partition(k, n) for k in keys}
    # v2 sends every b to its a's instance shifted by one: locality drops to 0.
    apart = {k: (i + 1) % n for k, i in together.items()}
    config_store.save(
        RoutingConfig(
            version=2,
            parent_version=1,
            created_by="manual",
            operators={
                "A": OperatorRouting(parallelism=n, table=together),
                "B": OperatorRouting(parallelism=n, table=apart),
            },
        ),
        store,
    )
    done = _keyplane(tmp_path, "config", "diff", "1", "2")
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("expected on statistics manual__diff (hold-out of 1,200 tuples)")
    assert "locality 100.0% → 0.0%" in last
    empty = _keyplane(tmp_path, "config", "diff", "1", "2", "--statistics", str(tmp_path / "none"))
    assert "expected gain: no statistics snapshot in" in empty.stdout


# --- bad input against the real job: refused early, explained at once ------------------------


def _job_env(home: Path, broker: str, topic: str, key: str) -> dict[str, str]:
    """A job of its own in ``home``: its topics on the test broker, and its signing key."""
    return {
        "KEYPLANE_BOOTSTRAP_SERVERS": broker,
        "KEYPLANE_EVENTS_TOPIC": topic,
        "KEYPLANE_CONTROL_TOPIC": f"{topic}.control",
        "KEYPLANE_MIGRATION_TOPIC": f"{topic}.migration",
        "KEYPLANE_METRICS_TOPIC": f"{topic}.metrics",
        "KEYPLANE_DEAD_LETTER_TOPIC": f"{topic}.dead-letter",
        "KEYPLANE_CONTROL_KEY": key,
    }


@pytest.mark.integration
def test_config_publish_refuses_what_the_real_job_cannot_take_and_says_why_at_once(
    tmp_path: Path, broker: str, topic_name: str, control_key: str
) -> None:
    """The routed job runs 2 state partitions per operator under Spark.

    * v2 over 4 instances is refused before it is stored, naming both counts;
    * published past that check, the job itself answers REFUSED with its store's reason,
      and the command fails at once rather than after its 120 s timeout;
    * a controller with another signing key is told that the job rejected its signature,
      which the job can only say through its metrics;
    * once the job is stopped, a version is refused before it is stored.
    """
    home = tmp_path / "home"
    env = _job_env(home, broker, topic_name, control_key)
    store = home / "configs"
    config_store.save(RoutingConfig.all_hash(2, OPERATORS), store)
    produce_workload(PairsWorkload(n_events=500), broker, topic_name, partitions=2)
    rescaled = RoutingConfig.all_hash(4, OPERATORS).model_copy(
        update={"version": 2, "parent_version": 1, "created_by": "scale"}
    )
    same = RoutingConfig.all_hash(2, OPERATORS).model_copy(
        update={"version": 3, "parent_version": 1, "created_by": "manual"}
    )
    (tmp_path / "v2.json").write_text(rescaled.model_dump_json())
    (tmp_path / "v3.json").write_text(same.model_dump_json())
    publish = ("config", "publish", "--timeout", "120")

    started = _keyplane(home, "job", "start", "--shuffle-partitions", "2", env=env)
    try:
        assert started.returncode == 0, started.stderr
        checked = _keyplane(home, *publish, str(tmp_path / "v2.json"), env=env)
        stored_after_check = config_store.stored_versions(store)
        clock = time.monotonic()
        refused = _keyplane(home, *publish, str(tmp_path / "v2.json"), "--no-job-check", env=env)
        refused_s = time.monotonic() - clock
        clock = time.monotonic()
        wrong_key = _keyplane(
            home,
            *publish,
            str(tmp_path / "v3.json"),
            env={**env, "KEYPLANE_CONTROL_KEY": "not-the-jobs-key-0123456789abcdef"},
        )
        wrong_key_s = time.monotonic() - clock
    finally:
        stopped = _keyplane(home, "job", "stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    after_stop = _keyplane(home, *publish, str(tmp_path / "v3.json"), env=env)

    assert checked.returncode == 2
    assert len(checked.stderr.splitlines()) == 1
    assert checked.stderr.startswith(
        f"keyplane: {tmp_path / 'v2.json'} routes A over 4 instances, but the job (pid "
    )
    assert "runs 2 state partitions per operator" in checked.stderr
    assert checked.stderr.endswith("nothing was stored\n")
    assert stored_after_check == [1]

    assert refused.returncode == 2, refused.stdout
    assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith("keyplane: the job refused v2: unknown_checksum: ")
    assert refused.stderr.endswith("; rollout of v2 aborted\n")
    assert refused_s < 60, refused_s

    assert wrong_key.returncode == 2, wrong_key.stdout
    assert len(wrong_key.stderr.splitlines()) == 1, wrong_key.stderr
    assert wrong_key.stderr.startswith("keyplane: the job rejected our signature (")
    assert "KEYPLANE_CONTROL_KEY here is not the job's" in wrong_key.stderr
    assert wrong_key_s < 60, wrong_key_s

    assert after_stop.returncode == 2
    assert after_stop.stderr == (
        f"keyplane: no job runs in {home} to take v3: start it with `keyplane job start` first "
        "(nothing was stored; for a job started elsewhere, pass --no-job-check)\n"
    )


@pytest.mark.integration
def test_job_start_on_a_checkpoint_ahead_of_its_topic_names_topic_partition_and_offsets(
    tmp_path: Path, topic_name: str, control_key: str
) -> None:
    """The job reads 300 events, stops, and its memory broker restarts empty; 20 events are
    written again. `keyplane job start` must refuse in one line that names the topic, the
    partition, the checkpoint's offset and the topic's end, and say what to do, before
    Spark starts: not fail with a line of Spark's plan."""
    broker = EmbeddedBroker(tmp_path / "broker", free_port())
    bootstrap = broker.start().bootstrap_servers
    home = tmp_path / "home"
    env = _job_env(home, bootstrap, topic_name, control_key)
    try:
        produce_workload(PairsWorkload(n_events=300), bootstrap, topic_name, partitions=2)
        started = _keyplane(home, "job", "start", "--shuffle-partitions", "2", env=env)
        stopped = _keyplane(home, "job", "stop", env=env)
        broker.stop()
        broker.start()
        produce_workload(PairsWorkload(n_events=20), bootstrap, topic_name, partitions=2)
        clock = time.monotonic()
        again = _keyplane(home, "job", "start", env=env)
        again_s = time.monotonic() - clock
    finally:
        _keyplane(home, "job", "stop", env=env)
        broker.stop()

    assert started.returncode == 0, started.stderr
    assert stopped.returncode == 0, stopped.stderr
    assert again.returncode == 2, again.stdout
    assert again.stderr == (
        f"keyplane: the checkpoint {home.resolve() / 'job' / 'checkpoint'} has read topic "
        f"'{topic_name}' partition 0 up to offset 150, but the topic ends at offset 10: the "
        "broker lost records it had acknowledged (a broker on memory storage restarted?): "
        "bring its storage back, or start the job on a new checkpoint (move KEYPLANE_HOME/job "
        "aside, then `keyplane job start`)\n"
    )
    assert again_s < 30, again_s


def test_config_show_into_a_reader_that_stops_early_ends_quietly(tmp_path: Path) -> None:
    """`keyplane config show 1 | head -3`: the reader closes the pipe after three lines, and
    the rest of a long configuration cannot be written. That is no error to report."""
    table = {f"key-{i:05d}": i % 4 for i in range(20_000)}
    config = RoutingConfig.all_hash(4, OPERATORS)
    config = config.model_copy(
        update={
            "operators": {
                **config.operators,
                "A": config.operators["A"].model_copy(update={"table": table}),
            }
        }
    )
    config_store.save(config, tmp_path / "configs")
    env = {**os.environ, "KEYPLANE_HOME": str(tmp_path)}
    shown = subprocess.Popen(
        [sys.executable, "-m", "keyplane.cli", "config", "show", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert shown.stdout is not None and shown.stderr is not None
    first = [shown.stdout.readline() for _ in range(3)]
    shown.stdout.close()
    errors = shown.stderr.read().decode()
    code = shown.wait(timeout=60)

    assert all(first)
    assert (code, errors) == (0, "")
