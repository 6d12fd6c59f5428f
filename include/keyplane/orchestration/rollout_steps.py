"""Step 4 of the reconfiguration and scale DAGs: publish a configuration and roll it out to
the running job through the controller's protocol (paper 000 §3.4).

Protocol steps go through :class:`keyplane.control.controller.Controller`, whose
retried steps re-send the same message (same id), which the job ignores.

Gates. :func:`publish` refuses a version without a passed validation record
and a decision to publish, so a configuration Great Expectations rejected
cannot reach the job even if a task were skipped or marked success by hand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from keyplane.orchestration import decision_steps, run_records
from keyplane.orchestration.deployment import Deployment
from keyplane.orchestration.run_records import (
    DECISION,
    PROPOSAL,
    ROLLBACK,
    ROLLOUT,
    SCALE_DAG_ID,
    SCALE_PROPOSAL,
    Refused,
)
from keyplane.routing import config as config_store

if TYPE_CHECKING:
    from keyplane.control.controller_protocol import ControllerState, Reconfiguration

log = logging.getLogger(__name__)

WaitKind = Literal["ack", "migrated", "metrics"]


@contextmanager
def controller(deployment: Deployment) -> Iterator[Any]:
    """A :class:`keyplane.control.controller.Controller` on the deployment's control topic,
    rolling out the pipeline's stages upstream first (000 §3.4)."""
    from keyplane.control.controller import Controller
    from keyplane.kafka.control import ControlChannel

    with ControlChannel(deployment.bootstrap_servers, deployment.control_topic) as channel:
        yield Controller(
            channel, deployment.controller_state, deployment.routing_store, deployment.operators
        )


def require_validated(deployment: Deployment, version: int) -> None:
    path = run_records.validation_path(deployment, version)
    record = run_records.read_record(path, f"the validation record of v{version}")
    if not record.get("success"):
        raise Refused(f"v{version} failed validation; it is never published")
    if record["checksum"] != config_store.checksum(deployment.routing_store, version):
        raise Refused(f"v{version} changed since it was validated")


def _require_planned_on_active(state: ControllerState | None, version: int, parent: int) -> None:
    """Refuse a proposal planned on a version that is no longer active.

    A migration plan is a difference from the version it was computed on
    (000 §3.4), and a proposal is only as good as the statistics of that
    version. Two runs (a scheduled and a manual one) can plan at the same
    time; the controller lets only one roll out, and once it is done the
    other's proposal is stale: its ``publish``, retried, fails saying so
    rather than rolling out a plan for a job that no longer exists. A
    retried ``publish`` of a version the controller already took is let
    through: it re-sends the same PREPARE.
    """
    if state is None or parent == state.active_version:
        return
    if version in {r.version for r in (state.current, state.last) if r is not None}:
        return
    raise Refused(
        f"v{version} was planned from v{parent}, but v{state.active_version} is active now; "
        f"it is stale and will not be published (the next run plans from v{state.active_version})"
    )


