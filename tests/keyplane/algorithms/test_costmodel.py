"""Tests of keyplane.algorithms.costmodel: the batch-time model and its calibration from metrics."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.costmodel import (
    MIN_CALIBRATION_BATCHES,
    PRIOR_RELATIVE_DRIFT,
    CostModel,
    Drift,
    calibrate,
    measure_drift,
    next_window,
    prior_drift,
)


def test_throughput_weighs_a_point_of_locality_like_a_point_of_imbalance_by_default() -> None:
    model = CostModel()
    assert model.batch_time(1.0, 1.0, 1.0) == 2.0
    assert model.throughput(0.9, 1.0, 1.0) == pytest.approx(model.throughput(1.0, 1.1, 1.0))
    assert model.throughput(0.5, 1.0, 1.0) > model.throughput(0.4, 1.0, 1.0)
    assert model.throughput(0.5, 1.0, 1.0) > model.throughput(0.5, 1.2, 1.0)


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="remote"):
        CostModel(remote=-1.0)
    with pytest.raises(ValueError, match="service"):
        CostModel(service=(float("nan"), 1.0))
    with pytest.raises(ValueError, match="takes some time"):
        CostModel(service=(0.0, 0.0))


def test_a_stage_the_weights_do_not_cover_takes_their_mean() -> None:
    model = CostModel(service=(1.0, 3.0))
    assert model.stage_service(2) == 2.0
    assert model.batch_time(1.0, 1.0, 1.0, 2.0) == 1.0 + 3.0 + 4.0
    assert CostModel().stage_service(5) == 1.0


def _batches(services: dict[str, float], remote: float, count: int) -> list[BatchMetrics]:
    rng = np.random.default_rng(0)
    records = []
    for batch in range(count):
        loads = {stage: rng.integers(500, 3_000, 4) for stage in services}
        first = next(iter(loads.values()))
        hops = int(first.sum())
        local = int(rng.integers(0, hops))
        duration = (
            40
            + sum(services[stage] * stage_loads.max() for stage, stage_loads in loads.items())
            + remote * (hops - local) / 4
        )
        records.append(
            BatchMetrics(
                batch_id=batch,
                rows=hops,
                duration_ms=round(duration),
                load={
                    stage: {i: int(v) for i, v in enumerate(stage_loads)}
                    for stage, stage_loads in loads.items()
                },
                hops=hops,
                local_hops=local,
            )
        )
    return records


def test_calibration_recovers_the_weights_of_measured_batches() -> None:
    model = calibrate(_batches({"A": 0.02, "B": 0.05}, 0.03, 40), ("A", "B"))
    assert model.source == "calibrated"
    assert model.service == pytest.approx((0.02, 0.05), rel=0.1)
    assert model.remote == pytest.approx(0.03, rel=0.1)


def test_calibration_fits_one_weight_per_stage_of_a_three_stage_chain() -> None:
    services = {"parse": 0.01, "sessions": 0.06, "pages": 0.03}
    model = calibrate(_batches(services, 0.02, 60), tuple(services))
    assert model.service == pytest.approx(tuple(services.values()), rel=0.15)
    assert model.remote == pytest.approx(0.02, rel=0.15)
    assert calibrate(_batches(services, 0.02, 60), ("parse", "missing")) == CostModel()


def test_too_few_batches_keep_the_defaults() -> None:
    model = calibrate(
        _batches({"A": 0.02, "B": 0.05}, 0.03, MIN_CALIBRATION_BATCHES - 1), ("A", "B")
    )
    assert model == CostModel()
    assert calibrate([], ("A", "B"), CostModel(remote=3.0)).remote == 3.0


def test_measure_drift_recovers_a_multiplicative_drift_and_the_unseen_keys() -> None:
    rng = np.random.default_rng(3)
    before = rng.dirichlet(np.ones(4_000))
    after = before * np.exp(rng.normal(0.0, 0.2, before.size))
    keys = np.arange(before.size)
    drift = measure_drift(keys, before, keys, after, 6)
    assert 0.15 < drift.relative < 0.26
    assert drift.unseen == 0.0 and drift.windows == 1
    assert len(drift.residuals) >= 6
    with_new = measure_drift(keys, before, np.r_[keys, 99_999], np.r_[after, after.sum()], 6)
    assert with_new.unseen == pytest.approx(0.5**2, rel=1e-9)
    assert measure_drift(keys, before, [], [], 6) == Drift()


def test_next_window_without_drift_is_the_in_sample_imbalance() -> None:
    share = np.array([0.2, 0.2, 0.3, 0.3])
    ahead = next_window([(share, share**2, Drift()), (np.full(4, 0.25), np.zeros(4), Drift())])
    assert ahead.imbalances[0] == pytest.approx(1.2)
    assert ahead.imbalances[1] == pytest.approx(1.0)
    assert ahead.promise == pytest.approx(1.2)


def test_the_promise_widens_with_the_drift_and_tops_the_expected_imbalance() -> None:
    share = np.full(6, 1 / 6)
    squares = np.full(6, 0.01)
    promises = []
    for relative in (0.05, 0.2, 0.5):
        drift = Drift(relative=relative, windows=1)
        ahead = next_window([(share, squares, drift), (share, squares, drift)])
        assert ahead.promise > max(ahead.imbalances) > 1.0
        promises.append(ahead.promise)
    assert promises == sorted(promises)


def test_the_prior_drift_is_the_counts_sampling_noise_and_the_documented_popularity_drift() -> None:
    prior = prior_drift(20_000.0)
    assert prior.tally == pytest.approx(1.0 / 20_000.0)
    assert prior.relative == PRIOR_RELATIVE_DRIFT
    assert prior.windows == 0  # not a measurement: the first measured drift replaces it
    measured = Drift(relative=0.1, tally=1e-5, windows=1)
    assert prior.blend(measured) == measured
    assert prior_drift(0.0).tally == 0.0
    with pytest.raises(ValueError, match="tuple count"):
        prior_drift(float("nan"))
