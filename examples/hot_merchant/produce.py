"""Write payments to a Kafka topic: merchant ``m0`` takes ``--hot-share`` of them.

``python -m examples.hot_merchant.produce --events 20000`` writes to
``PAYMENTS_TOPIC`` (default ``payments``) on ``KEYPLANE_BOOTSTRAP_SERVERS``.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Iterator
from typing import Any

from examples.producing import write_json


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
    topic = os.environ.get("PAYMENTS_TOPIC", "payments")
    written = write_json(
        topic, payment_events(args.events, hot_share=args.hot_share, seed=args.seed)
    )
    print(f"wrote {written} payments to {topic}")


if __name__ == "__main__":
    main()
