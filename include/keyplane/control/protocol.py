"""The online reconfiguration protocol as pure state machines (paper 000 §3.4).

Paper 000 §3.4 reconfigures a running job without stopping it. The manager
sends every instance the new configuration and waits for all the
acknowledgements; it then *propagates* the change operator by operator in DAG
order, upstream first, and each operator swaps its routing and hands over the
state of the keys that move. keyplane runs the same exchange over a Kafka
control topic:

    controller                          job (driver, at batch boundaries)
    PREPARE(v, checksum)        ─►      record v as pending
                                ◄─      ACK(v), or REFUSED(v, reason)
    PROPAGATE(v, A)             ─►      A switches to v in the next batch …
    PROPAGATE(v, B)             ─►      … and B with it (never before A)
                                ◄─      MIGRATED(v, A)   once A's state is installed
                                ◄─      MIGRATED(v, B)   once B's state is installed
    DONE(v)                     ─►      v becomes the active version
    ABORT(v)                    ─►      every operator back on the active version

This module holds the message model, its signed wire form, and the two state
machines: :class:`JobProtocol`, which the job's driver runs, and
:class:`ControllerProtocol`, which the Airflow tasks drive. Neither touches
Kafka, Spark or a clock of its own, so both can be tested exhaustively and
wired to any transport.

Kafka delivers at least once, and a driver or an Airflow task may be killed
and retried at any point, so every step is idempotent: a duplicate changes
nothing and earns the reply the original earned. Messages that arrive early
are held until they apply (a PROPAGATE before its PREPARE, a PREPARE while
another reconfiguration is in flight); messages that can never apply are
ignored with a reason. Versions only grow: a rollback publishes a new version
with the old contents. An ABORT puts every operator back on the active
version at once, handing back any state already handed over.

Micro-batches make two things simpler than in the paper. A batch is planned
atomically, and the job records which version routes each operator in the
batches Spark may replay, so a replayed batch routes as it did the first time
and counts stay exact across driver restarts. And a batch is a barrier: every
row of a batch is routed by that batch's plan and no row outlives it, so the
paper's guarantee (no tuple of a moved key still on its way to the old
instance) holds as soon as the operators switch in the same batch. keyplane
keeps the paper's order (no operator propagated before its upstream, nor
migrated before it) but lets the controller propagate every operator at
once: a rollout takes the ACK's batch, one switch batch and one install
batch, not two batches per operator.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Self, TypeVar, get_args
from uuid import UUID, uuid4, uuid5

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, model_validator

from keyplane.control.signing import canonical_json, sign, verify
from keyplane.reference.events import MAX_NESTING_DEPTH, nested_deeper_than
from keyplane.util.validation_errors import describe_error

MessageType = Literal["PREPARE", "ACK", "REFUSED", "PROPAGATE", "MIGRATED", "DONE", "ABORT"]
Sender = Literal["controller", "job"]
MESSAGE_TYPES: frozenset[str] = frozenset(get_args(MessageType))

SENT_BY: Mapping[MessageType, Sender] = {
    "PREPARE": "controller",
    "PROPAGATE": "controller",
    "DONE": "controller",
    "ABORT": "controller",
    "ACK": "job",
    "REFUSED": "job",
    "MIGRATED": "job",
}
"""Which side sends each type: the controller commands, the job replies."""

RejectReason = Literal[
    "not_json", "schema", "missing_signature", "bad_signature", "unknown_type", "undecodable"
]
"""Why a record is not an authentic control message. ``undecodable`` is the
transport's backstop (:class:`keyplane.kafka.control.ControlChannel`): :func:`decode`
raised something other than :class:`InvalidMessage`, which is a bug to report,
not a message to act on."""

IgnoreReason = Literal[
    "own_message",
    "stale_version",
    "unknown_checksum",
    "checksum_mismatch",
    "wrong_base",
    "unknown_operator",
    "upstream_not_propagated",
    "not_prepared",
    "not_migrated",
    "already_done",
    "not_propagated",
]
"""Why a well-formed, correctly signed message was not acted on."""

Outcome = Literal["applied", "duplicate", "held", "ignored", "refused"]
OperatorPhase = Literal["steady", "prepared", "switching", "migrated", "reverting"]
PROPAGATED: frozenset[OperatorPhase] = frozenset({"switching", "migrated"})
"""The phases of an operator that was propagated: it routes on the pending version."""
ControllerPhase = Literal["idle", "preparing", "prepared", "propagating", "migrated"]

Clock = Callable[[], datetime]
ChecksumLookup = Callable[[int], str | None]
UnusableReason = Callable[[int], str | None]
"""``explain(version)``: why the last lookup found ``version`` unusable (one line), or None."""
"""``lookup(version)``: the checksum the configuration store records for
``version``, or None when it holds no such version or none the job can use
(damaged, not a configuration, or over other instances)."""

CHECKPOINT_FORMAT: Literal[1] = 1
MAX_REASON_CHARS = 500
"""A refusal's reason is one line for a terminal; longer ones are cut."""


