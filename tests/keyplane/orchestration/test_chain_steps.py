"""The reconfiguration DAG's steps for a three-stage pipeline (no broker, real GX).

Statistics of the clickstream example's three stages → validated → planned
jointly over the chain → validated → backtested → decided; and a Param that
names no stage of the pipeline fails the first task for good.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from keyplane.orchestration import configuration_steps, decision_steps, planning, statistics_steps
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.testing import deployment_under, write_statistics_snapshot

pytestmark = pytest.mark.integration

P = 4
RUN = "manual__2026-12-06T08:00:00+00:00"
PIPELINE = "examples.clickstream.pipeline:clicks"
STAGES = ("sessions", "users", "categories")


def _deployment(home: Path) -> Deployment:
    return deployment_under(home).model_copy(update={"pipeline": PIPELINE, "operators": STAGES})


def _clicks(seed: int) -> pd.DataFrame:
    """Tuple counts of page views keyed (session, user, category): a session is one
    user's, and each user keeps to one category most of the time."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(48):
        for session in range(3):
            for _ in range(int(rng.integers(20, 40))):
                category = f"c{user // 4}" if rng.random() < 0.85 else f"c{rng.integers(12)}"
                rows.append((f"u{user}-s{session}", f"u{user}", category, rng.random() < 0.2))
    frame = pd.DataFrame(rows, columns=["session", "user", "category", "holdout"])
    grouped = frame.groupby(["session", "user", "category", "holdout"], as_index=False).size()
    return grouped.rename(columns={"size": "n"})


def test_a_three_stage_pipeline_is_planned_validated_backtested_and_decided(
    tmp_path: Path,
) -> None:
    deployment = _deployment(tmp_path)
    config_store.save(RoutingConfig.all_hash(P, STAGES), deployment.routing_store)
    write_statistics_snapshot(deployment.snapshots, RUN, _clicks(1), STAGES)

    assert (
        "all"
        in statistics_steps.validate_statistics(deployment, RUN, min_total_count=1_000)["summary"]
    )
    proposal = configuration_steps.compute_configuration(
        deployment, RUN, planning.PlanParams(alpha=1.1)
    )
    config = config_store.load(deployment.routing_store, proposal["version"])
    assert list(config.operators) == list(STAGES)
    assert all(config.operators[stage].table for stage in STAGES)
    assert configuration_steps.validate_configuration(deployment, RUN)["success"]
    result = decision_steps.backtest(deployment, RUN)
    assert result["current"]["locality"] < 0.4
    assert result["new"]["locality"] > 0.7
    assert set(result["new"]["imbalance"]) == set(STAGES)
    assert decision_steps.decide(deployment, RUN, planning.DecisionRule(), dry_run=False)["publish"]


def test_an_operator_that_is_not_a_stage_of_the_pipeline_fails_the_first_task(
    tmp_path: Path,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from keyplane.orchestration.dagparts import fail_fast

    deployment = _deployment(tmp_path)
    config_store.save(RoutingConfig.all_hash(P, STAGES), deployment.routing_store)
    checked = configuration_steps.check_plan_params(deployment, ["users", "categories"], None)
    assert checked["operators"] == ["users", "categories"]
    with pytest.raises(AirflowFailException, match="'A' are not stages of the pipeline; its "):
        fail_fast(lambda: configuration_steps.check_plan_params(deployment, ["A"], None))()
