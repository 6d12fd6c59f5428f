"""The reference keyed job: two consecutive stateful running counts.

This mirrors paper 000's evaluation application (§4.1): stage A keeps a
running count per field-1 key, stage B a running count per field-2 key, and
every tuple flows A → B. Both stages keep their state in Spark's own keyed
state store, so checkpoints, recovery and exactly-once come from Spark.

Stage A is a ``transformWithState`` processor in event-time mode, because
that is the stateful operator Spark allows to be chained into a second one in
the same query (DESIGN: "Two consecutive stateful operators"). It emits one
row per (a, b) pair it saw in the batch, with the pair's tuple count ``n``
and a's new running count, so stage B receives every tuple's weight without
one row per tuple. Stage B (``applyInPandasWithState``, the fastest stateful
API on PySpark) adds ``n`` to b's count and emits both stages' new counts.

Output schema: ``stage STRING ('A' | 'B'), key STRING, count LONG`` — the
latest running count of each key updated in the batch.

Routed variant (:func:`routed_running_counts`). Given a routing config, each
stage groups by a *routed key* (:mod:`keyplane.spark.routing`) instead of the
plain key, so a routing table (paper 000 §3.3) places keys on chosen
instances and a hot key is split over several (paper 001 §4.1.2). The
stateful functions recover the original key with
:func:`keyplane.routedkeys.original_key`, count per routed key, and report
``stage, key, routed_key, instance, count`` (:data:`ROUTED_COUNTS_SCHEMA`):
``count`` is the routed key's partial count, ``instance`` the partition the
operator really ran on, read inside the operator from ``TaskContext``, so
placement is observed rather than assumed. :mod:`keyplane.partials` merges
the partials into exact per-key counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pandas as pd
from pyspark import TaskContext
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from keyplane.events import EVENT_DDL
from keyplane.routedkeys import original_key
from keyplane.spark.routing import RoutedStages, with_routed_key

STAGE_A_OUTPUT = "a STRING, b STRING, n LONG, count_a LONG, ts TIMESTAMP"
COUNTS_SCHEMA = "stage STRING, key STRING, count LONG"
ROUTED_STAGE_A_OUTPUT = "a STRING, ra STRING, ia INT, b STRING, n LONG, count_a LONG, ts TIMESTAMP"
ROUTED_COUNTS_SCHEMA = "stage STRING, key STRING, routed_key STRING, instance INT, count LONG"


def parse_events(raw: DataFrame, watermark: str = "1 minute") -> DataFrame:
    """Kafka records → typed events with an event-time column and watermark."""
    parsed = raw.select(F.from_json(F.col("value").cast("string"), EVENT_DDL).alias("e"))
    return (
        parsed.select(
            "e.seq", "e.a", "e.b", "e.pad", (F.col("e.ts") / 1000).cast("timestamp").alias("ts")
        )
        .where(F.col("a").isNotNull() & F.col("b").isNotNull())
        .withWatermark("ts", watermark)
    )


class CountByFirstKey(StatefulProcessor):
    """Stage A: running count per field-1 key; forwards pair weights to stage B."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count LONG")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        per_b, latest = _pair_weights(rows)
        total = _add_to_count(self.count, sum(per_b.values()))
        for b, n in per_b.items():
            yield Row(a=key[0], b=b, n=n, count_a=total, ts=latest)

    def close(self) -> None:
        pass


class CountByRoutedFirstKey(StatefulProcessor):
    """Stage A grouped by routed key: a partial count per routed key of field 1.

    The grouping key is a routed key; its original key comes back through
    :func:`original_key`. Each output row carries the routed key (``ra``) and
    the partition this group ran on (``ia``), so stage B can report stage A's
    partials and where they live.
    """

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count LONG")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        routed = key[0]
        a = original_key(routed)
        instance = _partition_id()
        per_b, latest = _pair_weights(rows)
        total = _add_to_count(self.count, sum(per_b.values()))
        for b, n in per_b.items():
            yield Row(a=a, ra=routed, ia=instance, b=b, n=n, count_a=total, ts=latest)

    def close(self) -> None:
        pass


def _pair_weights(rows: Iterator[Any]) -> tuple[dict[str, int], Any]:
    """Tuples per field-2 key, and the latest event time, of one group's rows."""
    per_b: dict[str, int] = {}
    latest = None
    for row in rows:
        per_b[row.b] = per_b.get(row.b, 0) + 1
        latest = row.ts if latest is None or row.ts > latest else latest
    return per_b, latest


def _add_to_count(count: Any, n: int) -> int:
    """Add ``n`` to a ``count LONG`` value state; return the new count."""
    stored = count.get() if count.exists() else None
    total = (int(stored[0]) if stored else 0) + n
    count.update((total,))
    return total


