"""A driver's offset queries at each batch boundary: a consumer per query vs one kept open.

The routed job's driver asks for the events' and the migration topic's high
watermarks at every micro-batch boundary (``latestOffset``), and the plain
Kafka source for its topics'. Each query used to open a kafka-python
consumer of its own; the sources now keep a
:class:`keyplane.kafka.admin.HighWatermarks` open for the query's life. Both
ways are timed here, taking turns, in one process on one broker: each round
sends a few records to some partitions, as a live topic gets between two
boundaries, then asks for both topics' marks and checks them against what
was sent.

    python bench/offset_queries.py [--rounds 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _harness import private_broker
from _output import emit

from keyplane.kafka.admin import HighWatermarks, ensure_topic, high_watermarks
from keyplane.kafka.producer import make_producer

TOPICS = {"events": 4, "migration": 2}
"""The routed job's two queried topics and their partitions (as the benches run it)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"a consumer per query": [], "one kept open": []}
    with private_broker() as (bootstrap, _):
        for topic, partitions in TOPICS.items():
            ensure_topic(bootstrap, topic, partitions)
        producer = make_producer(bootstrap)
        sent = {topic: dict.fromkeys(range(n), 0) for topic, n in TOPICS.items()}
        with HighWatermarks(bootstrap) as kept:
            for round_ in range(args.rounds + 1):
                for way in seconds:
                    partition = round_ % TOPICS["events"]
                    for i in range(5):
                        producer.send("events", value=b"%d" % i, partition=partition)
                    sent["events"][partition] += 5
                    producer.flush()
                    started = time.perf_counter()
                    if way == "one kept open":
                        marks = {topic: kept.of(topic) for topic in TOPICS}
                    else:
                        marks = {topic: high_watermarks(bootstrap, topic) for topic in TOPICS}
                    took = time.perf_counter() - started
                    if marks != sent:
                        raise RuntimeError(f"round {round_}, {way}: {marks} != {sent}")
                    if round_:  # round 0 warms up: imports, first metadata
                        seconds[way].append(took)
        producer.close(timeout=10)
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    per_query, kept_open = medians.values()
    lines = [
        f"{args.rounds} batch boundaries, each asking for the marks of {len(TOPICS)} topics "
        f"({', '.join(f'{t}: {n} partitions' for t, n in TOPICS.items())}) after 5 new "
        "events; the two ways taking turns; every answer checked against the records sent",
        "",
        "| consumer | median ms per boundary | mean ms |",
        "|---|---:|---:|",
        *(
            f"| {way} | {medians[way] * 1000:.1f} | {statistics.fmean(s) * 1000:.1f} |"
            for way, s in seconds.items()
        ),
        "",
        f"a consumer per query / one kept open: **{per_query / kept_open:.1f}×**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
