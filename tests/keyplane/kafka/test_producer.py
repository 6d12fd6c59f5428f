"""Producer delivery settings: validation, and what the embedded broker accepts."""

from __future__ import annotations

import pytest

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.producer import SAFE_DELIVERY, Delivery, make_producer


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
