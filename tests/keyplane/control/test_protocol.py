"""Tests of the reconfiguration protocol of paper 000 §3.4 (keyplane.control.messages).

The two state machines are pure, so these tests drive them directly; messages
between them go through the signed wire form, as they would on Kafka.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from keyplane.control.controller_protocol import ControllerProtocol, ControllerState, rollout_for
from keyplane.control.job_protocol import REPLAYABLE_BATCHES, JobProtocol
from keyplane.control.messages import (
    ControlMessage,
    InvalidMessage,
    ProtocolError,
    UnplannedBatchError,
    decode,
    encode,
)
from keyplane.control.signing import canonical_json, sign

KEY = b"control-key-for-tests-0123456789"
T0 = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
OPS = ("A", "B")
STORE = {v: hashlib.sha256(f"manifest v{v}".encode()).hexdigest() for v in range(1, 200)}


def fixed_clock() -> datetime:
    return T0


def new_job(operators: tuple[str, ...] = OPS) -> JobProtocol:
    return JobProtocol(operators, 1, STORE[1], lookup_checksum=STORE.get, clock=fixed_clock)


def checkpoint_of(job: JobProtocol) -> dict[str, Any]:
    """The job's checkpoint as the offset log holds it: JSON."""
    return json.loads(json.dumps(job.to_dict()))


def from_checkpoint(checkpoint: dict[str, Any]) -> JobProtocol:
    return JobProtocol.from_dict(checkpoint, lookup_checksum=STORE.get, clock=fixed_clock)


def restored(job: JobProtocol) -> JobProtocol:
    """The job as a restarted driver gets it back from its JSON checkpoint."""
    return from_checkpoint(checkpoint_of(job))


def wire(message: ControlMessage) -> ControlMessage:
    return decode(encode(message, KEY), KEY)


def command(
    kind: str, version: int, base: int | None, operator: str | None = None
) -> ControlMessage:
    return ControlMessage(
        type=kind,
        config_version=version,
        previous_version=base,
        operator=operator,
        checksum=STORE[version],
        sender="controller",
        sent_at=T0,
    )


