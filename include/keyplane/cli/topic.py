"""``keyplane topic create|describe``: a topic made to the partition count asked, or counted."""

from __future__ import annotations

import argparse

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.settings import Settings


def _ensure_topic(bootstrap: str, topic: str, partitions: int) -> int:
    """:func:`ensure_topic`, saying so when the topic exists with another partition count.

    The topic keeps its count (tansu cannot add partitions), so without a
    word the events would spread over partitions the user did not ask for.
    """
    n = ensure_topic(bootstrap, topic, partitions)
    if n != partitions:
        print(
            f"notice: topic {topic} already exists with {n} partitions, not {partitions}; "
            f"it keeps {n} (for {partitions}, delete it or choose another name)"
        )
    return n


def cmd_topic(settings: Settings, args: argparse.Namespace) -> int:
    bootstrap = settings.resolved_bootstrap_servers()
    if args.action == "create":
        n = _ensure_topic(bootstrap, args.name, args.partitions)
        print(f"topic {args.name}: {n} partitions")
    else:
        marks = high_watermarks(bootstrap, args.name)
        print(f"topic {args.name}: {sum(marks.values()):,} records in {len(marks)} partitions")
    return 0
