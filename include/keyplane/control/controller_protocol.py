"""The controller's side of the reconfiguration protocol (paper 000 §3.4), as a pure state machine.

The Airflow tasks drive it: PREPARE, wait for every ACK, PROPAGATE the
operators upstream first, wait for MIGRATED, then DONE. Each step is
idempotent, so a killed and retried task resumes where it was. The exchange
is described in :mod:`keyplane.control.messages`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, Self

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from keyplane.control.messages import (
    CHECKPOINT_FORMAT,
    Clock,
    ControllerPhase,
    ControlMessage,
    IgnoreReason,
    MessageType,
    ProtocolError,
    Reaction,
    applied_reaction,
    check_operators,
    duplicate_reaction,
    ignored_reaction,
    require_aware,
    restored,
    utc_now,
)


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
        check_operators(self.operators)
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
            operators=check_operators(operators),
            active_version=active_version,
            active_checksum=active_checksum,
        )
        self._init(state, clock)

    def _init(self, state: ControllerState, clock: Clock) -> None:
        self._state = state
        self._clock = clock
        self.ignored_reaction: Counter[IgnoreReason] = Counter()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, clock: Clock = utc_now) -> ControllerProtocol:
        """Restore the state written by :meth:`to_dict` (raises ``ValueError`` if invalid)."""
        state = restored(ControllerState, data, "controller protocol state")
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
        return Counter(self.ignored_reaction)

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
            self.ignored_reaction[reaction.reason] += 1
        return reaction

    def _handle(self, message: ControlMessage) -> Reaction:
        state = self._state
        current = state.current
        if message.sender != "job":
            return ignored_reaction("own_message", f"{message.describe()} is a controller message")
        if current is None or message.config_version != current.version:
            return ignored_reaction("stale_version", f"{message.describe()} is not for the rollout")
        if message.checksum != current.checksum:
            return ignored_reaction(
                "checksum_mismatch",
                f"{message.describe()} has checksum {message.checksum}, "
                f"the rollout {current.checksum}",
            )
        if message.type == "REFUSED":
            if current.ack is not None:
                return duplicate_reaction(
                    f"v{current.version} was acknowledged before this refusal"
                )
            if current.refused is None:
                updated = current.model_copy(update={"refused": message})
                self._state = state.model_copy(update={"current": updated})
            # The rollout stays in flight: the caller aborts it and says why.
            return Reaction(outcome="refused", detail=message.reason or "")
        if message.type == "ACK":
            if current.ack is not None:
                return duplicate_reaction(f"v{current.version} was already acknowledged")
            updated = current.model_copy(update={"ack": message})
            self._state = state.model_copy(update={"current": updated})
            return applied_reaction(f"the job acknowledged v{current.version}")
        name = message.operator
        assert name is not None
        if name not in state.operators:
            return ignored_reaction("unknown_operator", f"{message.describe()}: no such operator")
        if name not in current.propagated:
            return ignored_reaction(
                "not_propagated", f"{message.describe()} but {name} was not propagated"
            )
        if name in current.migrated:
            return duplicate_reaction(f"{name} already migrated")
        updated = current.model_copy(update={"migrated": {**current.migrated, name: message}})
        self._state = state.model_copy(update={"current": updated})
        return applied_reaction(f"{name} migrated to v{current.version}")

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
        require_aware(now)
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
