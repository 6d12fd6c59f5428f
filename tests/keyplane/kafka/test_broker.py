"""Lifecycle of the embedded broker, against the real tansu binary."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.broker import BrokerError, EmbeddedBroker, answers_kafka, port_is_free
from keyplane.kafka.objectstore import LocalS3Server, ObjectStoreError
from keyplane.testing import free_port
from keyplane.util.processes import alive


def test_start_status_stop(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path, free_port())
    assert broker.status() is None
    state = broker.start()
    try:
        assert answers_kafka(state.bootstrap_servers)
        assert broker.inspect() == (state, [])
        assert state.command[0].endswith("tansu") and alive(state.pid, state.command)
        assert EmbeddedBroker(tmp_path, free_port()).status() == state  # read from the file
    finally:
        assert broker.stop() is True
    assert broker.status() is None
    assert port_is_free(state.port)
    assert broker.stop() is False


def test_second_start_is_refused(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path, free_port())
    state = broker.start()
    try:
        with pytest.raises(BrokerError, match=f"already running \\(pid {state.pid}"):
            broker.start()
    finally:
        broker.stop()


def test_port_taken_gives_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} is taken.*--port"):
            EmbeddedBroker(tmp_path, port).start()
    assert not (tmp_path / "broker.json").exists()


def test_stale_pid_file_is_cleared(tmp_path: Path) -> None:
    (tmp_path / "broker.json").write_text(
        '{"pid": 999999, "port": 1, "storage": "memory://tansu/", "log": "x"}'
    )
    assert EmbeddedBroker(tmp_path, free_port()).status() is None
    assert not (tmp_path / "broker.json").exists()


def test_topic_creation_and_high_watermarks(broker: str, topic_name: str) -> None:
    from kafka import KafkaProducer

    assert ensure_topic(broker, topic_name, 3) == 3
    assert ensure_topic(broker, topic_name, 3) == 3  # idempotent
    assert high_watermarks(broker, topic_name) == {0: 0, 1: 0, 2: 0}
    producer = KafkaProducer(bootstrap_servers=broker, linger_ms=5)
    for i in range(1000):
        producer.send(topic_name, value=b"x", partition=i % 3)
    producer.flush()
    producer.close()
    # tansu's ListOffsets(latest) under-reports; the fetch-based marks are exact.
    assert high_watermarks(broker, topic_name) == {0: 334, 1: 333, 2: 333}


def _pid_file(home: Path, **fields: object) -> Path:
    path = home / "broker.json"
    path.write_text(json.dumps({"port": 19092, "storage": "memory://tansu/", "log": "x", **fields}))
    return path


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (["/somewhere/tansu", "broker"], "that pid now runs another program, which was left alone"),
        (None, "it records no command line (an older keyplane wrote it), so that process may"),
    ],
    ids=["other-command", "no-command"],
)
def test_a_pid_file_naming_another_program_is_stale_and_stop_leaves_it_alone(
    tmp_path: Path,
    stranger: subprocess.Popen[bytes],
    command: list[str] | None,
    reason: str,
) -> None:
    fields = {} if command is None else {"command": command}
    path = _pid_file(tmp_path, pid=stranger.pid, **fields)
    broker = EmbeddedBroker(tmp_path, free_port())

    running, stale = broker.inspect()

    assert running is None and len(stale) == 1
    assert (
        stale[0]
        .describe()
        .startswith(f"removed the stale pid file {path} of pid {stranger.pid}: {reason}")
    )
    assert not path.exists()
    _pid_file(tmp_path, pid=stranger.pid, **fields)
    assert broker.stop() is False
    assert stranger.poll() is None
    assert not path.exists()


@pytest.mark.parametrize("pid", [0, 1, -1])
def test_a_pid_of_one_or_less_is_refused_and_the_file_kept(tmp_path: Path, pid: int) -> None:
    path = _pid_file(tmp_path, pid=pid, command=["tansu"])
    with pytest.raises(BrokerError) as refused:
        EmbeddedBroker(tmp_path, free_port()).status()
    assert str(refused.value) == (
        f"{path} is not a broker pid file (pid: Input should be greater than 1); "
        "if no broker is running, remove it"
    )
    assert path.exists()


@pytest.mark.parametrize(
    ("contents", "problem"),
    [
        ("", "file: Invalid JSON: EOF while parsing a value at line 1 column 0"),
        ('{"pid": 4000000', "file: Invalid JSON: EOF while parsing an object at line 1 column 15"),
        ('{"pid": 4000000}', "port: Field required"),
        ("[4000000]", "file: Input should be an object"),
        ('{"pid": "x", "port": 1, "storage": "s", "log": "l"}', "pid: Input should be a valid"),
    ],
    ids=["empty", "cut", "partial", "list", "pid-text"],
)
def test_a_truncated_or_partial_pid_file_is_one_line_naming_it(
    tmp_path: Path, contents: str, problem: str
) -> None:
    path = tmp_path / "broker.json"
    path.write_text(contents)
    broker = EmbeddedBroker(tmp_path, free_port())
    for action in (broker.status, broker.stop, broker.start):
        with pytest.raises(BrokerError) as refused:
            action()
        assert str(refused.value).startswith(f"{path} is not a broker pid file ({problem}")
        assert str(refused.value).endswith("; if no broker is running, remove it")
    assert path.read_text() == contents


@pytest.mark.parametrize(
    "contents", ["", '{"pid": 4000000}', '{"pid": 0, "port": 1, "data": "d", "log": "l"}']
)
def test_a_truncated_s3_server_state_file_is_one_line_naming_it(
    tmp_path: Path, contents: str
) -> None:
    path = tmp_path / "s3-server.json"
    path.write_text(contents)
    with pytest.raises(ObjectStoreError, match=f"^{path} is not an S3 server state file \\("):
        LocalS3Server(tmp_path).status()
    with pytest.raises(BrokerError, match=f"^{path} is not an S3 server state file \\("):
        EmbeddedBroker(tmp_path, free_port()).stop()
    assert path.read_text() == contents


@pytest.mark.parametrize(
    "command", [None, ["/elsewhere/python", "-m", "localbucket"]], ids=["no-command", "other"]
)
def test_an_s3_server_state_file_not_naming_its_server_is_stale_and_stop_leaves_it_alone(
    tmp_path: Path, stranger: subprocess.Popen[bytes], command: list[str] | None
) -> None:
    """A state file without a command line (an older keyplane's) cannot prove its pid is
    the S3 server: it is neither reused nor stopped, as with the broker's pid file."""
    path = tmp_path / "s3-server.json"
    fields = {"pid": stranger.pid, "port": 9000, "data": str(tmp_path / "s3"), "log": "x"}
    state = json.dumps(fields if command is None else {**fields, "command": command})

    path.write_text(state)
    seen = LocalS3Server(tmp_path).status()
    removed = not path.exists()
    path.write_text(state)
    stopped = EmbeddedBroker(tmp_path, free_port()).stop()

    assert (seen, removed, stopped) == (None, True, False)
    assert stranger.poll() is None
    assert not path.exists()


@pytest.mark.parametrize("port", [0, -5, 65536, 70000])
def test_a_port_outside_1_to_65535_is_refused(tmp_path: Path, port: int) -> None:
    with pytest.raises(BrokerError, match=f"port {port} is not one of 1..65535"):
        EmbeddedBroker(tmp_path, port)