def publish(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """PREPARE the run's proposal (000 §3.4) once it was validated and chosen.

    Only one rollout is ever in flight: the controller takes its file lock and
    refuses a second version until the first is done or aborted, so of two
    runs that publish at once one fails naming the other.
    """
    folder = run_records.reconfigure_folder(deployment, run_id)
    decision = run_records.read_record(folder / DECISION, "the decision")
    if not decision["publish"]:
        raise Refused(f"the decision was not to publish: {decision['reason']}")
    decision_steps.require_approved(folder)
    version = int(decision["version"])
    require_validated(deployment, version)
    proposal, _ = run_records.read_proposal(deployment, run_id)
    parent = proposal.waves[-1] if proposal.waves else proposal.parent_version
    return publish_version(deployment, version, parent)


def advance_waves(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Send what the proposal's waves need next; say which reply to await, if any.

    The waves before the proposal's last version roll out one after the
    other, each a whole rollout (000 §3.4: PREPARE → ACK → PROPAGATE every
    operator → every MIGRATED → DONE); the last version then goes through
    the DAG's own ``publish`` and rollout tasks, and ``verify`` judges it
    against the version before the waves. Each call reads the job's replies,
    takes every step they allow (finishing a wave and preparing the next),
    and returns ``wait``: ``"ack"``, ``"migrated"`` (of ``operator``) or
    None once every wave is done, for
    :class:`~keyplane.orchestration.triggers.RollOutWavesOperator` to defer
    on. Its steps follow from the controller's state file alone, so a call
    after a crash, a retry or a lost trigger resumes where the waves stand
    and sends nothing for waves the job already runs.
    """
    folder = run_records.reconfigure_folder(deployment, run_id)
    decision = run_records.read_record(folder / DECISION, "the decision")
    if not decision["publish"]:
        raise Refused(f"the decision was not to publish: {decision['reason']}")
    proposal, _ = run_records.read_proposal(deployment, run_id)
    waves = list(proposal.waves)

    def step(
        wait: str | None, version: int | None = None, operator: str | None = None
    ) -> dict[str, Any]:
        return {"waves": waves, "version": version, "wait": wait, "operator": operator}

    if not waves:
        return step(None)
    for wave in waves:
        require_validated(deployment, wave)
    with controller(deployment) as control:
        control.poll()
        state = control.state
        if state is not None and state.active_version not in (
            proposal.parent_version,
            *waves,
            proposal.version,
        ):
            _require_planned_on_active(state, waves[0], proposal.parent_version)
        while True:
            state = control.state
            pending = [w for w in waves if state is None or w > state.active_version]
            if not pending:
                return step(None)
            wave = pending[0]
            number = f"wave {waves.index(wave) + 1} of {len(waves) + 1}"
            current = None if state is None else state.current
            if current is None or current.version != wave:
                control.prepare(wave)
                log.info("PREPARE v%d (%s)", wave, number)
                return step("ack", wave)
            if current.ack is None:
                return step("ack", wave)
            operators = control.operators_for(wave)
            unsent = [name for name in operators if name not in current.propagated]
            if unsent:
                control.propagate_all(unsent, version=wave)
                log.info("PROPAGATE v%d to %s (%s)", wave, ", ".join(unsent), number)
            missing = [name for name in operators if name not in current.migrated]
            if missing:
                return step("migrated", wave, missing[0])
            control.done(version=wave)
            log.info("DONE v%d (%s)", wave, number)


def publish_version(deployment: Deployment, version: int, parent: int) -> dict[str, Any]:
    """PREPARE ``version``, planned on ``parent``, once validated (the reconfigure and
    scale DAGs' publish)."""
    require_validated(deployment, version)
    with controller(deployment) as control:
        _require_planned_on_active(control.state, version, parent)
        message = control.prepare(version)
    log.info("PREPARE v%d sent (planned on v%d); awaiting the job's ACK", version, parent)
    return {"version": version, "message_id": str(message.message_id)}


def propagate(
    deployment: Deployment, operators: Sequence[str], version: int | None = None
) -> dict[str, Any]:
    """PROPAGATE ``version`` to every one of ``operators``, upstream first, in one publish
    (after the ACK), so the job switches them all in the same micro-batch.

    ``version`` is the one the run PREPAREd; if another is in flight (the
    run's was aborted and an operator published one by hand), the step is
    refused rather than propagating theirs. None: whatever is in flight. A
    retry re-sends the same messages, which the job ignores as duplicates.
    """
    with controller(deployment) as control:
        messages = control.propagate_all(operators, version=version)
    log.info(
        "PROPAGATE v%d sent to %s in one publish",
        messages[0].config_version,
        ", ".join(m.operator or "?" for m in messages),
    )
    return {
        "version": messages[0].config_version,
        "operators": [m.operator for m in messages],
    }


def metrics_end(deployment: Deployment) -> dict[int, int]:
    """The metrics topic's end offsets: where records of later batches start."""
    from keyplane.kafka.admin import ensure_topic, high_watermarks

    ensure_topic(deployment.bootstrap_servers, deployment.metrics_topic, 1)
    return high_watermarks(deployment.bootstrap_servers, deployment.metrics_topic)


def done(
    deployment: Deployment,
    run_id: str,
    record_name: str = ROLLOUT,
    version: int | None = None,
) -> dict[str, Any]:
    """Send DONE: the new version becomes active. Records where its metrics begin."""
    return done_into(
        deployment, run_records.reconfigure_folder(deployment, run_id) / record_name, version
    )


def done_into(deployment: Deployment, record: Path, version: int | None = None) -> dict[str, Any]:
    """Send DONE and write the rollout record (version, metrics start) to ``record``.

    ``version`` as for :func:`propagate`. :func:`~keyplane.orchestration.verification_steps.verify`
    measures the batches from the record's metrics start on, so every try must record the same
    start. It is reserved once, before DONE is sent, when every operator has MIGRATED: read after
    DONE, a try that died between DONE and its record left its retry measuring from later, skipping
    the batches between. The batches from the reservation on already run the new version (an
    operator switches before its MIGRATED), and verify keeps only the new version's batches. Should
    the controller learn of the last MIGRATED only as it sends DONE, the start is reserved after
    DONE, as before.
    """
    reserved = record.with_name(f"{record.stem}.metrics-start.json")

    def reserve() -> dict[str, Any]:
        if reserved.is_file():
            return run_records.read_record(reserved, "the reserved metrics start")
        ends = metrics_end(deployment)
        return run_records.write_once(
            reserved, {"metrics_start": {str(p): o for p, o in ends.items()}}
        )

    with controller(deployment) as control:
        state = control.state
        migrated = None if state is None else state.migrated_rollout
        if migrated is not None and version in (None, migrated.version):
            reserve()
        message = control.done(version=version)
    start = reserve()["metrics_start"]
    written = run_records.write_once(
        record, {"version": message.config_version, "metrics_start": start}
    )
    log.info("DONE v%d sent: it is the job's active version", written["version"])
    return written


def reply_arrived(
    deployment: Deployment,
    kind: Literal["ack", "migrated"],
    operator: str | None = None,
    *,
    version: int | None = None,
) -> bool:
    """Whether the job's ACK (or ``operator``'s MIGRATED) for the rollout is in.

    One poll of the control topic through the controller, which records the
    replies in its state file: the check a deferrable trigger repeats. A
    PREPARE the job answered with REFUSED raises
    :class:`~keyplane.control.controller.ControllerError` with the job's reason.
    ``version`` is the version the wait is for (:func:`awaited_rollout`);
    None takes the rollout in flight, else the last one.
    """
    with controller(deployment) as control:
        control.poll()
        rollout = awaited_rollout(control.state, version)
        if kind == "ack":
            if rollout.ack is None and rollout.refused is not None:
                from keyplane.control.controller import ControllerError

                raise ControllerError(
                    f"the job refused v{rollout.version}: {rollout.refused.reason}"
                )
            return rollout.ack is not None
        assert operator is not None
        return operator in rollout.migrated


def awaited_rollout(state: ControllerState | None, version: int | None) -> Reconfiguration:
    """The rollout of ``version`` in the controller's state; raise if it cannot be awaited.

    A wait that took whatever is in flight would, after an operator aborted
    the run's v2 and published v3, report v3's ACK as the run's; so a wait
    names its version and :func:`keyplane.control.controller_protocol.rollout_for` judges it as
    it judges the protocol's steps. Its refusal is raised as a
    :class:`~keyplane.control.controller.ControllerError`, as the controller's other
    refusals to wait are.
    """
    from keyplane.control.controller import ControllerError
    from keyplane.control.controller_protocol import rollout_for
    from keyplane.control.messages import ProtocolError

    try:
        return rollout_for(state, version)
    except ProtocolError as refused:
        raise ControllerError(str(refused)) from None


def abort(deployment: Deployment, versions: Collection[int]) -> int | None:
    """ABORT the rollout in flight if it is one of ``versions``; return the version aborted.

    The job returns to its active version. A version not in ``versions`` is
    left alone: it belongs to another run or to ``keyplane config publish``,
    which share the controller, and aborting it would undo a rollout the
    caller knows nothing of.
    """
    with controller(deployment) as control:
        message = control.abort_any_of(versions)
    return None if message is None else message.config_version


def run_versions(deployment: Deployment, dag_id: str, run_id: str) -> tuple[int, ...]:
    """Every version a DAG run stored to roll out: its waves, its proposal, its rollback.

    Read from the records of ``dag_id``'s run
    (:func:`~keyplane.orchestration.run_records.run_folder`): ``proposal.json`` and
    ``rollback.json`` of a reconfiguration run, ``scale_proposal.json`` of a scale run. A caller
    that knows only the run (the DAGs' failure callback, a wave task whose deferral failed) passes
    them to :func:`abort` so that it aborts only this run's version, not that of the other DAG's run
    of the same id.
    """
    folder = run_records.run_folder(deployment, dag_id, run_id)
    versions: list[int] = []
    if dag_id == SCALE_DAG_ID:
        names: tuple[str, ...] = (SCALE_PROPOSAL,)
    else:
        proposal = folder / PROPOSAL
        if proposal.is_file():
            record = json.loads(proposal.read_text())
            versions += [int(v) for v in record.get("waves", ())] + [int(record["version"])]
        names = (ROLLBACK,)
    for name in names:
        path = folder / name
        if path.is_file():
            versions.append(int(json.loads(path.read_text())["version"]))
    return tuple(versions)
