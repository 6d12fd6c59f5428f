"""Write payments to a Kafka topic: merchant ``m0`` takes ``--hot-share`` of them.

``python -m examples.hot_merchant.produce --events 20000`` writes to
``PAYMENTS_TOPIC`` (default ``payments``) on ``KEYPLANE_BOOTSTRAP_SERVERS``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from typing import Any

from kafka import KafkaProducer


def payment_events(
    events: int, merchants: int = 200, hot_share: float = 0.5, seed: int = 11
) -> Iterator[dict[str, Any]]:
    """``events`` payments; the same seed gives the same events."""
    rng = random.Random(seed)
    for _ in range(events):
        merchant = 0 if rng.random() < hot_share else rng.randrange(1, merchants)
        yield {"merchant": f"m{merchant}", "cents": rng.randrange(100, 100_000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--hot-share", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    servers = os.environ.get("KEYPLANE_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    topic = os.environ.get("PAYMENTS_TOPIC", "payments")
    producer = KafkaProducer(bootstrap_servers=servers, acks="all")
    sent = [
        producer.send(topic, json.dumps(p).encode())
        for p in payment_events(args.events, hot_share=args.hot_share, seed=args.seed)
    ]
    producer.flush()
    for future in sent:
        future.get(timeout=30)  # raises if the broker did not take the payment
    print(f"wrote {len(sent)} payments to {topic}")


if __name__ == "__main__":
    main()
