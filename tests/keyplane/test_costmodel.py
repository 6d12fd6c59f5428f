"""Tests of keyplane.costmodel: the batch-time model and its calibration from metrics."""

from __future__ import annotations

import numpy as np
import pytest

from keyplane.batchmetrics import BatchMetrics
from keyplane.costmodel import MIN_CALIBRATION_BATCHES, CostModel, calibrate


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
