"""The routed job's source: events, routed by the version the driver planned, plus state moves.

Why the source plans the batch. Structured Streaming fixes a query's plan when
it starts; the only code that runs on the driver at *every* micro-batch
boundary, before the batch is written to the checkpoint's offset log, is the
sources' ``latestOffset``. So this source is where keyplane's driver side of
the reconfiguration protocol lives (paper 000 §3.4): at each boundary it

1. reads the new control messages (:class:`~keyplane.kafka.control.ControlChannel`)
   and feeds them to the job's :class:`~keyplane.control.job_protocol.JobProtocol`, which
   refuses (one log line, a count in the metrics, no reply) one that is
   unsigned, stale or for a configuration it cannot load;
2. fixes the batch's routing with :meth:`JobProtocol.begin_batch`;
3. publishes the protocol's replies (ACK, MIGRATED);
4. returns an *offset* that holds everything the batch needs: the events
   range, the control and migration topic positions, the protocol checkpoint,
   the routing version of each operator and the hand-offs that switch in it.

Spark writes that offset to its write-ahead log before running the batch, so
a batch replayed after a crash gets the same offset back, and with it the same
routing, the same evictions and the same installs: counts stay exact across
driver restarts with no checkpoint of keyplane's own.

What the batch reads, as rows of :data:`ROUTED_INPUT_SCHEMA` distinguished
by ``kind`` (:meth:`RoutedEventsReader.partitions`): ``event`` rows with
their stage-A and stage-B routed keys computed here from the planned
versions (no Python UDF and no join on the data path); ``evict`` and
``install`` rows for the states moving in this batch, or ``evicts`` and
``installs`` rows that carry an instance's moves together in a control group
(``per-instance`` hand-offs, the JVM stages: :func:`install_groups`,
:func:`evict_groups`, :func:`batch_end_rows`); and ``invalid`` rows, so that
the sink dead-letters a bad record rather than dropping it. With the ``events``
option ``skip``, Spark's own Kafka connector reads the events in the same
query and this source plans the batch and reads the rollout's rows only
(:mod:`keyplane.spark.connector_events`).

The switch batch routes its tuples with the *old* version, so the old group
sees every tuple up to the switch before it hands over, and the new group
gets its state in the same batch as its first tuples. No tuple ever reaches a
group before its state, which is what the buffer of 000 §3.4 guarantees.
Rows addressed to stage B travel through stage A under a reserved grouping
value (``CONTROL_PREFIX``, :func:`control_group`) that no key can take
(:mod:`keyplane.routing.routedkeys`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from keyplane.control.job_protocol import JobProtocol
from keyplane.control.messages import ControlMessage, Reaction
from keyplane.control.operators import OPERATORS
from keyplane.kafka.offsets import PartitionOffsets, cap_offsets, check_not_ahead, total_rows
from keyplane.kafka.ranges import OffsetRange, split_range
from keyplane.reference.events import (
    FORWARD_MODES,
    MAX_EVENT_BYTES,
    Forward,
)
from keyplane.routing import config as config_store
from keyplane.routing.exported_tables import export_tables
from keyplane.spark.job_checkpoint import events_read, newest_logged_batch, offset_log_entry
from keyplane.spark.kafka_source import (
    KafkaSourceOptionError,
    ReadTask,
    grouped_into_tasks,
    max_partitions_option,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from keyplane.kafka.admin import HighWatermarks
    from keyplane.kafka.control import ControlChannel, ControlRead
from keyplane.spark.routed_partitions import (
    HANDOFF_MODES,
    EventRouting,
    EvictPartition,
    HandOff,
    HandoffMode,
    MigrationPartition,
    RoutedEventsPartition,
    Switch,
    tables_for,
)
from keyplane.spark.routed_reads import (
    batch_end_rows,
    read_events,
    read_evictions,
    read_installs,
    routed_input_schema,
)

SOURCE_NAME = "keyplane-routed-events"

EventsMode = Literal["read", "skip"]
EVENTS_MODES: tuple[EventsMode, ...] = get_args(EventsMode)
"""The ``events`` option: ``read`` the events topic (the default), or ``skip`` it because
Spark's connector reads it in the same query (:mod:`keyplane.spark.connector_events`)."""


