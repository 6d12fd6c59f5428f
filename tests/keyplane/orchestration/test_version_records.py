"""What the store and the run records say about each version: who made it, whether it was
published, and for a scale-in what it predicts.

Real configuration store, snapshot folder, Great Expectations and, for the scale, a
real embedded broker holding the events topic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_control import decide_scale_in_of_b

from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.orchestration import (
    configuration_steps,
    dagparts,
    decision_steps,
    planning,
    run_records,
    scale_steps,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing import config as config_store
from keyplane.routing.config import CreatedBy, OperatorRouting, RoutingConfig
from keyplane.testing import deployment_under, paired_tuple_counts, write_statistics_snapshot

pytestmark = pytest.mark.integration

P = 4


def test_pure_created_by_follows_the_airflow_run_type() -> None:
    assert dagparts.created_by_of("manual") == "manual"
    assert dagparts.created_by_of("scheduled") == "schedule"
    assert dagparts.created_by_of("asset_triggered") == "event"
    assert dagparts.created_by_of("backfill") == "manual"


def _planned(
    deployment: Deployment, run: str, created_by: CreatedBy = "schedule"
) -> dict[str, Any]:
    write_statistics_snapshot(deployment.snapshots, run, paired_tuple_counts(60, 3))
    proposal = configuration_steps.compute_configuration(
        deployment,
        run,
        planning.PlanParams(alpha=1.1),
        created_by=created_by,
    )
    configuration_steps.validate_configuration(deployment, run)
    decision_steps.backtest(deployment, run)
    return proposal


def test_a_manual_run_records_its_version_as_manual(tmp_path: Path) -> None:
    deployment = deployment_under(tmp_path)
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)

    proposal = _planned(deployment, "manual__2026-11-03T12:00:00+00:00", created_by="manual")

    stored = config_store.load(deployment.routing_store, int(proposal["version"]))
    assert stored.created_by == "manual"


def test_versions_not_published_are_marked_and_the_oldest_pruned(tmp_path: Path) -> None:
    """Each run that decides not to publish marks its version; beyond the retention the
    oldest such versions are deleted, never the newest stored one."""
    deployment = deployment_under(tmp_path).model_copy(update={"unpublished_versions_kept": 2})
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)
    for minute in range(5):
        run = f"scheduled__2026-11-03T12:{minute:02d}:00+00:00"
        _planned(deployment, run)
        decision = decision_steps.decide(deployment, run, planning.DecisionRule(), dry_run=True)
        assert not decision["publish"]

    marked = config_store.not_published(deployment.routing_store)
    # Versions 2..6 were planned; 2, 3 and 4 pruned, 5 and 6 kept (2 kept).
    assert sorted(marked) == [5, 6]
    assert marked[6]["reason"].startswith("dry run") and marked[6]["run_id"].startswith(
        "scheduled__"
    )
    assert config_store.stored_versions(deployment.routing_store) == [1, 5, 6]
    assert not (deployment.routing_store / "validation-v000002.json").exists()
    # The next run still numbers after the newest version ever stored.
    proposal = _planned(deployment, "scheduled__2026-11-03T13:00:00+00:00")
    assert proposal["version"] == 7


def test_pure_pruning_keeps_the_newest_stored_and_protected_versions(tmp_path: Path) -> None:
    store = tmp_path / "configs"
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), store)
    for version in range(2, 6):
        config_store.save(
            RoutingConfig.all_hash(P, OPERATORS).model_copy(
                update={"version": version, "parent_version": 1, "created_by": "schedule"}
            ),
            store,
        )
        config_store.mark_not_published(store, version, "gain too small", f"run-{version}")

    pruned = config_store.prune_not_published(store, keep=0, protected=[3])

    assert pruned == [2, 4]
    assert config_store.stored_versions(store) == [1, 3, 5]


def test_a_scale_in_records_its_reason_run_and_predicted_locality(
    broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workload whose pairs are co-located by hash (``locality=1.0`` with A and B keys
    equal) loses locality when B is folded onto two of four instances and A is not."""
    deployment = deployment_under(tmp_path, broker, topic_prefix=f"{topic_name}-")
    # The reference pipeline reads the events topic the settings name.
    monkeypatch.setenv("KEYPLANE_EVENTS_TOPIC", deployment.events_topic)
    workload = PairsWorkload(n_keys=40, locality=1.0, n_events=2_000, seed=3)
    assert produce_workload(workload, broker, deployment.events_topic, partitions=1) == 2_000
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)
    run = "manual__2026-11-03T12:00:00+00:00"
    decide_scale_in_of_b(deployment, run)

    proposal = scale_steps.compute_scaled_configuration(deployment, run)

    assert proposal["run_id"] == run
    assert proposal["reason"] == "scale B in"
    assert proposal["locality_before"] is not None and proposal["locality_after"] is not None
    assert proposal["locality_after"] < proposal["locality_before"]
    recorded = json.loads(
        (run_records.scale_folder(deployment, run) / scale_steps.PROPOSAL).read_text()
    )
    assert recorded["locality_after"] == proposal["locality_after"]


def test_pure_scaled_locality_counts_pairs_split_by_the_fold(tmp_path: Path) -> None:
    before = RoutingConfig.all_hash(P, OPERATORS)
    table = {"x": 0, "y": 1}
    after = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="scale",
        operators={
            "A": OperatorRouting(parallelism=P, table={"x": 0, "y": 1}),
            "B": OperatorRouting(parallelism=P, table={"x": 0, "y": 0}, active_instances=(0, 1)),
        },
    )
    a_before = RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            "A": OperatorRouting(parallelism=P, table=table),
            "B": OperatorRouting(parallelism=P, table=table),
        },
    )
    pairs = {("A", "x", "x"): 3.0, ("A", "y", "y"): 1.0}
    assert scale_steps.predicted_locality(a_before, pairs, OPERATORS) == pytest.approx(1.0)
    assert scale_steps.predicted_locality(after, pairs, OPERATORS) == pytest.approx(0.75)
    assert scale_steps.predicted_locality(before, {}, OPERATORS) == 0.0
