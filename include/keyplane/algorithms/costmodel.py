"""What a routing plan is predicted to cost per micro-batch: the planner's objective.

Paper 000 §3.1 maximises locality under a hard imbalance bound α. What a job
pays for is neither figure alone but the time of a micro-batch: each stage
ends with its slowest instance (a straggler costs ``imbalance`` × the mean
instance's work), and every tuple that crosses servers between two
consecutive stages costs a network transfer (000 §2.2). :class:`CostModel`
weighs the two over a chain of stages s = 1..k:

    batch time per mean instance tuple = Σ_s service_s · I_s + remote · (1 − L)

with ``I_s`` stage s's max/mean instance load and ``L`` the locality over
the chain's consecutive stage pairs. Predicted throughput is its inverse.
The defaults (every weight 1) make a point of locality worth a point of any
stage's imbalance, the same exchange rate as
:class:`keyplane.orchestration.planning.DecisionRule`; :func:`calibrate`
fits the weights to the job's own metrics records when it has enough of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls

from keyplane.algorithms.batchmetrics import BatchMetrics

CostSource = Literal["default", "calibrated"]

MIN_CALIBRATION_BATCHES = 8
"""Fewest metrics records :func:`calibrate` fits on: three weights and an
intercept need a few batches more than four to be more than noise."""


@dataclass(frozen=True)
class CostModel:
    """Weights of the batch-time model (module docstring), in any one time unit.

    ``service``: time of one tuple on an instance of each stage, upstream
    first; a stage it does not cover (and every stage when it is empty)
    takes the mean of the given weights, 1 when none is given. ``remote``:
    the extra time of one tuple sent to another server. Only ratios matter
    when plans are compared; calibrated weights are in milliseconds per tuple.
    """

    service: tuple[float, ...] = ()
    remote: float = 1.0
    source: CostSource = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "service", tuple(float(s) for s in self.service))
        for name, value in [*(("service", s) for s in self.service), ("remote", self.remote)]:
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and ≥ 0, got {value}")
        if self.service and sum(self.service) <= 0:
            raise ValueError("the service weights sum to 0: a batch takes some time")

    def stage_service(self, stage: int) -> float:
        """The service weight of the chain's ``stage``-th stage (0 is the most upstream)."""
        if stage < len(self.service):
            return self.service[stage]
        return float(np.mean(self.service)) if self.service else 1.0

    def batch_time(self, locality: float, *imbalances: float) -> float:
        """Time of a batch per tuple of the mean instance, given each stage's
        imbalance upstream first (module docstring)."""
        return sum(
            self.stage_service(stage) * value for stage, value in enumerate(imbalances)
        ) + self.remote * (1.0 - locality)

    def throughput(self, locality: float, *imbalances: float) -> float:
        """Predicted tuples per time unit per instance: the inverse of :meth:`batch_time`."""
        return 1.0 / self.batch_time(locality, *imbalances)


def _features(record: BatchMetrics, stages: Sequence[str]) -> list[float] | None:
    """Per batch: each stage's busiest instance's tuples and the mean remote tuples
    per instance."""
    loads = [record.load.get(stage, {}) for stage in stages]
    if not stages or any(not stage_loads for stage_loads in loads) or record.duration_ms <= 0:
        return None
    n = max(len(stage_loads) for stage_loads in loads)
    remote = max(0, record.hops - record.local_hops) / n
    return [float(max(stage_loads.values())) for stage_loads in loads] + [float(remote)]


def calibrate(
    records: Sequence[BatchMetrics], stages: Sequence[str], default: CostModel | None = None
) -> CostModel:
    """Fit the weights of the chain ``stages`` (upstream first) to measured batches,
    else return ``default``.

    A batch's duration is regressed on each stage's busiest instance's
    tuples and its remote tuples per instance, plus an intercept for the
    fixed cost of a batch (planning, commits), by non-negative least
    squares: a weight cannot be negative. The fit is used only with at least
    :data:`MIN_CALIBRATION_BATCHES` usable records and a positive service
    weight; otherwise the documented defaults hold.
    """
    fallback = default if default is not None else CostModel()
    usable = [(f, r) for f, r in ((_features(r, stages), r) for r in records) if f is not None]
    if len(usable) < MIN_CALIBRATION_BATCHES:
        return fallback
    rows = [f for f, _ in usable]
    durations = [float(r.duration_ms) for _, r in usable]
    design = np.column_stack([np.asarray(rows, dtype=np.float64), np.ones(len(rows))])
    scale = np.maximum(design.max(axis=0), 1e-12)
    weights, _ = nnls(design / scale, np.asarray(durations, dtype=np.float64))
    fitted = weights / scale
    service, remote = fitted[: len(stages)], fitted[len(stages)]
    if float(service.sum()) <= 0 or not np.all(np.isfinite(weights)):
        return fallback
    return CostModel(tuple(float(s) for s in service), float(remote), source="calibrated")


