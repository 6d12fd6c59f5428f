"""The controller of live reconfiguration: the protocol of paper 000 §3.4 over Kafka.

Paper 000 §3.4 has a manager send every instance the new configuration, wait
for all acknowledgements, then propagate the change operator by operator,
upstream first, waiting for each to install its moved state. A micro-batch
job needs no such wait (:mod:`keyplane.control.messages`), so the controller sends
every operator's PROPAGATE at once, upstream first, and then waits for each
MIGRATED: all operators switch in one batch and install in the next. The
:class:`Controller` is that manager: it drives a
:class:`~keyplane.control.controller_protocol.ControllerProtocol` over a
:class:`~keyplane.kafka.control.ControlChannel` and keeps the protocol's state,
plus the offset up to which it has read the job's replies, in a JSON file.

Each step (prepare, propagate, done, abort, and each wait) is meant to be an
Airflow task, which may be killed and retried at any point. So every step
reloads the state file, acts, writes the file atomically (a temporary file
renamed over it) *before* it publishes, and publishes the message the
protocol returned. A step retried after it published finds its message in
the file and publishes it again with the same ``message_id``: the job treats
it as a duplicate, and the protocol state does not change. A lock file
(``<state file>.lock``) serialises the steps of concurrent processes, so
``keyplane config abort`` in one terminal stops a rollout waiting in another
instead of being overwritten by it.

Where the job starts. With no state file, the controller learns which
version the job runs at its first PREPARE: ``initial_version`` if given,
otherwise the ``parent_version`` of the configuration being prepared, the
version it was computed to replace. Neither the oldest nor the newest stored
version would do: a store keeps history, and the version being published is
already the newest. (A job started without a version runs the newest stored
one, which is that parent when versions are published in order.) The
operators default to those of that starting configuration, upstream first.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field

from keyplane.control.controller_protocol import (
    ControllerProtocol,
    ControllerState,
    Reconfiguration,
    rollout_for,
)
from keyplane.control.messages import ControlMessage, ProtocolError, Reaction, utc_now
from keyplane.kafka.control import ControlChannel
from keyplane.routing import config as config_store
from keyplane.util.processes import write_atomically
from keyplane.util.statefiles import read_model_file

log = logging.getLogger(__name__)

STATE_FORMAT: Literal[1] = 1
POLL_INTERVAL_S = 0.25
JOB_HINT = "is the job running? `keyplane job status`"

TickCallback = Callable[[float], None]
"""``on_tick(seconds_waited)``, called at every poll of a wait (for progress displays)."""


class ControllerError(RuntimeError):
    """A step cannot run as asked: nothing in flight, another rollout in flight, bad state."""


class RolloutTimeout(TimeoutError):
    """A reply of the job did not arrive in time.

    ``reply`` is ``"ACK"`` or ``"MIGRATED"``; ``operator`` names the operator
    whose MIGRATED was missing. ``aborted`` says whether the rollout was
    aborted because of it.
    """

    def __init__(
        self,
        message: str,
        *,
        version: int,
        reply: Literal["ACK", "MIGRATED"],
        operator: str | None,
        waited_s: float,
        aborted: bool = False,
    ) -> None:
        super().__init__(message)
        self.version = version
        self.reply: Literal["ACK", "MIGRATED"] = reply
        self.operator = operator
        self.waited_s = waited_s
        self.aborted = aborted


class RolloutRefused(ControllerError):
    """The job will not take the version: it answered REFUSED, or it rejected the
    signature of our messages. The rollout was aborted; the message says why."""

    def __init__(self, message: str, *, version: int) -> None:
        super().__init__(message)
        self.version = version


SIGNATURE_REJECTIONS = ("bad_signature", "missing_signature")
"""The job's ``rejected_control`` reasons that a controller with another key causes."""
METRICS_CHECK_S = 2.0
"""How often a wait looks at the job's metrics for rejected signatures."""
METRICS_WINDOW = 50
"""Metrics records looked at, back from the end, for rejected signatures."""


