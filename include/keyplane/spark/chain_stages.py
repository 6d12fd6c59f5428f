"""A pipeline's chain of keyed stages, each grouped by routed keys, state moved live.

Stage *i* of the chain groups its input by the routed key of its own key
(``r<i>``, :func:`keyplane.spark.pipeline_frames.routed_rows`), holds its
:class:`~keyplane.aggregates.KeyedAggregate`'s partial state per routed key, and
hands each event on to stage *i + 1*, on the routed key the reader chose for
it there, so that the shuffle between consecutive stages carries the
correlated keys that a locality-aware table keeps on one executor (paper 000
§2-§3). Events travel combined: a row stands for ``n`` events with the same
keys, values and routed keys of the stages still to come.

A group handles its rows in the order of 000 §3.4, whatever order Spark
delivers them in, as the reference stages do (:mod:`keyplane.spark.routed_counts`):
moved-in states first (once per marker and source, each source's partial
reported as the aggregate's zero from then on), then the batch's events,
then an eviction, which emits the state for the migration topic. Each
group's ``count`` row carries the time the stage spent on it (``busy_ns``,
:func:`keyplane.spark.routed_counts.busy_since`), from which the metrics
measure each stage's execute rate (paper 003 §4.1).

A row that is not for the stage's own keys travels in a control group (its
grouping value starts with NUL, :func:`keyplane.spark.routed_partitions.control_group`):
a rollout's row for a later stage, a report of an earlier stage on its way to
the sink, a record that could not be keyed. Such groups pass their rows on
unchanged. The last stage writes the job's output rows
(:data:`~keyplane.spark.routed_counts.ROUTED_OUTPUT_SCHEMA`), which the routed
job's sink takes as they are (:mod:`keyplane.spark.routed_sink`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql import DataFrame, Row

from keyplane.aggregates import KeyedAggregate
from keyplane.pipeline import Pipeline
from keyplane.spark.pipeline_frames import (
    chain_columns,
    chain_schema,
    key_column,
    routed_column,
    value_column,
)
from keyplane.spark.routed_counts import (
    OUTPUT_FIELDS,
    ROUTED_OUTPUT_SCHEMA,
    TOP_PAIRS_PER_GROUP,
    _added,
    _installed,
    _RoutedStage,
    _task_partition,
    busy_since,
    executor_id,
)
from keyplane.spark.routed_partitions import CONTROL_PREFIX, control_group


class ChainStage(_RoutedStage):
    """Stage ``index`` of a chain of ``stages``: ``aggregate``'s partial per routed key.

    ``parallelism`` names the control groups its reports travel in to the
    sink, through the stages after it.
    """

    def __init__(
        self,
        index: int,
        stages: Sequence[str],
        aggregate: KeyedAggregate[Any],
        parallelism: int,
    ) -> None:
        self.index = index
        self.stages = tuple(stages)
        self.name = self.stages[index]
        self.aggregate = aggregate
        self.parallelism = parallelism
        self.last = index == len(self.stages) - 1
        chain = () if self.last else chain_columns(len(stages))
        self.fields = (*OUTPUT_FIELDS, *chain)
        self.key_field, self.value_field = key_column(index), value_column(index)
        self.later = range(index + 1, len(self.stages))

    def _row(self, about: str | None = None, /, **fields: Any) -> Row:
        """One output row; before the last stage, a row for the sink takes the control group
        of ``about`` in every later stage."""
        if not self.last and about is not None:
            for j in self.later:
                fields[routed_column(j)] = control_group(self.stages[j], about, self.parallelism)
        return Row(**{name: fields.get(name) for name in self.fields})

    def _passed(self, row: Row) -> Row:
        """A row of a control group, on to the next stage or, from the last, to the sink."""
        return Row(**{name: row[name] for name in self.fields})

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        group: str = key[0]
        if group.startswith(CONTROL_PREFIX):
            yield from (self._passed(row) for row in rows)
            return
        installs: list[tuple[str, tuple[str, int], int]] = []
        events: list[Row] = []
        evict: tuple[str, int] | None = None
        stage_key: str | None = None
        for row in rows:
            if row.kind == "event":
                events.append(row)
                stage_key = stage_key or row[self.key_field]
            elif row.kind == "install":
                installs.append((row.routed_key, (row.state, int(row["count"])), int(row.marker)))
                stage_key = stage_key or row.key
            elif row.kind == "evict":
                evict = (row.target, int(row.marker))
                stage_key = stage_key or row.key
        started = time.perf_counter_ns()
        agg = self.aggregate
        held, sources = _installed(agg, self._held(), installs)
        instance, executor = _task_partition(), executor_id()
        values = [v for row in events for v in [row[self.value_field]] * int(row.n)]
        state = held.state
        if values:
            state = _added(agg, self.name, stage_key or "", state, values)
        count = held.count + len(values)
        text = agg.encode(state)
        busy = busy_since(started)
        for source in sources:
            yield self._row(
                source, kind="count", stage=self.name, key=stage_key, routed_key=source, count=0,
                state=self.zero_text,
            )  # fmt: skip
        yield self._row(
            group, kind="count", stage=self.name, key=stage_key, routed_key=group,
            instance=instance, count=count, state=text, busy_ns=busy,
        )  # fmt: skip
        if events:
            yield from self._traffic(group, events, instance, executor)
            if not self.last:
                yield from self._forwarded(events, instance, executor)
        if evict is None:
            self.state.update((text, count, held.marker))
            return
        if count > 0:
            yield self._row(
                group, kind="moved", stage=self.name, key=stage_key, routed_key=group,
                count=count, state=text, target=evict[0], marker=evict[1],
            )  # fmt: skip
        self.state.clear()

    def _traffic(
        self, group: str, events: list[Row], instance: int, executor: str
    ) -> Iterator[Row]:
        """``hop`` rows: the events each upstream instance sent this one, the traffic matrix
        of consecutive stages; ``pair`` rows: the heaviest pairs of the chain's first two
        stages' keys (:func:`keyplane.algorithms.batchmetrics.traffic_metrics`). A one-stage
        chain reports its load as hops from its own instance."""
        if self.index == 0 and len(self.stages) > 1:
            return  # the next stage reports the hops from this one
        hops: dict[tuple[int, str], int] = {}
        pairs: dict[str, int] = {}
        for row in events:
            n = int(row.n)
            if self.index == 0:
                where = (instance, executor)
            else:
                where = (int(row.upstream), row.upstream_executor)
            hops[where] = hops.get(where, 0) + n
            if self.index == 1:
                upstream_key = row[key_column(0)]
                pairs[upstream_key] = pairs.get(upstream_key, 0) + n
        for (upstream, upstream_executor), n in hops.items():
            yield self._row(
                group, kind="hop", stage=self.name, instance=instance, executor=executor,
                upstream=upstream, upstream_executor=upstream_executor, n=n,
            )  # fmt: skip
        stage_key = events[0][self.key_field]
        for a, n in heapq.nlargest(TOP_PAIRS_PER_GROUP, pairs.items(), key=lambda item: item[1]):
            yield self._row(group, kind="pair", key=stage_key, detail=a, instance=instance, n=n)

    def _forwarded(self, events: list[Row], instance: int, executor: str) -> Iterator[Row]:
        """The events for the next stage, one row per distinct (this stage's key, and the
        keys, values and routed keys of the stages still to come), weighing ``n`` events."""
        carried = [key_column(self.index)] + [
            name for j in self.later for name in (key_column(j), value_column(j), routed_column(j))
        ]
        weights: dict[tuple[Any, ...], int] = {}
        for row in events:
            fields = tuple(row[name] for name in carried)
            weights[fields] = weights.get(fields, 0) + int(row.n)
        for fields, n in weights.items():
            yield self._row(
                None, kind="event", upstream=instance, upstream_executor=executor, n=n,
                **dict(zip(carried, fields, strict=True)),
            )  # fmt: skip


def routed_chain(inputs: DataFrame, pipeline: Pipeline, parallelism: int) -> DataFrame:
    """:func:`~keyplane.spark.pipeline_frames.routed_rows` → the job's output rows
    (:data:`~keyplane.spark.routed_counts.ROUTED_OUTPUT_SCHEMA`), through every stage.

    Each stage is a row-based ``transformWithState`` without a time mode: no
    stage sets a timer.
    """
    names = pipeline.stage_names
    rows = inputs
    for index, stage in enumerate(pipeline.stages):
        last = index == len(names) - 1
        rows = rows.groupBy(routed_column(index)).transformWithState(
            ChainStage(index, names, stage.aggregate, parallelism),
            ROUTED_OUTPUT_SCHEMA if last else chain_schema(len(names)),
            "Append",
            "None",
        )
    return rows
