"""The driver killed at every phase of a live migration, and mid-batch (paper 000 §3.4).

One routed job, run as its own process, takes v1 → v2 while events stream
in; v2 moves keys of both stages and splits a hot stage-A key. The controller
is driven step by step, and at each point below the whole job process group
(Python driver and JVM) is SIGKILLed and the job restarted on its checkpoint:

1. mid-batch: a batch is in Spark's offset log but not in its commit log;
   PREPARE is then published while the driver is down (no ACK yet);
2. after ACK, before PROPAGATE A;
3. after PROPAGATE A, once A's moved state is on the migration topic and
   before it is installed (mid hand-off);
4. after MIGRATED A, before PROPAGATE B; the controller is restarted too
   (a new process would only have its state file);
5. mid-batch in B's switch batch: planned with B's evictions, not committed;
6. after MIGRATED B, before DONE; DONE is published while the driver is down.

Then the controller process itself dies: ``keyplane config publish v3`` is
SIGKILLed while it waits for MIGRATED A, and the same command run again
resumes from the state file and finishes. Last, v4 is prepared and
propagated to A, the driver is killed mid hand-off, ``keyplane config
abort`` runs while it is down, and the restarted job hands A's state back.

The kill points are read from the topics and the checkpoint, never from
timing. At the end every per-key count equals the generator's ground truth
(0 lost, 0 duplicated); the job's checkpoint has v3 active with nothing
pending or moving, the controller agrees (v3 active, v4 aborted), and every
key's state sits where v3 puts it, as reported from inside the operators.

Cost. The eight job starts are the scenario; what is cut around them: each
of the nine slices is two batches of 500 events (the same proof of exact
counts as three batches of 1,000, in fewer and cheaper batches); only the
waits for a kill point that a batch can run past poll fast, and those that
read a topic first wait for the checkpoint file that precedes what they look
for; every other wait polls four times a second, so the test's own reads
leave the two cores to the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyplane.algorithms.partials import latest_partials
from keyplane.control.controller import Controller, read_controller_file
from keyplane.control.controller_protocol import Reconfiguration
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import make_producer
from keyplane.reference.events import encode_batch
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.handoff import routed_key_table
from keyplane.settings import KafkaSource
from keyplane.spark.batch_plan import planned_offset
from keyplane.spark.counts_job import CountsJobSettings, read_output, read_partials
from keyplane.spark.job_checkpoint import committed_events
from keyplane.testing import (
    moved_off_hash,
    moved_off_hash_config,
    routed_job_settings,
    stage_keys_by_count,
    start_job_process,
    wait_while_job_runs,
)

pytestmark = pytest.mark.integration


@pytest.fixture(
    params=[
        pytest.param("embedded", marks=pytest.mark.slow),
        pytest.param("kafka", marks=[pytest.mark.apache_kafka, pytest.mark.slow]),
        pytest.param("kafka-connector", marks=[pytest.mark.apache_kafka, pytest.mark.slow]),
    ],
)
def engine_broker(request: pytest.FixtureRequest) -> str:
    """The conftest's engines, each run in the slow suite (the scenario takes minutes):
    the embedded broker, Apache Kafka with keyplane's source, and Apache Kafka with Spark's
    connector reading the events (:func:`kafka_source`)."""
    name = "broker" if request.param == "embedded" else "apache_kafka_broker"
    return str(request.getfixturevalue(name))


P = 4
SLICES = 9
"""One slice of events before the first start, one after each of the seven
restarts, and one during the rollout of v3."""
BATCH_EVENTS = 500
"""Events per batch at most; a slice is two batches, so the first slice has a
batch in flight after a committed one (kill point 1)."""
WAIT_S = 600.0
"""Spark starts slowly on a busy machine; every wait is on a condition, this only bounds it."""
RACE_POLL_S = 0.02
"""Polling of a kill point that lasts about one trigger interval (a batch in flight, moved
state not yet installed): fast, and each check reads only files or, once the checkpoint
shows the switch, one topic."""
POLL_S = 0.25
"""Polling of a state that lasts until the test acts: slow, so the test leaves the cores
to the job."""
HANDOFF_TRIGGER = "6 seconds"
"""The trigger of the runs killed mid hand-off (3 and 8). The moved state sits on the
migration topic from the end of the switch batch until the next trigger plans its install
and publishes MIGRATED; on a loaded machine a batch outlasts a 2 s interval and the next
one starts at once, so the kill would race the install. 6 s keeps that window open."""


def produce_slice(spec: ZipfEvolvingWorkload, broker: str, topic: str, index: int) -> None:
    """Events of slice ``index`` of ``spec``, laid out as ``produce_workload`` lays them."""
    size = spec.n_events // SLICES
    start, stop = index * size, spec.n_events if index == SLICES - 1 else (index + 1) * size
    partitions = ensure_topic(broker, topic, 2)
    producer = make_producer(broker)
    try:
        batch = spec.events(start, stop)
        for seq, value in enumerate(encode_batch(batch, 1_700_000_000_000), start=start):
            producer.send(topic, value=value, partition=seq % partitions)
        producer.flush()
    finally:
        producer.close(timeout=10)


def _batch_ids(checkpoint: Path, log: str) -> list[int]:
    try:
        return sorted(int(p.name) for p in (checkpoint / log).iterdir() if p.name.isdigit())
    except FileNotFoundError:
        return []


def planned_through(checkpoint: Path) -> int | None:
    """The newest batch in Spark's offset log (planned; maybe not run)."""
    return max(_batch_ids(checkpoint, "offsets"), default=None)


