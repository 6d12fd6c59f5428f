"""Producer delivery settings, what the embedded broker accepts, and the workload trickle."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from keyplane.kafka import producer as producer_module
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import (
    SAFE_DELIVERY,
    Delivery,
    LongLivedProducer,
    WorkloadTrickle,
    make_producer,
    produce_workload,
)
from keyplane.kafka.ranges import OffsetRange, read_range
from keyplane.testing import crash_broker, free_port
from keyplane.workloads import PairsWorkload


def test_idempotence_with_acks_1_is_refused() -> None:
    with pytest.raises(ValueError, match="acks='all'"):
        Delivery(acks="1", idempotent=True)


@pytest.mark.parametrize(
    ("rate", "partitions", "message"),
    [
        (0.0, 8, "rate must be a positive, finite number"),
        (-5.0, 8, "rate must be a positive, finite number"),
        (float("nan"), 8, "rate must be a positive, finite number"),
        (float("inf"), 8, "rate must be a positive, finite number"),
        (None, 0, "1 partition or more, not 0"),
        (100.0, -1, "1 partition or more, not -1"),
    ],
)
def test_a_rate_or_partition_count_it_cannot_honour_is_refused_before_connecting(
    rate: float | None, partitions: int, message: str
) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=message):
        produce_workload(PairsWorkload(n_events=10), nobody, "t", partitions=partitions, rate=rate)


class FakeProducer:
    """Records the partition of each send, in place of a Kafka producer (no broker runs)."""

    def __init__(self) -> None:
        self.partitions: list[int] = []

    def send(self, topic: str, *, value: bytes, partition: int) -> None:
        self.partitions.append(partition)

    def flush(self) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def test_a_partition_count_the_caller_already_has_is_not_asked_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a fake admin call and a fake producer: the events spread over the count
    given, which need not be the one asked for (an existing topic keeps its own)."""
    fake = FakeProducer()

    def topic_asked_again(*args: Any) -> int:
        raise AssertionError(f"ensure_topic{args} called again")

    monkeypatch.setattr(producer_module, "ensure_topic", topic_asked_again)
    monkeypatch.setattr(producer_module, "make_producer", lambda *args, **kwargs: fake)
    spec = PairsWorkload(n_events=10)

    sent = produce_workload(spec, "unused:9092", "t", partitions=8, topic_partitions=3)

    assert sent == 10
    assert fake.partitions == [seq % 3 for seq in range(10)]
    with pytest.raises(ValueError, match="1 partition or more, not 0"):
        produce_workload(spec, "unused:9092", "t", topic_partitions=0)


@pytest.mark.integration
def test_every_delivery_setting_writes_each_record_once(broker: str, topic_name: str) -> None:
    """The embedded broker (tansu) accepts idempotent producers (InitProducerId) and acks=1."""
    ensure_topic(broker, topic_name, 1)
    settings = (SAFE_DELIVERY, Delivery(acks="all", idempotent=False), Delivery("1", False))
    written = 0
    for delivery in settings:
        producer = make_producer(broker, delivery)
        try:
            assert producer.config["acks"] == (-1 if delivery.acks == "all" else 1)
            assert producer.config["enable_idempotence"] is delivery.idempotent
            futures = [producer.send(topic_name, value=b"%d" % i, partition=0) for i in range(50)]
            producer.flush()
            offsets = [future.get(timeout=10).offset for future in futures]
        finally:
            producer.close(timeout=10)
        assert offsets == list(range(written, written + 50))
        written += 50
    assert high_watermarks(broker, topic_name) == {0: written}


@pytest.mark.integration
def test_a_trickle_sends_chunks_until_finished_and_lists_exactly_what_it_sent(
    broker: str, topic_name: str
) -> None:
    trickle = WorkloadTrickle(
        lambda i: PairsWorkload(n_keys=10, n_events=50 + i, seed=i),
        broker,
        topic_name,
        pause_s=0.05,
    )
    trickle.start()
    deadline = time.monotonic() + 60
    while len(trickle.specs) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sent = trickle.finish()

    assert len(sent) >= 3
    assert [spec.n_events for spec in sent] == [50 + i for i in range(len(sent))]
    assert sum(high_watermarks(broker, topic_name).values()) == sum(s.n_events for s in sent)


@pytest.mark.integration
def test_a_trickle_raises_its_error_when_finished(broker: str, topic_name: str) -> None:
    def chunk(i: int) -> PairsWorkload:
        if i == 1:
            raise ValueError("no second chunk")
        return PairsWorkload(n_keys=10, n_events=20, seed=i)

    trickle = WorkloadTrickle(chunk, broker, topic_name, pause_s=0.01)
    trickle.start()
    trickle.join(timeout=60)
    with pytest.raises(ValueError, match="no second chunk"):
        trickle.finish()
    assert sum(high_watermarks(broker, topic_name).values()) == 20


@pytest.mark.integration
def test_a_long_lived_producer_delivers_across_a_broker_crash(tmp_path: Path) -> None:
    """The sink's kept producer, after the broker was SIGKILLed and started again on ``s3``.

    Every record sent before the crash and after the restart is on the topic.
    (In this run the kept producer itself delivers after the restart; when a
    broker refuses it, the send goes out again through a new producer, which
    the fake-producer tests of the routed sink check.)
    """
    broker = EmbeddedBroker(tmp_path, free_port(), storage="s3")
    bootstrap = broker.start().bootstrap_servers
    sends = LongLivedProducer(bootstrap)
    try:
        ensure_topic(bootstrap, "kept", 1)
        assert sends.send("kept", [(b"k", b"%d" % i) for i in range(3)]) == 3
        crash_broker(broker)
        broker.start()
        assert sends.send("kept", [(b"k", b"%d" % i) for i in range(3, 6)]) == 3
        assert sends.send("kept", [(b"k", b"6")]) == 1
        end = high_watermarks(bootstrap, "kept")[0]
        read = read_range(OffsetRange(bootstrap, "kept", 0, 0, end))
        values = [int(v) for batch in read for v in batch.column("value").to_pylist()]
    finally:
        sends.close()
        broker.stop()
    assert sorted(set(values)) == list(range(7))
