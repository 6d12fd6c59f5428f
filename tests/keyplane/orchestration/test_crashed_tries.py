"""A task's try that dies half-way, and Airflow's retry of it, on the steps that store versions.

A worker can die between any two writes of a step (out of memory, a node
lost, a kill at ``execution_timeout``), and Airflow runs the task again. The
death is simulated here by making one write raise :class:`WorkerDied`, which
no ``except Exception`` of the code under test catches, then the step is
called again as the retry would. The configuration store, the snapshot, the
planner and the controller are the real ones; the control topic is a list
(``fake_control.FakeControlTopic``), so the tests on it say "fake".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_control import FakeControlTopic, decide_scale_in_of_b, prepare, reply, roll_out

from keyplane.algorithms import statistics as stats
from keyplane.control.operators import OPERATORS
from keyplane.orchestration import (
    configuration_steps,
    planning,
    rollout_steps,
    run_records,
    scale_steps,
    verification_steps,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.testing import (
    deployment_under,
    moved_off_hash_config,
    paired_tuple_counts,
    write_statistics_snapshot,
)

RUN = "scheduled__2026-11-03T12:00:00+00:00"
P = 4


class WorkerDied(BaseException):
    """The worker's process ended here: nothing after this write ran."""


@pytest.fixture
def deployment(tmp_path: Path) -> Deployment:
    """An all-hash v1 that the job runs, and a statistics snapshot for ``RUN``."""
    target = deployment_under(tmp_path, bootstrap_servers="fake:9092")
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), target.routing_store)
    write_statistics_snapshot(target.snapshots, RUN, paired_tuple_counts(60, 3))
    return target


def dies_writing(
    monkeypatch: pytest.MonkeyPatch, matches: Callable[[str], bool]
) -> Callable[[], None]:
    """Make the next write of a record whose name ``matches`` kill the try; return the undo."""
    real = run_records.write_once

    def write_once(path: Path, record: Any) -> dict[str, Any]:
        if matches(path.name):
            raise WorkerDied(path.name)
        return real(path, record)

    monkeypatch.setattr(run_records, "write_once", write_once)
    return lambda: monkeypatch.setattr(run_records, "write_once", real)


def dies_saving(monkeypatch: pytest.MonkeyPatch, after: int) -> Callable[[], None]:
    """Make the store's save after ``after`` saves kill the try; return the undo."""
    real = config_store.save
    saves = {"n": 0}

    def save(config: RoutingConfig, directory: Path | str) -> config_store.SavedConfig:
        saves["n"] += 1
        if saves["n"] > after:
            raise WorkerDied(f"saving v{config.version}")
        return real(config, directory)

    monkeypatch.setattr(config_store, "save", save)
    return lambda: monkeypatch.setattr(config_store, "save", real)


def stored(deployment: Deployment) -> list[int]:
    return config_store.stored_versions(deployment.routing_store)


# --- compute_configuration --------------------------------------------------------------


