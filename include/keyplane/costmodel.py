"""What a routing plan is predicted to cost per micro-batch: the planner's objective.

Paper 000 §3.1 maximises locality under a hard imbalance bound α. What a job
pays for is neither figure alone but the time of a micro-batch: each stage
ends with its slowest instance (a straggler costs ``imbalance`` × the mean
instance's work), and every tuple that crosses servers between the stages
costs a network transfer (000 §2.2). :class:`CostModel` weighs the two:

    batch time per mean instance tuple = service_a · I_A + service_b · I_B + remote · (1 − L)

with ``I_A``, ``I_B`` the stages' max/mean instance loads and ``L`` the
locality. Predicted throughput is its inverse. The defaults (1, 1, 1) make a
point of locality worth a point of either stage's imbalance, the same
exchange rate as :class:`keyplane.orchestration.planning.DecisionRule`;
:func:`calibrate` fits the three weights to the job's own metrics records
when it has enough of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.optimize import nnls

from keyplane.batchmetrics import BatchMetrics

CostSource = Literal["default", "calibrated"]

MIN_CALIBRATION_BATCHES = 8
"""Fewest metrics records :func:`calibrate` fits on: three weights and an
intercept need a few batches more than four to be more than noise."""


@dataclass(frozen=True)
class CostModel:
    """Weights of the batch-time model (module docstring), in any one time unit.

    ``service_a``/``service_b``: time of one tuple on a stage-A/B instance;
    ``remote``: the extra time of one tuple sent to another server. Only
    ratios matter when plans are compared; calibrated weights are in
    milliseconds per tuple.
    """

    service_a: float = 1.0
    service_b: float = 1.0
    remote: float = 1.0
    source: CostSource = "default"

    def __post_init__(self) -> None:
        for name in ("service_a", "service_b", "remote"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and ≥ 0, got {value}")
        if self.service_a + self.service_b <= 0:
            raise ValueError("service_a + service_b must be > 0: a batch takes some time")

    def batch_time(self, locality: float, imbalance_a: float, imbalance_b: float) -> float:
        """Time of a batch per tuple of the mean instance (module docstring)."""
        return (
            self.service_a * imbalance_a
            + self.service_b * imbalance_b
            + self.remote * (1.0 - locality)
        )

    def throughput(self, locality: float, imbalance_a: float, imbalance_b: float) -> float:
        """Predicted tuples per time unit per instance: the inverse of :meth:`batch_time`."""
        return 1.0 / self.batch_time(locality, imbalance_a, imbalance_b)


def _features(record: BatchMetrics) -> tuple[float, float, float] | None:
    """Per batch: the busiest A and B instance's tuples and the mean remote tuples per instance."""
    loads_a = record.load.get("A", {})
    loads_b = record.load.get("B", {})
    if not loads_a or not loads_b or record.duration_ms <= 0:
        return None
    n = max(len(loads_a), len(loads_b))
    remote = max(0, record.hops - record.local_hops) / n
    return float(max(loads_a.values())), float(max(loads_b.values())), float(remote)


def calibrate(records: Sequence[BatchMetrics], default: CostModel | None = None) -> CostModel:
    """Fit the weights to measured batches, else return ``default``.

    A batch's duration is regressed on its busiest A instance's tuples, its
    busiest B instance's tuples and its remote tuples per instance, plus an
    intercept for the fixed cost of a batch (planning, commits), by
    non-negative least squares: a weight cannot be negative. The fit is used
    only with at least :data:`MIN_CALIBRATION_BATCHES` usable records and a
    positive service weight; otherwise the documented defaults hold.
    """
    fallback = default if default is not None else CostModel()
    rows = [f for f in (_features(r) for r in records) if f is not None]
    durations = [float(r.duration_ms) for r in records if _features(r) is not None]
    if len(rows) < MIN_CALIBRATION_BATCHES:
        return fallback
    design = np.column_stack([np.asarray(rows, dtype=np.float64), np.ones(len(rows))])
    scale = np.maximum(design.max(axis=0), 1e-12)
    weights, _ = nnls(design / scale, np.asarray(durations, dtype=np.float64))
    service_a, service_b, remote, _ = weights / scale
    if service_a + service_b <= 0 or not np.all(np.isfinite(weights)):
        return fallback
    return CostModel(float(service_a), float(service_b), float(remote), source="calibrated")
