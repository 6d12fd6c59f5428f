"""Airflow's retries and two runs at once, on the DAG's own steps (paper 000 §3.4).

Airflow retries a failed task (``retries=2``) and an operator may clear a
task and run it again, so every rollout step must change nothing the second
time. A scheduled and a manual run may also be created at the same time:
``max_active_runs=1`` queues the second (``tests/dags/test_dag_integrity.py``),
and behind it the controller's file lock and its one-rollout-in-flight rule
hold even if both runs reach ``publish`` together: one rollout goes out, the
other ``publish`` fails naming it, and once the first is done the other's
proposal, planned on a version that is no longer active, is refused as stale.

Real broker and control topic, real controller, real Great Expectations; the
job is :class:`keyplane.testing.ProtocolOnlyJob`, the real job protocol
without Spark (the Spark side of duplicates and reordering is in
``tests/keyplane/spark/test_control_faults.py``).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyplane.algorithms import statistics as stats
from keyplane.control.controller import ControllerError
from keyplane.control.operators import OPERATORS
from keyplane.kafka.control import ControlChannel
from keyplane.orchestration import (
    configuration_steps,
    decision_steps,
    planning,
    rollout_steps,
    run_records,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.testing import (
    ProtocolOnlyJob,
    deployment_under,
    paired_tuple_counts,
    write_statistics_snapshot,
)

pytestmark = pytest.mark.integration

P = 4
SCHEDULED = "scheduled__2026-11-03T12:00:00+00:00"
MANUAL = "manual__2026-11-03T12:00:05+00:00"


def _write_snapshot(deployment: Deployment, run_id: str, seed: int) -> None:
    """A statistics snapshot of a job on v1 whose stage-A keys pair with few B keys."""
    write_statistics_snapshot(deployment.snapshots, run_id, paired_tuple_counts(60, seed))


def _plan_and_decide(deployment: Deployment, run_id: str) -> int:
    """The run's steps up to ``decide``; the version it will publish."""
    proposal = configuration_steps.compute_configuration(
        deployment, run_id, planning.PlanParams(alpha=1.1)
    )
    configuration_steps.validate_configuration(deployment, run_id)
    decision_steps.backtest(deployment, run_id)
    assert decision_steps.decide(deployment, run_id, planning.DecisionRule(), dry_run=False)[
        "publish"
    ]
    return int(proposal["version"])


