"""The job's side of the reconfiguration protocol (paper 000 §3.4), as a pure state machine.

The job's driver feeds it every control message at a batch boundary and asks
it how to route the next batch (:meth:`JobProtocol.begin_batch`). What it
records goes into the batch's offset, so a replayed batch routes as it did
the first time. The exchange and its guarantees are described in
:mod:`keyplane.control.messages`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Self
from uuid import UUID, uuid5

from pydantic import BaseModel, ConfigDict, Field, model_validator

from keyplane.control.messages import (
    CHECKPOINT_FORMAT,
    MAX_REASON_CHARS,
    PROPAGATED,
    ChecksumLookup,
    Clock,
    ControlMessage,
    IgnoreReason,
    OperatorPhase,
    ProtocolError,
    Reaction,
    UnplannedBatchError,
    UnusableReason,
    applied_reaction,
    check_operators,
    duplicate_reaction,
    ignored_reaction,
    restored,
    utc_now,
)


class Handoff(BaseModel):
    """An operator whose state is moving between two versions' locations.

    The first batch routed on ``to_version`` is ``switch_batch`` (None until
    the driver plans it): in it the old groups emit the state of the keys
    that move, and a later batch installs it at the new locations.
    """

    model_config = ConfigDict(frozen=True)

    operator: str
    from_version: int
    to_version: int
    switch_batch: int | None


class OperatorState(BaseModel):
    """Where one operator stands in the reconfiguration.

    ``prepared``: acknowledged, still routing on the active version.
    ``switching``: propagated; routes on the pending version and awaits its
    state. ``migrated``: state installed, MIGRATED sent. ``reverting``: an
    aborted version had moved it, and its state is on its way back.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    phase: OperatorPhase = "steady"
    reverting_from: int | None = Field(default=None, ge=1)
    switch_batch: int | None = Field(default=None, ge=0)
    propagated_by: UUID | None = None
    migrated: ControlMessage | None = None


class PendingVersion(BaseModel):
    """The version being rolled out, its base, and the ACK the job sent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=1)
    checksum: str = Field(min_length=1)
    base: int = Field(ge=1)
    ack: ControlMessage


STEADY = OperatorState()


class JobState(BaseModel):
    """Everything the job's protocol knows: what the driver checkpoints.

    ``latest_version`` is the newest version prepared, finished or aborted;
    no version at or below it is prepared again. ``routes`` keeps, per
    operator, the batches at which its routing version changed, so the
    routing of a planned batch is known with one entry per change rather
    than one per batch; only the changes that the latest
    :data:`REPLAYABLE_BATCHES` planned batches route by are kept, so that
    the checkpoint does not grow with every rollout. A checkpoint written
    with a longer history is read as it is, and trimmed when it plans its
    next batch. ``planned_through`` is the last planned batch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = CHECKPOINT_FORMAT
    operators: tuple[str, ...]
    active_version: int = Field(ge=1)
    active_checksum: str = Field(min_length=1)
    latest_version: int = Field(ge=1)
    pending: PendingVersion | None = None
    phases: dict[str, OperatorState]
    held: tuple[ControlMessage, ...] = ()
    routes: dict[str, tuple[tuple[int, int], ...]]
    planned_through: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check_consistency(self) -> Self:
        check_operators(self.operators)
        if set(self.phases) != set(self.operators) or set(self.routes) != set(self.operators):
            raise ValueError("phases and routes must list exactly the operators")
        if self.latest_version < self.active_version:
            raise ValueError("latest_version cannot be older than active_version")
        pending = self.pending
        if pending is not None and not (
            pending.base == self.active_version < pending.version <= self.latest_version
        ):
            raise ValueError(
                f"pending version {pending.version} (base {pending.base}) does not follow "
                f"active version {self.active_version}"
            )
        allowed = (
            {"steady", "reverting"} if pending is None else {"prepared", "switching", "migrated"}
        )
        for index, name in enumerate(self.operators):
            state = self.phases[name]
            if state.phase not in allowed:
                rollout = "no version" if pending is None else f"v{pending.version}"
                raise ValueError(f"{name} is {state.phase} while {rollout} is pending")
            if state.phase == "reverting" and state.reverting_from is None:
                raise ValueError(f"{name} is reverting but names no version it reverts from")
            if state.phase in PROPAGATED and state.propagated_by is None:
                raise ValueError(f"{name} is {state.phase} but was never propagated")
            if (state.phase == "migrated") != (state.migrated is not None):
                raise ValueError(f"{name}: a MIGRATED reply exists exactly when migrated")
            upstream = {u: self.phases[u].phase for u in self.operators[:index]}
            if state.phase in PROPAGATED:
                behind = [u for u, p in upstream.items() if p not in PROPAGATED]
                if behind:
                    raise ValueError(f"{name} moved before its upstream {', '.join(behind)}")
            if state.phase == "migrated":
                behind = [u for u, p in upstream.items() if p != "migrated"]
                if behind:
                    raise ValueError(f"{name} migrated before its upstream {', '.join(behind)}")
        for name, changes in self.routes.items():
            batches = [batch for batch, _ in changes]
            if batches != sorted(set(batches)):
                raise ValueError(f"route changes of {name} are not in increasing batch order")
            if changes and (self.planned_through is None or batches[-1] > self.planned_through):
                raise ValueError(f"route changes of {name} go past the last planned batch")
        return self


