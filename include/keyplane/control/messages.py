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

This module holds the message model and its signed wire form. The two state
machines live beside it: :class:`~keyplane.control.job_protocol.JobProtocol`,
which the job's driver runs, and
:class:`~keyplane.control.controller_protocol.ControllerProtocol`, which the
Airflow tasks drive. Neither touches Kafka, Spark or a clock of its own, so
both can be tested exhaustively and wired to any transport.

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

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Self, TypeVar, get_args
from uuid import UUID, uuid4

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


def authentic_object(raw: bytes, key: bytes | str | None = None) -> dict[str, Any]:
    """The JSON object in ``raw``, its ``signature`` included, once that signature verifies
    over every other field; :class:`InvalidMessage` otherwise.

    Whoever can write to a signed topic controls ``raw``, and a record this
    raised anything else for would stop its reader for good: the driver
    reads the control topic again from its checkpointed offset at every
    restart (000 §3.4). So ``raw`` must be strict UTF-8, as the signed wire
    form is (ASCII), and nested no deeper than
    :data:`keyplane.reference.events.MAX_NESTING_DEPTH`, checked before
    ``json.loads`` could exceed the recursion limit on it. The signature is
    checked before anything in the object is interpreted, so an
    unauthenticated message cannot even probe the schema.
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
    return data


def decode(raw: bytes, key: bytes | str | None = None) -> ControlMessage:
    """Parse and authenticate ``raw`` (:func:`authentic_object`), or raise
    :class:`InvalidMessage`.

    A correctly signed message of a type this version does not know is
    ``unknown_type`` rather than ``schema``: it most likely comes from a
    newer controller. The type is checked to be a string before it is looked
    up. ``key`` defaults to ``KEYPLANE_CONTROL_KEY``.
    """
    data = authentic_object(raw, key)
    kind = data.get("type")
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


def applied_reaction(detail: str, replies: tuple[ControlMessage, ...] = ()) -> Reaction:
    return Reaction(outcome="applied", detail=detail, replies=replies)


def duplicate_reaction(detail: str, replies: tuple[ControlMessage, ...] = ()) -> Reaction:
    return Reaction(outcome="duplicate", detail=detail, replies=replies)


def ignored_reaction(reason: IgnoreReason, detail: str) -> Reaction:
    return Reaction(outcome="ignored", reason=reason, detail=detail)


def check_operators(operators: Sequence[str]) -> tuple[str, ...]:
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


def restored(model: type[_State], data: Mapping[str, Any], what: str) -> _State:
    """``data`` validated as ``model``, or ``ValueError`` naming ``what`` it should have been."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"not a valid {what}: {exc}") from None


def require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("times must be timezone-aware")