PROMISE_CONFIDENCE = 0.95
"""Share of next windows a plan's :func:`next_window` promise is meant to hold on."""
_PROMISE_DRAWS = 512
_PROBE_PLACEMENTS = 8
"""Random placements :func:`measure_drift` scores the measured drift on."""
_MAX_RESIDUALS = 1024
_MIN_RESIDUALS = 48
"""Fewest residuals drawn from instead of the normal distribution."""


@dataclass(frozen=True)
class Drift:
    """How a stage's key shares move from the statistics a plan is built on to the next window.

    A plan balances the shares it was trained on; the next window's shares
    differ, so its instance loads do too. A key of share ``s`` (of its
    stage's load) is taken to move by a zero-mean amount of variance
    ``relative² · s² + tally · s``: ``relative`` is popularity drift, which
    scales with the key; ``tally`` the noise of a share counted from finitely
    many tuples (Poisson, variance ∝ ``s``). ``unseen`` is ``Σ s²`` over the
    next window's keys the statistics did not know: they are hashed, so they
    land on instances at random. That gives each instance a standard
    deviation (:meth:`instance_sd`); ``residuals`` are the measured instance
    deviations in units of it, so that what a normal law misses (a cold key
    turning hot at once, a trend) is drawn as often as it was seen.
    ``windows`` says how many window pairs were measured (0: none, no drift
    assumed).
    """

    relative: float = 0.0
    tally: float = 0.0
    unseen: float = 0.0
    windows: int = 0
    residuals: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("relative", "tally", "unseen"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and ≥ 0, got {value}")

    def instance_sd(
        self, share: npt.NDArray[np.float64], share_squares: npt.NDArray[np.float64], n: int
    ) -> npt.NDArray[np.float64]:
        """Standard deviation of each instance's next-window share, given the shares
        (summed, and squared-summed) of the keys the plan puts on it."""
        variance = self.relative**2 * share_squares + self.tally * share + self.unseen / n
        return np.sqrt(np.maximum(variance, 0.0))

    def blend(self, newer: Drift, weight: float = 0.25) -> Drift:
        """Exponentially smoothed over windows (``weight`` on ``newer``); the
        residuals pooled, newest first, up to a bound."""
        if self.windows == 0:
            return newer
        if newer.windows == 0:
            return self
        keep = 1.0 - weight
        return Drift(
            relative=float(np.sqrt(keep * self.relative**2 + weight * newer.relative**2)),
            tally=keep * self.tally + weight * newer.tally,
            unseen=keep * self.unseen + weight * newer.unseen,
            windows=self.windows + newer.windows,
            residuals=(newer.residuals + self.residuals)[:_MAX_RESIDUALS],
        )

    def draw(self, rng: np.random.Generator, shape: tuple[int, int]) -> npt.NDArray[np.float64]:
        """Standardised instance deviations: the measured residuals when there are
        enough of them, else standard normal. Residuals of a fitted model are
        narrower than its variance says (the fit saw them), so they give the
        shape only: scaled to unit variance when narrower than that."""
        if len(self.residuals) < _MIN_RESIDUALS:
            return rng.standard_normal(shape)
        pool = np.asarray(self.residuals, dtype=np.float64)
        spread = float(np.sqrt(np.mean(pool**2)))
        return rng.choice(pool / min(spread, 1.0) if spread > 0 else pool, size=shape)


PRIOR_RELATIVE_DRIFT = 0.5
"""Popularity drift assumed before any has been measured: a key's share moves by
half of itself (one standard deviation) from one window to the next. A first
promise has no earlier window to learn from, so the prior is wide on purpose: it
states what a plan can honestly expect, not what it hopes for."""


def prior_drift(total: float) -> Drift:
    """The drift a stage is assumed to have before one has been measured.

    Two parts, neither fitted: the sampling noise of shares counted from
    ``total`` tuples (multinomial, so a share ``s`` varies by ``s / total``:
    ``tally = 1 / total``) and the documented popularity drift
    :data:`PRIOR_RELATIVE_DRIFT`. ``windows`` stays 0, so the first measured
    drift replaces it (:meth:`Drift.blend`) and nothing treats it as measured.
    """
    if not (np.isfinite(total) and total >= 0):
        raise ValueError(f"total must be a finite tuple count ≥ 0, got {total}")
    return Drift(relative=PRIOR_RELATIVE_DRIFT, tally=1.0 / total if total > 0 else 0.0)


def measure_drift(
    before_keys: npt.ArrayLike,
    before_weights: npt.ArrayLike,
    after_keys: npt.ArrayLike,
    after_weights: npt.ArrayLike,
    n_instances: int,
    seed: int = 0,
) -> Drift:
    """Fit a :class:`Drift` to one stage's key weights before and after (e.g. the
    decayed history a plan is built on, and the window that followed it).

    Shares are normalised per side; each known key's squared share change is
    regressed on its share squared and its share by non-negative least
    squares (a variance cannot be negative). The residuals are the instance
    deviations of a few random placements of the keys over ``n_instances``,
    each divided by the fitted standard deviation. Returns no drift when
    either side is empty.
    """
    keys_0 = np.asarray(before_keys)
    keys_1 = np.asarray(after_keys)
    w_0 = np.asarray(before_weights, dtype=np.float64)
    w_1 = np.asarray(after_weights, dtype=np.float64)
    if w_0.sum() <= 0 or w_1.sum() <= 0 or n_instances < 1:
        return Drift()
    keys = np.union1d(keys_0, keys_1)
    s_0 = np.zeros(keys.size)
    s_1 = np.zeros(keys.size)
    np.add.at(s_0, np.searchsorted(keys, keys_0), w_0 / w_0.sum())
    np.add.at(s_1, np.searchsorted(keys, keys_1), w_1 / w_1.sum())
    known = s_0 > 0
    unseen = float((s_1[~known] ** 2).sum())
    design = np.column_stack([s_0[known] ** 2, s_0[known]])
    scale = np.maximum(design.max(axis=0), 1e-300)
    fitted, _ = nnls(design / scale, (s_1[known] - s_0[known]) ** 2)
    squared, tally = fitted / scale
    drift = Drift(float(np.sqrt(squared)), float(tally), unseen, windows=1)
    rng = np.random.default_rng(seed)
    residuals: list[float] = []
    for _ in range(_PROBE_PLACEMENTS):
        part = rng.integers(0, n_instances, keys.size)
        share_0, share_1, squares = (
            np.bincount(part, weights=w, minlength=n_instances).astype(np.float64)
            for w in (s_0, s_1, s_0**2)
        )
        sd = drift.instance_sd(share_0, squares, n_instances)
        usable = sd > 1e-12
        residuals += ((share_1 - share_0)[usable] / sd[usable]).tolist()
    return dataclasses.replace(drift, residuals=tuple(residuals)[:_MAX_RESIDUALS])


class NextWindow(NamedTuple):
    """What a plan's instance loads are expected to do on the next window."""

    imbalances: tuple[float, ...]
    """Each stage's expected max/mean, in the order the profiles were given."""
    promise: float


StageProfile = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], Drift]
"""One stage under a plan: each instance's share of the stage's load, the sum of
the squared shares of the keys on it that can drift (split keys are spread
evenly and do not), and the stage's :class:`Drift`."""


