"""A rollout's moved states on the migration topic: one record per move vs packed.

A switch batch's sink sends every evicted state to the migration topic, and
the install batch reads them back (paper 000 §3.4). The states used to
travel one Kafka record per move; :mod:`keyplane.kafka.migration_topic` now
packs them into records of at most ``MAX_RECORD_BYTES``. Both ways are timed
here on one broker, taking turns, for the moves of
``bench/reconfiguration.py``'s rollout (10,000 stage-A keys and 178 stage-B
routed keys): the sink's send through the job's own producer, and the read
back through :func:`keyplane.kafka.migration_topic.read_moves`. Every round
writes a topic of its own and checks that every move reads back.

    python bench/migration_records.py [--moves 10178] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _harness import private_broker
from _output import emit

from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.migration_topic import move_records, read_moves
from keyplane.kafka.producer import LongLivedProducer
from keyplane.routing.routedkeys import routed_key

WAYS = ("one record per move", "packed")


def rollout_moves(n: int) -> list[dict[str, Any]]:
    """``n`` moves shaped as a JVM stage A evicts them: a routed key to a salted one."""
    return [
        {
            "operator": "A",
            "key": f"k{i:06d}",
            "source": f"k{i:06d}",
            "target": routed_key(f"k{i:06d}", 7 + i % 13),
            "count": 1 + i % 97,
            "state": str(1 + i % 97),
            "marker": 2,
        }
        for i in range(n)
    ]


def values(way: str, moves: list[dict[str, Any]]) -> list[bytes]:
    """The migration records' values ``way`` writes for ``moves``."""
    if way == "packed":
        return list(move_records(moves))
    return [json.dumps(move, separators=(",", ":")).encode() for move in moves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=10_178)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    moves = rollout_moves(args.moves)
    seconds: dict[str, dict[str, list[float]]] = {
        way: {"encode": [], "send": [], "read": []} for way in WAYS
    }
    records: dict[str, int] = {}
    with private_broker() as (bootstrap, _):
        producer = LongLivedProducer(bootstrap)
        for round_ in range(args.rounds + 1):
            for way in WAYS:
                topic = f"migration-{round_}-{WAYS.index(way)}"
                ensure_topic(bootstrap, topic, 1)
                started = time.perf_counter()
                written = values(way, moves)
                encoded = time.perf_counter()
                producer.send(topic, [(b"1", value) for value in written])
                sent = time.perf_counter()
                read = read_moves(bootstrap, topic)
                done = time.perf_counter()
                if read != moves:
                    raise RuntimeError(f"round {round_}, {way}: {len(read)} moves read back")
                records[way] = len(written)
                if round_:  # round 0 warms up: imports, first metadata
                    took = seconds[way]
                    took["encode"].append(encoded - started)
                    took["send"].append(sent - encoded)
                    took["read"].append(done - sent)
        producer.close()
    median = {
        way: {step: statistics.median(s) for step, s in steps.items()}
        for way, steps in seconds.items()
    }
    per_move, packed = (median[way] for way in WAYS)
    lines = [
        f"{args.moves:,} moved states, {args.rounds} rounds of each way taking turns, "
        "one embedded broker; every move read back and compared",
        "",
        "| migration records | records | median s: encode | send | read back |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {way} | {records[way]:,} | {median[way]['encode']:.3f} "
            f"| {median[way]['send']:.3f} | {median[way]['read']:.3f} |"
            for way in WAYS
        ),
        "",
        f"one record per move / packed: send **{per_move['send'] / packed['send']:.0f}×**, "
        f"read back **{per_move['read'] / packed['read']:.1f}×**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