REPLAYABLE_BATCHES = 2
"""How many of the latest planned batches a checkpoint can still route again.

A driver plans a batch and checkpoints this state with the batch's offsets
before any row of it runs, so the batch a restarted driver may plan again
is the last one its checkpoint planned (``planned_through``): Spark replays
at most its last uncommitted batch, with the offsets it logged. Keeping the
batch before it as well costs at most one route change per operator, and
keeps known the routing of the switch batch whose moved state the latest
batch may install (:class:`Handoff`). Older batches have run and been
committed; their route changes would only grow the checkpoint, which Spark
writes into every offset-log entry and the driver parses at every batch
boundary (000 §3.4)."""


def _replayable(
    changes: tuple[tuple[int, int], ...], planned_through: int
) -> tuple[tuple[int, int], ...]:
    """``changes`` without those no replayable batch routes by.

    The change in effect at the oldest replayable batch is kept, with every
    later one, so :meth:`JobProtocol.version_for_batch` answers each of the
    :data:`REPLAYABLE_BATCHES` latest planned batches exactly as before.
    """
    oldest = planned_through - REPLAYABLE_BATCHES + 1
    in_effect = bisect.bisect_right([batch for batch, _ in changes], oldest) - 1
    return changes[in_effect:] if in_effect > 0 else changes