class ControllerFile(BaseModel):
    """What the state file holds: the protocol state and how far replies were read.

    ``control_topic`` is kept because ``read_offset`` means nothing on
    another topic.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = STATE_FORMAT
    control_topic: str = Field(min_length=1)
    read_offset: int = Field(ge=0)
    protocol: ControllerState


@dataclass(frozen=True)
class StepTiming:
    """How long one step of a rollout took, from sending its request to its reply.

    ``step`` is ``"PREPARE"``, ``"PROPAGATE <operator>"`` or ``"DONE"``;
    ``label`` adds the version and the reply awaited, for display.
    """

    step: str
    label: str
    seconds: float


@dataclass(frozen=True)
class RolloutProgress:
    """A rollout's progress, reported when a step starts, at each poll, and when it ends."""

    step: str
    label: str
    index: int
    total: int
    elapsed_s: float
    finished: bool


@dataclass(frozen=True)
class RolloutResult:
    """A finished rollout: which version replaced which, and the time of each step."""

    version: int
    previous_version: int
    checksum: str
    steps: tuple[StepTiming, ...]

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per step, keyed by :attr:`StepTiming.step`."""
        return {timing.step: timing.seconds for timing in self.steps}

    @property
    def total_s(self) -> float:
        return sum(timing.seconds for timing in self.steps)


def read_controller_file(path: Path) -> ControllerFile | None:
    """The controller's saved state, None when no rollout was ever started (no file).

    Raises :class:`ControllerError` naming the field when the file is not one.
    """
    return read_model_file(
        path,
        ControllerFile,
        what="a controller state file",
        fix="restore it, or move it aside to start from the job's current version",
        error=ControllerError,
    )


class Controller:
    """Drive the controller's side of 000 §3.4 over a control channel, step by step.

    ``store`` is the configuration store: PREPARE carries the checksum it
    records, so the job acts only on the configuration that was saved.
    ``operators`` (upstream first) and ``initial_version`` matter only while
    no state file exists: see the module docstring. Waits poll the channel
    every ``poll_interval_s``. The caller owns ``channel`` and closes it.

    A job that will not take a version answers its PREPARE with REFUSED; a
    wait then aborts the rollout and raises :class:`RolloutRefused` with the
    job's reason at once. A job that cannot verify our signature (another
    ``KEYPLANE_CONTROL_KEY``) cannot answer at all, but counts the records it
    rejected in its metrics: with ``metrics_topic`` given, a wait reads them
    and fails the same way, rather than waiting out its timeout.
    """

    def __init__(
        self,
        channel: ControlChannel,
        state_file: Path,
        store: Path,
        operators: Sequence[str] | None = None,
        *,
        initial_version: int | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
        metrics_topic: str | None = None,
    ) -> None:
        self._channel = channel
        self._metrics_topic = metrics_topic
        self.state_file = Path(state_file)
        self._store = Path(store)
        self._operators = None if operators is None else tuple(operators)
        self._initial_version = initial_version
        self._poll_interval_s = poll_interval_s
        self._topic_ready = False
        self.rejected = 0
        """Records of the control topic this object found not authentic (logged as warnings)."""
        self._load()

    # --- the state file ------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.state_file.with_name(self.state_file.name + ".lock")
        with lock_path.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _load(self) -> ControllerFile | None:
        saved = read_controller_file(self.state_file)
        if saved is None:
            return None
        if saved.control_topic != self._channel.topic:
            raise ControllerError(
                f"{self.state_file} records the control topic {saved.control_topic!r}, "
                f"not {self._channel.topic!r}; use a state file per control topic"
            )
        if self._operators is not None and saved.protocol.operators != self._operators:
            raise ControllerError(
                f"{self.state_file} drives operators {', '.join(saved.protocol.operators)}, "
                f"not {', '.join(self._operators)}"
            )
        return saved

    def _save(self, before: ControllerFile | None, after: ControllerFile) -> None:
        """Write ``after`` unless it equals ``before``, so a retried step leaves the file alone."""
        if after != before:
            write_atomically(self.state_file, after.model_dump_json(indent=2) + "\n")

    @staticmethod
    def _protocol(saved: ControllerFile) -> ControllerProtocol:
        return ControllerProtocol.from_dict(saved.protocol.model_dump(mode="json"))

    def _required(self) -> ControllerFile:
        saved = self._load()
        if saved is None:
            raise ControllerError(
                f"no rollout in flight: the controller has no state yet ({self.state_file})"
            )
        return saved

    @property
    def state(self) -> ControllerState | None:
        """The protocol state in the file, or None before the first PREPARE."""
        saved = self._load()
        return None if saved is None else saved.protocol

    @property
    def read_offset(self) -> int | None:
        """The control-topic offset up to which the job's replies were read."""
        saved = self._load()
        return None if saved is None else saved.read_offset

    @property
    def in_flight(self) -> int | None:
        """The version being rolled out, if any."""
        state = self.state
        return None if state is None or state.current is None else state.current.version

    # --- starting from the store ---------------------------------------------------------

    def _starting_version(self, config: config_store.RoutingConfig) -> int:
        if self._initial_version is not None:
            return self._initial_version
        if config.parent_version is None:
            raise ControllerError(
                f"v{config.version} is an initial configuration (no parent_version): "
                "start the job on it; only its descendants are rolled out"
            )
        return config.parent_version

    def _initial_file(self, config: config_store.RoutingConfig) -> ControllerFile:
        """The state before the first PREPARE: the job runs the starting version."""
        start = self._starting_version(config)
        operators = self._operators
        if operators is None:
            operators = tuple(config_store.load(self._store, start).operators)
        protocol = ControllerProtocol(operators, start, config_store.checksum(self._store, start))
        self._ensure_topic()
        return ControllerFile(
            control_topic=self._channel.topic,
            read_offset=self._channel.end_offset(),
            protocol=protocol.state,
        )

    def operators_for(self, version: int) -> tuple[str, ...]:
        """The operators a rollout of ``version`` propagates, upstream first."""
        saved = self._load()
        if saved is not None:
            return saved.protocol.operators
        if self._operators is not None:
            return self._operators
        start = self._starting_version(config_store.load(self._store, version))
        return tuple(config_store.load(self._store, start).operators)

    # --- steps ---------------------------------------------------------------------------

    def _ensure_topic(self) -> None:
        """Create the control topic once per object: the job may not have created it yet."""
        if not self._topic_ready:
            self._channel.ensure()
            self._topic_ready = True

    def _publish(self, *messages: ControlMessage) -> None:
        self._ensure_topic()
        self._channel.send(messages)

    def prepare(self, version: int) -> ControlMessage:
        """Send PREPARE for stored ``version``, with the checksum the store records.

        The stored files are verified first, so a damaged configuration is
        never announced. Retried, it sends the same PREPARE again.
        """
        config = config_store.load(self._store, version)
        checksum = config_store.checksum(self._store, version)
        with self._locked():
            saved = self._load()
            saved_or_new = self._initial_file(config) if saved is None else saved
            current = saved_or_new.protocol.current
            if current is not None and current.version != version:
                raise ControllerError(
                    f"v{current.version} is still rolling out; finish it or abort it "
                    f"(`keyplane config abort`) before preparing v{version}"
                )
            protocol = self._protocol(saved_or_new)
            message = protocol.prepare(version, checksum)
            self._save(saved, saved_or_new.model_copy(update={"protocol": protocol.state}))
            self._publish(message)
        return message

    def _after_replies(
        self, steps: Sequence[Callable[[ControllerProtocol], ControlMessage]]
    ) -> list[ControlMessage]:
        """Record the replies not yet read, then take ``steps``, persist and publish.

        Reading first means a step run right after its wait never fails for
        a reply that is already on the topic. The messages of all steps are
        published together, after the state file holds them all.
        """
        with self._locked():
            saved = self._required()
            protocol = self._protocol(saved)
            offset = self._poll_into(protocol, saved.read_offset)[1]
            messages = [step(protocol) for step in steps]
            self._save(
                saved,
                saved.model_copy(update={"protocol": protocol.state, "read_offset": offset}),
            )
            self._publish(*messages)
        return messages

    def propagate(self, operator: str, *, version: int | None = None) -> ControlMessage:
        """Send PROPAGATE for ``operator`` once the job acknowledged and its upstream's is out.

        ``version``, if given, is the rollout the caller drives: the step is
        refused if another is in flight (checked under the lock, with the
        step), so a retried task of an aborted run never propagates a version
        an operator published since.
        """
        [message] = self.propagate_all([operator], version=version)
        return message

    def propagate_all(
        self, operators: Sequence[str], *, version: int | None = None
    ) -> list[ControlMessage]:
        """Send PROPAGATE for every one of ``operators`` (upstream first) in one publish.

        One publish, so the job usually reads them at the same batch boundary
        and switches every operator in the same batch; read at two
        boundaries, the downstream operators switch one batch later.
        ``version`` as for :meth:`propagate`. No operators is a ``ValueError``:
        a publish of nothing would leave the caller no message to report.
        """
        if not operators:
            raise ValueError("PROPAGATE needs at least one operator")
        return self._after_replies(
            [
                functools.partial(ControllerProtocol.propagate, operator=name, version=version)
                for name in operators
            ]
        )

    def done(self, *, version: int | None = None) -> ControlMessage:
        """Send DONE once every operator migrated: the new version becomes active.

        ``version`` as for :meth:`propagate`.
        """
        [message] = self._after_replies([lambda protocol: protocol.done(version=version)])
        return message

    def abort(self) -> ControlMessage:
        """Send ABORT for the rollout in flight: the job goes back to the active version."""
        with self._locked():
            message = self._abort(self._required())
        return message

    def abort_any_of(self, versions: Collection[int]) -> ControlMessage | None:
        """ABORT the rollout in flight if it is one of ``versions``; None if it is not.

        For a caller that may abort only its own versions (a DAG run's
        failure handling): the version in flight is read and aborted under
        one lock, so a rollout that another process finished and replaced
        between the two is left alone.
        """
        with self._locked():
            saved = self._load()
            current = None if saved is None else saved.protocol.current
            if saved is None or current is None or current.version not in versions:
                return None
            return self._abort(saved)

    def _abort(self, saved: ControllerFile) -> ControlMessage:
        protocol = self._protocol(saved)
        message = protocol.abort()
        self._save(saved, saved.model_copy(update={"protocol": protocol.state}))
        self._publish(message)
        return message

    # --- replies -------------------------------------------------------------------------

    def _poll_into(self, protocol: ControllerProtocol, start: int) -> tuple[list[Reaction], int]:
        read = self._channel.read(start)
        for offset, invalid in read.rejected:
            self.rejected += 1
            log.warning(
                "control topic %s, offset %d: record rejected (%s): %s",
                self._channel.topic,
                offset,
                invalid.reason,
                invalid.detail,
            )
        reactions = [
            protocol.on_message(message) for _, message in read.messages if message.sender == "job"
        ]
        return reactions, read.end

    def poll(self) -> list[Reaction]:
        """Read the job's replies since the last read and record them; return what each did."""
        with self._locked():
            saved = self._load()
            if saved is None:
                return []
            protocol = self._protocol(saved)
            reactions, offset = self._poll_into(protocol, saved.read_offset)
            self._save(
                saved,
                saved.model_copy(update={"protocol": protocol.state, "read_offset": offset}),
            )
        return reactions

    def _rollout(self, saved: ControllerFile | None) -> Reconfiguration:
        """The rollout a wait is about: the one in flight, or the last one if it finished
        (:func:`~keyplane.control.controller_protocol.rollout_for`)."""
        try:
            return rollout_for(None if saved is None else saved.protocol, None)
        except ProtocolError as error:
            raise ControllerError(str(error)) from None

    def _wait(
        self,
        satisfied: Callable[[Reconfiguration], bool],
        missing: Callable[[Reconfiguration, float], RolloutTimeout],
        timeout_s: float,
        on_tick: TickCallback | None,
    ) -> float:
        started = time.monotonic()
        checked_metrics = started
        while True:
            self.poll()
            rollout = self._rollout(self._load())
            waited = time.monotonic() - started
            if satisfied(rollout):
                return waited
            if rollout.refused is not None and rollout.ack is None:
                raise self._abort_refused(
                    rollout.version,
                    f"the job refused v{rollout.version}: {rollout.refused.reason}",
                )
            now = time.monotonic()
            due = now - checked_metrics >= METRICS_CHECK_S or waited >= timeout_s
            if rollout.ack is None and due:
                checked_metrics = now
                rejected = self._signatures_rejected(rollout.prepare)
                # An ACK sent at the boundary that rejected a stranger's record may have
                # arrived since the poll above: only a job without it rejected ours.
                self.poll()
                if rejected and satisfied(self._rollout(self._load())):
                    return time.monotonic() - started
                if rejected:
                    raise self._abort_refused(
                        rollout.version,
                        f"the job rejected our signature ({rejected} control record(s) since "
                        f"{rollout.prepare.describe()}): KEYPLANE_CONTROL_KEY here is not the "
                        "job's; set the job's key and publish again",
                    )
            if on_tick is not None:
                on_tick(waited)
            if waited >= timeout_s:
                raise missing(rollout, waited)
            time.sleep(min(self._poll_interval_s, max(0.0, timeout_s - waited)))

    def _signatures_rejected(self, since: ControlMessage) -> int:
        """Control records the job rejected as unsigned or wrongly signed at the boundaries
        of batches that started after ``since`` was sent, so had read it too; 0 without a
        metrics topic or such records."""
        if self._metrics_topic is None:
            return 0
        from keyplane.kafka.admin import TopicError, partitions_of, tail_offsets
        from keyplane.kafka.metrics_topic import read_metrics

        servers = self._channel.bootstrap_servers
        try:
            partitions_of(servers, self._metrics_topic, timeout_s=1.0)
            starts, ends = tail_offsets(servers, self._metrics_topic, METRICS_WINDOW)
            records = read_metrics(servers, self._metrics_topic, starts, ends, idle_timeout_s=5.0)
        except (TopicError, TimeoutError, KafkaError) as error:
            log.warning("cannot read the metrics topic %s: %s", self._metrics_topic, error)
            return 0
        after = since.sent_at.timestamp()
        return sum(
            record.metrics.rejected_control.get(reason, 0)
            for record in records
            if (
                record.metrics.started_at.timestamp()
                if record.metrics.started_at is not None
                else record.published_s
            )
            >= after
            for reason in SIGNATURE_REJECTIONS
        )

    def _abort_refused(self, version: int, why: str) -> RolloutRefused:
        """Abort the rollout the job will not take, and say why and what is left."""
        try:
            self.abort()
        except Exception as exc:
            outcome = f"ABORT v{version} could not be sent ({exc}); run `keyplane config abort`"
        else:
            outcome = f"rollout of v{version} aborted"
        return RolloutRefused(f"{why}; {outcome}", version=version)

    def _missing(
        self,
        rollout: Reconfiguration,
        waited: float,
        reply: Literal["ACK", "MIGRATED"],
        operator: str | None,
        request: ControlMessage,
    ) -> RolloutTimeout:
        since = max(waited, (utc_now() - request.sent_at).total_seconds())
        who = "the job" if operator is None else f"operator {operator}"
        unverified = (
            f"; {self.rejected} record(s) of the control topic did not verify with "
            "KEYPLANE_CONTROL_KEY here"
            if self.rejected
            else ""
        )
        return RolloutTimeout(
            f"no {reply} from {who} for v{rollout.version} {since:.1f} s after "
            f"{request.describe()} (control topic {self._channel.topic!r}){unverified}; "
            f"{JOB_HINT}",
            version=rollout.version,
            reply=reply,
            operator=operator,
            waited_s=waited,
        )

    def wait_ack(self, timeout_s: float, on_tick: TickCallback | None = None) -> float:
        """Wait until the job acknowledged PREPARE; return the seconds waited.

        Raises :class:`RolloutTimeout` after ``timeout_s``; the rollout stays
        in flight, for the caller to wait again or abort.
        """
        return self._wait(
            lambda rollout: rollout.ack is not None,
            lambda rollout, waited: self._missing(rollout, waited, "ACK", None, rollout.prepare),
            timeout_s,
            on_tick,
        )

    def wait_migrated(
        self, operator: str, timeout_s: float, on_tick: TickCallback | None = None
    ) -> float:
        """Wait until ``operator`` reported MIGRATED; return the seconds waited."""
        rollout = self._rollout(self._load())
        if operator not in rollout.propagated:
            raise ControllerError(
                f"{operator} was not propagated to v{rollout.version}; propagate it first"
            )
        return self._wait(
            lambda rollout: operator in rollout.migrated,
            lambda rollout, waited: self._missing(
                rollout, waited, "MIGRATED", operator, rollout.propagated[operator]
            ),
            timeout_s,
            on_tick,
        )

    # --- the whole exchange --------------------------------------------------------------

    def _steps(self, version: int, timeout_s: float) -> list[_Step]:
        operators = self.operators_for(version)
        steps = [
            _Step(
                "PREPARE",
                f"PREPARE v{version} → ACK",
                functools.partial(self.prepare, version),
                functools.partial(self.wait_ack, timeout_s),
            ),
            _Step(
                "PROPAGATE",
                f"PROPAGATE {', '.join(operators)}",
                functools.partial(self.propagate_all, operators),
                None,
            ),
        ]
        steps += [
            _Step(
                f"MIGRATED {name}",
                f"await MIGRATED {name}",
                None,
                functools.partial(self.wait_migrated, name, timeout_s),
            )
            for name in operators
        ]
        steps.append(_Step("DONE", f"DONE v{version}", self.done, None))
        return steps

    def rollout(
        self,
        version: int,
        *,
        timeout_s: float,
        on_step: Callable[[RolloutProgress], None] | None = None,
    ) -> RolloutResult:
        """PREPARE → ACK → PROPAGATE every operator → every MIGRATED → DONE (000 §3.4).

        ``timeout_s`` bounds the wait for each reply. When one is missing,
        the rollout is aborted (the job returns to the active version) and
        :class:`RolloutTimeout` says which reply was missing. Called again
        after an interruption, it resumes where the state file stands; after
        success it changes nothing. ``on_step`` hears when each step starts,
        at each poll while it waits, and when it ends.
        """
        steps = self._steps(version, timeout_s)
        timings: list[StepTiming] = []
        for index, step in enumerate(steps):
            progress = _StepProgress(step, index, len(steps), on_step)
            progress.report(finished=False)
            if step.act is not None:
                step.act()
            if step.wait is not None:
                try:
                    step.wait(progress.tick)
                except RolloutTimeout as timeout:
                    raise self._aborted(timeout) from timeout
            timings.append(StepTiming(step.step, step.label, progress.elapsed()))
            progress.report(finished=True)
        last = self._required().protocol.last
        assert last is not None and last.version == version
        return RolloutResult(version, last.base, last.checksum, tuple(timings))

    def rollout_waves(
        self,
        versions: Sequence[int],
        *,
        timeout_s: float,
        on_step: Callable[[RolloutProgress], None] | None = None,
    ) -> list[RolloutResult]:
        """Roll out each of ``versions``, the waves of one reconfiguration, in turn.

        Waves (:func:`keyplane.routing.waves.split_into_waves`) spread a large
        rollout's moved states over more micro-batches, so each batch pays a
        share. Called again after an interruption, it skips the waves the
        job already runs past and resumes the one in flight; a timeout aborts
        the wave in flight and leaves the job on the last finished wave, a
        valid configuration. Returns the result of each wave it rolled out or
        found finished.
        """
        results = []
        for version in versions:
            state = self.state
            if state is not None and state.active_version > version:
                continue
            results.append(self.rollout(version, timeout_s=timeout_s, on_step=on_step))
        return results

    def _aborted(self, timeout: RolloutTimeout) -> RolloutTimeout:
        """Abort after a missing reply, and say so in the error."""
        try:
            self.abort()
        except Exception as exc:
            outcome = (
                f"ABORT v{timeout.version} could not be sent ({exc}); run `keyplane config abort`"
            )
            aborted = False
        else:
            outcome = f"rollout of v{timeout.version} aborted"
            aborted = True
        return RolloutTimeout(
            f"{outcome}: {timeout}",
            version=timeout.version,
            reply=timeout.reply,
            operator=timeout.operator,
            waited_s=timeout.waited_s,
            aborted=aborted,
        )


@dataclass(frozen=True)
class _Step:
    """One step of a rollout: the requests to send, the wait for a reply, or both."""

    step: str
    label: str
    act: Callable[[], object] | None
    wait: Callable[[TickCallback], float] | None


class _StepProgress:
    """Reports one step's progress to a rollout's ``on_step`` callback."""

    def __init__(
        self,
        step: _Step,
        index: int,
        total: int,
        on_step: Callable[[RolloutProgress], None] | None,
    ) -> None:
        self._step = step
        self._index = index
        self._total = total
        self._on_step = on_step
        self._started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def report(self, *, finished: bool) -> None:
        if self._on_step is not None:
            step = self._step
            self._on_step(
                RolloutProgress(
                    step.step, step.label, self._index, self._total, self.elapsed(), finished
                )
            )

    def tick(self, _waited: float) -> None:
        self.report(finished=False)