def utc_now() -> datetime:
    """The default clock: the current time in UTC."""
    return datetime.now(UTC)


class ProtocolError(RuntimeError):
    """A step was called out of order: a programming error, not a network event."""


class UnplannedBatchError(LookupError):
    """No routing was recorded for the requested micro-batch."""


class InvalidMessage(ValueError):
    """Raw bytes that are not a valid, authentic control message.

    ``reason`` says which check failed, so a consumer can count and alert on
    forged messages (``bad_signature``) apart from a version skew
    (``unknown_type``) or a broken producer (``not_json``, ``schema``).
    """

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"invalid control message ({reason}): {detail}")
        self.reason: RejectReason = reason
        self.detail = detail


class ControlMessage(BaseModel):
    """One protocol message (000 §3.4), as carried on the control topic.

    ``checksum`` is the manifest checksum of configuration ``config_version``,
    so the job acts only on the configuration that was published.
    ``previous_version`` is the version the change starts from: a migration
    plan is a difference between two versions and is wrong on any other base.
    ``batch_id`` is the micro-batch at which the job acted; only the job's
    replies carry one. ``reason``, on a REFUSED reply only, says in one line
    why the job will not prepare the version, so that the controller can stop
    waiting and say so at once. ``signature`` is set on decoded messages only; build
    messages without it and let :func:`encode` sign them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: MessageType
    config_version: int = Field(ge=1)
    previous_version: int | None = Field(default=None, ge=1)
    operator: str | None = Field(default=None, min_length=1)
    checksum: str = Field(min_length=1, max_length=128)
    sender: Sender
    message_id: UUID = Field(default_factory=uuid4)
    sent_at: AwareDatetime = Field(default_factory=utc_now)
    batch_id: int | None = Field(default=None, ge=0)
    reason: str | None = Field(default=None, min_length=1, max_length=MAX_REASON_CHARS)
    signature: str | None = None

    @model_validator(mode="after")
    def _check_fields_fit_the_type(self) -> Self:
        if (self.type == "REFUSED") != (self.reason is not None):
            raise ValueError("a REFUSED reply, and only it, carries the reason for the refusal")
        expected = SENT_BY[self.type]
        if self.sender != expected:
            raise ValueError(f"{self.type} is sent by the {expected}, not the {self.sender}")
        per_operator = self.type in ("PROPAGATE", "MIGRATED")
        if per_operator and (self.operator is None or not self.operator.strip()):
            raise ValueError(f"{self.type} names the operator it concerns")
        if not per_operator and self.operator is not None:
            raise ValueError(f"{self.type} concerns every operator; operator must be null")
        if self.sender == "job" and self.batch_id is None:
            raise ValueError(f"{self.type} carries the micro-batch id at which the job acted")
        if self.sender == "controller" and self.batch_id is not None:
            raise ValueError(f"{self.type} comes from the controller and has no batch_id")
        if self.type == "PREPARE" and self.previous_version is None:
            raise ValueError("PREPARE names the version it starts from (previous_version)")
        if self.previous_version is not None and self.previous_version >= self.config_version:
            raise ValueError(
                f"previous_version {self.previous_version} must be older than "
                f"config_version {self.config_version}"
            )
        return self

    def describe(self) -> str:
        """A short label for logs and error messages."""
        target = f" {self.operator}" if self.operator is not None else ""
        return f"{self.type}{target} v{self.config_version}"


def encode(message: ControlMessage, key: bytes | str | None = None) -> bytes:
    """The signed wire form: canonical JSON of every field plus ``signature``.

    The signature covers every other field, so no part of a message can be
    altered in transit. ``key`` defaults to ``KEYPLANE_CONTROL_KEY``.
    """
    body = message.model_dump(mode="json", exclude={"signature"})
    if body["reason"] is None:
        # Only REFUSED carries one: every other message keeps its wire form.
        del body["reason"]
    return canonical_json({**body, "signature": sign(body, key)})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(raw: bytes, key: bytes | str | None = None) -> ControlMessage:
    """Parse and authenticate ``raw``, or raise :class:`InvalidMessage`.

    The signature is checked before anything in the message is interpreted,
    so an unauthenticated message cannot even probe the schema. A correctly
    signed message of a type this version does not know is ``unknown_type``
    rather than ``schema``: it most likely comes from a newer controller.
    ``key`` defaults to ``KEYPLANE_CONTROL_KEY``.

    Whoever can write to the control topic controls ``raw``, and a record
    this raises anything else for would stop the job for good: the driver
    reads it again from its checkpointed offset at every restart (000 §3.4).
    So ``raw`` must be strict UTF-8, as :func:`encode` writes it (ASCII), and
    nested no deeper than :data:`keyplane.reference.events.MAX_NESTING_DEPTH`, checked
    before ``json.loads`` could exceed the recursion limit on it; and the
    type is checked to be a string before it is looked up.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMessage("not_json", str(exc)) from None
    if nested_deeper_than(raw, MAX_NESTING_DEPTH):
        raise InvalidMessage("not_json", f"nested deeper than {MAX_NESTING_DEPTH} levels")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise InvalidMessage("not_json", str(exc)) from None
    except RecursionError:
        raise InvalidMessage("not_json", "nested deeper than the parser's stack") from None
    if not isinstance(data, dict):
        raise InvalidMessage("schema", f"expected a JSON object, got {type(data).__name__}")
    if "signature" not in data or data["signature"] in (None, ""):
        raise InvalidMessage("missing_signature", "the message carries no signature")
    body = {name: value for name, value in data.items() if name != "signature"}
    if not verify(body, data["signature"], key):
        raise InvalidMessage("bad_signature", "the signature does not match the message")
    kind = body.get("type")
    if not isinstance(kind, str):
        raise InvalidMessage("schema", f"type: expected a string, got {type(kind).__name__}")
    if kind not in MESSAGE_TYPES:
        known = ", ".join(sorted(MESSAGE_TYPES))
        raise InvalidMessage("unknown_type", f"type {kind!r} is not one of {known}")
    try:
        return ControlMessage.model_validate_json(canonical_json(data), strict=True)
    except ValidationError as exc:
        problems = "; ".join(describe_error(error, "message") for error in exc.errors())
        raise InvalidMessage("schema", problems) from None


