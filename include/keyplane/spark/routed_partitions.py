"""The routed source's partitions: what a task of a batch reads, and the control groups.

The driver (:class:`keyplane.spark.routed_source.RoutedEventsReader`) plans a
batch into these partitions; Spark pickles them to the tasks, which read them
(:mod:`keyplane.spark.routed_reads`, :mod:`keyplane.spark.chain_source`). Rows
that are not a key's own travel under *control groups*: grouping values that
start with a character no key's grouping value starts with
(:data:`keyplane.routing.routedkeys.CONTROL_STARTS`), one per stage and
instance (:func:`control_group`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from pyspark.sql.datasource import InputPartition

from keyplane.kafka.ranges import OffsetRange
from keyplane.reference.events import (
    MAX_EVENT_BYTES,
    Forward,
)
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.routing.handoff import StateMove, VersionedTables
from keyplane.routing.routedkeys import (
    CONTROL_STARTS,
    find_salt,
    routed_key,
    spark_partition,
)

if TYPE_CHECKING:
    pass

CONTROL_PREFIX, CLOSING_PREFIX = CONTROL_STARTS
"""What the grouping values that are not a key's routed key start with: NUL, and, for
the control groups that sort after every routed key, U+10FFFF (the last code point:
Spark calls a stateful operator's groups in the order of their grouping values). No
key's grouping value starts with either (:data:`keyplane.routing.routedkeys.CONTROL_STARTS`)."""

HandoffMode = Literal["per-key", "per-instance"]
"""How a rollout's moves reach the stages: one row per moved routed key, which the
key's own group handles (the Python stages), or one row per stage and instance,
which a control group handles for all its keys (the JVM stages)."""
HANDOFF_MODES: tuple[HandoffMode, ...] = get_args(HandoffMode)


def control_group(stage: str, about: str, parallelism: int) -> str:
    """The grouping value under which a control row about ``about`` travels.

    Rows for stage B travel through stage A under it, and stage A's reports
    reach the sink through stage B under it. There is one such group per
    ``stage`` and instance, not one per routed key: every group costs a
    stateful operator one Python call with its own state-server round trips,
    so a rollout that moves 10,000 keys would otherwise add 10,000 groups to
    each of its batches. A row travels in the group of its routed key's own
    instance (``spark_partition(about)``), so control work spreads over the
    instances as the keys do.
    """
    return control_groups(stage, parallelism)[spark_partition(about, parallelism)]


def control_groups(stage: str, parallelism: int) -> tuple[str, ...]:
    """The control groups of ``stage``, the i-th salted onto instance i."""
    return _salted_groups(f"{CONTROL_PREFIX}{stage}", parallelism)


def install_groups(stage: str, parallelism: int) -> tuple[str, ...]:
    """Where ``stage`` installs a batch's moved-in states, per instance, before any key's group.

    The group's value starts with :data:`CONTROL_PREFIX`, which sorts first, so
    a moved-in state is in place before its key's first tuple of the batch.
    Stage-B installs pass through stage A under the same value.
    """
    return _salted_groups(f"{CONTROL_PREFIX}install-{stage}", parallelism)


def evict_groups(stage: str, parallelism: int) -> tuple[str, ...]:
    """Where ``stage`` evicts a batch's moved-out states, per instance, after every key's group.

    The group's value starts with :data:`CLOSING_PREFIX`, which sorts last, so
    an evicted state holds every tuple its key had in the switch batch.
    """
    return _salted_groups(f"{CLOSING_PREFIX}evict-{stage}", parallelism)


@functools.cache
def _salted_groups(prefix: str, parallelism: int) -> tuple[str, ...]:
    return tuple(
        routed_key(prefix, find_salt(prefix, instance, parallelism))
        for instance in range(parallelism)
    )


@dataclass(frozen=True)
class Switch:
    """An operator whose state moves in this batch: from ``from_version``'s routed keys
    to ``to_version``'s. The batch is ``marker``, the plan id every move carries."""

    operator: str
    from_version: int
    to_version: int


MoveTriple = tuple[str, str, str]
"""One state move of an operator: (key, source routed key, target routed key)."""


@dataclass(frozen=True)
class EvictPartition(InputPartition):
    """A share of the evict rows of one switching operator: ``moves``, as the driver planned them.

    The driver computes a switch's moves once (:meth:`RoutedEventsReader.partitions`)
    and deals them out. Each Python worker computing all of them itself, to
    emit its share, would load the new version and salt its routed keys in
    the switch batch. The moves travel as plain tuples (:meth:`of`), not
    :class:`~keyplane.routing.handoff.StateMove` objects: Spark pickles the partition
    on the driver and unpickles it in the task, and tuples pickle far faster
    than dataclass instances.
    """

    operator: str
    moves: tuple[MoveTriple, ...]
    parallelism: int
    marker: int
    forward: Forward = "pairs"
    handoff: HandoffMode = "per-key"

    @classmethod
    def of(
        cls,
        operator: str,
        moves: Sequence[StateMove],
        parallelism: int,
        marker: int,
        forward: Forward = "pairs",
        handoff: HandoffMode = "per-key",
    ) -> EvictPartition:
        """The share of ``operator``'s ``moves``, packed as :data:`MoveTriple` tuples."""
        triples = tuple((move.key, move.source, move.target) for move in moves)
        return cls(operator, triples, parallelism, marker, forward, handoff)


@dataclass(frozen=True)
class MigrationPartition(InputPartition):
    """Moved states written by the previous batch: become install rows."""

    records: OffsetRange
    parallelism: int
    forward: Forward = "pairs"
    handoff: HandoffMode = "per-key"


HandOff = EvictPartition | MigrationPartition
"""A batch's share of a rollout's work: evict rows, or install rows."""


@dataclass(frozen=True)
class EventRouting:
    """What a task routes a batch's events by: the versions the driver planned for the
    batch, and the job's settings (:func:`keyplane.spark.routed_reads.route_events`)."""

    store: str
    parallelism: int
    version_a: int
    version_b: int
    max_event_bytes: int = MAX_EVENT_BYTES
    forward: Forward = "pairs"
    prepared: int | None = None
    """A version the job has acknowledged and not yet routes on: the task loads its
    tables ahead."""
    quarantine: tuple[tuple[str, str, str], ...] = ()
    """The quarantined (field-1 key, field-2 key, reason) pairs, whose events are
    dead-lettered with that reason rather than routed (:mod:`keyplane.control.quarantine`)."""

    @classmethod
    def planned(
        cls,
        plan: Mapping[str, Any],
        store: str,
        parallelism: int,
        *,
        max_event_bytes: int,
        forward: Forward,
        quarantine: tuple[tuple[str, str, str], ...],
    ) -> EventRouting:
        """The routing of a batch the routed source planned with ``plan``, its offset:
        each stage's version (``routing``) and the version to load ahead (``prepared``)."""
        versions = plan["routing"]
        prepared = plan.get("prepared")
        return cls(
            store,
            parallelism,
            int(versions[FIRST_STAGE]),
            int(versions[SECOND_STAGE]),
            max_event_bytes,
            forward,
            None if prepared is None else int(prepared),
            quarantine,
        )


@dataclass(frozen=True)
class RoutedEventsPartition(InputPartition):
    """Events ``start <= offset < end`` of one partition, routed on the planned versions,
    then the rows of ``handoffs``, the share of a rollout's work this task reads
    (:meth:`RoutedEventsReader.partitions`)."""

    events: OffsetRange
    routing: EventRouting
    handoffs: tuple[HandOff, ...] = ()
    batch_end: bool = False
    """Whether this task reads the batch's :func:`batch_end_rows` before its events."""


_TABLES: dict[tuple[str, int], VersionedTables] = {}


def tables_for(store: str, parallelism: int) -> VersionedTables:
    """The process's cached routed-key tables of ``store`` (one per Python worker)."""
    found = _TABLES.get((store, parallelism))
    if found is None:
        found = VersionedTables(store, parallelism)
        _TABLES[(store, parallelism)] = found
    return found
