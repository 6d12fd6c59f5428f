"""The routed job's migration topic: moved states, packed many to a record.

A switch batch evicts every moved routed key's state and the sink writes
them here; the next batch's source reads them back as install rows (paper
000 §3.4). One record per move would cost a rollout that moves many keys a
Kafka send per move on the driver, and the install batch a JSON parse and a
Kafka record per move on the executor. Packed into records of at most
:data:`MAX_RECORD_BYTES`, the moves are a few records (a JVM stage packs
each task's own); ``bench/migration_records.py`` compares the two.

A record's value is ``{"moves": [move, ...]}``; a move is ``{"operator",
"key", "source", "target", "count", "state", "marker"}``.
Installs are idempotent per marker and source, so a replayed batch that
writes its records again, packed the same way or not, installs nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from keyplane.kafka.ranges import offset_ranges, read_range

MAX_RECORD_BYTES = 256 * 1024
"""A packed record's budget: well under the producer's and broker's 1 MB defaults."""


def move_records(moves: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    """``moves`` as record values of at most :data:`MAX_RECORD_BYTES` each.

    A single move larger than the budget travels alone (its state decides
    its size; the broker's own limit still applies to it).
    """
    chunk: list[str] = []
    size = 0
    for move in moves:
        text = json.dumps(move, default=str, separators=(",", ":"))
        if chunk and size + len(text) > MAX_RECORD_BYTES:
            yield _packed(chunk)
            chunk, size = [], 0
        chunk.append(text)
        size += len(text) + 1
    if chunk:
        yield _packed(chunk)


def _packed(texts: list[str]) -> bytes:
    # json.dumps escapes non-ASCII, so a text's length is its size in bytes.
    return ('{"moves":[' + ",".join(texts) + "]}").encode()


def moves_of(value: bytes | str) -> list[dict[str, Any]]:
    """The moves one record holds."""
    record = json.loads(value)
    moves = record.get("moves") if isinstance(record, dict) else None
    if not isinstance(moves, list):
        raise ValueError('a migration record is a JSON object {"moves": [...]}')
    return list(moves)


def read_moves(bootstrap_servers: str, topic: str) -> list[dict[str, Any]]:
    """Every move the topic holds, in order, unpacked from its records."""
    from keyplane.kafka.admin import high_watermarks

    end = high_watermarks(bootstrap_servers, topic)
    return [
        move
        for part in offset_ranges(bootstrap_servers, topic, {}, end)
        for records in read_range(part)
        for value in records.column("value").to_pylist()
        for move in moves_of(value)
    ]


def count_moved_states(bootstrap_servers: str, topic: str) -> int:
    """How many states the topic holds, over all its records (for reports and benches)."""
    return len(read_moves(bootstrap_servers, topic))