class Reaction(BaseModel):
    """What one message did: the outcome, why it was ignored, and the replies."""

    model_config = ConfigDict(frozen=True)

    outcome: Outcome
    reason: IgnoreReason | None = None
    detail: str = ""
    replies: tuple[ControlMessage, ...] = ()


def _applied(detail: str, replies: tuple[ControlMessage, ...] = ()) -> Reaction:
    return Reaction(outcome="applied", detail=detail, replies=replies)


def _duplicate(detail: str, replies: tuple[ControlMessage, ...] = ()) -> Reaction:
    return Reaction(outcome="duplicate", detail=detail, replies=replies)


def _ignored(reason: IgnoreReason, detail: str) -> Reaction:
    return Reaction(outcome="ignored", reason=reason, detail=detail)


def _check_operators(operators: Sequence[str]) -> tuple[str, ...]:
    names = tuple(operators)
    if not names:
        raise ValueError("the protocol needs at least one operator")
    if any(not name.strip() for name in names):
        raise ValueError("operator names must not be blank")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"operators are listed more than once: {', '.join(repeated)}")
    return names


_State = TypeVar("_State", bound=BaseModel)


def _restored(model: type[_State], data: Mapping[str, Any], what: str) -> _State:
    """``data`` validated as ``model``, or ``ValueError`` naming ``what`` it should have been."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"not a valid {what}: {exc}") from None


def _require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("times must be timezone-aware")


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
        _check_operators(self.operators)
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
        names = _check_operators(operators)
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
        self._ignored: Counter[IgnoreReason] = Counter()

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
        state = _restored(JobState, data, "job protocol checkpoint")
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
        return Counter(self._ignored)

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
            reaction = _ignored("own_message", f"{message.describe()} is a job reply")
        elif message.type == "PREPARE":
            reaction = self._on_prepare(message, batch_id)
        elif message.type == "PROPAGATE":
            reaction = self._on_propagate(message)
        elif message.type == "DONE":
            reaction = self._on_done(message)
        else:
            reaction = self._on_abort(message)
        if reaction.reason is not None:
            self._ignored[reaction.reason] += 1
        return reaction

    def _pending_mismatch(self, message: ControlMessage) -> Reaction | None:
        pending = self._state.pending
        assert pending is not None
        if message.checksum != pending.checksum:
            return _ignored(
                "checksum_mismatch",
                f"{message.describe()} has checksum {message.checksum}, "
                f"but the pending version has {pending.checksum}",
            )
        if message.previous_version not in (None, pending.base):
            return _ignored(
                "wrong_base",
                f"{message.describe()} starts from v{message.previous_version}, "
                f"the pending version from v{pending.base}",
            )
        return None

    def _stale(self, message: ControlMessage) -> Reaction:
        return _ignored(
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
            return _duplicate(f"{message.describe()} was already acknowledged", (pending.ack,))
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
            ignored = _ignored(
                "unknown_checksum",
                f"{message.describe()} has checksum {message.checksum}; the job's store {held}",
            )
            return self._refused(ignored, message, batch_id)
        if self._waits(message):
            return self._hold(message)
        if message.previous_version != state.active_version:
            ignored = _ignored(
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
        return _applied(f"prepared v{version}", (ack,))

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
            return _ignored(
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
            return _duplicate(f"{name} is already switching to v{pending.version}")
        if current.phase == "migrated":
            assert current.migrated is not None
            return _duplicate(f"{name} already migrated to v{pending.version}", (current.migrated,))
        position = state.operators.index(name)
        behind = [u for u in state.operators[:position] if state.phases[u].phase not in PROPAGATED]
        if behind:
            return _ignored(
                "upstream_not_propagated",
                f"{message.describe()} arrived before upstream {', '.join(behind)} was "
                "propagated (operators switch upstream first)",
            )
        updated = current.model_copy(
            update={"phase": "switching", "propagated_by": message.message_id}
        )
        self._state = state.model_copy(update={"phases": {**state.phases, name: updated}})
        return _applied(f"{name} routes on v{pending.version} from the next batch")

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
                return _ignored(
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
            return _applied(f"v{version} is active")
        if version == state.active_version:
            if message.checksum != state.active_checksum:
                return _ignored(
                    "checksum_mismatch",
                    f"{message.describe()} has checksum {message.checksum}, "
                    f"the active version {state.active_checksum}",
                )
            return _duplicate(f"v{version} is already active")
        if version <= state.latest_version:
            return self._stale(message)
        return _ignored("not_prepared", f"{message.describe()} for a version never prepared")

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
            return _applied(f"v{version} aborted; back on v{state.active_version}")
        if version == state.active_version:
            return _ignored(
                "already_done",
                f"{message.describe()}: v{version} is already active; "
                "roll back by publishing a new version",
            )
        if version <= state.latest_version:
            return self._stale(message)
        self._state = state.model_copy(update={"latest_version": version})
        return _applied(f"v{version} aborted before it was prepared; it will not be prepared")


class Wait(BaseModel):
    """A reply the controller still waits for, and the request to re-send for it."""

    model_config = ConfigDict(frozen=True)

    reply: Literal["ACK", "MIGRATED"]
    operator: str | None
    request: ControlMessage
    since: AwareDatetime


class Reconfiguration(BaseModel):
    """One rollout as the controller sees it: every message sent and received."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=1)
    checksum: str = Field(min_length=1)
    base: int = Field(ge=1)
    prepare: ControlMessage
    ack: ControlMessage | None = None
    propagated: dict[str, ControlMessage] = Field(default_factory=dict)
    migrated: dict[str, ControlMessage] = Field(default_factory=dict)
    finish: ControlMessage | None = None
    refused: ControlMessage | None = None
    """The job's REFUSED of the PREPARE: kept, so that every later wait (a retried
    Airflow task, the same command again) reports it rather than waiting for an ACK."""


