"""The planner's choice: which plan to deploy, and the imbalance it promises.

:func:`choose_plan` builds a plan with balance headroom sized from the drift
:class:`~keyplane.algorithms.pair_history.PairHistory` measured, keeps it only
if the cost model predicts it beats keeping hash routing and keeping the
current tables on the next window, and states the imbalance the next window is
expected to keep (``promised_imbalance``), calibrated on how earlier plans
fared. The weights it balances may be a forecast of the next window's
(:mod:`keyplane.algorithms.forecast`), whose drift is then the forecasts'
error rather than the history's lag.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from keyplane.algorithms.costmodel import (
    PROMISE_CONFIDENCE,
    CostModel,
    Drift,
    StageProfile,
    next_window,
)
from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import LocalityPlan, stage_profiles
from keyplane.algorithms.pair_statistics import ChainStatistics, PairStatistics
from keyplane.algorithms.plan_settings import HeavyKeyPolicy

DEFAULT_HEADROOM = 0.5
"""Share of the slack ``α − 1`` a plan may use on its training window: it is
built to ``1 + headroom · (α − 1)`` so that the drift of the next window has
the rest (α = 1.03 → planned to 1.015)."""


def hash_plan(n_instances: int, alpha: float = 1.03) -> LocalityPlan:
    """Plain hash routing as a plan: no tables, no split keys."""
    return LocalityPlan(n_instances, alpha, {}, {}, (), (), 0.0, 1.0, 1.0, candidate="hash")


def score(
    plan: LocalityPlan,
    window: PairStatistics,
    cost: CostModel,
    drift: tuple[Drift, Drift] | None = None,
) -> LocalityPlan:
    """``plan`` with its predictions measured on ``window``, its predicted
    throughput and its promise on the next window.

    Under ``drift`` (per stage;
    :attr:`~keyplane.algorithms.pair_history.PairHistory.drift`) the throughput
    is the cost model's at the expected next-window imbalance and the promise the
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE` bound of
    :func:`keyplane.algorithms.costmodel.next_window`. Without ``drift`` both
    are in-sample: the caller scores a plan on the window it runs on. A
    ``drift`` that has measured no window yet is no evidence of how the next
    window moves, and the in-sample imbalance is a bound the next window
    breaks, so the promise is then unbounded (``math.inf``): none is made.
    """
    measured = plan.evaluate(window)
    ahead = next_window(stage_profiles(plan, window, drift or (Drift(), Drift())))
    bound = max(ahead.promise, 1.0)
    known = _measured_any(drift)
    return dataclasses.replace(
        plan,
        predicted_locality=measured.locality,
        predicted_imbalance_a=measured.imbalance_a,
        predicted_imbalance_b=measured.imbalance_b,
        predicted_throughput=cost.throughput(measured.locality, *ahead.imbalances),
        promised_imbalance=bound if drift is None or known else math.inf,
        model_promise=bound if known else 0.0,
    )


def _measured_any(drift: tuple[Drift, Drift] | None) -> bool:
    return drift is not None and any(stage.windows > 0 for stage in drift)


MAX_PROMISE_RATIOS = 48
"""Most of the earlier plans' outcomes :func:`choose_plan` calibrates its promise on."""


def _calibration(ratios: tuple[float, ...]) -> float:
    """Factor on the model's slack so that the promise would have held on the
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE` share of earlier plans
    (split conformal prediction: the ⌈(k+1)·q⌉-th smallest of k ratios, the
    largest when there are too few); never below 1, the model's own bound."""
    if not ratios:
        return 1.0
    ordered = np.sort(np.asarray(ratios, dtype=np.float64))
    rank = min(ordered.size, int(np.ceil((ordered.size + 1) * PROMISE_CONFIDENCE)))
    return max(1.0, float(ordered[rank - 1]))


