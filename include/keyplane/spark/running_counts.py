"""The reference keyed job: two consecutive stateful running counts.

This mirrors paper 000's evaluation application (§4.1): stage A keeps a
running count per field-1 key, stage B a running count per field-2 key, and
every tuple flows A → B. Both stages keep their state in Spark's own keyed
state store, so checkpoints, recovery and exactly-once come from Spark.

Stage A is a ``transformWithState`` processor without a time mode (it sets
no timer), so no event is ever dropped as late. It emits one
row per (a, b) pair it saw in the batch, with the pair's tuple count ``n``
and a's new running count, so stage B receives every tuple's weight without
one row per tuple. Stage B, a ``transformWithState`` processor too, adds ``n``
to b's count and emits both stages' new counts.

Output schema: ``stage STRING ('A' | 'B'), key STRING, count LONG`` — the
latest running count of each key updated in the batch.

The routed variant, which takes new routing configurations live, is
:mod:`keyplane.spark.routed_counts`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from keyplane.reference.events import EVENT_DDL
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE

STAGE_A_OUTPUT = "a STRING, b STRING, n LONG, count_a LONG"
COUNTS_SCHEMA = "stage STRING, key STRING, count LONG"


def parse_events(raw: DataFrame) -> DataFrame:
    """Kafka records → typed events.

    ``ts`` is the event's time, exact to the millisecond (``timestamp_millis``
    computes in integers; ``ts / 1000`` as a double is off by microseconds).
    No watermark is on it: the stages keep no state by time.
    """
    parsed = raw.select(F.from_json(F.col("value").cast("string"), EVENT_DDL).alias("e"))
    return parsed.select(
        "e.seq", "e.a", "e.b", "e.pad", F.timestamp_millis(F.col("e.ts")).alias("ts")
    ).where(F.col("a").isNotNull() & F.col("b").isNotNull())


class CountByFirstKey(StatefulProcessor):
    """Stage A: running count per field-1 key; forwards pair weights to stage B."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count LONG")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        per_b = _pair_weights(rows)
        total = _add_to_count(self.count, sum(per_b.values()))
        for b, n in per_b.items():
            yield Row(a=key[0], b=b, n=n, count_a=total)

    def close(self) -> None:
        pass


def _pair_weights(rows: Iterator[Any]) -> dict[str, int]:
    """Tuples per field-2 key of one group's rows."""
    per_b: dict[str, int] = {}
    for row in rows:
        per_b[row.b] = per_b.get(row.b, 0) + 1
    return per_b


def _add_to_count(count: Any, n: int) -> int:
    """Add ``n`` to a ``count LONG`` value state; return the new count."""
    # get() is None when the group holds no state: one call to the JVM, not two.
    stored = count.get()
    total = (int(stored[0]) if stored else 0) + n
    count.update((total,))
    return total


class CountBySecondKey(StatefulProcessor):
    """Stage B: running count per field-2 key; emits stage A's and B's new counts.

    Called once per field-2 key per micro-batch, so per-call overhead is what
    limits throughput on keys with many distinct values. A row-based
    ``transformWithState`` costs a group its state calls only;
    ``applyInPandasWithState`` would also build a pandas frame in and out of
    every group.
    """

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count LONG")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        n = 0
        a_counts: dict[str, int] = {}
        for row in rows:
            n += row.n
            if row.count_a > a_counts.get(row.a, -1):
                a_counts[row.a] = row.count_a
        yield Row(stage=SECOND_STAGE, key=key[0], count=_add_to_count(self.count, n))
        for a, count_a in a_counts.items():
            yield Row(stage=FIRST_STAGE, key=a, count=count_a)

    def close(self) -> None:
        pass


def running_counts(events: DataFrame) -> DataFrame:
    """Events (``a``, ``b``: :func:`parse_events`) → the two stages' updated running counts."""
    stage_a = events.groupBy("a").transformWithState(
        CountByFirstKey(), STAGE_A_OUTPUT, "Append", "None"
    )
    return stage_a.groupBy("b").transformWithState(
        CountBySecondKey(), COUNTS_SCHEMA, "Append", "None"
    )


def latest_counts(updates: DataFrame) -> DataFrame:
    """Collapse a batch's updates to one (latest, i.e. largest) count per key."""
    return updates.groupBy("stage", "key").agg(F.max("count").alias("count"))
