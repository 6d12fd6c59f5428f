"""The configuration steps, with the DAG's steps around them, on a real snapshot folder,
configuration store and GX context (no broker).

Statistics → validated → planned → validated → backtested → decided, twice
(every step is idempotent), and a deliberately bad configuration (one
instance carrying three times the average load) is rejected by Great
Expectations and refused by ``publish`` before any control message is sent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.algorithms import statistics as stats
from keyplane.control.operators import OPERATORS
from keyplane.orchestration import (
    configuration_steps,
    decision_steps,
    planning,
    rollout_steps,
    run_records,
    statistics_steps,
)
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.testing import deployment_under, paired_tuple_counts, write_statistics_snapshot

pytestmark = pytest.mark.integration

P = 4
RUN = "manual__2026-11-03T12:00:00+00:00"


def test_steps_are_idempotent_and_a_bad_configuration_never_gets_published(
    tmp_path: Path,
) -> None:
    deployment = deployment_under(tmp_path)
    config_store.save(
        RoutingConfig.all_hash(P, OPERATORS),
        deployment.routing_store,
    )
    write_statistics_snapshot(deployment.snapshots, RUN, paired_tuple_counts(60, 3))

    checked = statistics_steps.validate_statistics(deployment, RUN, min_total_count=1_000)
    assert "all" in checked["summary"]
    params = planning.PlanParams(alpha=1.1)
    proposal = configuration_steps.compute_configuration(deployment, RUN, params)
    assert proposal["version"] == 2 and proposal["parent_version"] == 1
    assert configuration_steps.compute_configuration(deployment, RUN, params) == proposal
    assert config_store.stored_versions(deployment.routing_store) == [1, 2]
    assert configuration_steps.validate_configuration(deployment, RUN)["success"]
    result = decision_steps.backtest(deployment, RUN)
    assert result["new"]["locality"] > result["current"]["locality"]
    decision = decision_steps.decide(deployment, RUN, planning.DecisionRule(), dry_run=False)
    assert decision["publish"], decision
    assert decision_steps.decide(
        deployment, RUN, planning.DecisionRule(min_gain=1.0), dry_run=True
    ) == (decision)
    # Planned in one version: no waves to roll out, and nothing sent (there is no broker).
    no_waves: dict[str, object] = {"waves": [], "version": None, "wait": None, "operator": None}
    assert rollout_steps.advance_waves(deployment, RUN) == no_waves

    # One instance given 3x the average load: every stage-A key on instance 0.
    snapshot = stats.read_snapshot(deployment.snapshots, RUN)
    a_keys = snapshot.frequencies.loc[snapshot.frequencies["stage"] == "A", "key"].tolist()
    skewed = {k: 0 for k in a_keys[: len(a_keys) * 3 // 4]}
    skewed |= {k: 1 + i % 3 for i, k in enumerate(a_keys[len(a_keys) * 3 // 4 :])}
    bad = RoutingConfig(
        version=3,
        parent_version=1,
        created_by="manual",
        operators={
            "A": OperatorRouting(parallelism=P, table=skewed),
            "B": OperatorRouting(parallelism=P),
        },
    )
    config_store.save(bad, deployment.routing_store)
    with pytest.raises(run_records.StepError, match="failed validation") as rejected:
        configuration_steps.validate_configuration(deployment, RUN, version=3)
    assert "max/mean within α" in str(rejected.value)
    with pytest.raises(run_records.StepError, match="never published"):
        rollout_steps.require_validated(deployment, 3)
    assert not deployment.controller_state.exists()


def _planned_and_validated(
    tmp_path: Path, current: RoutingConfig, params: planning.PlanParams
) -> dict[str, object]:
    """Store ``current`` as the running version, plan from a snapshot, validate the plan."""
    deployment = deployment_under(tmp_path)
    config_store.save(current, deployment.routing_store)
    write_statistics_snapshot(deployment.snapshots, RUN, paired_tuple_counts(60, 3))
    configuration_steps.compute_configuration(deployment, RUN, params)
    return configuration_steps.validate_configuration(deployment, RUN)


def test_an_operator_the_run_did_not_replan_is_not_judged(tmp_path: Path) -> None:
    # B runs a table that puts every key on instance 0, far over α; the run
    # re-plans A only, so B's balance is not this run's to judge.
    snapshot_keys = paired_tuple_counts(60, 3)["b"].astype(str).unique()
    current = RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            "A": OperatorRouting(parallelism=P),
            "B": OperatorRouting(parallelism=P, table=dict.fromkeys(snapshot_keys, 0)),
        },
    )

    record = _planned_and_validated(
        tmp_path, current, planning.PlanParams(alpha=1.1, operators=("A",))
    )

    assert record["success"], record["summary"]


def test_a_scaled_in_job_is_judged_on_its_active_instances(tmp_path: Path) -> None:
    # Instances 2 and 3 are released (003 §5.3): idle by design, not imbalance.
    current = RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            name: OperatorRouting(parallelism=P, active_instances=(0, 1)) for name in OPERATORS
        },
    )

    record = _planned_and_validated(tmp_path, current, planning.PlanParams(alpha=1.1))

    assert record["success"], record["summary"]


def test_a_change_needing_more_waves_than_a_run_allows_fails_before_storing_any(
    tmp_path: Path,
) -> None:
    """A DAG run's ``dagrun_timeout`` counts at most ``max_waves`` waves, so a change that
    needs more is refused with the smallest ``max_moves_per_wave`` that fits, and nothing
    is stored; that value then plans within the limit."""
    deployment = deployment_under(tmp_path)
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)
    write_statistics_snapshot(deployment.snapshots, RUN, paired_tuple_counts(60, 3))

    with pytest.raises(run_records.StepError, match="more than the 3 allowed") as refused:
        configuration_steps.compute_configuration(
            deployment, RUN, planning.PlanParams(alpha=1.1, max_moves_per_wave=1), max_waves=3
        )

    assert config_store.stored_versions(deployment.routing_store) == [1]
    fits = int(str(refused.value).rsplit("at least ", 1)[1].replace(",", ""))
    assert fits > 1
    next_run = "manual__2026-11-03T12:10:00+00:00"
    write_statistics_snapshot(deployment.snapshots, next_run, paired_tuple_counts(60, 3))
    proposal = configuration_steps.compute_configuration(
        deployment,
        next_run,
        planning.PlanParams(alpha=1.1, max_moves_per_wave=fits),
        max_waves=3,
    )
    assert 1 <= len(proposal["waves"]) + 1 <= 3


def test_a_small_window_is_validated_and_forecast_over_the_windows_before_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from keyplane.algorithms.batchmetrics import BatchMetrics
    from keyplane.testing import paired_tuple_counts

    deployment = deployment_under(tmp_path)
    previous: stats.Snapshot | None = None
    start = 0
    for index in range(3):
        grouped = paired_tuple_counts(8, index)
        size = int(grouped["n"].sum())
        manifest, frames = stats.build_snapshot(
            run_id=f"run{index}",
            grouped=stats.chain_rows(grouped, ("A", "B")),
            stages=("A", "B"),
            metrics=[BatchMetrics(batch_id=index, versions={"A": 1, "B": 1})],
            events=stats.TopicWindow(topic="events", start={0: start}, end={0: start + size}),
            metrics_window=stats.TopicWindow(topic="metrics", start={0: 0}, end={0: 1}),
            previous=previous,
            config=None,
            settings=stats.StatisticsSettings(),
        )
        stats.write_snapshot(deployment.snapshots, manifest, **frames)
        previous = stats.read_snapshot(deployment.snapshots, manifest.run_id)
        start += size
    assert previous is not None
    one_window = int(previous.quality_frame()["count"].sum())
    with caplog.at_level("INFO"):
        checked = statistics_steps.validate_statistics(
            deployment, "run2", min_total_count=2 * one_window
        )
    assert "all" in checked["summary"]
    assert "window widened to" in caplog.text and "run1" in caplog.text
    with pytest.raises(run_records.Refused, match="failed validation"):
        statistics_steps.validate_statistics(deployment, "run2", min_total_count=100 * one_window)
    # The plan balances the next window's forecast, fitted on the three windows.
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)
    caplog.clear()
    with caplog.at_level("INFO"):
        proposal = configuration_steps.compute_configuration(
            deployment, "run2", planning.PlanParams(alpha=1.1)
        )
    assert "forecast from 3 windows" in caplog.text, caplog.text
    assert proposal["version"] == 2
    caplog.clear()
    with caplog.at_level("INFO"):
        configuration_steps.compute_configuration(
            deployment, "run1", planning.PlanParams(alpha=1.1)
        )
    assert "2 consecutive window(s), a forecast needs 3" in caplog.text, caplog.text
