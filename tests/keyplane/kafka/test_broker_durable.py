"""The embedded broker's ``s3`` storage keeps records and committed offsets across restarts.

Real tansu on a real local S3 server (localbucket). The same scenario on
``memory`` storage loses everything, which shows the checks can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata

from keyplane.cli import main
from keyplane.kafka.admin import TopicError, ensure_topic, high_watermarks, partitions_of
from keyplane.kafka.broker import BrokerStorage, EmbeddedBroker
from keyplane.testing import crash_broker, free_port

pytestmark = pytest.mark.integration

TOPIC = "durable"
GROUP = "durable-readers"
N_RECORDS = 3_000
PARTITIONS = 3
COMMITTED = {0: 250, 1: 0, 2: 999}


def _produce(bootstrap: str) -> None:
    assert ensure_topic(bootstrap, TOPIC, PARTITIONS) == PARTITIONS
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for i in range(N_RECORDS):
        producer.send(TOPIC, value=b"%d" % i, partition=i % PARTITIONS)
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    consumer.commit(
        {TopicPartition(TOPIC, p): OffsetAndMetadata(o, "", -1) for p, o in COMMITTED.items()}
    )
    consumer.close()


def _read_back(bootstrap: str) -> tuple[list[int], dict[int, int | None]]:
    """Every record's value, sorted, and the group's committed offsets."""
    tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
    marks = high_watermarks(bootstrap, TOPIC)
    values: list[int] = []
    reader = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    reader.assign(tps)
    reader.seek_to_beginning(*tps)
    while any(reader.position(tp) < marks[tp.partition] for tp in tps):
        for records in reader.poll(timeout_ms=500).values():
            values.extend(int(record.value) for record in records)
    reader.close()
    group = KafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    committed = {tp.partition: group.committed(tp) for tp in tps}
    group.close()
    return sorted(values), committed


def test_s3_storage_survives_a_broker_crash_and_a_full_stop(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path, free_port(), storage="s3")
    first = broker.start()
    try:
        assert first.storage == "s3://keyplane-broker/"
        _produce(first.bootstrap_servers)
        server = broker.local_s3.status()
        assert server is not None

        crash_broker(broker)
        second = broker.start()
        assert broker.local_s3.status() == server, "the running S3 server is reused"
        assert _read_back(second.bootstrap_servers) == (list(range(N_RECORDS)), COMMITTED)

        assert broker.stop() is True
        assert broker.local_s3.status() is None, "stop stops the S3 server too"
        third = broker.start()
        assert _read_back(third.bootstrap_servers) == (list(range(N_RECORDS)), COMMITTED)
    finally:
        broker.stop()
    assert broker.status() is None and broker.local_s3.status() is None


def test_memory_storage_loses_records_on_restart(tmp_path: Path) -> None:
    storage: BrokerStorage = "memory"
    broker = EmbeddedBroker(tmp_path, free_port(), storage=storage)
    state = broker.start()
    try:
        _produce(state.bootstrap_servers)
        broker.stop()
        state = broker.start()
        with pytest.raises(TopicError, match="does not exist"):
            partitions_of(state.bootstrap_servers, TOPIC, timeout_s=2.0)
    finally:
        broker.stop()


def test_cli_starts_s3_storage_and_status_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    monkeypatch.setenv("KEYPLANE_BROKER_PORT", str(free_port()))

    def keyplane(*args: str) -> tuple[int, str]:
        code = main(["broker", *args])
        return code, capsys.readouterr().out.strip()

    try:
        code, out = keyplane("start", "--storage", "s3")
        assert code == 0, out
        code, out = keyplane("status")
        assert code == 0
        assert "storage s3://keyplane-broker/ at http://127.0.0.1:" in out
        assert (tmp_path / "s3" / "keyplane-broker").is_dir()
    finally:
        stopped = keyplane("stop")
    assert stopped == (0, "broker stopped")
    assert not (tmp_path / "s3-server.json").exists()
    assert keyplane("status") == (
        1,
        f"broker: not running (none started from KEYPLANE_HOME={tmp_path})",
    )