def committed_through(checkpoint: Path) -> int | None:
    """The newest batch in Spark's commit log (run to the end)."""
    return max(_batch_ids(checkpoint, "commits"), default=None)


def plan_of(checkpoint: Path, batch: int) -> dict[str, Any]:
    """The routed source's offset for ``batch``: its routing, switches and protocol state."""
    return planned_offset(str(checkpoint), batch)


def is_committed(checkpoint: Path, batch: int) -> bool:
    return (checkpoint / "commits" / str(batch)).exists()


def switches(checkpoint: Path, batch: int, operator: str) -> bool:
    """Whether ``batch``'s plan switches ``operator`` (evicts its moving state)."""
    return any(s["operator"] == operator for s in plan_of(checkpoint, batch)["switch"])


class MovedState:
    """Whether ``operator``'s state, evicted in a switch batch logged after ``after``, has
    reached the migration topic (past ``moved_before`` records).

    The state is on the topic only once its switch batch is in the offset log, so
    the topic is read only from then on: a race poll that reads only files until
    the switch, and one topic while it runs.
    """

    def __init__(
        self, settings: CountsJobSettings, operator: str, after: int, moved_before: int = 0
    ) -> None:
        self.settings, self.operator = settings, operator
        self.next_batch, self.moved_before = after + 1, moved_before
        self.switch_batch: int | None = None

    def __call__(self) -> bool:
        checkpoint = self.settings.checkpoint
        while self.switch_batch is None and self.next_batch <= (planned_through(checkpoint) or -1):
            if switches(checkpoint, self.next_batch, self.operator):
                self.switch_batch = self.next_batch
            self.next_batch += 1
        if self.switch_batch is None:
            return False
        broker, topic = self.settings.bootstrap_servers, self.settings.migration_topic
        return sum(high_watermarks(broker, topic).values()) > self.moved_before


