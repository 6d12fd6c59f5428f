"""How the promises of earlier rollouts are recorded and fed to the next plan, on a real
snapshot folder and configuration store (no broker: the verification's measurement is
made from metrics records built here, as :func:`planning.measure` reads them)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.operators import OPERATORS
from keyplane.orchestration import (
    configuration_steps,
    planning,
    run_records,
    verification_steps,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.testing import deployment_under, paired_tuple_counts, write_statistics_snapshot

pytestmark = pytest.mark.integration

P = 4
FIRST = "scheduled__2026-11-03T12:00:00+00:00"
SECOND = "scheduled__2026-11-03T13:00:00+00:00"


def _deployment(tmp_path: Path) -> Deployment:
    deployment = deployment_under(tmp_path)
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)
    return deployment


def _batches(imbalance: float) -> list[BatchMetrics]:
    """Batches whose worst operator's max/mean instance load is ``imbalance``."""
    mean = 1_000_000
    busiest = round(imbalance * mean)
    others = (P * mean - busiest) // (P - 1)
    load = {0: busiest, **dict.fromkeys(range(1, P), others)}
    return [
        BatchMetrics(
            batch_id=batch,
            rows=P * mean,
            hops=P * mean,
            local_hops=P * mean // 2,
            load=dict.fromkeys(OPERATORS, load),
            versions=dict.fromkeys(OPERATORS, 2),
        )
        for batch in range(3)
    ]


def _record_verification(deployment: Deployment, run_id: str, imbalance: float) -> float:
    """Record the run's verification as the verify step does, after batches of ``imbalance``."""
    folder = run_records.reconfigure_folder(deployment, run_id)
    proposal = run_records.read_record(folder / run_records.PROPOSAL, "the proposal")
    after = planning.measure(_batches(imbalance))
    record = run_records.write_once(
        folder / run_records.VERIFICATION,
        {
            "version": proposal["version"],
            "regressed": False,
            **verification_steps.promise_outcome(proposal, after),
        },
    )
    return float(record["promise_ratio"])


def test_the_next_plan_is_calibrated_on_an_earlier_runs_promise_ratio(tmp_path: Path) -> None:
    deployment = _deployment(tmp_path)
    params = planning.PlanParams(alpha=1.1)
    write_statistics_snapshot(deployment.snapshots, FIRST, paired_tuple_counts(60, 3))
    first = configuration_steps.compute_configuration(deployment, FIRST, params)
    # Nothing earlier to calibrate on: the promise is the drift model's own.
    assert first["model_promise"] > 1.0
    assert first["promised_imbalance"] == pytest.approx(first["model_promise"])
    # The rollout's batches went three times as far above 1 as the model promised.
    measured = 1.0 + 3.0 * (first["model_promise"] - 1.0)
    ratio = _record_verification(deployment, FIRST, measured)
    assert ratio == pytest.approx(3.0, rel=1e-2)
    assert run_records.promise_ratios(deployment) == (ratio,)

    write_statistics_snapshot(deployment.snapshots, SECOND, paired_tuple_counts(60, 4))
    second = configuration_steps.compute_configuration(deployment, SECOND, params)
    assert second["model_promise"] > 1.0
    assert second["promised_imbalance"] == pytest.approx(
        1.0 + ratio * (second["model_promise"] - 1.0)
    )


def test_a_rollout_whose_plan_made_no_promise_records_no_ratio() -> None:
    after = planning.measure(_batches(1.2))
    older = {"version": 2, "parent_version": 1}
    assert verification_steps.promise_outcome(older, after)["promise_ratio"] is None
    none = {"version": 2, "promised_imbalance": None, "model_promise": 0.0}
    assert verification_steps.promise_outcome(none, after) == {
        "promised_imbalance": None,
        "model_promise": 0.0,
        "promise_ratio": None,
    }
    nothing_measured = planning.measure([])
    promised = {"version": 2, "promised_imbalance": 1.1, "model_promise": 1.1}
    assert verification_steps.promise_outcome(promised, nothing_measured)["promise_ratio"] is None


def test_unreadable_promise_records_are_left_out_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deployment = _deployment(tmp_path)
    # No run folder at all yet: no calibration, no failure.
    assert run_records.promise_ratios(deployment) == ()

    def verification(run: str, text: str) -> None:
        folder = deployment.snapshots / run
        folder.mkdir(parents=True)
        (folder / run_records.VERIFICATION).write_text(text)

    verification("good-late", json.dumps({"version": 9, "promise_ratio": 1.5}))
    verification("good-early", json.dumps({"version": 3, "promise_ratio": 0.25}))
    verification("no-promise", json.dumps({"version": 4, "promise_ratio": None}))
    verification("older", json.dumps({"version": 5, "regressed": False}))
    verification("truncated", '{"version": 6, "promise_ra')
    verification("a-list", "[1, 2]")
    verification("not-a-number", json.dumps({"version": 7, "promise_ratio": "wide"}))
    verification("infinite", '{"version": 8, "promise_ratio": Infinity}')
    with caplog.at_level(logging.WARNING, logger=run_records.__name__):
        ratios = run_records.promise_ratios(deployment)
    assert ratios == (0.25, 1.5)  # oldest first, by version
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 4
    assert all(any(run in m for m in left_out) for run in ("truncated", "a-list", "infinite"))
    assert run_records.promise_ratios(deployment, 1) == (1.5,)
    assert run_records.promise_ratios(deployment, 0) == ()
    assert math.isfinite(sum(ratios))
