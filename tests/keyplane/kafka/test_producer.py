"""Producer delivery settings, what the embedded broker accepts, and the workload trickle."""

from __future__ import annotations

import time

import pytest

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.producer import SAFE_DELIVERY, Delivery, WorkloadTrickle, make_producer
from keyplane.workloads import PairsWorkload


def test_idempotence_with_acks_1_is_refused() -> None:
    with pytest.raises(ValueError, match="acks='all'"):
        Delivery(acks="1", idempotent=True)


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
