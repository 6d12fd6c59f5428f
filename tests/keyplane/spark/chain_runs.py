"""What the chain tests share: events written and read back, ground truth, versions."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pandas as pd

from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.producer import LongLivedProducer
from keyplane.kafka.ranges import offset_ranges, read_range
from keyplane.routing.config import RoutingConfig
from keyplane.testing import moved_off_hash_config

P = 4
"""Instances per operator: the ``spark`` fixture's shuffle partitions."""


def produce(broker: str, topic: str, events: Iterator[dict[str, Any]]) -> int:
    """Write ``events`` as JSON over two partitions; how many the broker took."""
    ensure_topic(broker, topic, 2)
    producer = LongLivedProducer(broker)
    try:
        records = [(None, json.dumps(event).encode()) for event in events]
        producer.send(topic, records)
    finally:
        producer.close()
    return len(records)


def raw_records(broker: str, topic: str) -> list[tuple[int, int, bytes]]:
    """Every record of ``topic`` as (partition, offset, value)."""
    found = []
    for part in offset_ranges(broker, topic, {}, high_watermarks(broker, topic)):
        for batch in read_range(part):
            for offset, value in zip(
                batch.column("offset").to_pylist(), batch.column("value").to_pylist(), strict=True
            ):
                found.append((part.partition, offset, value))
    return found


def records(broker: str, topic: str) -> pd.DataFrame:
    """Every event of ``topic`` that is a JSON object, with its (partition, offset)."""
    rows = []
    for partition, offset, value in raw_records(broker, topic):
        try:
            event = json.loads(value)
        except ValueError:
            continue
        if isinstance(event, dict):
            rows.append({"partition": partition, "offset": offset, **event})
    return pd.DataFrame(rows)


def top_k(frame: pd.DataFrame, key: str, value: str, k: int) -> dict[str, list[list[Any]]]:
    """Each key's ``k`` most frequent values, ties by value, as TopK reports them."""
    out = {}
    pairs = frame.groupby([key, value]).size().reset_index(name="n")
    for name, group in pairs.groupby(key):
        ranked = group.sort_values(["n", value], ascending=[False, True]).head(k)
        out[str(name)] = [[v, int(n)] for v, n in zip(ranked[value], ranked["n"], strict=True)]
    return out


def clicks_truth(events: pd.DataFrame) -> dict[tuple[str, str], object]:
    flat = events.assign(category=events["page"].map(lambda page: page["category"]))
    truth: dict[tuple[str, str], object] = {}
    for session, total in flat.groupby("session_id")["dwell_ms"].sum().items():
        truth["sessions", str(session)] = int(total)
    for user, distinct in flat.groupby("user_id")["category"].nunique().items():
        truth["users", str(user)] = int(distinct)
    for category, top in top_k(flat, "category", "user_id", 3).items():
        truth["categories", category] = top
    return truth


def ranked_keys(events: pd.DataFrame, column: Callable[[pd.DataFrame], pd.Series]) -> list[str]:
    """A stage's keys in ``events``, most frequent first (ties in first-seen order)."""
    return [str(key) for key in column(events).value_counts(sort=True).index]


def versions(
    stages: Sequence[str], keys: dict[str, list[str]]
) -> tuple[RoutingConfig, RoutingConfig, RoutingConfig]:
    """v1 all hash; v2 moves keys 2-4 of every stage off hash and splits its hottest key
    over three instances; v3 pins the first stage's hot key to one instance (a split
    undone) and keeps the rest of v2."""
    v1 = RoutingConfig.all_hash(P, stages)
    moved = {stage: keys[stage][1:4] for stage in stages}
    hot = {stage: {keys[stage][0]: (0, 1, 3)} for stage in stages}
    v2 = moved_off_hash_config(2, moved, P, hot_keys=hot)
    first = stages[0]
    v3 = moved_off_hash_config(
        3,
        {**moved, first: [*moved[first], keys[first][0]]},
        P,
        hot_keys={stage: hot[stage] for stage in stages[1:]},
    )
    return v1, v2, v3


def latest_results(rows: pd.DataFrame) -> dict[tuple[str, str], object]:
    latest = rows.drop_duplicates(["stage", "key"], keep="last")
    return {(s, k): json.loads(r) for s, k, r in latest[["stage", "key", "result"]].values}