def _eventually(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_retried_steps_change_nothing_and_two_runs_never_roll_out_together(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    deployment = deployment_under(tmp_path, broker, f"{topic_name}.")
    config_store.save(
        RoutingConfig.all_hash(P, OPERATORS),
        deployment.routing_store,
    )
    # Both runs take their statistics and plan before either publishes.
    _write_snapshot(deployment, SCHEDULED, seed=3)
    _write_snapshot(deployment, MANUAL, seed=4)
    planned = {run: _plan_and_decide(deployment, run) for run in (SCHEDULED, MANUAL)}
    assert sorted(planned.values()) == [2, 3]
    assert all(
        config_store.load(deployment.routing_store, v).parent_version == 1 for v in planned.values()
    )

    channel = ControlChannel(broker, deployment.control_topic)
    channel.ensure()
    with ProtocolOnlyJob(channel, deployment.routing_store, OPERATORS, 1) as job:
        # Both runs' publish at the same moment.
        start = threading.Barrier(2)
        outcomes: dict[str, Any] = {}

        def publish(run_id: str) -> None:
            start.wait()
            try:
                outcomes[run_id] = rollout_steps.publish(deployment, run_id)
            except (ControllerError, run_records.StepError) as refused:
                outcomes[run_id] = refused

        racers = [threading.Thread(target=publish, args=(run,)) for run in planned]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(timeout=120)
        winners = [run for run, out in outcomes.items() if isinstance(out, dict)]
        assert len(winners) == 1, outcomes
        winner = winners[0]
        loser = MANUAL if winner == SCHEDULED else SCHEDULED
        version, other = planned[winner], planned[loser]
        assert isinstance(outcomes[loser], ControllerError)
        assert f"v{version} is still rolling out" in str(outcomes[loser])
        assert f"before preparing v{other}" in str(outcomes[loser])

        # The winner's rollout, every step run twice as a retry would.
        first = outcomes[winner]
        assert rollout_steps.publish(deployment, winner) == first
        _eventually(lambda: rollout_steps.reply_arrived(deployment, "ack"), "the ACK")
        once = rollout_steps.propagate(deployment, OPERATORS)
        assert rollout_steps.propagate(deployment, OPERATORS) == once
        for operator in OPERATORS:
            _eventually(
                functools.partial(rollout_steps.reply_arrived, deployment, "migrated", operator),
                f"MIGRATED {operator}",
            )
        finished = rollout_steps.done(deployment, winner)
        assert rollout_steps.done(deployment, winner) == finished
        assert finished["version"] == version
        assert rollout_steps.publish(deployment, winner) == first
        assert job.wait_until(lambda s: s.active_version == version and s.pending is None)

        # The other run, retried after the first finished: refused as stale, nothing sent.
        with pytest.raises(
            run_records.StepError, match=f"planned from v1, but v{version} is active"
        ):
            rollout_steps.publish(deployment, loser)
        state = job.state

    assert state.active_version == version and state.latest_version == version
    with ControlChannel(broker, deployment.control_topic) as reader:
        read = reader.read(0)
    assert read.rejected == ()
    sent = [m for _, m in read.messages if m.sender == "controller"]
    replies = [m for _, m in read.messages if m.sender == "job"]
    assert {m.config_version for _, m in read.messages} == {version}
    # Four distinct commands, each sent twice (PREPARE three times: two retries).
    assert [m.type for m in sent].count("PREPARE") == 3
    assert len(sent) == 9 and len({m.message_id for m in sent}) == 4
    assert sorted(
        (m.type, m.operator or "") for m in {m.message_id: m for m in replies}.values()
    ) == [
        ("ACK", ""),
        ("MIGRATED", "A"),
        ("MIGRATED", "B"),
    ]


def test_a_run_in_waves_rolls_each_out_in_turn_and_a_retry_resumes_the_wave_in_flight(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    """``max_moves_per_wave``: ``compute_configuration`` stores the change as waves,
    ``validate_configuration`` passes them with the plan, ``advance_waves`` (the
    ``roll_out_waves`` task's steps) rolls all but the last out one after the other
    (resuming a wave a killed try left in flight, and sending nothing when called once
    more), and the last goes through ``publish`` and the DAG's own rollout steps."""
    from keyplane.routing.migration import plan_migration
    from keyplane.routing.routedkeys import spark_partition

    deployment = deployment_under(tmp_path, broker, f"{topic_name}.")
    store = deployment.routing_store
    v1 = RoutingConfig.all_hash(P, OPERATORS)
    config_store.save(v1, store)
    _write_snapshot(deployment, SCHEDULED, seed=3)
    params = planning.PlanParams(alpha=1.1, max_moves_per_wave=10)
    proposal = configuration_steps.compute_configuration(deployment, SCHEDULED, params)
    assert configuration_steps.compute_configuration(deployment, SCHEDULED, params) == proposal
    waves, version = list(proposal["waves"]), int(proposal["version"])
    assert len(waves) >= 2 and [*waves, version] == list(range(2, version + 1))

    # Each wave moves at most 10 keys; the last routes as one version planned at once.
    snapshot = stats.read_snapshot(deployment.snapshots, SCHEDULED)
    at_once = planning.plan_configuration(
        snapshot.pairs, snapshot.frequencies, v1, planning.PlanParams(alpha=1.1), version=2
    ).config
    chain = [v1, *(config_store.load(store, v) for v in [*waves, version])]
    for old, new in itertools.pairwise(chain):
        assert new.parent_version == old.version
        assert 1 <= plan_migration(old, new, spark_partition).cost.keys <= 10
    assert chain[-1].operators == at_once.operators

    configuration_steps.validate_configuration(deployment, SCHEDULED)
    for wave in waves:
        rollout_steps.require_validated(deployment, wave)
    decision_steps.backtest(deployment, SCHEDULED)
    assert decision_steps.decide(deployment, SCHEDULED, planning.DecisionRule(), dry_run=False)[
        "publish"
    ]

    channel = ControlChannel(broker, deployment.control_topic)
    channel.ensure()
    with ProtocolOnlyJob(channel, store, OPERATORS, 1) as job:
        # A first try killed right after it sent the first wave's PREPARE; then the
        # operator's loop: each call sends what the waves need next, then its reply is awaited.
        rollout_steps.publish_version(deployment, waves[0], 1)
        steps = []
        while (step := rollout_steps.advance_waves(deployment, SCHEDULED))["wait"] is not None:
            steps.append((step["version"], step["wait"], step["operator"]))
            _eventually(
                functools.partial(
                    rollout_steps.reply_arrived, deployment, step["wait"], step["operator"]
                ),
                f"{step['wait']} of v{step['version']}",
            )
        assert [v for v, wait, _ in steps if wait == "ack"] == waves
        assert {v for v, wait, _ in steps if wait == "migrated"} == set(waves)
        assert job.wait_until(lambda s: s.active_version == waves[-1] and s.pending is None)
        with ControlChannel(broker, deployment.control_topic) as reader:
            before_retry = len(reader.read(0).messages)
        assert rollout_steps.advance_waves(deployment, SCHEDULED)["wait"] is None
        with ControlChannel(broker, deployment.control_topic) as reader:
            assert len(reader.read(0).messages) == before_retry

        # The last version: the DAG's publish → ACK → PROPAGATE → MIGRATED → DONE.
        assert rollout_steps.publish(deployment, SCHEDULED)["version"] == version
        _eventually(lambda: rollout_steps.reply_arrived(deployment, "ack"), "the ACK")
        rollout_steps.propagate(deployment, OPERATORS)
        for operator in OPERATORS:
            _eventually(
                functools.partial(rollout_steps.reply_arrived, deployment, "migrated", operator),
                f"MIGRATED {operator}",
            )
        assert rollout_steps.done(deployment, SCHEDULED)["version"] == version
        assert job.wait_until(lambda s: s.active_version == version and s.pending is None)

    with ControlChannel(broker, deployment.control_topic) as reader:
        read = reader.read(0)
    assert read.rejected == ()
    done = [m.config_version for _, m in read.messages if m.type == "DONE"]
    assert list(dict.fromkeys(done)) == [*waves, version]
    acks = {m.config_version for _, m in read.messages if m.type == "ACK"}
    assert acks == {*waves, version}