def test_a_plan_retried_after_its_try_died_before_its_proposal_stores_no_second_version(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = planning.PlanParams(alpha=1.1)
    undo = dies_writing(monkeypatch, lambda name: name == run_records.PROPOSAL)
    with pytest.raises(WorkerDied):
        configuration_steps.compute_configuration(deployment, RUN, params)
    assert stored(deployment) == [1, 2]
    undo()

    proposal = configuration_steps.compute_configuration(deployment, RUN, params)

    assert proposal["version"] == 2 and proposal["parent_version"] == 1
    assert stored(deployment) == [1, 2]
    assert config_store.checksum(deployment.routing_store, 2) == proposal["checksum"]


def test_a_plan_in_waves_retried_after_its_try_died_storing_them_stores_each_once(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = planning.PlanParams(alpha=1.1, max_moves_per_wave=20)
    undo = dies_saving(monkeypatch, after=2)
    with pytest.raises(WorkerDied):
        configuration_steps.compute_configuration(deployment, RUN, params)
    assert stored(deployment) == [1, 2, 3]
    undo()

    proposal = configuration_steps.compute_configuration(deployment, RUN, params)

    versions = [*proposal["waves"], proposal["version"]]
    assert len(versions) > 2, "the plan must have more waves than the try stored"
    assert versions == list(range(2, 2 + len(versions)))
    assert stored(deployment) == [1, *versions]


def test_a_plan_whose_reserved_version_was_published_meanwhile_fails_and_leaves_it(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The try reserved v2 and died before storing it; an operator then ran
    ``keyplane config publish`` of their own v2. The retry must not take it."""
    params = planning.PlanParams(alpha=1.1)
    undo = dies_saving(monkeypatch, after=0)
    with pytest.raises(WorkerDied):
        configuration_steps.compute_configuration(deployment, RUN, params)
    undo()
    theirs = config_store.save(
        moved_off_hash_config(2, {"A": ["a1"], "B": ["b1"]}, P), deployment.routing_store
    )

    with pytest.raises(
        run_records.StepError, match="v2, which this run reserved, was stored meanwhile"
    ):
        configuration_steps.compute_configuration(deployment, RUN, params)

    assert stored(deployment) == [1, 2]
    assert config_store.checksum(deployment.routing_store, 2) == theirs.checksum
    assert rollout_steps.run_versions(deployment, run_records.RECONFIGURE_DAG_ID, RUN) == ()


# --- compute_scaled_configuration ------------------------------------------------------


def test_a_scale_retried_after_its_try_died_plans_from_the_same_keys_with_fake_loads(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events keep arriving: a retry that counts again counts more keys than the try did."""
    decide_scale_in_of_b(deployment, RUN)
    events = {"keys": 20}

    def fake_count(_: Deployment) -> scale_steps.EventCounts:
        loads = {name: {f"{name}{i}": 1 + i for i in range(events["keys"])} for name in OPERATORS}
        return scale_steps.EventCounts(windows=(), loads=loads, pairs={})

    monkeypatch.setattr(scale_steps, "count_events", fake_count)
    undo = dies_writing(monkeypatch, lambda name: name == scale_steps.PROPOSAL)
    with pytest.raises(WorkerDied):
        scale_steps.compute_scaled_configuration(deployment, RUN)
    first = config_store.load(deployment.routing_store, 2)
    undo()
    events["keys"] = 25
    # The run's stored counts are lost too, so the retry counts the 25 keys.
    (run_records.scale_folder(deployment, RUN) / scale_steps.COUNTS).unlink()

    proposal = scale_steps.compute_scaled_configuration(deployment, RUN)

    assert proposal["version"] == 2 and proposal["keys"] == 20
    assert stored(deployment) == [1, 2]
    assert config_store.load(deployment.routing_store, 2).operators == first.operators


# --- prepare_rollback -------------------------------------------------------------------


@pytest.fixture
def regressed(deployment: Deployment, topic: FakeControlTopic) -> Deployment:
    """The run's v2 is active (DONE) and its verification says it regressed."""
    config_store.save(
        moved_off_hash_config(2, {"A": ["a1", "a2"], "B": ["b1"]}, P), deployment.routing_store
    )
    configuration_steps.record_validation(deployment, 2, True, "passed")
    folder = stats.snapshot_folder(deployment.snapshots, RUN)
    (folder / run_records.PROPOSAL).write_text(json.dumps({"version": 2, "parent_version": 1}))
    roll_out(topic, deployment, 2)
    (folder / run_records.VERIFICATION).write_text(
        json.dumps({"version": 2, "regressed": True, "reason": "locality fell"})
    )
    return deployment


@pytest.mark.parametrize("dies_at", ["validation-v000003.json", run_records.ROLLBACK])
def test_a_rollback_retried_after_its_try_died_prepares_it_in_a_fake_topic(
    regressed: Deployment, topic: FakeControlTopic, monkeypatch: pytest.MonkeyPatch, dies_at: str
) -> None:
    """Dying before the validation record left the rollback unpublishable (every
    retry: "the validation record of v3 is missing", the job kept the version that
    regressed); dying before ``rollback.json`` left a second rollback version."""
    sent = len(topic.messages)
    undo = dies_writing(monkeypatch, lambda name: name == dies_at)
    with pytest.raises(WorkerDied):
        verification_steps.prepare_rollback(regressed, RUN)
    undo()

    record = verification_steps.prepare_rollback(regressed, RUN)

    assert record["version"] == 3 and record["restores"] == 1 and record["replaces"] == 2
    assert stored(regressed) == [1, 2, 3]
    assert topic.sent(sent) == ["controller:PREPARE v3"]
    assert rollout_steps.run_versions(regressed, run_records.RECONFIGURE_DAG_ID, RUN) == (2, 3)
    rolled_back = config_store.load(regressed.routing_store, 3)
    assert rolled_back.operators == config_store.load(regressed.routing_store, 1).operators


def test_a_rollback_that_an_older_try_recorded_without_validation_is_prepared_in_a_fake_topic(
    regressed: Deployment, topic: FakeControlTopic
) -> None:
    """An older keyplane's try wrote ``rollback.json`` for v3 and died before the
    validation record; the retry finds that record and no reservation beside it."""
    config_store.save(
        planning.rollback_config(
            config_store.load(regressed.routing_store, 1),
            config_store.load(regressed.routing_store, 2),
            3,
        ),
        regressed.routing_store,
    )
    folder = stats.snapshot_folder(regressed.snapshots, RUN)
    rollback = {"version": 3, "restores": 1, "replaces": 2, "reason": "locality fell"}
    (folder / run_records.ROLLBACK).write_text(json.dumps(rollback))

    assert verification_steps.prepare_rollback(regressed, RUN) == rollback
    assert stored(regressed) == [1, 2, 3]
    assert topic.sent()[-1] == "controller:PREPARE v3"


# --- done ---------------------------------------------------------------------------------


def test_done_retried_after_its_try_died_measures_from_the_first_tries_start_in_a_fake_topic(
    deployment: Deployment, topic: FakeControlTopic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The try sent DONE and died before its rollout record, and batches ran before the
    retry. The retry read the metrics topic's end again, after DONE, so verify skipped
    the batches between; now both tries record the start reserved before DONE."""
    config_store.save(
        moved_off_hash_config(2, {"A": ["a1"], "B": ["b1"]}, P), deployment.routing_store
    )
    prepare(deployment, 2)
    reply(topic, deployment, "ACK", 2)
    with rollout_steps.controller(deployment) as controller:
        controller.propagate_all(["A", "B"], version=2)
    reply(topic, deployment, "MIGRATED", 2, "A")
    reply(topic, deployment, "MIGRATED", 2, "B")
    with rollout_steps.controller(deployment) as controller:
        controller.poll()
    ends = iter([{0: 10}, {0: 17}, {0: 23}])
    monkeypatch.setattr(rollout_steps, "metrics_end", lambda _deployment: next(ends))
    sent = len(topic.messages)

    undo = dies_writing(monkeypatch, lambda name: name == run_records.ROLLOUT)
    with pytest.raises(WorkerDied):
        rollout_steps.done(deployment, RUN, version=2)
    undo()
    record = rollout_steps.done(deployment, RUN, version=2)

    assert record == {"version": 2, "metrics_start": {"0": 10}}
    assert set(topic.sent(sent)) == {"controller:DONE v2"}  # a retry sends the same DONE