def _partition_id() -> int:
    """The partition (operator instance) the calling task processes.

    A stateful operator's task for partition p holds state partition p, so
    this is where the group's state lives, observed from inside the operator.
    """
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("no TaskContext: stateful functions run inside Spark tasks")
    return context.partitionId()


def count_by_second_key(
    key: tuple[str], batches: Iterator[pd.DataFrame], state: GroupState
) -> Iterator[pd.DataFrame]:
    """Stage B: running count per field-2 key; emits stage A's and B's new counts.

    Called once per field-2 key per micro-batch, so per-call overhead is what
    limits throughput on keys with many distinct values: plain Python and
    numpy only, one small DataFrame out.
    """
    total = int(state.get[0]) if state.exists else 0
    a_counts: dict[str, int] = {}
    for pdf in batches:
        total += int(pdf["n"].to_numpy().sum())
        for a, count_a in zip(pdf["a"].tolist(), pdf["count_a"].tolist(), strict=True):
            if count_a > a_counts.get(a, -1):
                a_counts[a] = count_a
    state.update((total,))
    yield pd.DataFrame(
        {
            "stage": ["B"] + ["A"] * len(a_counts),
            "key": [key[0], *a_counts],
            "count": [total, *a_counts.values()],
        }
    )


def count_by_routed_second_key(
    key: tuple[str], batches: Iterator[pd.DataFrame], state: GroupState
) -> Iterator[pd.DataFrame]:
    """Stage B grouped by routed key: a partial count per routed key of field 2.

    Emits this routed key's partial (with the partition it ran on) and, for
    each stage-A routed key that sent it rows, the largest partial seen
    (stage A's counts only grow within a batch), with stage A's partition.
    """
    routed = key[0]
    total = int(state.get[0]) if state.exists else 0
    a_partials: dict[str, tuple[str, int, int]] = {}
    for pdf in batches:
        total += int(pdf["n"].to_numpy().sum())
        for ra, a, ia, count_a in zip(
            pdf["ra"].tolist(),
            pdf["a"].tolist(),
            pdf["ia"].tolist(),
            pdf["count_a"].tolist(),
            strict=True,
        ):
            seen = a_partials.get(ra)
            if seen is None or count_a > seen[2]:
                a_partials[ra] = (a, ia, count_a)
    state.update((total,))
    yield pd.DataFrame(
        {
            "stage": ["B"] + ["A"] * len(a_partials),
            "key": [original_key(routed), *(a for a, _, _ in a_partials.values())],
            "routed_key": [routed, *a_partials],
            "instance": [_partition_id(), *(ia for _, ia, _ in a_partials.values())],
            "count": [total, *(n for _, _, n in a_partials.values())],
        }
    )


def running_counts(events: DataFrame) -> DataFrame:
    """Events (``a``, ``b``, ``ts``) → the two stages' updated running counts."""
    stage_a = events.groupBy("a").transformWithState(
        CountByFirstKey(), STAGE_A_OUTPUT, "Append", "EventTime", eventTimeColumnName="ts"
    )
    return stage_a.groupBy("b").applyInPandasWithState(
        count_by_second_key,
        COUNTS_SCHEMA,
        "count LONG",
        "append",
        GroupStateTimeout.NoTimeout,
    )


def routed_running_counts(events: DataFrame, stages: RoutedStages) -> DataFrame:
    """Events → both stages' updated partial counts, grouped by routed keys.

    Stage A's hot-key split spreads by ``seq``; stage B's by the stage-A
    routed key and ``b``, the fields fixed for a stage-A output row, so a
    replayed batch routes every row as before.
    """
    keyed = with_routed_key(events, "a", stages.a, "ra", spread_by=("seq",))
    stage_a = keyed.groupBy("ra").transformWithState(
        CountByRoutedFirstKey(),
        ROUTED_STAGE_A_OUTPUT,
        "Append",
        "EventTime",
        eventTimeColumnName="ts",
    )
    to_b = with_routed_key(stage_a, "b", stages.b, "rb", spread_by=("ra", "b"))
    return to_b.groupBy("rb").applyInPandasWithState(
        count_by_routed_second_key,
        ROUTED_COUNTS_SCHEMA,
        "count LONG",
        "append",
        GroupStateTimeout.NoTimeout,
    )


def latest_counts(updates: DataFrame) -> DataFrame:
    """Collapse a batch's updates to one (latest, i.e. largest) count per key."""
    return updates.groupBy("stage", "key").agg(F.max("count").alias("count"))


def latest_partials(updates: DataFrame) -> DataFrame:
    """Collapse a batch's routed updates to the largest partial per routed key.

    Grouping also by ``instance`` keeps every observed placement: a routed key
    seen on two instances would show up as two rows, not be hidden.
    """
    return updates.groupBy("stage", "key", "routed_key", "instance").agg(
        F.max("count").alias("count")
    )
