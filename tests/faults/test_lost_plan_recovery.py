"""A driver killed after it published a reply and before Spark logged the plan (000 §3.4).

The routed source publishes the protocol's replies from ``latestOffset``;
Spark writes the plan to its offset log only after ``latestOffset`` returns.
A driver that dies in between has told the controller MIGRATED, but its
checkpoint does not know it: the restarted driver plans the install batch
again from the previous checkpoint, and by then the controller may already
have sent its next step (DONE, or, from a controller that waits for each
MIGRATED, the next operator's PROPAGATE). That step is read at the same
boundary, *before* the install is re-planned: a DONE must wait for the
install instead of being dropped, or the rollout would stall; a PROPAGATE
may switch its operator in the re-planned batch at once.

Pure logic: the job's and the controller's real state machines, with a fixed
clock so that the interrupted and the uninterrupted run can be compared
field by field.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from keyplane.control.controller_protocol import ControllerProtocol
from keyplane.control.job_protocol import JobProtocol
from keyplane.control.messages import ControlMessage
from keyplane.control.operators import OPERATORS

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
STORE = {v: hashlib.sha256(f"manifest v{v}".encode()).hexdigest() for v in (1, 2)}


def fixed_clock() -> datetime:
    return T0


def checkpoint_of(job: JobProtocol) -> dict[str, Any]:
    """What Spark's offset log would hold for the batch just planned."""
    return json.loads(json.dumps(job.to_dict()))


def revived(checkpoint: dict[str, Any]) -> JobProtocol:
    return JobProtocol.from_dict(checkpoint, lookup_checksum=STORE.get, clock=fixed_clock)


def boundary(
    job: JobProtocol, controller: ControllerProtocol, messages: list[ControlMessage], plan: int
) -> list[ControlMessage]:
    """One ``latestOffset`` of the routed source: react, plan, install what is due, reply."""
    replies: list[ControlMessage] = []
    for message in messages:
        replies += job.on_message(message, plan)
    job.begin_batch(plan)
    for handoff in job.migrating():
        if handoff.switch_batch is not None and handoff.switch_batch == plan - 1:
            replies += job.state_installed(handoff.operator, plan)
    for reply in replies:
        controller.on_message(reply)
    return replies


def prepared() -> tuple[ControllerProtocol, JobProtocol, list[ControlMessage], ControlMessage]:
    """A controller and a job at plan 1, v2 prepared and acknowledged; the topic so far."""
    controller = ControllerProtocol(OPERATORS, 1, STORE[1], clock=fixed_clock)
    job = JobProtocol(OPERATORS, 1, STORE[1], lookup_checksum=STORE.get, clock=fixed_clock)
    topic: list[ControlMessage] = []
    boundary(job, controller, [], 0)
    topic.append(controller.prepare(2, STORE[2]))
    [ack] = boundary(job, controller, topic[-1:], 1)
    return controller, job, topic, ack


def test_done_read_before_a_replanned_install_waits_for_it_with_a_fixed_clock() -> None:
    controller, job, topic, ack = prepared()
    topic += [controller.propagate("A"), controller.propagate("B")]
    boundary(job, controller, topic[-2:], 2)
    switch = checkpoint_of(job)

    # Plan 3 installs A and B and replies both MIGRATED; the driver dies
    # before the offset log holds plan 3. The controller, told, sends DONE.
    migrated = boundary(job, controller, [], 3)
    assert [(m.type, m.operator) for m in migrated] == [("MIGRATED", "A"), ("MIGRATED", "B")]
    topic.append(controller.done())
    assert controller.active_version == 2
    uninterrupted = job
    boundary(uninterrupted, controller, topic[-1:], 4)

    restarted = revived(switch)
    replies = boundary(restarted, controller, topic, 3)
    assert replies == [ack, *migrated]
    assert restarted.active_version == 2 and restarted.pending_version is None
    assert restarted.held == () and restarted.migrating() == ()
    boundary(restarted, controller, [], 4)
    assert restarted.to_dict() == uninterrupted.to_dict()
    assert restarted.routing_for_batch(3) == restarted.routing_for_batch(4) == {"A": 2, "B": 2}


def test_a_propagate_read_before_a_replanned_install_switches_in_it_with_a_fixed_clock() -> None:
    """A controller that waits for A's MIGRATED before propagating B (the paper's order)."""
    controller, job, topic, ack = prepared()
    topic.append(controller.propagate("A"))
    boundary(job, controller, topic[-1:], 2)
    switch_a = checkpoint_of(job)

    # Plan 3 installs A and replies MIGRATED(A); the driver dies before the
    # offset log holds plan 3. The controller, told, propagates B.
    [migrated_a] = boundary(job, controller, [], 3)
    assert (migrated_a.type, migrated_a.operator) == ("MIGRATED", "A")
    topic.append(controller.propagate("B"))

    restarted = revived(switch_a)
    replies = boundary(restarted, controller, topic, 3)
    assert replies == [ack, migrated_a]
    assert restarted.phase("A") == "migrated" and restarted.phase("B") == "switching"
    assert [(h.operator, h.switch_batch) for h in restarted.migrating()] == [("B", 3)]
    assert restarted.routing_for_batch(3) == {"A": 2, "B": 2}

    [migrated_b] = boundary(restarted, controller, [], 4)
    assert (migrated_b.type, migrated_b.operator, migrated_b.batch_id) == ("MIGRATED", "B", 4)
    topic.append(controller.done())
    boundary(restarted, controller, topic[-1:], 5)
    assert restarted.active_version == 2 and restarted.held == ()
    assert controller.active_version == 2 and controller.phase == "idle"


def test_a_next_step_for_an_operator_never_switched_is_still_ignored() -> None:
    """Only an install already in transit makes a step wait; a step out of order is dropped."""
    controller = ControllerProtocol(OPERATORS, 1, STORE[1], clock=fixed_clock)
    job = JobProtocol(OPERATORS, 1, STORE[1], lookup_checksum=STORE.get, clock=fixed_clock)
    boundary(job, controller, [controller.prepare(2, STORE[2])], 0)
    out_of_order_b = ControlMessage(
        type="PROPAGATE",
        config_version=2,
        previous_version=1,
        operator="B",
        checksum=STORE[2],
        sender="controller",
    )
    out_of_order_done = ControlMessage(
        type="DONE", config_version=2, previous_version=1, checksum=STORE[2], sender="controller"
    )

    reactions = [job.react(m, 1) for m in (out_of_order_b, out_of_order_done)]

    assert [(r.outcome, r.reason) for r in reactions] == [
        ("ignored", "upstream_not_propagated"),
        ("ignored", "not_migrated"),
    ]
    assert job.held == ()
