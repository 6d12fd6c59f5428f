"""Write clickstream page views to a Kafka topic, as a user's own producer would.

``python -m examples.clickstream.produce --events 20000`` writes to the
topic ``CLICKS_TOPIC`` (default ``clicks``) on ``KEYPLANE_BOOTSTRAP_SERVERS``
(default: the embedded broker's address). Users are Zipf-skewed, each keeps
to three favourite categories, and sessions belong to one user.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Iterator
from typing import Any

from examples.producing import write_json

CATEGORIES = ("shoes", "books", "garden", "music", "toys", "games", "food", "tools")


def page_views(events: int, users: int = 500, seed: int = 7) -> Iterator[dict[str, Any]]:
    """``events`` page views; the same seed gives the same events."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(users)]
    favourites = {u: rng.sample(CATEGORIES, 3) for u in range(users)}
    for _ in range(events):
        user = rng.choices(range(users), weights)[0]
        category = rng.choice(favourites[user])
        yield {
            "user_id": f"u{user}",
            "session_id": f"u{user}-s{rng.randrange(4)}",
            "page": {"category": category, "path": f"/{category}/{rng.randrange(100)}"},
            "dwell_ms": rng.randrange(100, 30_000),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--chunks", type=int, default=1, help="write the events in this many equal chunks"
    )
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds between chunks: a stream, not a burst"
    )
    args = parser.parse_args()
    topic = os.environ.get("CLICKS_TOPIC", "clicks")
    views = list(page_views(args.events, seed=args.seed))
    size = -(-len(views) // max(args.chunks, 1))
    written = 0
    for start in range(0, len(views), size):
        if start:
            time.sleep(args.pause)
        written += write_json(topic, views[start : start + size])
    print(f"wrote {written} page views to {topic}")


if __name__ == "__main__":
    main()