class KilledJob:
    """The routed job as a process that the test kills and restarts on one checkpoint."""

    def __init__(self, settings: CountsJobSettings, log: Path) -> None:
        self.settings = settings
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self, trigger_interval: str | None = None) -> None:
        """Start on the checkpoint; ``trigger_interval`` overrides the settings' for this run."""
        settings = self.settings
        if trigger_interval is not None:
            settings = settings.model_copy(update={"trigger_interval": trigger_interval})
        self.process = start_job_process(settings, self.log)

    def kill(self) -> None:
        """SIGKILL the driver with its JVM, as a machine failure would."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.restarts += 1

    def wait(self, condition: Callable[[], bool], what: str, *, poll_s: float = POLL_S) -> None:
        assert self.process is not None
        wait_while_job_runs(
            condition, what, self.process, self.log, timeout_s=WAIT_S, poll_s=poll_s
        )

    def wait_logged(self, batch: int) -> None:
        """Until Spark's offset log holds ``batch``: a reply's plan is durable."""
        checkpoint = self.settings.checkpoint
        self.wait(lambda: (checkpoint / "offsets" / str(batch)).exists(), f"plan {batch} logged")

    def ensure_gone(self) -> None:
        """Kill a job a failed test left running."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=120) == 0, self.log.read_text()[-3000:]


