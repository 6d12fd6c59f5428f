"""Lifecycle of the embedded broker, against the real tansu binary."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.broker import BrokerError, EmbeddedBroker, answers_kafka, port_is_free
from keyplane.testing import free_port


def test_start_status_stop(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path, free_port())
    assert broker.status() is None
    state = broker.start()
    try:
        assert answers_kafka(state.bootstrap_servers)
        assert broker.status() == state
        assert (tmp_path / "broker.json").exists()
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
