"""The DAGs' validation steps wait for the GX project's lock before they touch it.

Great Expectations' file data context is not safe for concurrent writers, and
a reconfiguration run and a scale run can validate under the same
``gx_root`` at once. Each step must hold ``gx_root/.lock``
(:func:`keyplane.orchestration.quality.gx_lock`) from building the context until its
checkpoints have run. Here the lock is held by the test, as another worker's
validation would hold it, and GX itself is faked (building the context and
running the suites: what the lock guards is when they are called); the
snapshot, the planner and the configuration store are real.
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_control import decide_scale_in_of_b

from keyplane.control.operators import OPERATORS
from keyplane.orchestration import (
    configuration_steps,
    planning,
    quality,
    scale_steps,
    statistics_steps,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.testing import deployment_under, paired_tuple_counts, write_statistics_snapshot

RUN = "manual__2026-11-03T12:00:00+00:00"
P = 4
HELD_S = 2.0
"""How long the test holds the lock: a step that ignores it calls GX well within it."""


def validate_statistics(deployment: Deployment) -> dict[str, Any]:
    return statistics_steps.validate_statistics(deployment, RUN, min_total_count=1)


def validate_configuration(deployment: Deployment) -> dict[str, Any]:
    configuration_steps.compute_configuration(deployment, RUN, planning.PlanParams(alpha=1.1))
    return configuration_steps.validate_configuration(deployment, RUN)


def validate_scaled_configuration(deployment: Deployment) -> dict[str, Any]:
    decide_scale_in_of_b(deployment, RUN)
    scale_steps.compute_scaled_configuration(deployment, RUN)
    return scale_steps.validate_scaled_configuration(deployment, RUN, alpha=1.5)


@pytest.mark.parametrize(
    "step", [validate_statistics, validate_configuration, validate_scaled_configuration]
)
def test_a_validation_step_waits_for_the_gx_lock_with_fake_suites(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step: Callable[[Deployment], dict[str, Any]],
) -> None:
    deployment = deployment_under(tmp_path, bootstrap_servers="fake:9092")
    config_store.save(RoutingConfig.all_hash(P, OPERATORS), deployment.routing_store)
    write_statistics_snapshot(deployment.snapshots, RUN, paired_tuple_counts(60, 3))
    loads = {name: {f"{name}{i}": 1 + i % 3 for i in range(24)} for name in OPERATORS}
    counts = scale_steps.EventCounts(windows=(), loads=loads, pairs={})
    monkeypatch.setattr(scale_steps, "count_events", lambda _: counts)
    built = threading.Event()

    def fake_context(gx_root: Path | None = None) -> object:
        built.set()
        return object()

    def fake_suites(*_: Any, **__: Any) -> quality.QualityResult:
        assert built.is_set()
        return quality.QualityResult(True, "fake suites: passed", tmp_path / "index.html")

    monkeypatch.setattr(quality, "quality_context", fake_context)
    monkeypatch.setattr(quality, "validate_statistics", fake_suites)
    monkeypatch.setattr(quality, "validate_configuration", fake_suites)
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(step(deployment))
        except BaseException as error:
            outcome.append(error)

    deployment.gx_root.mkdir(parents=True, exist_ok=True)
    with (deployment.gx_root / quality.LOCK_NAME).open("a") as other_worker:
        fcntl.flock(other_worker, fcntl.LOCK_EX)
        worker = threading.Thread(target=run)
        worker.start()
        assert not built.wait(HELD_S), "the step built the GX context while the lock was held"
        fcntl.flock(other_worker, fcntl.LOCK_UN)
    worker.join(60)

    assert not worker.is_alive() and built.is_set()
    (result,) = outcome
    assert isinstance(result, dict), result
    assert "fake suites: passed" in str(result["summary"])