class JobProtocol:
    """The job's side of 000 §3.4, run by the driver at micro-batch boundaries.

    At each boundary the driver passes every new control message to
    :meth:`on_message` and publishes the replies, then calls
    :meth:`begin_batch` to fix the routing of the batch it is about to run,
    and checkpoints :meth:`to_dict` together with the batch's offsets, before
    any row of the batch is routed. When an operator's moved state has been
    installed, it calls :meth:`state_installed` and publishes the reply.

    After a restart the driver restores the checkpoint with :meth:`from_dict`
    and reads the control topic again from the checkpointed offset: messages
    it had already handled are duplicates and change nothing, and
    :meth:`begin_batch` for the batch the checkpoint was written with (or the
    one before it, :data:`REPLAYABLE_BATCHES`) returns the routing that batch
    used the first time.

    ``lookup_checksum`` asks the configuration store which checksum it holds
    for a version, so the job only prepares a configuration it can load;
    ``explain``, if given, says why a version it found none for is unusable.
    A PREPARE the job will not act on (a version it cannot load, a base it
    does not run, a version it has already seen) is answered with REFUSED and
    the reason, so that the controller need not wait for an ACK that will
    never come.
    ``clock`` stamps replies. Neither is part of the checkpoint. Reply ids are
    derived from the request's id, so a reply produced again after a restart
    has the id it had the first time, and the controller can deduplicate it.
    """

    def __init__(
        self,
        operators: Sequence[str],
        active_version: int,
        active_checksum: str,
        *,
        lookup_checksum: ChecksumLookup,
        clock: Clock = utc_now,
        explain: UnusableReason | None = None,
    ) -> None:
        names = check_operators(operators)
        state = JobState(
            operators=names,
            active_version=active_version,
            active_checksum=active_checksum,
            latest_version=active_version,
            phases=dict.fromkeys(names, STEADY),
            routes={name: () for name in names},
        )
        self._init(state, lookup_checksum, clock, explain)

    def _init(
        self,
        state: JobState,
        lookup_checksum: ChecksumLookup,
        clock: Clock,
        explain: UnusableReason | None = None,
    ) -> None:
        self._state = state
        self._lookup = lookup_checksum
        self._explain = explain
        self._clock = clock
        self.ignored_reaction: Counter[IgnoreReason] = Counter()

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        lookup_checksum: ChecksumLookup,
        clock: Clock = utc_now,
        explain: UnusableReason | None = None,
    ) -> JobProtocol:
        """Restore a checkpoint written by :meth:`to_dict`.

        Raises ``ValueError`` naming what is wrong if ``data`` is not a
        consistent job checkpoint.
        """
        state = restored(JobState, data, "job protocol checkpoint")
        protocol = cls.__new__(cls)
        protocol._init(state, lookup_checksum, clock, explain)
        return protocol

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint: plain JSON-compatible data. Ignore counters are not in it."""
        return self._state.model_dump(mode="json")

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def operators(self) -> tuple[str, ...]:
        return self._state.operators

    @property
    def active_version(self) -> int:
        return self._state.active_version

    @property
    def pending_version(self) -> int | None:
        pending = self._state.pending
        return None if pending is None else pending.version

    @property
    def held(self) -> tuple[ControlMessage, ...]:
        """Messages that arrived early and wait for the state they need."""
        return self._state.held

    @property
    def ignored(self) -> Counter[IgnoreReason]:
        """How many messages were ignored for each reason since this object was built.

        Diagnostics only, so not checkpointed: a duplicate must leave the
        checkpoint exactly as it was.
        """
        return Counter(self.ignored_reaction)

    def phase(self, operator: str) -> OperatorPhase:
        """Where ``operator`` stands: see :class:`OperatorState`."""
        return self._operator(operator).phase

    def next_routing(self) -> dict[str, int]:
        """The version that will route each operator in the next planned batch."""
        return {name: self._routes_on(name) for name in self._state.operators}

    def migrating(self) -> tuple[Handoff, ...]:
        """Operators whose state is moving, upstream first.

        During a rollout the state moves from the active version's locations
        to the pending one's; after an ABORT it moves back. The driver moves
        it in both cases the same way and then calls :meth:`state_installed`.
        """
        handoffs = []
        for name in self._state.operators:
            state = self._state.phases[name]
            if state.phase == "switching":
                assert self._state.pending is not None
                source, target = self._state.active_version, self._state.pending.version
            elif state.phase == "reverting":
                assert state.reverting_from is not None
                source, target = state.reverting_from, self._state.active_version
            else:
                continue
            handoffs.append(
                Handoff(
                    operator=name,
                    from_version=source,
                    to_version=target,
                    switch_batch=state.switch_batch,
                )
            )
        return tuple(handoffs)

    def version_for_batch(self, batch_id: int, operator: str) -> int:
        """The version that routed ``operator`` in planned batch ``batch_id``.

        Raises :class:`UnplannedBatchError` for a batch not planned, or planned
        too long ago to be replayed (see :data:`REPLAYABLE_BATCHES`).
        """
        self._operator(operator)
        state = self._state
        changes = state.routes[operator]
        if state.planned_through is None or not changes:
            raise UnplannedBatchError(f"no batch has been planned yet (asked for {batch_id})")
        if not changes[0][0] <= batch_id <= state.planned_through:
            raise UnplannedBatchError(
                f"batch {batch_id} was not planned by this protocol, or too long ago to be "
                f"replayed: it routes planned batches {changes[0][0]}..{state.planned_through}"
            )
        position = bisect.bisect_right([batch for batch, _ in changes], batch_id) - 1
        return changes[position][1]

    def routing_for_batch(self, batch_id: int) -> dict[str, int]:
        """The version that routed every operator in planned batch ``batch_id``."""
        return {name: self.version_for_batch(batch_id, name) for name in self._state.operators}

    def begin_batch(self, batch_id: int) -> dict[str, int]:
        """Fix, record and return the routing of micro-batch ``batch_id``.

        A batch planned before (a replay after a restart) gets the routing it
        had, if it is one Spark may still replay (:data:`REPLAYABLE_BATCHES`).
        Batches are planned in order: skipping one would leave a batch whose
        routing nobody recorded. Route changes older than any replayable batch
        are dropped here.
        """
        state = self._state
        last = state.planned_through
        if batch_id < 0:
            raise ValueError(f"batch ids are non-negative, got {batch_id}")
        if last is not None and batch_id <= last:
            return self.routing_for_batch(batch_id)
        if last is not None and batch_id != last + 1:
            raise ProtocolError(
                f"batch {batch_id} follows batch {last}: batches {last + 1}..{batch_id - 1} "
                "were never planned; restore the checkpoint written with the previous batch"
            )
        routing = self.next_routing()
        phases = {
            name: op.model_copy(update={"switch_batch": batch_id})
            if op.phase in ("switching", "reverting") and op.switch_batch is None
            else op
            for name, op in state.phases.items()
        }
        routes = {
            name: _replayable(
                changes
                if changes and changes[-1][1] == routing[name]
                else (*changes, (batch_id, routing[name])),
                batch_id,
            )
            for name, changes in state.routes.items()
        }
        self._state = state.model_copy(
            update={"phases": phases, "routes": routes, "planned_through": batch_id}
        )
        return routing

    def on_message(self, message: ControlMessage, batch_id: int) -> list[ControlMessage]:
        """Handle ``message`` at the boundary before batch ``batch_id``; return the replies."""
        return list(self.react(message, batch_id).replies)

    def react(self, message: ControlMessage, batch_id: int) -> Reaction:
        """Like :meth:`on_message`, also saying what happened and why, for the driver's log."""
        if batch_id < 0:
            raise ValueError(f"batch ids are non-negative, got {batch_id}")
        reaction = self._handle(message, batch_id)
        if reaction.outcome == "applied":
            released = self._release_held(batch_id)
            reaction = reaction.model_copy(update={"replies": reaction.replies + released})
        return reaction

    def state_installed(self, operator: str, batch_id: int) -> list[ControlMessage]:
        """Record that ``operator``'s moved state was installed in batch ``batch_id``.

        For a rollout this completes the operator and returns its MIGRATED
        reply (the same reply again if called again). For a revert after an
        ABORT the operator is back on the active version and nothing is
        replied. A call after the reconfiguration finished changes nothing.
        """
        current = self._operator(operator)
        state = self._state
        if current.phase == "migrated":
            assert current.migrated is not None
            return [current.migrated]
        if current.phase == "steady":
            return []
        if current.phase == "prepared":
            raise ProtocolError(
                f"{operator} has not been propagated, so it has no state to install"
            )
        if current.switch_batch is None:
            raise ProtocolError(
                f"{operator} has not yet routed a batch on its new version; "
                "plan a batch with begin_batch first"
            )
        assert state.planned_through is not None
        if not current.switch_batch <= batch_id <= state.planned_through:
            raise ProtocolError(
                f"{operator} switched in batch {current.switch_batch}, so its state is "
                f"installed in a planned batch {current.switch_batch}..{state.planned_through}, "
                f"not in batch {batch_id}"
            )
        replies: tuple[ControlMessage, ...] = ()
        if current.phase == "switching":
            pending = state.pending
            assert pending is not None and current.propagated_by is not None
            reply = ControlMessage(
                type="MIGRATED",
                config_version=pending.version,
                previous_version=pending.base,
                operator=operator,
                checksum=pending.checksum,
                sender="job",
                message_id=uuid5(current.propagated_by, "MIGRATED"),
                sent_at=self._clock(),
                batch_id=batch_id,
            )
            updated = current.model_copy(update={"phase": "migrated", "migrated": reply})
            replies = (reply,)
        else:
            updated = STEADY
        self._state = state.model_copy(update={"phases": {**state.phases, operator: updated}})
        return list(replies + self._release_held(batch_id))

    def _operator(self, operator: str) -> OperatorState:
        try:
            return self._state.phases[operator]
        except KeyError:
            known = ", ".join(self._state.operators)
            raise KeyError(f"unknown operator {operator!r}; operators are {known}") from None

    def _routes_on(self, operator: str) -> int:
        state = self._state
        if state.phases[operator].phase in PROPAGATED:
            assert state.pending is not None
            return state.pending.version
        return state.active_version

    def _reverting(self) -> list[str]:
        return [n for n, op in self._state.phases.items() if op.phase == "reverting"]

    def _waits(self, message: ControlMessage) -> bool:
        """Whether ``message`` is for a future version and must wait for the state it needs.

        A PROPAGATE waits for its PREPARE. A PREPARE from the active version
        waits while another reconfiguration (or the revert of an aborted one)
        is in flight; a PREPARE from a newer base waits while that base may
        still become active: it is being rolled out or not yet seen.

        A DONE of the pending version waits while the operators not yet
        migrated are all in transit (switched, their install due in the next
        planned batch). The controller sends DONE only after every MIGRATED,
        so the job has replied them before: a driver that published MIGRATED
        and died before Spark wrote that plan to its offset log plans the
        install batch again, and reads DONE at the same boundary, before the
        install (000 §3.4, recovery).

        Other messages are ignored either because they can never apply, or
        because only the controller could make them apply (a PROPAGATE
        before its upstream's, a DONE before every operator migrated),
        and a correct controller never sends those. So delivering a sequence
        of messages twice has the same effect as delivering it once.
        """
        state = self._state
        if message.type == "DONE":
            needed = self._in_transit_needed(message)
            if needed is not None:
                return needed
        if message.config_version <= state.latest_version:
            return False
        if message.type == "PROPAGATE":
            return True
        if message.type != "PREPARE" or message.previous_version is None:
            return False
        pending = state.pending
        base = message.previous_version
        if base == state.active_version:
            return pending is not None or bool(self._reverting())
        if pending is not None and base == pending.version:
            return True
        return base > state.latest_version

    def _in_transit_needed(self, message: ControlMessage) -> bool | None:
        """For a DONE of the pending version: whether the operators that have not
        migrated yet are all switching, their switch batch planned (so their
        install is the next planned batch).

        None when the message is not for the pending version, so the other
        rules decide.
        """
        state = self._state
        pending = state.pending
        if pending is None or message.config_version != pending.version:
            return None
        behind = [op for op in state.phases.values() if op.phase != "migrated"]
        return bool(behind) and all(
            op.phase == "switching" and op.switch_batch is not None for op in behind
        )

    def _hold(self, message: ControlMessage) -> Reaction:
        def same(other: ControlMessage) -> bool:
            fields = ("type", "config_version", "previous_version", "operator", "checksum")
            return all(getattr(other, name) == getattr(message, name) for name in fields)

        if any(same(other) for other in self._state.held):
            return Reaction(outcome="held", detail=f"{message.describe()} is already held")
        self._state = self._state.model_copy(update={"held": (*self._state.held, message)})
        return Reaction(outcome="held", detail=f"{message.describe()} waits for its turn")

    def _release_held(self, batch_id: int) -> tuple[ControlMessage, ...]:
        """Act on held messages that no longer have to wait, in arrival order."""
        replies: tuple[ControlMessage, ...] = ()
        progressed = True
        while progressed:
            progressed = False
            for index, message in enumerate(self._state.held):
                if self._waits(message):
                    continue
                held = self._state.held
                self._state = self._state.model_copy(
                    update={"held": held[:index] + held[index + 1 :]}
                )
                replies += self._handle(message, batch_id).replies
                progressed = True
                break
        return replies

    def _handle(self, message: ControlMessage, batch_id: int) -> Reaction:
        if message.sender != "controller":
            reaction = ignored_reaction("own_message", f"{message.describe()} is a job reply")
        elif message.type == "PREPARE":
            reaction = self._on_prepare(message, batch_id)
        elif message.type == "PROPAGATE":
            reaction = self._on_propagate(message)
        elif message.type == "DONE":
            reaction = self._on_done(message)
        else:
            reaction = self._on_abort(message)
        if reaction.reason is not None:
            self.ignored_reaction[reaction.reason] += 1
        return reaction

    def _pending_mismatch(self, message: ControlMessage) -> Reaction | None:
        pending = self._state.pending
        assert pending is not None
        if message.checksum != pending.checksum:
            return ignored_reaction(
                "checksum_mismatch",
                f"{message.describe()} has checksum {message.checksum}, "
                f"but the pending version has {pending.checksum}",
            )
        if message.previous_version not in (None, pending.base):
            return ignored_reaction(
                "wrong_base",
                f"{message.describe()} starts from v{message.previous_version}, "
                f"the pending version from v{pending.base}",
            )
        return None

    def _stale(self, message: ControlMessage) -> Reaction:
        return ignored_reaction(
            "stale_version",
            f"{message.describe()} is stale: this job has already seen "
            f"v{self._state.latest_version} and runs v{self._state.active_version}",
        )

    def _on_prepare(self, message: ControlMessage, batch_id: int) -> Reaction:
        state = self._state
        version = message.config_version
        pending = state.pending
        if pending is not None and version == pending.version:
            mismatch = self._pending_mismatch(message)
            if mismatch is not None:
                return mismatch
            return duplicate_reaction(
                f"{message.describe()} was already acknowledged", (pending.ack,)
            )
        if version <= state.latest_version:
            if version == state.active_version and message.checksum == state.active_checksum:
                # A retried step of the rollout that made it active: nothing to refuse.
                return self._stale(message)
            return self._refused(self._stale(message), message, batch_id)
        stored = self._lookup(version)
        if stored != message.checksum:
            why = None if stored is not None or self._explain is None else self._explain(version)
            held = (
                f"holds no such version it can use{f' ({why})' if why else ''}"
                if stored is None
                else f"holds checksum {stored}"
            )
            ignored = ignored_reaction(
                "unknown_checksum",
                f"{message.describe()} has checksum {message.checksum}; the job's store {held}",
            )
            return self._refused(ignored, message, batch_id)
        if self._waits(message):
            return self._hold(message)
        if message.previous_version != state.active_version:
            ignored = ignored_reaction(
                "wrong_base",
                f"{message.describe()} starts from v{message.previous_version}, "
                f"but the job runs v{state.active_version}",
            )
            return self._refused(ignored, message, batch_id)
        ack = ControlMessage(
            type="ACK",
            config_version=version,
            previous_version=state.active_version,
            checksum=message.checksum,
            sender="job",
            message_id=uuid5(message.message_id, "ACK"),
            sent_at=self._clock(),
            batch_id=batch_id,
        )
        self._state = state.model_copy(
            update={
                "pending": PendingVersion(
                    version=version, checksum=message.checksum, base=state.active_version, ack=ack
                ),
                "latest_version": version,
                "phases": dict.fromkeys(state.operators, OperatorState(phase="prepared")),
            }
        )
        return applied_reaction(f"prepared v{version}", (ack,))

    def _refused(self, ignored: Reaction, message: ControlMessage, batch_id: int) -> Reaction:
        """``ignored`` with a REFUSED reply that tells the controller why, in one line."""
        reason = " ".join(f"{ignored.reason}: {ignored.detail}".split())
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        refusal = ControlMessage(
            type="REFUSED",
            config_version=message.config_version,
            previous_version=message.previous_version,
            checksum=message.checksum,
            sender="job",
            message_id=uuid5(message.message_id, "REFUSED"),
            sent_at=self._clock(),
            batch_id=batch_id,
            reason=reason,
        )
        return ignored.model_copy(update={"replies": (refusal,)})

    def _on_propagate(self, message: ControlMessage) -> Reaction:
        state = self._state
        name = message.operator
        assert name is not None
        if name not in state.phases:
            return ignored_reaction(
                "unknown_operator",
                f"{message.describe()}: this job's operators are {', '.join(state.operators)}",
            )
        pending = state.pending
        if pending is None or message.config_version != pending.version:
            if self._waits(message):
                return self._hold(message)
            return self._stale(message)
        mismatch = self._pending_mismatch(message)
        if mismatch is not None:
            return mismatch
        current = state.phases[name]
        if current.phase == "switching":
            return duplicate_reaction(f"{name} is already switching to v{pending.version}")
        if current.phase == "migrated":
            assert current.migrated is not None
            return duplicate_reaction(
                f"{name} already migrated to v{pending.version}", (current.migrated,)
            )
        position = state.operators.index(name)
        behind = [u for u in state.operators[:position] if state.phases[u].phase not in PROPAGATED]
        if behind:
            return ignored_reaction(
                "upstream_not_propagated",
                f"{message.describe()} arrived before upstream {', '.join(behind)} was "
                "propagated (operators switch upstream first)",
            )
        updated = current.model_copy(
            update={"phase": "switching", "propagated_by": message.message_id}
        )
        self._state = state.model_copy(update={"phases": {**state.phases, name: updated}})
        return applied_reaction(f"{name} routes on v{pending.version} from the next batch")

    def _on_done(self, message: ControlMessage) -> Reaction:
        state = self._state
        version = message.config_version
        pending = state.pending
        if pending is not None and version == pending.version:
            mismatch = self._pending_mismatch(message)
            if mismatch is not None:
                return mismatch
            behind = [n for n in state.operators if state.phases[n].phase != "migrated"]
            if behind and self._waits(message):
                return self._hold(message)
            if behind:
                return ignored_reaction(
                    "not_migrated", f"{message.describe()} before {', '.join(behind)} migrated"
                )
            self._state = state.model_copy(
                update={
                    "active_version": version,
                    "active_checksum": pending.checksum,
                    "pending": None,
                    "phases": dict.fromkeys(state.operators, STEADY),
                }
            )
            return applied_reaction(f"v{version} is active")
        if version == state.active_version:
            if message.checksum != state.active_checksum:
                return ignored_reaction(
                    "checksum_mismatch",
                    f"{message.describe()} has checksum {message.checksum}, "
                    f"the active version {state.active_checksum}",
                )
            return duplicate_reaction(f"v{version} is already active")
        if version <= state.latest_version:
            return self._stale(message)
        return ignored_reaction(
            "not_prepared", f"{message.describe()} for a version never prepared"
        )

    def _on_abort(self, message: ControlMessage) -> Reaction:
        state = self._state
        version = message.config_version
        pending = state.pending
        if pending is not None and version == pending.version:
            mismatch = self._pending_mismatch(message)
            if mismatch is not None:
                return mismatch
            phases = {
                name: OperatorState(phase="reverting", reverting_from=version)
                if op.phase == "migrated"
                or (op.phase == "switching" and op.switch_batch is not None)
                else STEADY
                for name, op in state.phases.items()
            }
            self._state = state.model_copy(update={"pending": None, "phases": phases})
            return applied_reaction(f"v{version} aborted; back on v{state.active_version}")
        if version == state.active_version:
            return ignored_reaction(
                "already_done",
                f"{message.describe()}: v{version} is already active; "
                "roll back by publishing a new version",
            )
        if version <= state.latest_version:
            return self._stale(message)
        self._state = state.model_copy(update={"latest_version": version})
        return applied_reaction(
            f"v{version} aborted before it was prepared; it will not be prepared"
        )