class ControllerState(BaseModel):
    """Everything the controller knows: what Airflow tasks persist between steps.

    ``current`` is the rollout in flight; ``last`` the most recent finished
    one, kept so that a retried step after DONE or ABORT returns what it
    returned the first time.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = CHECKPOINT_FORMAT
    operators: tuple[str, ...]
    active_version: int = Field(ge=1)
    active_checksum: str = Field(min_length=1)
    current: Reconfiguration | None = None
    last: Reconfiguration | None = None

    @model_validator(mode="after")
    def _check_consistency(self) -> Self:
        _check_operators(self.operators)
        current, last = self.current, self.last
        if current is not None and (
            current.finish is not None or current.base != self.active_version
        ):
            raise ValueError("the rollout in flight must be unfinished and start from active")
        if last is not None and last.finish is None:
            raise ValueError("the last rollout must be finished")
        for rollout in (current, last):
            if rollout is not None and not set(rollout.propagated) <= set(self.operators):
                raise ValueError("a rollout propagated an unknown operator")
        return self

    @property
    def migrated_rollout(self) -> Reconfiguration | None:
        """The rollout in flight once every operator has MIGRATED, when DONE may follow."""
        current = self.current
        if current is not None and set(current.migrated) == set(self.operators):
            return current
        return None


def _kept(state: ControllerState | None) -> list[Reconfiguration]:
    """The rollouts ``state`` keeps, newest first: the one in flight, then the last finished."""
    if state is None:
        return []
    return [rollout for rollout in (state.current, state.last) if rollout is not None]


def _in_flight_now(state: ControllerState | None) -> str:
    current = None if state is None else state.current
    return "no rollout is in flight" if current is None else f"v{current.version} is in flight now"


def _not_kept(state: ControllerState | None, version: int) -> str:
    """Why ``version`` is neither of the rollouts ``state`` keeps, and what is in flight."""
    kept = _kept(state)
    if not kept:
        return _in_flight_now(state)
    newest = kept[0].version
    if newest > version:
        told = f"superseded by v{newest}"
    else:
        told = f"newer than v{newest}, the latest rollout"
    if state is not None and state.current is not None:
        return f"{told}, which is in flight now"
    return f"{told}; {_in_flight_now(state)}"


def rollout_for(state: ControllerState | None, version: int | None) -> Reconfiguration:
    """The rollout a step or a wait for ``version`` may act on, else :class:`ProtocolError`.

    The controller drives one rollout at a time, and whoever shares its state
    (another DAG run, ``keyplane config abort`` and ``publish``) may abort a
    run's version and publish another between two of the run's steps. A step
    or a wait that took whatever is in flight would then act on, or report
    the replies of, a version that is not its own; so it names its version
    and is refused once that version was aborted or replaced, with an error
    that says which version, what became of it and what is in flight now.
    ``state.last`` counts too: a step retried after DONE repeats what it did,
    and a wait retried after DONE finds its replies there. ``version`` None
    is for a caller that does not know its version: the rollout in flight,
    else the last one.
    """
    rollouts = _kept(state)
    if version is None:
        if not rollouts:
            raise ProtocolError(f"{_in_flight_now(state)}; prepare a version first")
        rollout = rollouts[0]
    else:
        found = [r for r in rollouts if r.version == version]
        if not found:
            raise ProtocolError(f"v{version} is not in flight: {_not_kept(state, version)}")
        rollout = found[0]
    if rollout.finish is not None and rollout.finish.type == "ABORT":
        raise ProtocolError(f"v{rollout.version} was aborted; {_in_flight_now(state)}")
    return rollout


class ControllerProtocol:
    """The controller's side of 000 §3.4, driven by Airflow tasks.

    Each step returns the message to publish. A step repeated — an Airflow
    task retried after it published — returns the very message it returned
    the first time (same ``message_id``) and changes nothing, so publishing it
    again is harmless. Steps called out of order raise :class:`ProtocolError`.
    Replies from the job go to :meth:`on_message`; :meth:`awaiting` lists the
    replies still missing, and :meth:`overdue` those missing for longer than
    a timeout at a time the caller supplies (a sensor's poke time), after
    which the task re-sends the request or aborts.
    """

    def __init__(
        self,
        operators: Sequence[str],
        active_version: int,
        active_checksum: str,
        *,
        clock: Clock = utc_now,
    ) -> None:
        state = ControllerState(
            operators=_check_operators(operators),
            active_version=active_version,
            active_checksum=active_checksum,
        )
        self._init(state, clock)

    def _init(self, state: ControllerState, clock: Clock) -> None:
        self._state = state
        self._clock = clock
        self._ignored: Counter[IgnoreReason] = Counter()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, clock: Clock = utc_now) -> ControllerProtocol:
        """Restore the state written by :meth:`to_dict` (raises ``ValueError`` if invalid)."""
        state = _restored(ControllerState, data, "controller protocol state")
        protocol = cls.__new__(cls)
        protocol._init(state, clock)
        return protocol

    def to_dict(self) -> dict[str, Any]:
        return self._state.model_dump(mode="json")

    @property
    def state(self) -> ControllerState:
        return self._state

    @property
    def active_version(self) -> int:
        return self._state.active_version

    @property
    def ignored(self) -> Counter[IgnoreReason]:
        """How many job messages were ignored for each reason since this object was built."""
        return Counter(self._ignored)

    @property
    def phase(self) -> ControllerPhase:
        current = self._state.current
        if current is None:
            return "idle"
        if current.ack is None:
            return "preparing"
        if not current.propagated:
            return "prepared"
        if self._state.migrated_rollout is not None:
            return "migrated"
        return "propagating"

    def _latest_version(self) -> int:
        state = self._state
        versions = [state.active_version]
        versions += [r.version for r in (state.current, state.last) if r is not None]
        return max(versions)

    def _message(
        self, kind: MessageType, version: int, base: int, checksum: str, operator: str | None = None
    ) -> ControlMessage:
        return ControlMessage(
            type=kind,
            config_version=version,
            previous_version=base,
            operator=operator,
            checksum=checksum,
            sender="controller",
            sent_at=self._clock(),
        )

    def _follow_up(
        self, kind: MessageType, rollout: Reconfiguration, operator: str | None = None
    ) -> ControlMessage:
        return self._message(kind, rollout.version, rollout.base, rollout.checksum, operator)

    @staticmethod
    def _check_not_aborted(rollout: Reconfiguration) -> None:
        """A retried step of a finished rollout is a no-op only if it finished with DONE.

        Re-running a step of an aborted rollout would publish messages the
        job ignores as stale and then wait for replies that never come.
        """
        if rollout.finish is not None and rollout.finish.type == "ABORT":
            raise ProtocolError(
                f"v{rollout.version} was aborted; publish the configuration under a new version"
            )

    def prepare(self, config_version: int, checksum: str) -> ControlMessage:
        """Start rolling out ``config_version`` (stored with ``checksum``): the PREPARE."""
        state = self._state
        for rollout in (state.current, state.last):
            if rollout is not None and rollout.version == config_version:
                if rollout.checksum != checksum:
                    raise ProtocolError(
                        f"v{config_version} was prepared with checksum {rollout.checksum}, "
                        f"not {checksum}"
                    )
                if rollout is state.last:
                    self._check_not_aborted(rollout)
                return rollout.prepare
        if state.current is not None:
            raise ProtocolError(
                f"v{state.current.version} is still rolling out; "
                f"call done() or abort() before preparing v{config_version}"
            )
        if config_version <= self._latest_version():
            raise ProtocolError(
                f"v{config_version} is not newer than v{self._latest_version()}; "
                "publish the configuration under a new version"
            )
        base = state.active_version
        rollout = Reconfiguration(
            version=config_version,
            checksum=checksum,
            base=base,
            prepare=self._message("PREPARE", config_version, base, checksum),
        )
        self._state = state.model_copy(update={"current": rollout})
        return rollout.prepare

    def on_message(self, message: ControlMessage) -> Reaction:
        """Record a reply from the job (ACK or MIGRATED); anything else is ignored.

        A REFUSED of the rollout's PREPARE is recorded in the rollout
        (``refused``) and its reaction has outcome ``refused`` and the job's
        reason as ``detail``: the caller reports it and aborts."""
        reaction = self._handle(message)
        if reaction.reason is not None:
            self._ignored[reaction.reason] += 1
        return reaction

    def _handle(self, message: ControlMessage) -> Reaction:
        state = self._state
        current = state.current
        if message.sender != "job":
            return _ignored("own_message", f"{message.describe()} is a controller message")
        if current is None or message.config_version != current.version:
            return _ignored("stale_version", f"{message.describe()} is not for the rollout")
        if message.checksum != current.checksum:
            return _ignored(
                "checksum_mismatch",
                f"{message.describe()} has checksum {message.checksum}, "
                f"the rollout {current.checksum}",
            )
        if message.type == "REFUSED":
            if current.ack is not None:
                return _duplicate(f"v{current.version} was acknowledged before this refusal")
            if current.refused is None:
                updated = current.model_copy(update={"refused": message})
                self._state = state.model_copy(update={"current": updated})
            # The rollout stays in flight: the caller aborts it and says why.
            return Reaction(outcome="refused", detail=message.reason or "")
        if message.type == "ACK":
            if current.ack is not None:
                return _duplicate(f"v{current.version} was already acknowledged")
            updated = current.model_copy(update={"ack": message})
            self._state = state.model_copy(update={"current": updated})
            return _applied(f"the job acknowledged v{current.version}")
        name = message.operator
        assert name is not None
        if name not in state.operators:
            return _ignored("unknown_operator", f"{message.describe()}: no such operator")
        if name not in current.propagated:
            return _ignored("not_propagated", f"{message.describe()} but {name} was not propagated")
        if name in current.migrated:
            return _duplicate(f"{name} already migrated")
        updated = current.model_copy(update={"migrated": {**current.migrated, name: message}})
        self._state = state.model_copy(update={"current": updated})
        return _applied(f"{name} migrated to v{current.version}")

    def awaiting(self) -> tuple[Wait, ...]:
        """The replies still missing: the ACK, or MIGRATED of each propagated operator."""
        current = self._state.current
        if current is None:
            return ()
        if current.ack is None:
            return (
                Wait(
                    reply="ACK",
                    operator=None,
                    request=current.prepare,
                    since=current.prepare.sent_at,
                ),
            )
        return tuple(
            Wait(reply="MIGRATED", operator=name, request=request, since=request.sent_at)
            for name, request in current.propagated.items()
            if name not in current.migrated
        )

    def overdue(self, now: datetime, timeout: timedelta) -> tuple[Wait, ...]:
        """The missing replies whose request was sent more than ``timeout`` before ``now``."""
        _require_aware(now)
        return tuple(wait for wait in self.awaiting() if now - wait.since > timeout)

    def _finished_step(
        self, version: int, pick: Callable[[Reconfiguration], ControlMessage | None]
    ) -> ControlMessage:
        """A step for ``version`` when ``version`` is not the rollout in flight.

        Only a retry of a step of the last rollout, finished with DONE, may
        run: it returns the message that step sent. :func:`rollout_for`
        refuses the rest, a version that was aborted or replaced, so that the
        step does not act on the version an operator published by hand.
        """
        rollout = rollout_for(self._state, version)
        message = pick(rollout)
        if message is None:
            raise ProtocolError(
                f"v{version} is done without this step; {_in_flight_now(self._state)}"
            )
        return message

    def propagate(self, operator: str, version: int | None = None) -> ControlMessage:
        """Tell ``operator`` to switch to the new version: the PROPAGATE.

        Allowed once the job acknowledged and every upstream operator was
        propagated: 000 §3.4's upstream-first order. The paper also waits for
        the upstream's MIGRATED; a micro-batch barrier makes that unnecessary
        (see the module docstring), so the whole rollout can be propagated at
        once and every operator switches in the same batch. With ``version``,
        the step is for that version's rollout only (see :func:`rollout_for`).
        """
        state = self._state
        if operator not in state.operators:
            raise ProtocolError(
                f"unknown operator {operator!r}; operators are {', '.join(state.operators)}"
            )
        current = state.current
        if version is not None and (current is None or current.version != version):
            return self._finished_step(version, lambda rollout: rollout.propagated.get(operator))
        if current is None:
            last = state.last
            if last is not None and operator in last.propagated:
                self._check_not_aborted(last)
                return last.propagated[operator]
            raise ProtocolError("no rollout is in flight; call prepare() first")
        if operator in current.propagated:
            return current.propagated[operator]
        if current.ack is None:
            raise ProtocolError(f"the job has not acknowledged PREPARE v{current.version} yet")
        position = state.operators.index(operator)
        behind = [u for u in state.operators[:position] if u not in current.propagated]
        if behind:
            raise ProtocolError(
                f"{operator} cannot move before upstream {', '.join(behind)} is propagated"
            )
        message = self._follow_up("PROPAGATE", current, operator)
        updated = current.model_copy(
            update={"propagated": {**current.propagated, operator: message}}
        )
        self._state = state.model_copy(update={"current": updated})
        return message

    def done(self, version: int | None = None) -> ControlMessage:
        """Finish the rollout once every operator migrated: the DONE.

        With ``version``, only that version's rollout (see :func:`rollout_for`).
        """
        state = self._state
        current = state.current
        if version is not None and (current is None or current.version != version):
            return self._finished_step(version, lambda rollout: rollout.finish)
        if current is None:
            last = state.last
            if last is not None and last.finish is not None and last.finish.type == "DONE":
                return last.finish
            raise ProtocolError("no rollout is in flight")
        behind = [n for n in state.operators if n not in current.migrated]
        if behind:
            raise ProtocolError(
                f"v{current.version} cannot be done: {', '.join(behind)} not migrated"
            )
        message = self._follow_up("DONE", current)
        self._state = state.model_copy(
            update={
                "active_version": current.version,
                "active_checksum": current.checksum,
                "current": None,
                "last": current.model_copy(update={"finish": message}),
            }
        )
        return message

    def abort(self) -> ControlMessage:
        """Abandon the rollout in flight: the ABORT. The job returns to the active version.

        Operators that had already moved hand their state back before the job
        accepts another PREPARE; until then the next PREPARE simply waits for
        its ACK a little longer.
        """
        state = self._state
        current = state.current
        if current is None:
            last = state.last
            if last is not None and last.finish is not None and last.finish.type == "ABORT":
                return last.finish
            if last is not None:
                raise ProtocolError(
                    f"v{last.version} is done and cannot be aborted; "
                    "roll back by publishing a new version"
                )
            raise ProtocolError("no rollout is in flight")
        message = self._follow_up("ABORT", current)
        self._state = state.model_copy(
            update={"current": None, "last": current.model_copy(update={"finish": message})}
        )
        return message
