"""Producer delivery settings, what the embedded broker accepts, and the workload trickle."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kafka.errors import KafkaError, UnknownProducerIdError

from keyplane.kafka import producer as producer_module
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.producer import (
    SAFE_DELIVERY,
    Delivery,
    LongLivedProducer,
    WorkloadNotDelivered,
    WorkloadTrickle,
    make_producer,
    produce_workload,
)
from keyplane.kafka.ranges import OffsetRange, read_range
from keyplane.reference.workloads import PairsWorkload
from keyplane.testing import crash_broker, free_port


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


class FakeFuture:
    """A settled send, as kafka-python's future reports it: done, and failed or not."""

    def __init__(self, error: KafkaError | None) -> None:
        self.is_done = True
        self.exception = error

    def failed(self) -> bool:
        return self.exception is not None

    def get(self, timeout: float) -> None:
        if self.exception is not None:
            raise self.exception


class FakeProducer:
    """Records the partition and time of each send, in place of a Kafka producer (no broker
    runs); every send from the ``fail_from``-th on fails, as after a broker restart."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.partitions: list[int] = []
        self.sent_at: list[float] = []
        self.fail_from = fail_from

    def send(self, topic: str, *, value: bytes, partition: int) -> FakeFuture:
        self.partitions.append(partition)
        self.sent_at.append(time.monotonic())
        failing = self.fail_from is not None and len(self.partitions) > self.fail_from
        return FakeFuture(UnknownProducerIdError() if failing else None)

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


def test_fake_producer_sends_that_fail_make_the_workload_fail_with_the_count_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a fake producer whose sends fail from the 25,000th on: the call raises, counts
    exactly the 25,000 acknowledged, and stops sending soon after the first failure."""
    fake = FakeProducer(fail_from=25_000)
    monkeypatch.setattr(producer_module, "make_producer", lambda *args, **kwargs: fake)
    spec = PairsWorkload(n_events=40_000)

    with pytest.raises(WorkloadNotDelivered) as failed:
        produce_workload(spec, "unused:9092", "t", topic_partitions=2)

    assert failed.value.delivered == 25_000
    assert str(failed.value).startswith("only 25,000 of 40,000 events reached topic 't': ")
    assert "UnknownProducerIdError" in str(failed.value)
    assert len(fake.partitions) == failed.value.attempted < 40_000


def test_fake_producer_a_rate_is_kept_event_by_event_not_per_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 2,000 events/s, 1,000 events take about 0.5 s spread evenly: the 500th send is
    about 0.25 s after the first, not all of them at once before one long sleep."""
    fake = FakeProducer()
    monkeypatch.setattr(producer_module, "make_producer", lambda *args, **kwargs: fake)
    progress: list[int] = []

    started = time.monotonic()
    sent = produce_workload(
        PairsWorkload(n_events=1_000),
        "unused:9092",
        "t",
        topic_partitions=2,
        rate=2_000.0,
        on_progress=progress.append,
    )

    assert sent == 1_000 and sum(progress) == 1_000 and len(progress) >= 20
    halfway = fake.sent_at[499] - fake.sent_at[0]
    assert 0.2 <= halfway <= 0.4, halfway
    assert time.monotonic() - started >= 0.45


@pytest.mark.integration
def test_a_workload_sent_across_a_memory_broker_restart_fails_with_the_count_delivered(
    tmp_path: Path,
) -> None:
    """The broker (memory storage) stops and starts while a rate-limited workload is sent:
    the restarted broker knows neither the topic nor the producer, so the call must fail and
    say how many events were acknowledged, not report every event as sent."""
    broker = EmbeddedBroker(tmp_path, free_port(), storage="memory")
    bootstrap = broker.start().bootstrap_servers
    spec = PairsWorkload(n_events=20_000)
    outcome: list[BaseException | int] = []

    def send() -> None:
        try:
            outcome.append(produce_workload(spec, bootstrap, "restarted", partitions=2, rate=2_000))
        except BaseException as error:
            outcome.append(error)

    sender = threading.Thread(target=send)
    try:
        sender.start()
        time.sleep(1.0)
        broker.stop()
        broker.start()
        sender.join(timeout=240)
    finally:
        broker.stop()
    assert not sender.is_alive()
    [result] = outcome
    assert isinstance(result, WorkloadNotDelivered), result
    assert 0 < result.delivered < spec.n_events
    assert str(result).startswith(f"only {result.delivered:,} of 20,000 events reached topic ")


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