def drift_margin(
    pairs: PairStatistics | ChainStatistics, drift: Sequence[Drift], n_instances: int
) -> float:
    """How far above 1 the next window's expected imbalance is for a plan balanced
    perfectly on ``pairs``: the slack the measured drift (one per stage, upstream
    first) takes by itself."""
    chain = pairs.chain() if isinstance(pairs, PairStatistics) else pairs
    profiles: list[StageProfile] = []
    for index, stage_drift in enumerate(drift):
        weights = chain.stage_weights(index)
        total = float(weights.weights.sum())
        squares = float(((weights.weights / total) ** 2).sum()) / n_instances if total > 0 else 0.0
        profiles.append(
            (np.full(n_instances, 1.0 / n_instances), np.full(n_instances, squares), stage_drift)
        )
    ahead = next_window(profiles)
    return max(ahead.imbalances, default=1.0) - 1.0


def choose_plan(
    pairs: PairStatistics,
    n_instances: int,
    *,
    alpha: float = 1.03,
    headroom: float = DEFAULT_HEADROOM,
    current: LocalityPlan | None = None,
    cost: CostModel | None = None,
    max_table_entries: int | None = None,
    seed: int = 0,
    heavy_key_policy: HeavyKeyPolicy = "split",
    drift: tuple[Drift, Drift] | None = None,
    followed: PairStatistics | None = None,
) -> LocalityPlan:
    """The planner: the candidate with the highest predicted next-window throughput.

    Candidates are keeping ``current`` (when given), plain hash routing
    (:func:`hash_plan`) and a new
    :func:`~keyplane.algorithms.locality.build_plan` built with balance
    headroom whose splits must pay under ``cost``. Without a measured
    ``drift`` (per stage,
    :attr:`~keyplane.algorithms.pair_history.PairHistory.drift`) the headroom is
    ``headroom`` (:data:`DEFAULT_HEADROOM`). With one, it is sized from the
    drift: the plan is built to α less the :func:`drift_margin` the drift
    takes by itself, and to α when the drift takes all of the slack (a
    tighter plan would then cost locality for a balance the next window does
    not keep). Every candidate is scored at its expected next-window
    imbalance by the same ruler (:func:`score`), so the chosen plan is never
    predicted slower than hash routing; on a tie the earlier candidate
    (current, then hash) wins, since it moves no state.

    The chosen plan's ``promised_imbalance`` is the drift model's bound,
    calibrated on how earlier plans fared: ``followed`` is the window that
    ran under ``current``, whose imbalance there is added to the ratios
    ``current`` carries (:func:`_calibration`). Before ``drift`` has measured
    a window there is no promise (``math.inf``, :func:`score`).
    """
    if not 0.0 <= headroom <= 1.0:
        raise ValueError(f"headroom must lie in [0, 1], got {headroom}")
    if not np.isfinite(alpha) or alpha < 1.0:
        raise ValueError(f"alpha is an imbalance bound and must be ≥ 1, got {alpha}")
    model = cost if cost is not None else CostModel()
    bound = 1.0 + headroom * (alpha - 1.0)
    if drift is not None and _measured_any(drift):
        margin = drift_margin(pairs, drift, n_instances)
        bound = alpha - margin if margin < alpha - 1.0 else alpha
    built = build_plan(
        pairs,
        n_instances,
        alpha=bound,
        max_table_entries=max_table_entries,
        seed=seed,
        heavy_key_policy=heavy_key_policy,
        cost=model,
    )
    candidates = [hash_plan(n_instances, alpha), dataclasses.replace(built, alpha=alpha)]
    ratios: tuple[float, ...] = ()
    if current is not None:
        if current.n_instances != n_instances:
            raise ValueError(
                f"the current plan has {current.n_instances} instances, not {n_instances}"
            )
        candidates.insert(0, dataclasses.replace(current, candidate="current"))
        ratios = current.promise_ratios
        if followed is not None and current.model_promise > 1.0:
            realized = max(current.evaluate(followed)[1:])
            ratio = (realized - 1.0) / (current.model_promise - 1.0)
            ratios = (*ratios, ratio)[-MAX_PROMISE_RATIOS:]
    scored = [score(candidate, pairs, model, drift) for candidate in candidates]
    best = scored[0]
    for candidate in scored[1:]:
        if candidate.predicted_throughput > best.predicted_throughput * (1.0 + 1e-9):
            best = candidate
    promise = best.promised_imbalance
    if best.model_promise > 1.0:
        promise = 1.0 + (best.model_promise - 1.0) * _calibration(ratios)
    return dataclasses.replace(best, promised_imbalance=promise, promise_ratios=ratios)