@dataclass
class Deployment:
    """A controller and a job joined by a signed, in-order control topic.

    ``planned`` keeps the routing of every batch as it was planned, and
    ``checkpoints`` the checkpoint written with it, as Spark's offset log does.
    """

    job: JobProtocol = field(default_factory=new_job)
    controller: ControllerProtocol = field(
        default_factory=lambda: ControllerProtocol(OPS, 1, STORE[1], clock=fixed_clock)
    )
    batch: int = 0
    planned: dict[int, dict[str, int]] = field(default_factory=dict)
    checkpoints: dict[int, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.plan()

    def plan(self) -> dict[str, int]:
        self.planned[self.batch] = self.job.begin_batch(self.batch)
        self.checkpoints[self.batch] = checkpoint_of(self.job)
        return self.planned[self.batch]

    def send(self, message: ControlMessage) -> list[ControlMessage]:
        replies = self.job.on_message(wire(message), self.batch + 1)
        for reply in replies:
            self.controller.on_message(wire(reply))
        return replies

    def tick(self) -> dict[str, int]:
        self.batch += 1
        return self.plan()

    def install(self, operator: str) -> list[ControlMessage]:
        replies = self.job.state_installed(operator, self.batch)
        for reply in replies:
            self.controller.on_message(wire(reply))
        return replies

    def rollout(self, version: int) -> None:
        """Roll ``version`` out the way the DAG does: every PROPAGATE, then every MIGRATED."""
        self.send(self.controller.prepare(version, STORE[version]))
        self.tick()
        for operator in OPS:
            self.send(self.controller.propagate(operator))
        self.tick()
        self.tick()
        for operator in OPS:
            self.install(operator)
        self.send(self.controller.done())
        self.tick()


# --- the message model and its wire form -------------------------------------------------


def test_message_fields_must_fit_the_type() -> None:
    with pytest.raises(ValidationError, match="names the operator"):
        command("PROPAGATE", 2, 1)
    with pytest.raises(ValidationError, match="operator must be null"):
        command("PREPARE", 2, 1, operator="A")
    with pytest.raises(ValidationError, match="sent by the job"):
        ControlMessage(type="ACK", config_version=2, checksum="c", sender="controller", batch_id=1)
    with pytest.raises(ValidationError, match="micro-batch id"):
        ControlMessage(type="ACK", config_version=2, checksum="c", sender="job")
    with pytest.raises(ValidationError, match="no batch_id"):
        ControlMessage(type="DONE", config_version=2, checksum="c", sender="controller", batch_id=3)
    with pytest.raises(ValidationError, match="starts from"):
        ControlMessage(type="PREPARE", config_version=2, checksum="c", sender="controller")
    with pytest.raises(ValidationError, match="must be older"):
        command("PREPARE", 2, 2)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ControlMessage.model_validate(
            {**command("PREPARE", 2, 1).model_dump(), "config_version": 0}
        )


def test_encode_then_decode_returns_the_message_with_its_signature() -> None:
    message = command("PROPAGATE", 3, 2, operator="B")

    raw = encode(message, KEY)
    decoded = decode(raw, KEY)

    assert decoded.signature is not None and len(decoded.signature) == 64
    assert decoded.model_copy(update={"signature": None}) == message
    assert json.loads(raw)["operator"] == "B"
    assert encode(decoded, KEY) == raw


def signed(fields: dict[str, Any], key: bytes = KEY) -> bytes:
    """Sign arbitrary fields, as a buggy or newer producer holding the key would."""
    return canonical_json({**fields, "signature": sign(fields, key)})


def reason_of(raw: bytes) -> str:
    with pytest.raises(InvalidMessage) as caught:
        decode(raw, KEY)
    assert caught.value.reason in str(caught.value)
    return caught.value.reason


def test_decode_rejects_each_kind_of_bad_message_with_its_reason() -> None:
    good = command("PREPARE", 2, 1)
    body = good.model_dump(mode="json", exclude={"signature"})
    raw = json.loads(encode(good, KEY))

    assert reason_of(b"{not json") == "not_json"
    assert reason_of(b"\xff\xfe") == "not_json"
    assert reason_of(b'{"config_version": NaN}') == "not_json"
    assert reason_of(b"[1, 2]") == "schema"
    assert reason_of(canonical_json(body)) == "missing_signature"
    assert reason_of(canonical_json({**body, "signature": ""})) == "missing_signature"
    assert reason_of(encode(good, b"another-key-another-key-another!")) == "bad_signature"
    assert reason_of(canonical_json({**raw, "config_version": 3})) == "bad_signature"
    assert reason_of(canonical_json({**raw, "signature": "0" * 64})) == "bad_signature"
    assert reason_of(signed({**body, "type": "RESHARD"})) == "unknown_type"
    assert reason_of(canonical_json({**body, "type": "RESHARD"})) == "missing_signature"
    assert reason_of(signed({**body, "config_version": 0})) == "schema"
    assert reason_of(signed({**body, "config_version": "2"})) == "schema"
    assert reason_of(signed({**body, "surprise": True})) == "schema"
    assert reason_of(signed({**body, "sender": "job"})) == "schema"
    assert reason_of(signed({key: v for key, v in body.items() if key != "checksum"})) == "schema"


def test_decode_refuses_input_nested_too_deep_for_the_parser_as_not_json() -> None:
    """A forged record must not raise past decode: the job would stop at it for good."""
    body = command("PREPARE", 2, 1).model_dump(mode="json", exclude={"signature"})
    deep = b"[" * 300 + b"]" * 300

    assert reason_of(b"[" * 100_000) == "not_json"
    assert reason_of(b'{"a":' * 100_000) == "not_json"
    assert reason_of(deep) == "not_json"
    assert reason_of(signed({**body, "checksum": json.loads(deep)})) == "not_json"


def test_decode_refuses_a_type_that_is_not_a_string_as_schema() -> None:
    body = command("PREPARE", 2, 1).model_dump(mode="json", exclude={"signature"})

    for kind in ([], {}, ["PREPARE"], {"PREPARE": 1}, 1, None):
        assert reason_of(signed({**body, "type": kind})) == "schema", kind
    assert reason_of(canonical_json({**body, "type": []})) == "missing_signature"
    with pytest.raises(InvalidMessage, match="type: expected a string, got list"):
        decode(signed({**body, "type": []}), KEY)


def test_schema_errors_say_which_field_is_wrong() -> None:
    body = command("PREPARE", 2, 1).model_dump(mode="json", exclude={"signature"})
    with pytest.raises(InvalidMessage, match="config_version"):
        decode(signed({**body, "config_version": -1}), KEY)


# --- the happy path ----------------------------------------------------------------------


def test_rollout_v1_to_v2_to_v3_switches_both_stages_in_one_batch_and_replays_the_last() -> None:
    d = Deployment()
    job, controller = d.job, d.controller

    [ack] = d.send(controller.prepare(2, STORE[2]))
    assert (ack.type, ack.config_version, ack.previous_version, ack.batch_id) == ("ACK", 2, 1, 1)
    assert controller.phase == "prepared" and controller.awaiting() == ()
    assert job.pending_version == 2 and job.next_routing() == {"A": 1, "B": 1}
    with pytest.raises(ProtocolError, match="upstream A is propagated"):
        controller.propagate("B")
    assert d.tick() == {"A": 1, "B": 1}

    assert d.send(controller.propagate("A")) == []
    assert d.send(controller.propagate("B")) == []
    assert job.next_routing() == {"A": 2, "B": 2}
    assert [
        (h.operator, h.from_version, h.to_version, h.switch_batch) for h in job.migrating()
    ] == [("A", 1, 2, None), ("B", 1, 2, None)]
    assert d.tick() == {"A": 2, "B": 2}
    assert [h.switch_batch for h in job.migrating()] == [2, 2]
    assert [(w.reply, w.operator) for w in controller.awaiting()] == [
        ("MIGRATED", "A"),
        ("MIGRATED", "B"),
    ]
    with pytest.raises(ProtocolError, match="A, B not migrated"):
        controller.done()

    d.tick()
    [migrated_a] = d.install("A")
    [migrated_b] = d.install("B")
    assert [
        (m.type, m.operator, m.config_version, m.batch_id) for m in (migrated_a, migrated_b)
    ] == [
        ("MIGRATED", "A", 2, 3),
        ("MIGRATED", "B", 2, 3),
    ]
    assert job.phase("A") == job.phase("B") == "migrated" and job.migrating() == ()
    assert controller.phase == "migrated" and controller.awaiting() == ()
    done = controller.done()
    assert d.send(done) == []
    assert job.active_version == 2 and job.pending_version is None
    assert job.state.active_checksum == STORE[2]
    assert controller.active_version == 2 and controller.phase == "idle"
    assert d.tick() == {"A": 2, "B": 2}
    assert [d.planned[b] for b in range(5)] == [{"A": 1, "B": 1}] * 2 + [{"A": 2, "B": 2}] * 3
    assert [job.routing_for_batch(b) for b in (3, 4)] == [d.planned[3], d.planned[4]]

    d.rollout(3)

    assert job.active_version == 3 and controller.active_version == 3
    timeline = [d.planned[b] for b in range(d.batch + 1)]
    assert [job.routing_for_batch(b) for b in (d.batch - 1, d.batch)] == timeline[-2:]
    assert [(r["A"], r["B"]) for r in timeline] == [
        (1, 1), (1, 1), (2, 2), (2, 2), (2, 2),
        (2, 2), (3, 3), (3, 3), (3, 3),
    ]  # fmt: skip
    assert job.ignored == {}


def test_the_papers_order_still_works_b_propagated_only_after_a_migrated() -> None:
    """A controller that waits for each MIGRATED (000 §3.4 as written) is still served:
    B then switches in A's install batch or later."""
    d = Deployment()
    job, controller = d.job, d.controller
    d.send(controller.prepare(2, STORE[2]))
    d.tick()
    d.send(controller.propagate("A"))
    assert d.tick() == {"A": 2, "B": 1}
    d.tick()
    d.install("A")

    d.send(controller.propagate("B"))
    assert job.phase("A") == "migrated" and job.phase("B") == "switching"
    assert d.tick() == {"A": 2, "B": 2}
    d.tick()
    d.install("B")
    d.send(controller.done())

    assert job.active_version == 2 and job.ignored == {}
    assert [(h.operator, h.switch_batch) for h in job.migrating()] == []
    timeline = [d.planned[b] for b in range(d.batch + 1)]
    assert [(r["A"], r["B"]) for r in timeline] == [(1, 1), (1, 1), (2, 1), (2, 1), (2, 2), (2, 2)]
    assert [job.routing_for_batch(b) for b in (d.batch - 1, d.batch)] == timeline[-2:]


def test_b_propagated_while_a_is_in_its_install_batch_switches_in_that_batch() -> None:
    """The DAG's two PROPAGATE tasks may straddle a batch boundary: B then
    switches one batch after A, in A's install batch, and nothing waits."""
    d = Deployment()
    job, controller = d.job, d.controller
    d.send(controller.prepare(2, STORE[2]))
    d.tick()
    d.send(controller.propagate("A"))
    d.tick()
    d.send(controller.propagate("B"))
    assert d.tick() == {"A": 2, "B": 2}
    assert [(h.operator, h.switch_batch) for h in job.migrating()] == [("A", 2), ("B", 3)]
    [migrated_a] = d.install("A")
    assert migrated_a.batch_id == 3 and job.phase("B") == "switching"
    d.tick()
    [migrated_b] = d.install("B")
    assert migrated_b.batch_id == 4
    d.send(controller.done())
    assert job.active_version == 2 and job.ignored == {}


# --- stale, unknown and wrong messages ------------------------------------------------------


def test_stale_and_unknown_versions_are_ignored_and_the_job_keeps_the_last_good_one() -> None:
    d = Deployment()
    d.rollout(2)
    job = d.job
    before = job.to_dict()

    stale = job.react(command("PREPARE", 2, 1), 20)
    unknown_checksum = job.react(
        command("PREPARE", 3, 2).model_copy(update={"checksum": "f" * 64}), 20
    )
    not_stored = job.react(
        ControlMessage(
            type="PREPARE",
            config_version=500,
            previous_version=2,
            checksum="a" * 64,
            sender="controller",
        ),
        20,
    )
    wrong_base = job.react(command("PREPARE", 3, 1), 20)

    assert (stale.outcome, stale.reason) == ("ignored", "stale_version")
    assert (unknown_checksum.reason, not_stored.reason) == ("unknown_checksum", "unknown_checksum")
    assert "holds no such version" in not_stored.detail
    assert wrong_base.reason == "wrong_base"
    assert job.to_dict() == before
    assert job.active_version == 2 and job.next_routing() == {"A": 2, "B": 2}
    assert job.ignored == {"stale_version": 1, "unknown_checksum": 2, "wrong_base": 1}


def test_messages_that_do_not_fit_the_pending_version_are_ignored() -> None:
    job = new_job()
    job.begin_batch(0)
    job.on_message(command("PREPARE", 2, 1), 1)
    before = job.to_dict()

    forged_checksum = command("PROPAGATE", 2, 1, "A").model_copy(update={"checksum": "0" * 64})
    reasons = [
        job.react(forged_checksum, 1).reason,
        job.react(command("PROPAGATE", 2, 1, "Z"), 1).reason,
        job.react(command("PROPAGATE", 2, 1, "B"), 1).reason,
        job.react(command("DONE", 2, 1), 1).reason,
        job.react(command("DONE", 4, 3), 1).reason,
        job.react(command("ABORT", 1, None), 1).reason,
    ]
    ack = ControlMessage(
        type="ACK",
        config_version=2,
        previous_version=1,
        checksum=STORE[2],
        sender="job",
        batch_id=1,
    )
    reasons.append(job.react(ack, 1).reason)

    assert reasons == [
        "checksum_mismatch",
        "unknown_operator",
        "upstream_not_propagated",
        "not_migrated",
        "not_prepared",
        "already_done",
        "own_message",
    ]
    assert job.to_dict() == before


# --- duplicates and reordering ------------------------------------------------------------------


def test_duplicates_get_the_same_reply_and_change_nothing() -> None:
    d = Deployment()
    prepare = d.controller.prepare(2, STORE[2])
    [ack] = d.send(prepare)
    after_prepare = d.job.to_dict()

    assert d.send(prepare) == [ack]
    resent_by_a_new_controller = prepare.model_copy(
        update={"message_id": UUID(int=7), "sent_at": T0 + timedelta(hours=1)}
    )
    assert d.send(resent_by_a_new_controller) == [ack]
    assert d.job.to_dict() == after_prepare

    d.tick()
    propagate = d.controller.propagate("A")
    d.send(propagate)
    d.send(propagate)
    d.tick()
    d.tick()
    [migrated] = d.install("A")
    assert d.install("A") == [migrated]
    assert d.send(propagate) == [migrated]
    settled = d.job.to_dict()
    d.send(prepare)
    assert d.job.to_dict() == settled

    d.send(d.controller.propagate("B"))
    d.tick()
    d.install("B")
    done = d.controller.done()
    d.send(done)
    finished = d.job.to_dict()
    for message in (done, prepare, propagate):
        d.send(message)
    assert d.job.to_dict() == finished
    assert d.install("A") == []


def test_propagate_before_prepare_is_held_until_the_prepare_arrives() -> None:
    job = new_job()
    job.begin_batch(0)

    early = job.react(command("PROPAGATE", 2, 1, "A"), 1)
    again = job.react(command("PROPAGATE", 2, 1, "A"), 1)
    assert (early.outcome, again.outcome) == ("held", "held")
    assert len(job.held) == 1 and job.next_routing() == {"A": 1, "B": 1}

    [ack] = job.on_message(command("PREPARE", 2, 1), 1)

    assert ack.type == "ACK"
    assert job.held == () and job.phase("A") == "switching"
    assert job.next_routing() == {"A": 2, "B": 1}


def test_a_downstream_propagate_held_before_prepare_is_rejected_when_released() -> None:
    job = new_job()
    job.begin_batch(0)
    job.on_message(command("PROPAGATE", 2, 1, "B"), 1)

    job.on_message(command("PREPARE", 2, 1), 1)

    assert job.held == () and job.phase("B") == "prepared"
    assert job.ignored == {"upstream_not_propagated": 1}


def test_next_prepare_waits_for_the_rollout_in_flight_to_finish() -> None:
    d = Deployment()
    d.send(d.controller.prepare(2, STORE[2]))
    d.tick()
    for operator in OPS:
        d.send(d.controller.propagate(operator))
        d.tick()
        d.install(operator)

    early = d.job.react(command("PREPARE", 3, 2), d.batch + 1)
    assert early.outcome == "held" and d.job.pending_version == 2

    reaction = d.job.react(command("DONE", 2, 1), d.batch + 1)

    assert reaction.outcome == "applied"
    [ack] = reaction.replies
    assert (ack.type, ack.config_version, ack.previous_version) == ("ACK", 3, 2)
    assert d.job.active_version == 2 and d.job.pending_version == 3


# --- abort -------------------------------------------------------------------------------------


def test_abort_returns_every_operator_to_the_previous_version() -> None:
    d = Deployment()
    d.send(d.controller.prepare(2, STORE[2]))
    d.tick()
    d.send(d.controller.propagate("A"))
    d.tick()
    d.tick()
    d.install("A")
    d.send(d.controller.propagate("B"))
    assert d.job.next_routing() == {"A": 2, "B": 2}

    abort = d.controller.abort()
    assert d.send(abort) == []

    job = d.job
    assert job.active_version == 1 and job.pending_version is None
    assert job.next_routing() == {"A": 1, "B": 1}
    assert job.phase("B") == "steady", "B never routed a batch on v2, so it has nothing to move"
    [(operator, source, target, switch)] = [
        (h.operator, h.from_version, h.to_version, h.switch_batch) for h in job.migrating()
    ]
    assert (operator, source, target, switch) == ("A", 2, 1, None)

    assert d.tick() == {"A": 1, "B": 1}
    assert job.migrating()[0].switch_batch == d.batch
    d.tick()
    assert d.install("A") == []
    assert job.phase("A") == "steady" and job.migrating() == ()
    assert [d.planned[b]["A"] for b in range(d.batch + 1)] == [1, 1, 2, 2, 1, 1]
    assert [job.version_for_batch(b, "A") for b in (d.batch - 1, d.batch)] == [1, 1]
    assert job.version_for_batch(d.batch, "B") == 1

    assert job.react(command("PREPARE", 2, 1), d.batch + 1).reason == "stale_version"
    assert d.controller.abort() == abort
    with pytest.raises(ProtocolError, match="v2 was aborted"):
        d.controller.prepare(2, STORE[2])
    with pytest.raises(ProtocolError, match="v2 was aborted"):
        d.controller.propagate("A")
    d.rollout(3)
    assert job.active_version == 3


def test_a_prepare_sent_while_state_is_reverting_waits_for_the_revert() -> None:
    d = Deployment()
    d.send(d.controller.prepare(2, STORE[2]))
    d.tick()
    d.send(d.controller.propagate("A"))
    d.tick()
    d.send(d.controller.abort())

    prepare = d.controller.prepare(3, STORE[3])
    assert prepare.previous_version == 1
    assert d.send(prepare) == []
    assert [m.message_id for m in d.job.held] == [prepare.message_id]

    d.tick()
    replies = d.install("A")

    assert [(r.type, r.config_version) for r in replies] == [("ACK", 3)]
    assert d.controller.phase == "prepared"
    assert d.job.pending_version == 3 and d.job.held == ()


def test_abort_of_a_version_never_prepared_means_it_is_never_prepared() -> None:
    job = new_job()
    job.begin_batch(0)

    assert job.react(command("ABORT", 2, 1), 1).outcome == "applied"
    assert job.react(command("PREPARE", 2, 1), 1).reason == "stale_version"
    assert job.pending_version is None and job.active_version == 1


# --- restarts -----------------------------------------------------------------------------------


def test_killed_after_propagate_and_before_migrated_restores_and_replays_to_the_same_state() -> (
    None
):
    prepare = command("PREPARE", 2, 1)
    propagate_a = command("PROPAGATE", 2, 1, "A")
    propagate_b = command("PROPAGATE", 2, 1, "B")
    done = command("DONE", 2, 1)

    def until_the_kill(job: JobProtocol) -> list[ControlMessage]:
        job.begin_batch(0)
        replies = job.on_message(prepare, 1)
        job.begin_batch(1)
        replies += job.on_message(propagate_a, 2)
        job.begin_batch(2)
        return replies

    def after_the_kill(job: JobProtocol) -> list[ControlMessage]:
        job.begin_batch(3)
        replies = job.state_installed("A", 3)
        replies += job.on_message(propagate_b, 4)
        job.begin_batch(4)
        replies += job.state_installed("B", 4)
        return replies

    uninterrupted = new_job()
    until_the_kill(uninterrupted)
    expected_replies = after_the_kill(uninterrupted)
    expected_before_done = uninterrupted.to_dict()
    uninterrupted.on_message(done, 5)

    killed = new_job()
    [ack] = until_the_kill(killed)
    # The checkpoint written with batch 2: A routes on v2 from batch 2, its
    # state is not installed yet, and MIGRATED(A) was never sent.
    checkpoint = json.loads(json.dumps(killed.to_dict()))
    del killed

    revived = JobProtocol.from_dict(checkpoint, lookup_checksum=STORE.get, clock=fixed_clock)
    assert revived.begin_batch(2) == {"A": 2, "B": 1}
    assert revived.on_message(prepare, 3) == [ack]
    assert revived.on_message(propagate_a, 3) == []
    assert revived.to_dict() == checkpoint
    replies = after_the_kill(revived)

    assert replies == expected_replies
    assert [(r.type, r.operator, r.batch_id) for r in replies] == [
        ("MIGRATED", "A", 3),
        ("MIGRATED", "B", 4),
    ]
    assert revived.to_dict() == expected_before_done
    revived.on_message(done, 5)
    assert revived.to_dict() == uninterrupted.to_dict()
    assert [revived.routing_for_batch(b) for b in (3, 4)] == [
        uninterrupted.routing_for_batch(b) for b in (3, 4)
    ]


def test_a_replayed_batch_routes_as_the_first_time_even_after_the_state_moved_on() -> None:
    d = Deployment()
    d.rollout(2)
    d.rollout(3)
    job = restored(d.job)

    assert job.begin_batch(d.batch - 1) == d.planned[d.batch - 1] == {"A": 3, "B": 3}
    assert job.begin_batch(d.batch) == d.planned[d.batch]
    assert job.next_routing() == {"A": 3, "B": 3}
    for batch, checkpoint in d.checkpoints.items():
        # What a driver killed after Spark logged ``batch`` replays, rollouts later.
        assert from_checkpoint(checkpoint).begin_batch(batch) == d.planned[batch]
    with pytest.raises(ProtocolError, match="never planned"):
        job.begin_batch(d.batch + 2)
    with pytest.raises(UnplannedBatchError):
        job.version_for_batch(d.batch + 1, "A")
    with pytest.raises(KeyError, match="unknown operator"):
        job.version_for_batch(0, "Z")


def route_changes(planned: dict[int, dict[str, int]], operator: str) -> list[list[int]]:
    """Every change of ``operator``'s routing, as the checkpoint's JSON holds it."""
    changes: list[list[int]] = []
    for batch in sorted(planned):
        if not changes or changes[-1][1] != planned[batch][operator]:
            changes.append([batch, planned[batch][operator]])
    return changes


def test_after_many_rollouts_the_checkpoint_stays_bounded_and_still_replays_its_last_batch() -> (
    None
):
    """The checkpoint is in every offset-log entry: it must not grow with each rollout."""
    d = Deployment()
    for version in range(2, 5):
        d.rollout(version)
    few = len(json.dumps(d.job.to_dict()))
    for version in range(5, 151):
        d.rollout(version)
    many = len(json.dumps(d.job.to_dict()))
    assert many < few + 40, f"{few} bytes after 3 rollouts, {many} after 149"
    assert all(len(changes) <= REPLAYABLE_BATCHES for changes in d.job.state.routes.values())

    # v151's switch batch is the last one planned when the driver dies.
    d.send(d.controller.prepare(151, STORE[151]))
    d.tick()
    for operator in OPS:
        d.send(d.controller.propagate(operator))
    switch = d.batch + 1
    assert d.tick() == {"A": 151, "B": 151}
    job = from_checkpoint(d.checkpoints[switch])

    assert job.begin_batch(switch) == d.planned[switch] == {"A": 151, "B": 151}
    assert job.begin_batch(switch - 1) == d.planned[switch - 1] == {"A": 150, "B": 150}
    assert (
        from_checkpoint(d.checkpoints[switch - 1]).begin_batch(switch - 1)
        == (d.planned[switch - 1])
    )
    on_150 = min(batch for batch, routing in d.planned.items() if routing["A"] == 150)
    assert job.routing_for_batch(on_150) == {"A": 150, "B": 150}
    with pytest.raises(UnplannedBatchError, match="too long ago to be replayed"):
        job.begin_batch(on_150 - 1)
    assert [(h.operator, h.switch_batch) for h in job.migrating()] == [("A", switch), ("B", switch)]
    assert job.begin_batch(switch + 1) == d.tick()
    assert job.state_installed("A", switch + 1) == d.install("A")
    assert job.state_installed("B", switch + 1) == d.install("B")
    assert job.to_dict() == d.job.to_dict()


def test_a_checkpoint_with_the_whole_route_history_is_read_and_trimmed_at_its_next_batch() -> None:
    """Checkpoints written before route changes were trimmed hold every change since batch 0."""
    d = Deployment()
    d.rollout(2)
    d.rollout(3)
    history = {name: route_changes(d.planned, name) for name in OPS}
    assert history == {name: [[0, 1], [2, 2], [6, 3]] for name in OPS}
    job = from_checkpoint({**d.checkpoints[d.batch], "routes": history})

    assert job.routing_for_batch(0) == d.planned[0] == {"A": 1, "B": 1}
    assert job.begin_batch(d.batch) == d.planned[d.batch]
    assert job.begin_batch(d.batch + 1) == d.tick()
    assert job.state.routes == {name: ((6, 3),) for name in OPS}
    assert job.to_dict() == d.job.to_dict()


def test_version_for_batch_before_any_batch_is_planned_is_an_error() -> None:
    job = new_job()
    with pytest.raises(UnplannedBatchError, match="no batch"):
        job.version_for_batch(0, "A")
    job.begin_batch(5)
    with pytest.raises(UnplannedBatchError, match=r"5\.\.5"):
        job.version_for_batch(4, "A")


def test_state_installed_out_of_order_is_a_programming_error() -> None:
    job = new_job()
    job.begin_batch(0)
    job.on_message(command("PREPARE", 2, 1), 1)
    with pytest.raises(ProtocolError, match="not been propagated"):
        job.state_installed("A", 1)
    job.on_message(command("PROPAGATE", 2, 1, "A"), 1)
    with pytest.raises(ProtocolError, match="begin_batch"):
        job.state_installed("A", 1)
    job.begin_batch(1)
    with pytest.raises(ProtocolError, match="not in batch 0"):
        job.state_installed("A", 0)
    with pytest.raises(ProtocolError, match="not in batch 2"):
        job.state_installed("A", 2)
    with pytest.raises(KeyError):
        job.state_installed("Z", 1)


def test_a_corrupt_checkpoint_is_refused_with_the_reason() -> None:
    d = Deployment()
    d.send(d.controller.prepare(2, STORE[2]))
    data = d.job.to_dict()

    with pytest.raises(ValueError, match="not a valid job protocol checkpoint"):
        JobProtocol.from_dict({**data, "format": 2}, lookup_checksum=STORE.get)
    b_first = {"phase": "switching", "propagated_by": str(UUID(int=1))}
    with pytest.raises(ValueError, match="B moved before its upstream A"):
        JobProtocol.from_dict(
            {**data, "phases": {**data["phases"], "B": b_first}}, lookup_checksum=STORE.get
        )
    with pytest.raises(ValueError, match="B is migrated but was never propagated"):
        JobProtocol.from_dict(
            {**data, "phases": {**data["phases"], "B": {"phase": "migrated"}}},
            lookup_checksum=STORE.get,
        )
    with pytest.raises(ValueError, match="steady while v2 is pending"):
        JobProtocol.from_dict(
            {**data, "phases": {**data["phases"], "A": {"phase": "steady"}}},
            lookup_checksum=STORE.get,
        )


def test_operators_must_be_named_once() -> None:
    with pytest.raises(ValueError, match="more than once"):
        JobProtocol(("A", "A"), 1, STORE[1], lookup_checksum=STORE.get)
    with pytest.raises(ValueError, match="at least one"):
        ControllerProtocol((), 1, STORE[1])


# --- the controller -------------------------------------------------------------------------------


def test_controller_steps_retried_return_the_same_message_and_change_nothing() -> None:
    d = Deployment()
    controller = d.controller
    prepare = controller.prepare(2, STORE[2])
    assert controller.prepare(2, STORE[2]) == prepare
    d.send(prepare)
    state = controller.to_dict()
    assert controller.prepare(2, STORE[2]) == prepare
    assert controller.to_dict() == state

    propagate = controller.propagate("A")
    assert controller.propagate("A").message_id == propagate.message_id
    d.send(propagate)
    d.tick()
    d.install("A")
    d.send(controller.propagate("B"))
    d.tick()
    d.install("B")

    retried = ControllerProtocol.from_dict(json.loads(json.dumps(controller.to_dict())))
    done = retried.done()
    assert retried.done() == done
    assert retried.propagate("A") == propagate
    assert retried.prepare(2, STORE[2]) == prepare
    with pytest.raises(ProtocolError, match="roll back by publishing a new version"):
        retried.abort()
    assert retried.active_version == 2


def test_controller_refuses_steps_out_of_order() -> None:
    controller = ControllerProtocol(OPS, 1, STORE[1], clock=fixed_clock)
    with pytest.raises(ProtocolError, match="no rollout"):
        controller.propagate("A")
    with pytest.raises(ProtocolError, match="no rollout"):
        controller.done()
    with pytest.raises(ProtocolError, match="no rollout"):
        controller.abort()
    with pytest.raises(ProtocolError, match="not newer"):
        controller.prepare(1, STORE[1])

    controller.prepare(2, STORE[2])
    with pytest.raises(ProtocolError, match="not acknowledged"):
        controller.propagate("A")
    with pytest.raises(ProtocolError, match="still rolling out"):
        controller.prepare(3, STORE[3])
    with pytest.raises(ProtocolError, match="checksum"):
        controller.prepare(2, STORE[3])
    with pytest.raises(ProtocolError, match="A, B not migrated"):
        controller.done()
    with pytest.raises(ProtocolError, match="unknown operator"):
        controller.propagate("Z")


def test_controller_steps_for_a_version_act_only_on_that_version() -> None:
    controller = ControllerProtocol(OPS, 1, STORE[1], clock=fixed_clock)
    with pytest.raises(ProtocolError, match="v2 is not in flight: no rollout is in flight"):
        controller.propagate("A", version=2)

    controller.prepare(3, STORE[3])
    superseded = "v2 is not in flight: superseded by v3, which is in flight now"
    with pytest.raises(ProtocolError, match=superseded):
        controller.propagate("A", version=2)
    with pytest.raises(ProtocolError, match=superseded):
        controller.done(version=2)
    with pytest.raises(ProtocolError, match="not acknowledged"):
        controller.propagate("A", version=3)
    controller.abort()
    with pytest.raises(ProtocolError, match="v3 was aborted; no rollout is in flight"):
        controller.propagate("A", version=3)
    assert controller.state.current is None


def refusal(state: ControllerState | None, version: int | None) -> str:
    """The whole message :func:`rollout_for` refuses ``version`` with."""
    with pytest.raises(ProtocolError) as refused:
        rollout_for(state, version)
    return str(refused.value)


def test_rollout_for_judges_a_version_in_flight_finished_aborted_superseded_or_unknown() -> None:
    assert refusal(None, 2) == "v2 is not in flight: no rollout is in flight"
    assert refusal(None, None) == "no rollout is in flight; prepare a version first"
    d = Deployment()
    fresh = d.controller.state
    assert refusal(fresh, 2) == "v2 is not in flight: no rollout is in flight"
    assert refusal(fresh, None) == "no rollout is in flight; prepare a version first"

    d.send(d.controller.prepare(2, STORE[2]))
    in_flight = d.controller.state
    assert in_flight.current is not None
    assert rollout_for(in_flight, 2) is in_flight.current
    assert rollout_for(in_flight, None) is in_flight.current
    assert refusal(in_flight, 1) == "v1 is not in flight: superseded by v2, which is in flight now"
    assert refusal(in_flight, 5) == (
        "v5 is not in flight: newer than v2, the latest rollout, which is in flight now"
    )

    d.send(d.controller.abort())
    d.rollout(3)
    done = d.controller.state
    assert done.last is not None and done.last.finish is not None
    assert done.current is None and done.last.finish.type == "DONE"
    assert rollout_for(done, 3) is done.last, "a step retried after DONE finds its rollout"
    assert rollout_for(done, None) is done.last
    assert refusal(done, 2) == "v2 is not in flight: superseded by v3; no rollout is in flight"
    assert refusal(done, 4) == (
        "v4 is not in flight: newer than v3, the latest rollout; no rollout is in flight"
    )

    d.controller.prepare(4, STORE[4])
    d.controller.abort()
    aborted = d.controller.state
    assert refusal(aborted, 4) == "v4 was aborted; no rollout is in flight"
    assert refusal(aborted, None) == "v4 was aborted; no rollout is in flight"

    d.controller.prepare(5, STORE[5])
    replaced = d.controller.state
    assert refusal(replaced, 4) == "v4 was aborted; v5 is in flight now"
    assert refusal(replaced, 3) == "v3 is not in flight: superseded by v5, which is in flight now"
    assert rollout_for(replaced, None) is replaced.current


def test_controller_reports_missing_replies_and_timeouts_at_the_time_it_is_given() -> None:
    ticks = iter([T0, T0 + timedelta(minutes=3)])
    controller = ControllerProtocol(OPS, 1, STORE[1], clock=lambda: next(ticks))
    job = new_job()
    job.begin_batch(0)

    prepare = controller.prepare(2, STORE[2])
    [waiting] = controller.awaiting()
    assert (waiting.reply, waiting.request, waiting.since) == ("ACK", prepare, T0)
    assert controller.overdue(T0 + timedelta(minutes=1), timedelta(minutes=2)) == ()
    assert controller.overdue(T0 + timedelta(minutes=5), timedelta(minutes=2)) == (waiting,)
    with pytest.raises(ValueError, match="timezone-aware"):
        controller.overdue(datetime(2026, 11, 3), timedelta(minutes=2))

    [ack] = job.on_message(prepare, 1)
    assert controller.on_message(ack).outcome == "applied"
    assert controller.on_message(ack).outcome == "duplicate"
    assert controller.awaiting() == ()

    controller.propagate("A")
    [waiting] = controller.awaiting()
    assert (waiting.reply, waiting.operator, waiting.since) == (
        "MIGRATED",
        "A",
        T0 + timedelta(minutes=3),
    )
    assert controller.overdue(T0 + timedelta(minutes=4), timedelta(minutes=2)) == ()
    assert controller.overdue(T0 + timedelta(minutes=6), timedelta(minutes=2)) == (waiting,)


def test_controller_ignores_messages_that_are_not_replies_to_its_rollout() -> None:
    d = Deployment()
    controller = d.controller
    prepare = controller.prepare(2, STORE[2])
    [ack] = d.job.on_message(prepare, 1)
    other_version = ack.model_copy(update={"config_version": 3, "checksum": STORE[3]})
    early_migrated = ControlMessage(
        type="MIGRATED", config_version=2, previous_version=1, operator="A",
        checksum=STORE[2], sender="job", batch_id=1,
    )  # fmt: skip

    assert controller.on_message(prepare).reason == "own_message"
    assert controller.on_message(other_version).reason == "stale_version"
    assert controller.on_message(ack.model_copy(update={"checksum": "0" * 64})).reason == (
        "checksum_mismatch"
    )
    assert controller.on_message(early_migrated).reason == "not_propagated"
    assert controller.phase == "preparing"
    assert controller.ignored == {
        "own_message": 1, "stale_version": 1, "checksum_mismatch": 1, "not_propagated": 1,
    }  # fmt: skip


# --- properties under duplication, reordering and restarts ------------------------------------

PROPERTY_OPS = ("A", "B", "C")
Round = tuple[bool, list[tuple[int, bool]], bool, bool, bool]


@dataclass
class Chaos:
    """A correct controller and a job joined by a topic that duplicates and reorders.

    The job checkpoints at every batch it plans, as the driver does. ``trace``
    records every step of the job, so that a crash can be replayed from any
    checkpoint; ``handled`` lists (trace position, message) for every message
    the job applied or recognised as a duplicate.
    """

    job: JobProtocol = field(default_factory=lambda: new_job(PROPERTY_OPS))
    controller: ControllerProtocol = field(
        default_factory=lambda: ControllerProtocol(PROPERTY_OPS, 1, STORE[1], clock=fixed_clock)
    )
    in_flight: list[ControlMessage] = field(default_factory=list)
    batch: int = 0
    announced_done: set[int] = field(default_factory=lambda: {1})
    planned: dict[int, dict[str, int]] = field(default_factory=dict)
    checkpoints: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
    trace: list[tuple[str, Any]] = field(default_factory=list)
    handled: list[tuple[int, ControlMessage]] = field(default_factory=list)
    reply_ids: set[UUID] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.planned[0] = self.job.begin_batch(0)
        self.checkpoints.append((0, 0, self.job.to_dict()))

    def step(self, round_: Round) -> None:
        """One round: maybe a controller step, some deliveries, maybe a batch."""
        acts, deliveries, plans_batch, installs, aborts = round_
        if aborts and self.controller.state.current is not None:
            self.in_flight.append(self.controller.abort())
        elif acts:
            self.controller_step()
        for index, duplicate_later in deliveries:
            if self.in_flight:
                message = self.in_flight[index % len(self.in_flight)]
                if not duplicate_later:
                    self.in_flight.remove(message)
                self.deliver(message)
        if plans_batch:
            self.tick()
        if installs:
            for handoff in self.job.migrating():
                if handoff.switch_batch is not None and handoff.switch_batch < self.batch:
                    self.install(handoff.operator)

    def controller_step(self) -> None:
        """The controller's next step, as the DAG takes it; a wait re-sends the request."""
        controller = self.controller
        current = controller.state.current
        if current is None:
            state = controller.state
            sent = [r.version for r in (state.current, state.last) if r is not None]
            version = max([controller.active_version, *sent]) + 1
            self.in_flight.append(controller.prepare(version, STORE[version]))
        elif controller.phase == "migrated":
            message = controller.done()
            self.announced_done.add(message.config_version)
            self.in_flight.append(message)
        else:
            try:
                following = next(op for op in PROPERTY_OPS if op not in current.propagated)
                self.in_flight.append(controller.propagate(following))
            except (StopIteration, ProtocolError):
                self.in_flight.extend(wait.request for wait in controller.awaiting())

    def reply(self, replies: list[ControlMessage] | tuple[ControlMessage, ...]) -> None:
        for reply in replies:
            self.reply_ids.add(reply.message_id)
            self.controller.on_message(wire(reply))

    def deliver(self, sent: ControlMessage) -> None:
        message = wire(sent)
        self.trace.append(("deliver", message))
        reaction = self.job.react(message, self.batch + 1)
        if reaction.outcome in ("applied", "duplicate"):
            self.handled.append((len(self.trace), message))
        self.reply(reaction.replies)

    def tick(self) -> None:
        self.batch += 1
        self.trace.append(("tick", self.batch))
        self.planned[self.batch] = self.job.begin_batch(self.batch)
        checkpoint = json.loads(json.dumps(self.job.to_dict()))
        self.checkpoints.append((self.batch, len(self.trace), checkpoint))

    def install(self, operator: str) -> None:
        handoff = {h.operator: h for h in self.job.migrating()}.get(operator)
        if handoff is None or handoff.switch_batch is None:
            return
        self.trace.append(("install", operator))
        self.reply(self.job.state_installed(operator, self.batch))


def run(schedule: list[Round]) -> Chaos:
    chaos = Chaos()
    for event in schedule:
        chaos.step(event)
    return chaos


def check_invariants(chaos: Chaos, previous_active: int) -> None:
    job = chaos.job
    active = job.active_version
    routing = job.next_routing()
    versions = [routing[op] for op in PROPERTY_OPS]
    assert versions == sorted(versions, reverse=True), f"downstream ahead of upstream: {routing}"
    assert set(versions) <= {active, job.pending_version}
    assert active >= previous_active
    assert active in chaos.announced_done
    assert active <= chaos.controller.active_version
    assert job.state.active_checksum == STORE[active]
    for batch, recorded in chaos.planned.items():
        assert [recorded[op] for op in PROPERTY_OPS] == sorted(recorded.values(), reverse=True)
        if batch > chaos.batch - REPLAYABLE_BATCHES:
            assert job.routing_for_batch(batch) == recorded
    assert all(len(changes) <= REPLAYABLE_BATCHES for changes in job.state.routes.values())


schedules = st.lists(
    st.tuples(
        st.booleans(),
        st.lists(st.tuples(st.integers(min_value=0, max_value=29), st.booleans()), max_size=3),
        st.booleans(),
        st.booleans(),
        st.integers(min_value=0, max_value=24).map(lambda draw: draw == 0),
    ),
    min_size=20,
    max_size=60,
)
"""Rounds of a chaotic run: the controller acts, messages are delivered in any
order (some kept to be delivered again), batches are planned, moved state
arrives, and now and then the controller aborts."""

STRAY_MESSAGES = [
    command("PREPARE", 2, 1),
    command("PROPAGATE", 2, 1, "A"),
    command("PROPAGATE", 2, 1, "B"),
    command("DONE", 2, 1),
    command("ABORT", 2, 1),
    command("PREPARE", 3, 2),
    command("PROPAGATE", 3, 2, "A"),
    command("ABORT", 3, 2),
    command("PREPARE", 4, 1),
]
"""Valid messages of other possible histories: a controller that was restarted,
or one whose earlier rollout this job saw differently."""


def test_the_chaos_harness_reaches_finished_and_aborted_rollouts() -> None:
    act_deliver_plan: Round = (True, [(0, False)], True, False, False)
    plan_and_install: Round = (False, [], True, True, False)
    steps = [act_deliver_plan]
    for _ in PROPERTY_OPS:
        steps += [act_deliver_plan, plan_and_install]
    steps += [act_deliver_plan]
    steps += [(True, [(0, True)], True, False, False)]
    steps += [(True, [(1, False)], True, False, False)]
    steps += [(False, [(1, False), (0, False)], False, False, True)]

    chaos = run(steps)

    assert chaos.job.active_version == 2 and chaos.controller.active_version == 2
    assert chaos.job.pending_version is None and chaos.controller.phase == "idle"
    assert chaos.controller.state.last is not None
    assert chaos.controller.state.last.finish is not None
    assert chaos.controller.state.last.finish.type == "ABORT"
    assert [h.operator for h in chaos.job.migrating()] == ["A"]


@settings(max_examples=150, deadline=None)
@given(schedule=schedules)
def test_duplicated_and_reordered_messages_keep_dag_order_and_the_active_version(
    schedule: list[Round],
) -> None:
    chaos = Chaos()
    for event in schedule:
        previous_active = chaos.job.active_version
        chaos.step(event)
        check_invariants(chaos, previous_active)
    assert restored(chaos.job).to_dict() == chaos.job.to_dict()


@settings(max_examples=150, deadline=None)
@given(
    schedule=schedules,
    strays=st.lists(st.sampled_from(STRAY_MESSAGES), max_size=6),
    picks=st.lists(st.integers(min_value=0, max_value=200), max_size=14),
)
def test_redelivering_a_message_sequence_applies_only_what_ordering_held_back(
    schedule: list[Round], strays: list[ControlMessage], picks: list[int]
) -> None:
    chaos = run(schedule)
    delivered = [message for kind, message in chaos.trace if kind == "deliver"]
    pool = chaos.in_flight + delivered + strays
    if not pool:
        return
    sequence = [pool[pick % len(pool)] for pick in picks]
    at = chaos.batch + 1

    # A PROPAGATE that arrives before its upstream's is ignored, not
    # remembered, so that the controller's resend applies once the upstream
    # switched. Redelivering the sequence is such a resend, so a later pass
    # may apply those messages and no others; each pass can unblock one
    # more operator, so the passes settle within one per operator.
    job = restored(chaos.job)
    held_back: set[str] = set()
    known = set(chaos.reply_ids)
    for delivery in range(len(PROPERTY_OPS)):
        reactions = [(message, job.react(message, at)) for message in sequence]
        applied = {message.message_id for message, r in reactions if r.outcome == "applied"}
        if delivery > 0:
            assert applied <= held_back, "a redelivered message applied that was not held back"
        held_back = {
            message.message_id for message, r in reactions if r.reason == "upstream_not_propagated"
        }
        known |= {reply.message_id for _, r in reactions for reply in r.replies}
    settled = job.to_dict()
    again = [reply for message in sequence for reply in job.on_message(message, at)]
    assert job.to_dict() == settled, "the job did not settle within one pass per operator"
    assert {reply.message_id for reply in again} <= known, "a duplicate earned a new reply"


@settings(max_examples=100, deadline=None)
@given(schedule=schedules, crash=st.integers(min_value=0, max_value=100))
def test_restoring_any_checkpoint_and_replaying_equals_the_uninterrupted_run(
    schedule: list[Round], crash: int
) -> None:
    chaos = run(schedule)
    batch, position, checkpoint = chaos.checkpoints[crash % len(chaos.checkpoints)]

    job = JobProtocol.from_dict(checkpoint, lookup_checksum=STORE.get, clock=fixed_clock)
    assert job.begin_batch(batch) == chaos.planned[batch], "the replay routed differently"
    for handled_at, message in chaos.handled:
        if handled_at <= position:
            job.on_message(message, batch + 1)
    assert job.to_dict() == checkpoint, "re-reading handled messages changed the checkpoint"

    for kind, value in chaos.trace[position:]:
        if kind == "deliver":
            job.on_message(value, batch + 1)
        elif kind == "tick":
            batch = value
            job.begin_batch(batch)
        else:
            job.state_installed(value, batch)

    assert job.to_dict() == chaos.job.to_dict()
    for planned_batch in range(max(0, batch - REPLAYABLE_BATCHES + 1), batch + 1):
        assert job.routing_for_batch(planned_batch) == chaos.planned[planned_batch]


# --- REFUSED: the job says why it will not prepare a version ----------------------------------


def test_a_prepare_the_job_cannot_use_is_answered_with_refused_and_the_reason() -> None:
    """A version the job's store cannot route (here: over other instances) earns REFUSED with
    the store's reason, signed like every reply; the controller reports it as ``refused``
    and its rollout stays in flight for the caller to abort."""
    unusable = {7: "ValueError: v7 routes A over 8 instances, the query has 4"}
    job = JobProtocol(
        OPS,
        1,
        STORE[1],
        lookup_checksum=lambda v: None if v == 7 else STORE.get(v),
        clock=fixed_clock,
        explain=unusable.get,
    )
    controller = ControllerProtocol(OPS, 1, STORE[1], clock=fixed_clock)
    prepare = controller.prepare(7, STORE[7])

    reaction = job.react(wire(prepare), 3)
    [refusal] = reaction.replies
    heard = controller.on_message(wire(refusal))

    assert (reaction.outcome, reaction.reason) == ("ignored", "unknown_checksum")
    assert refusal.type == "REFUSED" and refusal.sender == "job" and refusal.batch_id == 3
    assert refusal.config_version == 7 and refusal.checksum == STORE[7]
    assert refusal.reason == (
        f"unknown_checksum: PREPARE v7 has checksum {STORE[7]}; the job's store holds no such "
        "version it can use (ValueError: v7 routes A over 8 instances, the query has 4)"
    )
    [again] = job.react(wire(prepare), 4).replies
    assert (again.message_id, again.reason) == (refusal.message_id, refusal.reason)
    assert (heard.outcome, heard.detail) == ("refused", refusal.reason)
    assert controller.state.current is not None and controller.state.current.ack is None


def test_a_prepare_of_a_version_already_seen_is_refused_a_retried_one_of_the_active_is_not() -> (
    None
):
    """v5 prepared then aborted: a PREPARE of v3 comes too late and is refused; a PREPARE of
    the active version sent again (a retried step) changes nothing and earns no refusal."""
    job = new_job()
    job.on_message(wire(command("PREPARE", 5, 1)), 1)
    job.on_message(wire(command("ABORT", 5, None)), 2)

    late = job.on_message(wire(command("PREPARE", 3, 1)), 3)
    deployment = Deployment()
    deployment.rollout(2)
    retried = deployment.send(deployment.controller.prepare(2, STORE[2]))

    [refusal] = late
    assert refusal.type == "REFUSED" and refusal.reason is not None
    assert refusal.reason.startswith("stale_version: PREPARE v3 is stale: this job has already ")
    assert deployment.job.state.active_version == 2 and retried == []


def test_only_refused_carries_a_reason_and_other_messages_keep_their_wire_form() -> None:
    prepare = command("PREPARE", 2, 1)
    assert b'"reason"' not in encode(prepare, KEY)
    with pytest.raises(ValidationError, match="REFUSED reply, and only it, carries the reason"):
        prepare.model_copy(update={"reason": "no"}).model_validate(
            {**prepare.model_dump(), "reason": "no"}
        )
    with pytest.raises(ValidationError, match="REFUSED reply, and only it"):
        ControlMessage(
            type="REFUSED", config_version=2, checksum=STORE[2], sender="job", batch_id=1
        )