_Mode = TypeVar("_Mode", bound=str)


log = logging.getLogger(__name__)


def _required(options: Mapping[str, str], name: str) -> str:
    value = options.get(name.lower())
    if not value:
        raise KafkaSourceOptionError(f"the keyplane routed source needs option {name!r}")
    return value


def _forward(options: Mapping[str, str]) -> Forward:
    """The ``forward`` option (default ``pairs``), refused in one line if unknown."""
    return _one_of(options, "forward", FORWARD_MODES)


def _handoff(options: Mapping[str, str]) -> HandoffMode:
    """The ``handoff`` option (default ``per-key``), refused in one line if unknown."""
    return _one_of(options, "handoff", HANDOFF_MODES)


def _one_of(options: Mapping[str, str], name: str, modes: tuple[_Mode, ...]) -> _Mode:
    """Option ``name``, one of ``modes`` (default: the first)."""
    raw = options.get(name, modes[0])
    for mode in modes:
        if raw == mode:
            return mode
    raise KafkaSourceOptionError(f"option {name!r} is one of {', '.join(modes)}, got {raw!r}")


def _quarantine(options: Mapping[str, str]) -> tuple[tuple[str, str, str], ...]:
    """The ``quarantine`` option: a JSON list of [field-1 key, field-2 key, reason]."""
    text = options.get("quarantine")
    if not text:
        return ()
    try:
        pairs = tuple((str(a), str(b), str(reason)) for a, b, reason in json.loads(text))
    except (ValueError, TypeError) as error:
        message = f"option quarantine: not a JSON list of triples ({error})"
        raise KafkaSourceOptionError(message) from None
    return pairs


def _max_event_bytes(options: Mapping[str, str]) -> int:
    raw = options.get("max.event.bytes")
    if raw is None:
        return MAX_EVENT_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KafkaSourceOptionError(
            f"option 'max.event.bytes' is a positive number of bytes, got {raw!r}"
        )
    return value


class ControlMessagesLost(RuntimeError):
    """Retention deleted control messages the job never read (one line, for a CLI)."""