def keyplane_cli(home: Path, settings: CountsJobSettings, *args: str) -> subprocess.Popen[str]:
    """``keyplane ARGS`` as its own process, on the job's broker, control and metrics topics."""
    env = {
        **os.environ,
        "KEYPLANE_HOME": str(home),
        "KEYPLANE_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "KEYPLANE_CONTROL_TOPIC": settings.control_topic,
        # config publish checks the job by its metrics (it runs outside keyplane job start).
        "KEYPLANE_METRICS_TOPIC": settings.metrics_topic,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "keyplane.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(cli: subprocess.Popen[str]) -> str:
    """The output of a CLI process that must succeed."""
    out, _ = cli.communicate(timeout=WAIT_S)
    assert cli.returncode == 0, out
    return out


def rollout_of(controller: Controller) -> Reconfiguration:
    controller.poll()
    state = controller.state
    assert state is not None and state.current is not None
    return state.current


def acked(controller: Controller) -> Callable[[], bool]:
    """Whether the job's ACK has reached the controller (read from the control topic)."""
    return lambda: rollout_of(controller).ack is not None


def migrated(controller: Controller, operator: str) -> Callable[[], bool]:
    """Whether ``operator``'s MIGRATED has reached the controller."""
    return lambda: operator in rollout_of(controller).migrated


@pytest.mark.timeout(WAIT_S * 6)
def test_driver_killed_at_every_phase_and_mid_batch_keeps_counts_exact(
    engine_broker: str,
    kafka_source: KafkaSource,
    topic_name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    spec = ZipfEvolvingWorkload(
        n_keys=300, exponent=1.2, n_categories=12, n_events=SLICES * 2 * BATCH_EVENTS, seed=11
    )
    truth = expected_counts(spec)
    a_keys, b_keys = stage_keys_by_count(truth)
    store = tmp_path / "routing"
    save(
        RoutingConfig.all_hash(P, OPERATORS),
        store,
    )
    v2 = moved_off_hash_config(
        2,
        {"A": a_keys[1:8], "B": b_keys[:4]},
        P,
        shifts={"B": 2},
        hot_keys={"A": {a_keys[0]: (0, 2)}},
    )
    save(v2, store)
    v3 = moved_off_hash_config(
        3,
        {"A": a_keys[:6], "B": b_keys[4:8]},
        P,
        shifts={"A": 3},
        hot_keys={"B": {b_keys[0]: (1, 3)}},
    )
    v3_file = tmp_path / "v3.json"
    v3_file.write_text(v3.model_dump_json(), encoding="utf-8")
    save(
        RoutingConfig(
            version=4,
            parent_version=3,
            created_by="manual",
            operators={
                "A": OperatorRouting(parallelism=P, table=moved_off_hash(a_keys[:12], P)),
                "B": v3.operators["B"],
            },
        ),
        store,
    )
    settings = routed_job_settings(
        engine_broker,
        topic_name,
        tmp_path,
        parallelism=P,
        batch=BATCH_EVENTS,
        # A batch at most every 2 s; the runs killed mid hand-off wait longer
        # (HANDOFF_TRIGGER), so that the moved state sits on the topic a while.
        trigger="2 seconds",
        version=1,
        source=kafka_source,
    )
    checkpoint = settings.checkpoint
    job = KilledJob(settings, tmp_path / "job.log")
    request.addfinalizer(job.ensure_gone)
    home = tmp_path / "home"
    state_file = home / "controller.json"

    produce_slice(spec, engine_broker, topic_name, 0)
    job.start()

    # 1. Mid-batch: planned, not committed. PREPARE then lands while the driver is down.
    def mid_batch() -> bool:
        done = committed_through(checkpoint)
        return done is not None and (planned_through(checkpoint) or -1) > done

    job.wait(mid_batch, "a batch in flight", poll_s=RACE_POLL_S)
    in_flight = planned_through(checkpoint)
    assert in_flight is not None
    job.kill()
    assert not is_committed(checkpoint, in_flight), "the kill must land mid-batch"
    channel = ControlChannel(engine_broker, settings.control_topic)
    request.addfinalizer(channel.close)
    controller = Controller(channel, state_file, store)
    controller.prepare(2)
    assert rollout_of(controller).ack is None

    job.start()
    produce_slice(spec, engine_broker, topic_name, 1)
    job.wait(acked(controller), "ACK")

    # 2. After ACK, before PROPAGATE A.
    ack = rollout_of(controller).ack
    assert ack is not None and ack.batch_id is not None
    job.wait_logged(ack.batch_id)
    job.kill()
    assert plan_of(checkpoint, ack.batch_id)["protocol"]["pending"]["version"] == 2

    job.start(HANDOFF_TRIGGER)
    produce_slice(spec, engine_broker, topic_name, 2)
    controller.propagate("A")

    # 3. After PROPAGATE A: A's state evicted to the migration topic, not installed.
    a_state_moved = MovedState(settings, "A", after=ack.batch_id)
    job.wait(a_state_moved, "stage A's moved state", poll_s=RACE_POLL_S)
    job.kill()
    assert "A" not in rollout_of(controller).migrated, "the kill must land before the install"

    job.start()
    produce_slice(spec, engine_broker, topic_name, 3)
    job.wait(migrated(controller, "A"), "MIGRATED A")

    # 4. After MIGRATED A, before PROPAGATE B; the controller restarts from its file.
    migrated_a = rollout_of(controller).migrated["A"]
    assert migrated_a.batch_id is not None
    job.wait_logged(migrated_a.batch_id)
    job.kill()
    channel.close()
    channel = ControlChannel(engine_broker, settings.control_topic)
    request.addfinalizer(channel.close)
    controller = Controller(channel, state_file, store)
    assert set(rollout_of(controller).migrated) == {"A"}

    job.start()
    produce_slice(spec, engine_broker, topic_name, 4)
    controller.propagate("B")

    # 5. Mid-batch in B's switch batch: planned with B's evictions, not committed.
    def b_switching() -> bool:
        batch = planned_through(checkpoint)
        if batch is None or is_committed(checkpoint, batch):
            return False
        return switches(checkpoint, batch, "B")

    job.wait(b_switching, "stage B's switch batch in flight", poll_s=RACE_POLL_S)
    switch_b = planned_through(checkpoint)
    assert switch_b is not None
    job.kill()
    assert not is_committed(checkpoint, switch_b), "the kill must land mid-batch"
    assert "B" not in rollout_of(controller).migrated

    job.start()
    produce_slice(spec, engine_broker, topic_name, 5)
    job.wait(migrated(controller, "B"), "MIGRATED B")

    # 6. After MIGRATED B, before DONE; DONE lands while the driver is down.
    migrated_b = rollout_of(controller).migrated["B"]
    assert migrated_b.batch_id is not None
    job.wait_logged(migrated_b.batch_id)
    job.kill()
    controller.done()
    channel.close()

    job.start(HANDOFF_TRIGGER)
    produce_slice(spec, engine_broker, topic_name, 6)

    def v2_active() -> bool:
        batch = committed_through(checkpoint)
        return batch is not None and plan_of(checkpoint, batch)["protocol"]["active_version"] == 2

    job.wait(v2_active, "v2 active in a committed plan")

    # 7. The controller's process dies mid-rollout; the same command resumes it.
    publish = ("config", "publish", str(v3_file), "--store", str(store), "--timeout", "600")
    first_publish = keyplane_cli(home, settings, *publish)

    def a_propagated_to_v3() -> bool:
        if first_publish.poll() is not None:
            raise AssertionError(f"publish exited early: {first_publish.communicate()[0]}")
        saved = read_controller_file(state_file)
        current = None if saved is None else saved.protocol.current
        return current is not None and current.version == 3 and "A" in current.propagated

    produce_slice(spec, engine_broker, topic_name, 7)
    job.wait(a_propagated_to_v3, "PROPAGATE A of v3", poll_s=RACE_POLL_S)
    first_publish.kill()
    first_publish.communicate(timeout=60)
    assert "v3 is active" in finished(keyplane_cli(home, settings, *publish))

    # 8. v4 propagated to A, the driver killed mid hand-off, aborted while it is down.
    channel = ControlChannel(engine_broker, settings.control_topic)
    request.addfinalizer(channel.close)
    controller = Controller(channel, state_file, store)
    controller.prepare(4)
    job.wait(acked(controller), "ACK of v4")
    moved_before = sum(high_watermarks(engine_broker, settings.migration_topic).values())
    v4_ack = rollout_of(controller).ack
    assert v4_ack is not None and v4_ack.batch_id is not None
    controller.propagate("A")
    a_state_moved_to_v4 = MovedState(
        settings, "A", after=v4_ack.batch_id, moved_before=moved_before
    )
    job.wait(a_state_moved_to_v4, "stage A's moved state for v4", poll_s=RACE_POLL_S)
    job.kill()
    assert "A" not in rollout_of(controller).migrated, "the kill must land before the install"
    channel.close()
    assert "v4" in finished(keyplane_cli(home, settings, "config", "abort", "--store", str(store)))

    job.start()
    produce_slice(spec, engine_broker, topic_name, 8)

    def all_counted() -> bool:
        """Every event in a committed batch (read from the checkpoint), then in the output."""
        batch = committed_through(checkpoint)
        if batch is None:
            return False
        committed = committed_events(checkpoint, topic_name)
        if committed is None or committed < spec.n_events:
            return False
        frame = read_output(settings.output)
        return int(frame.loc[frame["stage"] == "A", "count"].sum()) == spec.n_events

    def v4_reverted() -> bool:
        batch = committed_through(checkpoint)
        if batch is None:
            return False
        protocol = plan_of(checkpoint, batch)["protocol"]
        return (
            protocol["latest_version"] == 4
            and protocol["pending"] is None
            and all(op["phase"] == "steady" for op in protocol["phases"].values())
        )

    try:
        job.wait(all_counted, "every event")
        job.wait(v4_reverted, "A's state back on v3")
    finally:
        job.stop()

    assert job.restarts == 7
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == spec.n_events
    assert report.exact, report

    last = plan_of(checkpoint, planned_through(checkpoint) or 0)
    assert last["routing"] == {"A": 3, "B": 3}
    assert last["switch"] == []
    protocol = last["protocol"]
    assert (protocol["active_version"], protocol["pending"], protocol["held"]) == (3, None, [])
    assert {op["phase"] for op in protocol["phases"].values()} == {"steady"}
    saved = read_controller_file(state_file)
    assert saved is not None
    final = saved.protocol
    assert final.current is None and final.active_version == 3
    assert final.last is not None and final.last.finish is not None
    assert (final.last.version, final.last.finish.type) == (4, "ABORT")

    latest = latest_partials(read_partials(settings.output))
    live = latest[latest["count"] > 0]
    for stage in OPERATORS:
        table = routed_key_table(v3.operators[stage])
        for key, routed, instance in live.loc[
            live["stage"] == stage, ["key", "routed_key", "instance"]
        ].itertuples(index=False):
            assert routed in table.route(key) and instance == table.instance_of(routed), (
                stage,
                key,
                routed,
            )
