"""When the job's own metrics call for a re-plan: the event-driven start of keyplane_reconfigure.

Besides its schedule, the reconfiguration DAG starts when the routed job's
newest micro-batches, on one version, measure the worst operator's load
imbalance (max/mean over the instances the version keeps active, 000 §3.1)
above a bound, the share of the tuples between consecutive stages kept on
one executor (000 §2) below a bound, or the input lag growing faster than a
bound per batch. The figures are those of the DAG's ``verify`` step
(:func:`keyplane.orchestration.planning.measure`). Pure: the trigger that reads the topic is
:class:`keyplane.orchestration.triggers.MetricsSignalTrigger`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from keyplane.algorithms.batchmetrics import BatchMetrics


class SignalThresholds(BaseModel):
    """The bounds past which the job's metrics start a re-plan (0 or None: not watched)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    imbalance_above: float | None = Field(default=1.5, gt=1.0)
    """The worst operator's busiest active instance over the average one."""
    locality_below: float | None = Field(default=None, gt=0.0, le=1.0)
    """Share of the tuples between consecutive stages kept on one executor."""
    lag_growth_above: float | None = Field(default=None, gt=0.0)
    """Input records the lag grows by per micro-batch, on average over the window."""
    batches: int = Field(default=5, ge=2)
    """Newest micro-batches on one version judged together."""

    @model_validator(mode="after")
    def _watches_something(self) -> SignalThresholds:
        if (self.imbalance_above, self.locality_below, self.lag_growth_above) == (None,) * 3:
            raise ValueError(
                "give at least one of imbalance_above, locality_below, lag_growth_above"
            )
        return self


def reconfiguration_signal(
    records: Sequence[BatchMetrics],
    thresholds: SignalThresholds,
    active: Mapping[int, Mapping[str, Sequence[int]]] | None = None,
) -> dict[str, Any] | None:
    """The event that starts a re-plan, or None while the newest batches are within bounds.

    Judged over the newest ``thresholds.batches`` batches with tuples between stages
    that ran wholly on the newest such batch's version (a window that spans
    a rollout would mix two routings). ``active`` gives each version's
    active instances (:func:`keyplane.dashboard.metrics.active_instances`).
    """
    from keyplane.dashboard.metrics import batch_version, on_active_instances
    from keyplane.orchestration.planning import measure

    busy = sorted((r for r in records if r.hops > 0), key=lambda r: r.batch_id)
    if not busy:
        return None
    version = batch_version(busy[-1])
    if version is None:
        return None
    window = [r for r in busy if batch_version(r) == version][-thresholds.batches :]
    if len(window) < thresholds.batches:
        return None
    measured = measure(on_active_instances(r, active) for r in window)
    reasons = []
    imbalance, locality, growth = measured.imbalance, measured.locality, measured.lag_growth
    bound = thresholds.imbalance_above
    if bound is not None and imbalance is not None and imbalance > bound:
        reasons.append(f"imbalance {imbalance:.3f} > {bound}")
    floor = thresholds.locality_below
    if floor is not None and locality is not None and locality < floor:
        reasons.append(f"locality {locality:.1%} < {floor:.1%}")
    rise = thresholds.lag_growth_above
    if rise is not None and growth is not None and growth > rise:
        reasons.append(f"lag growing {growth:+.0f} records/batch > {rise:g}")
    if not reasons:
        return None
    return {
        "reason": "; ".join(reasons),
        "version": version,
        "first_batch": window[0].batch_id,
        "last_batch": window[-1].batch_id,
        "imbalance": _finite(imbalance),
        "locality": _finite(locality),
        "lag_growth": _finite(growth),
    }


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), 6)