class RoutedEventsReader(DataSourceStreamReader):
    """Plans each micro-batch of the routed job on the driver; reads it on executors."""

    def __init__(self, options: Mapping[str, str]) -> None:
        options = {k.lower(): v for k, v in options.items()}
        self.bootstrap_servers = _required(options, "kafka.bootstrap.servers")
        self.events_topic = _required(options, "subscribe")
        self.control_topic = _required(options, "control.topic")
        self.migration_topic = _required(options, "migration.topic")
        self.store = _required(options, "routing.store")
        self.parallelism = int(_required(options, "state.partitions"))
        self.initial_version = int(_required(options, "initial.version"))
        max_rows = options.get("maxoffsetspertrigger")
        self.max_rows = int(max_rows) if max_rows else None
        self.max_event_bytes = _max_event_bytes(options)
        self.max_partitions = max_partitions_option(options)
        self.forward = _forward(options)
        self.handoff = _handoff(options)
        self.quarantine = _quarantine(options)
        self.read_events = _one_of(options, "events", EVENTS_MODES) == "read"
        """Whether this source reads the events; ``skip``: Spark's connector reads them
        (:mod:`keyplane.spark.connector_events`) and this source plans and moves state."""
        self.checkpoint = None if self.read_events else Path(_required(options, "checkpoint"))
        """The query's checkpoint, whose offset log tells a ``skip`` source the batch it
        plans and how far the connector has read (:meth:`_skipped_batch`)."""
        stages = options.get("stages")
        self.stages: tuple[str, ...] = tuple(stages.split(",")) if stages else OPERATORS
        """The job's stages, upstream first: the operators its protocol steers."""
        self._channel: ControlChannel | None = None
        self._watermarks: HighWatermarks | None = None
        self._planner: ThreadPoolExecutor | None = None
        self._planning: tuple[tuple[int, int], Future[None]] | None = None
        self._unusable: dict[int, str] = {}
        self._latest: PartitionOffsets | None = None

    # -- driver side ---------------------------------------------------------

    def channel(self) -> ControlChannel:
        from keyplane.kafka.control import ControlChannel

        if self._channel is None:
            self._channel = ControlChannel(self.bootstrap_servers, self.control_topic)
        return self._channel

    def _marks(self, topic: str) -> dict[str, int]:
        from keyplane.kafka.admin import HighWatermarks

        if self._watermarks is None:
            self._watermarks = HighWatermarks(self.bootstrap_servers)
        return {str(p): off for p, off in self._watermarks.of(topic).items()}

    def _earliest(self, topic: str) -> dict[str, int]:
        from keyplane.kafka.admin import earliest_offsets

        return {str(p): off for p, off in earliest_offsets(self.bootstrap_servers, topic).items()}

    def lookup_checksum(self, version: int) -> str | None:
        """The stored checksum of ``version`` if this job can route on it, else None.

        The job checks a configuration itself before it acknowledges it, even
        if a validation step already did (000 §3.4: an instance acts only on a
        configuration it holds): files that do not match their checksums, a
        manifest that is not a configuration, or tables over instances the
        query does not have. Whatever is wrong, the answer is None and the
        job stays on its last good version; the reason is kept for the
        refusal's log line (:meth:`unusable`).
        """
        try:
            found = config_store.checksum(self.store, version)
            tables = tables_for(self.store, self.parallelism)
            for operator in self.stages:
                # Its tables are built with its hand-offs, off the batch's path.
                tables.routing(version, operator)
        except (config_store.ConfigStoreError, ValueError, KeyError, TypeError, OSError) as error:
            # One line, so that the refusal stays one line of the driver's log.
            self._unusable[version] = " ".join(f"{type(error).__name__}: {error}".split())
            return None
        self._unusable.pop(version, None)
        return found

    def unusable(self, version: int) -> str | None:
        """Why the last :meth:`lookup_checksum` of ``version`` found it unusable."""
        return self._unusable.get(version)

    def initialOffset(self) -> dict[str, Any]:
        checksum = self.lookup_checksum(self.initial_version)
        if checksum is None:
            raise config_store.UnknownVersionError(
                f"the job starts on v{self.initial_version}, which {self.store} does not hold "
                f"in a form this job can route: {self.unusable(self.initial_version)}"
            )
        protocol = JobProtocol(
            self.stages, self.initial_version, checksum, lookup_checksum=self.lookup_checksum
        )
        return {
            "plan": -1,
            "events": {self.events_topic: self._earliest(self.events_topic)}
            if self.read_events
            else {},
            # Control messages sent before the job started still apply; moved
            # states in the migration topic belong to an older checkpoint.
            "control": self._control_earliest(),
            "migration": self._marks(self.migration_topic),
            "protocol": protocol.to_dict(),
            "routing": dict.fromkeys(self.stages, self.initial_version),
            "switch": [],
        }

    def _control_earliest(self) -> int:
        """The first offset of the control topic that the broker still keeps.

        A new checkpoint starts reading there, as it starts each events
        partition at its first kept offset: retention may have deleted the
        topic's first records, and a read from offset 0 would then fail at
        every start. What retention deleted is older than anything kept; a
        rollout it belonged to has long ended, and the controller repeats
        whatever step it still waits for (each step is an idempotent,
        retryable call), so a new job misses nothing it could act on.
        """
        from keyplane.kafka.control import PARTITION

        return self._earliest(self.control_topic).get(str(PARTITION), 0)

    def _read_control(self, start: int, *, new: bool) -> ControlRead:
        """The control messages from ``start``, the checkpoint's position, to the topic's end.

        Raises :class:`ControlMessagesLost` when retention has deleted records
        the job never read. A job that restarts after being down longer than
        the topic's retention may have missed a PREPARE, a PROPAGATE or an
        ABORT addressed to it; it cannot know which, and skipping ahead would
        leave its protocol state and the controller's apart (000 §3.4: every
        instance takes every step). So it stops with an error that says what
        happened, and never skips silently. A ``new`` checkpoint, whose first
        batch this is, has read nothing yet: should retention delete records
        between its start (:meth:`_control_earliest`) and this read, it reads
        from the first kept one. Only a failed read pays for the broker's
        earliest offset.
        """
        from keyplane.kafka.admin import TopicError

        try:
            return self.channel().read(start)
        except TopicError as error:
            earliest = self._control_earliest()
            if start >= earliest:
                raise
            if new:
                return self.channel().read(earliest)
            raise ControlMessagesLost(
                f"the checkpoint's position in control topic {self.control_topic!r} is offset "
                f"{start}, but the broker keeps records from offset {earliest} only: retention "
                f"deleted {earliest - start} control message(s) this job never read, and a "
                "PREPARE, PROPAGATE or ABORT among them would leave the job and the controller "
                "disagreeing on its routing. Keep the control topic's records longer than a job "
                "may be down; to go on, start the job on a new checkpoint"
            ) from error

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.max_rows is None else ReadMaxRows(self.max_rows)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        connector_behind = False
        if self.read_events:
            plan = int(start["plan"]) + 1
        else:
            plan, connector_behind = self._skipped_batch()
        protocol = JobProtocol.from_dict(
            start["protocol"], lookup_checksum=self.lookup_checksum, explain=self.unusable
        )
        replies: list[ControlMessage] = []
        control = self._read_control(int(start["control"]), new=plan == 0)
        refused: Counter[str] = Counter()
        for offset, invalid in control.rejected:
            refused[invalid.reason] += 1
            log.warning(
                "keyplane: control record %s refused (%s): %s",
                offset,
                invalid.reason,
                invalid.detail,
            )
        for offset, message in control.messages:
            reaction: Reaction = protocol.react(message, plan)
            if reaction.outcome == "ignored" and reaction.reason != "own_message":
                assert reaction.reason is not None
                refused[reaction.reason] += 1
                why = self.unusable(message.config_version)
                log.warning(
                    "keyplane: control record %s refused (%s): %s%s",
                    offset,
                    reaction.reason,
                    reaction.detail,
                    f" ({why})" if reaction.reason == "unknown_checksum" and why else "",
                )
            replies += reaction.replies
        events = self._events_end(start["events"], limit) if self.read_events else start["events"]
        migration_marks = self._marks(self.migration_topic)
        check_not_ahead(self.migration_topic, start["migration"], migration_marks)
        migration = {**start["migration"], **migration_marks}
        work = (
            total_rows(start["events"], events) > 0
            or connector_behind
            or control.end != int(start["control"])
            or migration != start["migration"]
            or bool(protocol.migrating())
            or bool(replies)
        )
        if not work:
            return start
        routing = protocol.begin_batch(plan)
        for handoff in protocol.migrating():
            # This batch installs the state its switch batch moved. Its plan,
            # installs included, is in Spark's offset log before any row runs,
            # and every later batch runs after it: from here on the operator
            # has migrated, even if the driver dies and replays this batch.
            if handoff.switch_batch is not None and handoff.switch_batch == plan - 1:
                replies += protocol.state_installed(handoff.operator, plan)
        switches = [
            Switch(h.operator, h.from_version, h.to_version)
            for h in protocol.migrating()
            if h.switch_batch == plan
        ]
        effective = dict(routing)
        for switch in switches:
            effective[switch.operator] = switch.from_version
        if not self.read_events:
            # The connector's tasks route in the JVM, on files of the batch's tables.
            for version in sorted(set(effective.values())):
                export_tables(tables_for(self.store, self.parallelism), version, self.stages)
        if replies:
            self.channel().send(replies)
        prepared = protocol.pending_version
        if prepared is not None:
            self._plan_handoffs(protocol.active_version, prepared)
        return {
            "plan": plan,
            "events": events,
            "control": control.end,
            "migration": migration,
            "protocol": protocol.to_dict(),
            "routing": effective,
            "switch": [vars(s) for s in switches],
            # The batch's events: its rows are fewer in pairs mode (read_events),
            # so progress_of counts the batch by this.
            "read": total_rows(start["events"], events),
            # Control messages refused at this boundary, by reason: the
            # batch's metrics record reports them (keyplane.algorithms.batchmetrics).
            "rejected": dict(sorted(refused.items())),
            # The acknowledged version the tasks load ahead of its switch.
            "prepared": prepared,
        }

    def _skipped_batch(self) -> tuple[int, bool]:
        """With ``events=skip``: the id of the batch Spark will run next, and whether the
        connector has events still to read.

        Spark runs a batch when any source has new data. So that every batch the
        connector's events start has a plan of its own, stamped with Spark's batch id
        like those of a job that reads through this source, the source plans one
        whenever the events topic holds more than the connector had read by the last
        batch of the offset log, the batch before this one (Spark asks its sources for
        their offsets before it logs the next batch, and replays a logged one without
        asking).
        """
        assert self.checkpoint is not None
        last = newest_logged_batch(self.checkpoint)
        marks = self._marks(self.events_topic)
        read = None
        if last is not None:
            read = events_read(offset_log_entry(self.checkpoint, last), self.events_topic)
        if not read:
            read = self._earliest(self.events_topic)
        behind = any(int(end) > int(read.get(part, 0)) for part, end in marks.items())
        return (-1 if last is None else last) + 1, behind

    def _plan_handoffs(self, active: int, prepared: int) -> None:
        """Plan the hand-offs to ``prepared`` while the controller is still to PROPAGATE.

        The switch batch then finds its moves computed (000 §3.4, PREPARE).
        The version's tables are built and its moves planned on a thread of
        their own, which overlaps the batch that acknowledges: done in
        ``latestOffset``, planning many moves would hold that batch's start back.
        :meth:`partitions` waits for them before it reads them.
        """
        if self._planning is not None and self._planning[0] == (active, prepared):
            return
        tables = tables_for(self.store, self.parallelism)

        def plan() -> None:
            if not self.read_events:
                # First, so that the connector's tasks load it ahead of the switch.
                export_tables(tables, prepared, self.stages)
            for operator in self.stages:
                tables.moves(operator, active, prepared)

        if self._planner is None:
            self._planner = ThreadPoolExecutor(1, thread_name_prefix="keyplane-handoffs")
        self._planning = ((active, prepared), self._planner.submit(plan))

    def _handoffs_planned(self) -> None:
        """Wait for the hand-offs being planned, if any; raise what planning raised."""
        if self._planning is not None:
            self._planning[1].result()

    def _events_end(self, start: PartitionOffsets, limit: ReadLimit) -> PartitionOffsets:
        marks = {self.events_topic: self._marks(self.events_topic)}
        check_not_ahead(
            self.events_topic, start.get(self.events_topic, {}), marks[self.events_topic]
        )
        self._latest = marks
        known = all(p in start.get(t, {}) for t, parts in marks.items() for p in parts)
        earliest = {} if known else {self.events_topic: self._earliest(self.events_topic)}
        base = {t: {**earliest.get(t, {}), **start.get(t, {})} for t in marks}
        if isinstance(limit, ReadMaxRows):
            return cap_offsets(base, marks, limit.max_rows)
        return marks

    def reportLatestOffset(self) -> dict[str, Any]:
        # Spark asks right after latestOffset, for the progress report's lag:
        # the marks that call read are that recent.
        if not self.read_events:
            return {"events": {}}
        latest = self._latest or {self.events_topic: self._marks(self.events_topic)}
        return {"events": latest}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        """The batch's tasks: one per events partition with new events.

        A rollout's evict and install rows ride along with those tasks, each
        reading a share (:func:`spread_handoffs`), rather than in tasks of
        their own: a task of its own for 10,000 moves ran after every events
        task, alone, and lengthened the switch and install batches by its
        whole duration. With no new events, the shares are the tasks.
        """
        events = self._event_partitions(start, end) if self.read_events else []
        shares = max(1, len(events))
        handoffs: list[HandOff] = []
        tables = tables_for(self.store, self.parallelism)
        if end["switch"]:
            self._handoffs_planned()
        for raw in end["switch"]:
            switch = Switch(**raw)
            moves = tables.moves(switch.operator, switch.from_version, switch.to_version)
            handoffs += [
                EvictPartition.of(
                    switch.operator,
                    moves[share::shares],
                    self.parallelism,
                    end["plan"],
                    self.forward,
                    self.handoff,
                )
                for share in range(shares)
            ]
        for part, stop in sorted(end["migration"].items(), key=_by_partition):
            begin = int(start["migration"].get(part, 0))
            if stop > begin:
                kafka = OffsetRange(
                    self.bootstrap_servers, self.migration_topic, int(part), begin, int(stop)
                )
                handoffs += [
                    MigrationPartition(piece, self.parallelism, self.forward, self.handoff)
                    for piece in split_range(kafka, shares)
                ]
        if not events:
            return list(handoffs)
        if self.handoff == "per-instance":
            events[0] = dataclasses.replace(events[0], batch_end=True)
        tasks = spread_handoffs(events, handoffs)
        sizes = [p.events.end - p.events.start for p in events]
        return grouped_into_tasks(tasks, sizes, self.max_partitions)

    def _event_ranges(self, start: dict[str, Any], end: dict[str, Any]) -> list[OffsetRange]:
        """The batch's new events, one range per events partition that has some."""
        ranges = []
        for part, stop in sorted(end["events"][self.events_topic].items(), key=_by_partition):
            begin = int(start["events"].get(self.events_topic, {}).get(part, 0))
            if stop > begin:
                ranges.append(
                    OffsetRange(
                        self.bootstrap_servers, self.events_topic, int(part), begin, int(stop)
                    )
                )
        return ranges

    def _event_partitions(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> list[RoutedEventsPartition]:
        routing = EventRouting.planned(
            end,
            self.store,
            self.parallelism,
            max_event_bytes=self.max_event_bytes,
            forward=self.forward,
            quarantine=self.quarantine,
        )
        return [RoutedEventsPartition(kafka, routing) for kafka in self._event_ranges(start, end)]

    def commit(self, end: dict[str, Any]) -> None:
        """Offsets live in Spark's checkpoint; nothing to commit to Kafka."""

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._watermarks is not None:
            self._watermarks.close()
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)

    # -- executor side -------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, ReadTask):
            # partitions() groups only events partitions into tasks (grouped_into_tasks).
            events = [p for p in partition.parts if isinstance(p, RoutedEventsPartition)]
            if len(events) != len(partition.parts):
                raise TypeError(f"a routed-source task groups events partitions: {partition!r}")
            yield from self._read_event_task(events)
        elif isinstance(partition, RoutedEventsPartition):
            yield from self._read_event_task([partition])
        elif isinstance(partition, EvictPartition):
            yield from read_evictions(partition)
        elif isinstance(partition, MigrationPartition):
            yield from read_installs(partition)
        else:
            raise TypeError(f"not a routed-source partition: {partition!r}")

    def _read_event_task(self, parts: list[RoutedEventsPartition]) -> Iterator[pa.RecordBatch]:
        """A task's event partitions: the batch's end rows if the task carries them, the
        events of all its partitions combined (:func:`read_events`), then the hand-offs
        each partition brought along (:func:`spread_handoffs`)."""
        for part in parts:
            if part.batch_end:
                yield batch_end_rows(part.routing.forward, part.routing.parallelism)
        yield from read_events(*parts)
        for part in parts:
            for handoff in part.handoffs:
                yield from self.read(handoff)