def next_window(stages: Sequence[StageProfile], seed: int = 0) -> NextWindow:
    """Expected next-window imbalance of each stage and the plan's promise.

    Each instance's share moves by an independent deviation of the
    :class:`Drift`'s standard deviation (:meth:`Drift.draw`); over
    :data:`_PROMISE_DRAWS` draws this returns each stage's mean max/mean and
    the :data:`PROMISE_CONFIDENCE` quantile of the worse stage's max/mean:
    the bound the plan expects the next window to keep. With no drift both
    are the in-sample imbalance.
    """
    rng = np.random.default_rng(seed)
    draws = []
    for share, squares, drift in stages:
        n = share.size
        sd = drift.instance_sd(share, squares, n)
        noisy = np.maximum(share[None, :] + sd[None, :] * drift.draw(rng, (_PROMISE_DRAWS, n)), 0.0)
        top = noisy.max(axis=1)
        flat = top - noisy.min(axis=1) <= 1e-12 * np.maximum(top, 1e-300)
        draws.append(np.where(flat, 1.0, top / np.maximum(noisy.mean(axis=1), 1e-300)))
    if not draws:
        return NextWindow((), 1.0)
    worse = np.maximum.reduce(draws)
    means = tuple(float(d.mean()) for d in draws)
    return NextWindow(means, float(np.quantile(worse, PROMISE_CONFIDENCE)))
