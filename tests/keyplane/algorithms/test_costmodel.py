"""Tests of keyplane.algorithms.costmodel: the batch-time model and its calibration from metrics."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.costmodel import (
    MIN_CALIBRATION_BATCHES,
    CostModel,
    Drift,
    calibrate,
    measure_drift,
    next_window,
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
    with pytest.raises(ValueError, match="service_a"):
        CostModel(service_a=float("nan"))
    with pytest.raises(ValueError, match="takes some time"):
        CostModel(service_a=0.0, service_b=0.0)


def _batches(service_a: float, service_b: float, remote: float, count: int) -> list[BatchMetrics]:
    rng = np.random.default_rng(0)
    records = []
    for batch in range(count):
        loads_a = rng.integers(500, 3_000, 4)
        loads_b = rng.integers(500, 3_000, 4)
        hops = int(loads_a.sum())
        local = int(rng.integers(0, hops))
        duration = (
            40 + service_a * loads_a.max() + service_b * loads_b.max() + remote * (hops - local) / 4
        )
        records.append(
            BatchMetrics(
                batch_id=batch,
                rows=hops,
                duration_ms=round(duration),
                load={
                    "A": {i: int(v) for i, v in enumerate(loads_a)},
                    "B": {i: int(v) for i, v in enumerate(loads_b)},
                },
                hops=hops,
                local_hops=local,
            )
        )
    return records


def test_calibration_recovers_the_weights_of_measured_batches() -> None:
    model = calibrate(_batches(0.02, 0.05, 0.03, 40))
    assert model.source == "calibrated"
    assert model.service_a == pytest.approx(0.02, rel=0.1)
    assert model.service_b == pytest.approx(0.05, rel=0.1)
    assert model.remote == pytest.approx(0.03, rel=0.1)


def test_too_few_batches_keep_the_defaults() -> None:
    model = calibrate(_batches(0.02, 0.05, 0.03, MIN_CALIBRATION_BATCHES - 1))
    assert model == CostModel()
    assert calibrate([], CostModel(remote=3.0)).remote == 3.0


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
    assert ahead.imbalance_a == pytest.approx(1.2)
    assert ahead.imbalance_b == pytest.approx(1.0)
    assert ahead.promise == pytest.approx(1.2)


def test_the_promise_widens_with_the_drift_and_tops_the_expected_imbalance() -> None:
    share = np.full(6, 1 / 6)
    squares = np.full(6, 0.01)
    promises = []
    for relative in (0.05, 0.2, 0.5):
        drift = Drift(relative=relative, windows=1)
        ahead = next_window([(share, squares, drift), (share, squares, drift)])
        assert ahead.promise > max(ahead.imbalance_a, ahead.imbalance_b) > 1.0
        promises.append(ahead.promise)
    assert promises == sorted(promises)
