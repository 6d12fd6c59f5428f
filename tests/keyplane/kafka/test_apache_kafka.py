"""Apache Kafka as a local broker: installed, verified, started, stopped and restarted for real."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.apache_kafka import (
    KAFKA_VERSION,
    ApacheKafkaBroker,
    SaslPlainListener,
    java_binary,
    kafka_install_dir,
)
from keyplane.kafka.broker import BrokerError, answers_kafka
from keyplane.kafka.consumers import close_idle
from keyplane.kafka.producer import make_producer, send_confirmed
from keyplane.kafka.ranges import offset_ranges, read_range
from keyplane.kafka.security import client_config, kafka_security
from keyplane.spark.connector import CONNECTOR_VERSION, connector_dir
from keyplane.testing import free_port

REPO = Path(__file__).resolve().parents[3]


def test_the_pom_pins_the_version_the_module_runs() -> None:
    pom = ET.parse(REPO / "deploy" / "kafka" / "pom.xml").getroot()
    namespace = {"m": "http://maven.apache.org/POM/4.0.0"}
    assert pom.findtext("m:properties/m:kafka.version", namespaces=namespace) == KAFKA_VERSION


def test_a_second_install_does_nothing_and_the_recorded_checksums_match_the_jars() -> None:
    """Each set records its verified jars' SHA-256; a second run reads the markers only."""
    done = subprocess.run(
        [str(REPO / "scripts" / "install-jars")], capture_output=True, text=True, timeout=600
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    install = kafka_install_dir()
    for folder, main_jar in (
        (install, f"kafka_2.13-{KAFKA_VERSION}.jar"),
        (connector_dir(), f"spark-sql-kafka-0-10_2.13-{CONNECTOR_VERSION}.jar"),
    ):
        recorded = dict(
            reversed(line.split("  ", 1))
            for line in (folder / "installed").read_text().splitlines()
        )
        jars = {jar.name: jar for jar in (folder / "libs").glob("*.jar")}
        assert main_jar in jars
        assert set(recorded) == set(jars)
        for name, jar in jars.items():
            assert hashlib.sha256(jar.read_bytes()).hexdigest() == recorded[name], name


def test_no_java_is_one_line_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pure logic, no JVM: the look-up in an environment without Java."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(BrokerError, match=r"^Apache Kafka needs Java 17 or later: .*openjdk-17"):
        java_binary()


def test_a_missing_installation_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    broker = ApacheKafkaBroker(tmp_path / "home", free_port(), install=tmp_path / "none")
    with pytest.raises(BrokerError, match=r"is not installed in .*: run scripts/install-jars"):
        broker.start()
    assert broker.status() is None


def test_a_taken_port_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broker = ApacheKafkaBroker(tmp_path / "home", port)
        with pytest.raises(BrokerError, match=rf"^port {port} is taken by another process"):
            broker.start()
    assert not (tmp_path / "home" / "broker.json").exists()


def _keyplane(home: Path, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KEYPLANE_HOME": str(home), "KEYPLANE_BROKER_PORT": str(port)}
    return subprocess.run(
        [sys.executable, "-m", "keyplane.cli", "broker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _committed(bootstrap: str, group: str, topic: str) -> int | None:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return consumer.committed(TopicPartition(topic, 0))
    finally:
        consumer.close()


@pytest.mark.integration
@pytest.mark.apache_kafka
def test_cli_starts_apache_kafka_whose_records_and_offsets_survive_a_stop_and_start(
    tmp_path: Path,
) -> None:
    """``--engine kafka`` runs the real broker with its logs under the home; a restart keeps
    every acknowledged record and committed offset, and ``stop`` needs no ``--engine``."""
    home, port = tmp_path / "home", free_port()
    bootstrap = f"127.0.0.1:{port}"
    started = _keyplane(home, port, "start", "--engine", "kafka")
    try:
        assert started.returncode == 0, started.stderr
        logs = (home / "kafka" / "logs").resolve()
        assert started.stdout.startswith(f"broker running on {bootstrap} (pid ")
        assert f"storage {logs.as_uri()}, log {home / 'broker.log'}" in started.stdout
        assert (logs / "meta.properties").is_file()
        again = _keyplane(home, port, "start", "--engine", "kafka")
        assert again.returncode == 2
        assert again.stderr.startswith("keyplane: a broker is already running (pid ")

        assert ensure_topic(bootstrap, "kept", 1) == 1
        producer = make_producer(bootstrap)
        try:
            assert send_confirmed(producer, "kept", [(b"k", b"v%d" % i) for i in range(500)]) == 500
        finally:
            producer.close()
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, group_id="readers", enable_auto_commit=False
        )
        consumer.assign([TopicPartition("kept", 0)])
        consumer.seek(TopicPartition("kept", 0), 0)
        consumer.commit({TopicPartition("kept", 0): OffsetAndMetadata(321, "", -1)})
        consumer.close()

        stopped = _keyplane(home, port, "stop")
        assert (stopped.returncode, stopped.stdout) == (0, "broker stopped\n")
        assert _keyplane(home, port, "status").returncode == 1

        restarted = _keyplane(home, port, "start", "--engine", "kafka")
        assert restarted.returncode == 0, restarted.stderr
        status = _keyplane(home, port, "status")
        assert status.returncode == 0
        assert status.stdout.startswith(f"broker: running on {bootstrap} (pid ")
        overview = subprocess.run(
            [sys.executable, "-m", "keyplane.cli", "status"],
            capture_output=True,
            text=True,
            env={**os.environ, "KEYPLANE_HOME": str(home), "KEYPLANE_BROKER_PORT": str(port)},
            timeout=300,
        )
        assert f"up at {bootstrap} (Apache Kafka, pid " in overview.stdout, overview.stdout
        assert high_watermarks(bootstrap, "kept") == {0: 500}
        assert _committed(bootstrap, "readers", "kept") == 321
    finally:
        stopped = _keyplane(home, port, "stop")
    assert stopped.returncode == 0


@pytest.mark.integration
@pytest.mark.apache_kafka
def test_keyplane_clients_authenticate_with_sasl_plain_and_other_clients_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 4 of the security settings, on a broker that enforces them: with
    ``KEYPLANE_KAFKA_*`` set, keyplane's admin client, producer and range reader
    authenticate over SASL/PLAIN; a wrong password and an anonymous client get nothing."""
    sasl = SaslPlainListener(free_port(), {"keyplane": 'pa"ss word'})
    broker = ApacheKafkaBroker(tmp_path / "home", free_port(), sasl_plain=sasl)
    broker.start()
    secured = sasl.bootstrap_servers
    try:
        monkeypatch.setenv("KEYPLANE_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
        monkeypatch.setenv("KEYPLANE_KAFKA_SASL_MECHANISM", "PLAIN")
        monkeypatch.setenv("KEYPLANE_KAFKA_SASL_USERNAME", "keyplane")
        monkeypatch.setenv("KEYPLANE_KAFKA_SASL_PASSWORD", 'pa"ss word')
        kafka_security.cache_clear()
        assert ensure_topic(secured, "secured", 2) == 2
        producer = make_producer(secured)
        try:
            records = [(b"k%d" % i, b"v%d" % i) for i in range(200)]
            assert send_confirmed(producer, "secured", records) == 200
        finally:
            producer.close()
        ends = high_watermarks(secured, "secured")
        assert sum(ends.values()) == 200
        values = {
            value
            for r in offset_ranges(secured, "secured", {}, ends)
            for batch in read_range(r)
            for value in batch.column("value").to_pylist()
        }
        assert values == {b"v%d" % i for i in range(200)}
        close_idle()

        monkeypatch.setenv("KEYPLANE_KAFKA_SASL_PASSWORD", "wrong")
        kafka_security.cache_clear()
        with pytest.raises(KafkaError):
            KafkaAdminClient(**client_config(secured), bootstrap_timeout_ms=5_000).close()
        # The client only sees its connections closed; the broker says why.
        log = (tmp_path / "home" / "broker.log").read_text()
        assert "Authentication failed: Invalid username or password" in log
        # Anonymous, the same listener answers nothing; the plaintext one still serves.
        assert not answers_kafka(secured)
        assert answers_kafka(f"127.0.0.1:{broker.port}")
    finally:
        monkeypatch.undo()
        kafka_security.cache_clear()
        close_idle()
        broker.stop()