def _by_partition(item: tuple[str, int]) -> int:
    return int(item[0])


def spread_handoffs(
    events: list[RoutedEventsPartition], handoffs: list[HandOff]
) -> list[InputPartition]:
    """``events`` with ``handoffs`` dealt round robin over them, the i-th to task i mod n."""
    dealt: list[list[HandOff]] = [[] for _ in events]
    for i, handoff in enumerate(handoffs):
        dealt[i % len(events)].append(handoff)
    return [
        dataclasses.replace(part, handoffs=tuple(mine))
        for part, mine in zip(events, dealt, strict=True)
    ]


class RoutedEventsSource(DataSource):
    """``spark.readStream.format("keyplane-routed-events")``."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return routed_input_schema(_forward({k.lower(): v for k, v in self.options.items()}))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RoutedEventsReader(dict(self.options))


def source_options(
    bootstrap_servers: str,
    *,
    events_topic: str,
    control_topic: str,
    migration_topic: str,
    store: Path,
    state_partitions: int,
    initial_version: int,
    max_offsets_per_trigger: int | None = None,
    max_event_bytes: int | None = None,
    max_partitions: int | None = None,
) -> dict[str, str]:
    """The options of a source that runs the protocol's driver side: this one, and the
    pipeline source (:mod:`keyplane.spark.chain_source`), which reads them alike.

    ``max_event_bytes`` (default :data:`~keyplane.reference.events.MAX_EVENT_BYTES`)
    bounds an event's record; larger ones are dead-lettered as ``oversized``.
    ``max_partitions`` bounds the tasks that read a batch
    (:class:`~keyplane.spark.kafka_source.ReadTask`; default: one per events partition).
    """
    options = {
        "kafka.bootstrap.servers": bootstrap_servers,
        "subscribe": events_topic,
        "control.topic": control_topic,
        "migration.topic": migration_topic,
        "routing.store": str(store.resolve()),
        "state.partitions": str(state_partitions),
        "initial.version": str(initial_version),
    }
    optional = {
        "maxOffsetsPerTrigger": max_offsets_per_trigger,
        "max.event.bytes": max_event_bytes,
        "maxPartitions": max_partitions,
    }
    options.update({name: str(value) for name, value in optional.items() if value is not None})
    return options


def read_routed_events(
    spark: SparkSession,
    options: dict[str, str],
    *,
    forward: Forward = "pairs",
    handoff: HandoffMode = "per-key",
    quarantine: str | None = None,
    events: EventsMode = "read",
    checkpoint: Path | None = None,
) -> DataFrame:
    """A streaming DataFrame of :func:`routed_input_schema` rows for the routed job.

    ``options`` are :func:`source_options`. ``forward`` is what stage A will send
    stage B, and ``handoff`` how its stages take a rollout's moves (module docstring).
    ``quarantine`` is the quarantined pairs
    (:meth:`keyplane.control.quarantine.Quarantine.option`), whose events are dead-lettered.
    ``events="skip"`` leaves the events topic to Spark's connector in the same query
    (:mod:`keyplane.spark.connector_events`), whose ``checkpoint`` the source then reads.
    """
    spark.dataSource.register(RoutedEventsSource)
    reader = (
        spark.readStream.format(SOURCE_NAME)
        .options(**options)
        .option("forward", forward)
        .option("handoff", handoff)
        .option("events", events)
    )
    if checkpoint is not None:
        reader = reader.option("checkpoint", str(checkpoint))
    if quarantine:
        reader = reader.option("quarantine", quarantine)
    return reader.load()
