"""Reading a micro-batch's offset ranges with a lent consumer vs a new consumer per range.

A source task reads several ranges per micro-batch (its share of the events
partitions, and during a rollout the migration topic's). Each read used to
open a kafka-python consumer of its own; now it borrows the process's idle
one (:mod:`keyplane.kafka.consumers`). Both ways are timed here, taking
turns, in one process on one broker: 8 partitions of ``--per-partition``
events each, read range by range as a source task reads them, alternating
with the migration topic's ranges as a task of an install batch does.

    python bench/range_reads.py [--rounds 10] [--per-partition 2500] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _harness import private_broker
from _output import emit

from keyplane.kafka import consumers
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer
from keyplane.kafka.ranges import OffsetRange, read_range

PARTITIONS = 8
MIGRATION_RECORD_BYTES = 200_000
"""About a packed migration record's size (keyplane.kafka.migration_topic)."""


def produce(bootstrap: str, per_partition: int) -> None:
    """``per_partition`` 60-byte events in each partition of ``events``, one large record in each
    partition of ``migration``."""
    ensure_topic(bootstrap, "events", PARTITIONS)
    ensure_topic(bootstrap, "migration", PARTITIONS)
    producer = make_producer(bootstrap)
    try:
        for i in range(per_partition * PARTITIONS):
            producer.send("events", value=b"e" * 60, partition=i % PARTITIONS)
        for partition in range(PARTITIONS):
            producer.send("migration", value=b"m" * MIGRATION_RECORD_BYTES, partition=partition)
        producer.flush()
    finally:
        producer.close(timeout=10)


def read_all(bootstrap: str, per_partition: int, *, lent: bool) -> float:
    """Seconds to read every events range, each followed by a migration range; with a new
    consumer per range unless ``lent``."""
    started = time.perf_counter()
    rows = 0
    for partition in range(PARTITIONS):
        for topic, end in (("events", per_partition), ("migration", 1)):
            if not lent:
                consumers.close_idle()
            for batch in read_range(OffsetRange(bootstrap, topic, partition, 0, end)):
                rows += batch.num_rows
    if rows != PARTITIONS * (per_partition + 1):
        raise RuntimeError(f"read {rows} records, not {PARTITIONS * (per_partition + 1)}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-partition", type=int, default=2_500)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    with private_broker() as (bootstrap, _):
        produce(bootstrap, args.per_partition)
        read_all(bootstrap, args.per_partition, lent=True)  # warm-up: imports, first metadata
        for _ in range(args.rounds):
            for lent in (False, True):
                seconds[lent].append(read_all(bootstrap, args.per_partition, lent=lent))
        consumers.close_idle()
    ranges = 2 * PARTITIONS
    new_s, lent_s = (statistics.median(seconds[way]) for way in (False, True))
    lines = [
        f"{PARTITIONS} events ranges of {args.per_partition:,} records and {PARTITIONS} migration "
        f"ranges of one {MIGRATION_RECORD_BYTES:,}-byte record, read alternately; "
        f"{args.rounds} rounds of each way, taking turns",
        "",
        "| consumer | median s per round | ms per range |",
        "|---|---:|---:|",
        f"| new per range | {new_s:.3f} | {new_s / ranges * 1000:.1f} |",
        f"| lent by the process | {lent_s:.3f} | {lent_s / ranges * 1000:.1f} |",
        "",
        f"new / lent time per round: **{new_s / lent_s:.2f}×**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
