"""Write JSON records to a Kafka topic, as the examples' own producers do.

It stands in for the user's producer, which keyplane never needs: any client
that writes JSON values to the topic will do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from kafka import KafkaProducer


def write_json(topic: str, records: Iterable[dict[str, Any]]) -> int:
    """Send ``records`` to ``topic`` on ``KEYPLANE_BOOTSTRAP_SERVERS`` (default: the embedded
    broker's address) and wait for the broker to take every one; returns how many."""
    servers = os.environ.get("KEYPLANE_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    producer = KafkaProducer(bootstrap_servers=servers, acks="all")
    try:
        sent = [producer.send(topic, json.dumps(record).encode()) for record in records]
        producer.flush()
        for future in sent:
            future.get(timeout=30)  # raises if the broker did not take the record
    finally:
        producer.close()
    return len(sent)
