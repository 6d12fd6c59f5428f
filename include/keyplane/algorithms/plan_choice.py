"""The planner's choice: which plan to deploy, and the imbalance it promises.

One rule for a chain of any length, used by the reconfiguration DAG
(:func:`keyplane.orchestration.planning.plan_configuration`) and by the
planners of this package alike:

* the candidates are keeping the current routing, plain hash routing and a new
  plan built with balance headroom sized from the measured drift
  (:func:`planning_alpha`, :func:`drift_margin`);
* each is scored by the same ruler (:func:`score_candidate`): locality and the
  expected next-window imbalance of every stage, turned into a predicted
  throughput by the :class:`~keyplane.algorithms.costmodel.CostModel`; the
  highest wins (:func:`choose`), so the choice is never predicted slower than
  hash routing;
* the chosen candidate states the imbalance the next window is expected to
  keep (``promised_imbalance``): the drift model's bound
  (:func:`keyplane.algorithms.costmodel.next_window`), calibrated on how
  earlier plans fared (:func:`_calibration`). Before a drift has been measured
  the promise is made under the prior drift
  (:func:`keyplane.algorithms.costmodel.prior_drift`): the training counts'
  own sampling noise and a documented, wide popularity drift.

A candidate is given as how it routes each stage's keys (:class:`StageRouting`),
so the rule does not depend on how the routing is stored: the DAG's
configurations and :class:`~keyplane.algorithms.locality_plan.ChainPlan` are
both scored through it. :func:`choose_chain_plan` is the planner on a chain's
statistics, :func:`choose_plan` its two-stage form. The weights it balances may
be a forecast of the next window's (:mod:`keyplane.algorithms.forecast`), whose
drift is then the forecasts' error rather than the history's lag.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from keyplane.algorithms.costmodel import (
    PROMISE_CONFIDENCE,
    CostModel,
    Drift,
    StageProfile,
    next_window,
    prior_drift,
)
from keyplane.algorithms.locality import build_chain_plan
from keyplane.algorithms.locality_plan import (
    CandidateName,
    ChainPlan,
    LocalityPlan,
    TableRouter,
    _imbalance,
)
from keyplane.algorithms.pair_statistics import (
    ChainStatistics,
    FloatArray,
    KeyWeights,
    PairStatistics,
    aggregate_pairs,
)
from keyplane.algorithms.partitioner import KeyArray
from keyplane.algorithms.plan_settings import HeavyKeyPolicy

DEFAULT_HEADROOM = 0.5
"""Share of the slack ``α − 1`` a plan may use on its training window: it is
built to ``1 + headroom · (α − 1)`` so that the drift of the next window has
the rest (α = 1.03 → planned to 1.015)."""

MAX_PROMISE_RATIOS = 48
"""Most of the earlier plans' outcomes a promise is calibrated on."""

SharesOf = Callable[[KeyArray], FloatArray]
"""Each key's share of its tuples on each instance: a ``len(keys) × n`` matrix
whose rows sum to 1 (a key routed to one instance has a single 1)."""


@dataclass(frozen=True)
class StageRouting:
    """How a candidate routes one stage: ``shares`` (:data:`SharesOf`), and the
    instances that take load (``None``: all). Imbalance is max / mean over the
    active instances only: a released instance holds no keys by design (003 §5.3)."""

    shares: SharesOf
    active: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Candidate:
    """One routing of every stage of a chain, upstream first, over ``n_instances``."""

    name: CandidateName
    stages: tuple[StageRouting, ...]
    n_instances: int


@dataclass(frozen=True)
class Scored:
    """A candidate measured on a window (:func:`score_candidate`).

    ``locality`` and ``imbalances`` (per stage, upstream first) are the
    window's own figures; ``throughput`` is the cost model's at the expected
    next-window imbalance. ``promised_imbalance`` is the bound the next
    window's worse stage is expected to keep and ``model_promise`` the
    measured drift model's bound behind it (0 when no drift was measured: the
    promise then rests on the prior drift and is not calibrated).
    """

    name: CandidateName
    locality: float
    imbalances: tuple[float, ...]
    throughput: float
    promised_imbalance: float
    model_promise: float


@dataclass(frozen=True)
class Choice:
    """The scored candidates, the winner's index and its calibrated promise
    (:func:`choose`); ``promise_ratios`` are the earlier outcomes it was calibrated on."""

    index: int
    scores: tuple[Scored, ...]
    promised_imbalance: float
    promise_ratios: tuple[float, ...] = ()

    @property
    def chosen(self) -> Scored:
        return self.scores[self.index]

    @property
    def candidate(self) -> CandidateName:
        return self.chosen.name

    @property
    def model_promise(self) -> float:
        return self.chosen.model_promise

    @property
    def throughputs(self) -> dict[str, float]:
        return {scored.name: scored.throughput for scored in self.scores}


def _measured_any(drift: Sequence[Drift] | None) -> bool:
    return drift is not None and any(stage.windows > 0 for stage in drift)


def _stage_profile(
    routing: StageRouting, weights: KeyWeights, n: int, drift: Drift
) -> tuple[float, StageProfile]:
    """A stage's imbalance on the window and its profile for :func:`next_window`.

    Keys routed to one instance drift with their share; a key spread over
    several instances (a split or hot key) moves all of them alike and does
    not unbalance them.
    """
    shares = routing.shares(weights.keys)
    drifting = shares.max(axis=1, initial=0.0) >= 1.0
    loads = weights.weights @ shares
    squares = (weights.weights**2 * drifting) @ shares
    if routing.active is not None:
        active = [i for i in routing.active if 0 <= i < n]
        loads, squares = loads[active], squares[active]
    m = loads.size
    total = float(loads.sum())
    if total <= 0.0:  # an empty stage: nothing to drift
        return 1.0, (np.full(m, 1.0 / m), np.zeros(m), drift)
    return _imbalance(loads), (loads / total, squares / total / total, drift)


def _locality(candidate: Candidate, window: ChainStatistics) -> float:
    """Share of the pair weight over every link kept on one instance (000 §3.2);
    a pair of spread keys is local with probability ``Σ_i up[i] · down[i]``."""
    local = total = 0.0
    for index, link in enumerate(window.links):
        up, down, counts = aggregate_pairs(link.up_keys, link.down_keys, link.counts)
        if counts.size == 0:
            continue
        together = candidate.stages[index].shares(up) * candidate.stages[index + 1].shares(down)
        local += float((counts * together.sum(axis=1)).sum())
        total += float(counts.sum())
    return local / total if total > 0 else 0.0


def score_candidate(
    candidate: Candidate,
    window: ChainStatistics,
    cost: CostModel,
    drift: Sequence[Drift] | None = None,
) -> Scored:
    """``candidate`` measured on ``window``, its predicted throughput and its promise.

    Under ``drift`` (one per stage, upstream first) the throughput is the cost
    model's at the expected next-window imbalance and the promise the
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE` bound of
    :func:`~keyplane.algorithms.costmodel.next_window`. Without ``drift`` both
    are in-sample: the caller scores a candidate on the window it runs on. A
    ``drift`` that has measured no window yet is no evidence of how the next
    window moves, and the in-sample imbalance is a bound the next window
    breaks, so each stage then gets the
    :func:`~keyplane.algorithms.costmodel.prior_drift` of its own tuple count:
    the throughput and the promise are both made under it, and
    ``model_promise`` stays 0 so that no calibration ratio is taken against it.
    """
    stages = window.n_stages
    if len(candidate.stages) != stages:
        raise ValueError(
            f"the {candidate.name} candidate routes {len(candidate.stages)} stages, "
            f"the statistics have {stages}"
        )
    drifts = tuple(drift) if drift is not None else (Drift(),) * stages
    if len(drifts) != stages:
        raise ValueError(f"give one drift per stage: {stages}, got {len(drifts)}")
    known = _measured_any(drift)
    if drift is not None and not known:
        drifts = tuple(
            prior_drift(float(window.stage_weights(index).weights.sum())) for index in range(stages)
        )
    imbalances: list[float] = []
    profiles: list[StageProfile] = []
    for index, (routing, stage_drift) in enumerate(zip(candidate.stages, drifts, strict=True)):
        imbalance, profile = _stage_profile(
            routing, window.stage_weights(index), candidate.n_instances, stage_drift
        )
        imbalances.append(imbalance)
        profiles.append(profile)
    locality = _locality(candidate, window)
    ahead = next_window(profiles)
    bound = max(ahead.promise, 1.0)
    return Scored(
        name=candidate.name,
        locality=locality,
        imbalances=tuple(imbalances),
        throughput=cost.throughput(locality, *ahead.imbalances),
        promised_imbalance=bound,
        model_promise=bound if known else 0.0,
    )


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


def promise_ratio(realized: float, model_promise: float) -> float | None:
    """How far a plan's next window went, in units of its model's slack:
    ``(realized − 1) / (model_promise − 1)``; None when the plan had no model
    promise to measure against. The calibration's input (:func:`_calibration`)."""
    if not (math.isfinite(model_promise) and model_promise > 1.0 and math.isfinite(realized)):
        return None
    return (realized - 1.0) / (model_promise - 1.0)


def choose(
    candidates: Sequence[Candidate],
    window: ChainStatistics,
    cost: CostModel,
    drift: Sequence[Drift] | None = None,
    ratios: Sequence[float] = (),
) -> Choice:
    """The candidate with the highest predicted next-window throughput on ``window``.

    Every candidate is scored by :func:`score_candidate`; on a tie the earlier
    candidate wins (give "current", then "hash" first: they move no state).
    The winner's promise is its model bound with the slack widened by
    :func:`_calibration` over the last :data:`MAX_PROMISE_RATIOS` of
    ``ratios`` (:func:`promise_ratio` of earlier plans); with no drift
    measured it is the prior drift's bound (:func:`score_candidate`).
    """
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    scores = tuple(score_candidate(candidate, window, cost, drift) for candidate in candidates)
    best = 0
    for index in range(1, len(scores)):
        if scores[index].throughput > scores[best].throughput * (1.0 + 1e-9):
            best = index
    kept = tuple(float(r) for r in ratios)[-MAX_PROMISE_RATIOS:]
    chosen = scores[best]
    promise = chosen.promised_imbalance
    if chosen.model_promise > 1.0:
        promise = 1.0 + (chosen.model_promise - 1.0) * _calibration(kept)
    return Choice(best, scores, promise, kept)


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


def planning_alpha(
    statistics: PairStatistics | ChainStatistics,
    n_instances: int,
    alpha: float,
    headroom: float = DEFAULT_HEADROOM,
    drift: Sequence[Drift] | None = None,
) -> float:
    """The bound a new plan is built to on its training statistics.

    Without a measured ``drift`` it is ``1 + headroom · (α − 1)``. With one,
    α less the :func:`drift_margin` the drift takes by itself, and α when the
    drift takes all of the slack: a tighter plan would then cost locality for
    a balance the next window does not keep.
    """
    if not 0.0 <= headroom <= 1.0:
        raise ValueError(f"headroom must lie in [0, 1], got {headroom}")
    if not np.isfinite(alpha) or alpha < 1.0:
        raise ValueError(f"alpha is an imbalance bound and must be ≥ 1, got {alpha}")
    if drift is not None and _measured_any(drift):
        margin = drift_margin(statistics, drift, n_instances)
        return alpha - margin if margin < alpha - 1.0 else alpha
    return 1.0 + headroom * (alpha - 1.0)


def table_shares(table: Mapping[int, int], split: Collection[int], n: int) -> SharesOf:
    """:data:`SharesOf` for a routing table with Spark's hash fallback and ``split``
    keys (not in the table) spread evenly over all ``n`` instances, as the
    simulator and the job route them."""
    router = TableRouter(table, n)
    spread_keys = np.fromiter(split, dtype=np.int64, count=len(split))

    def shares(keys: KeyArray) -> FloatArray:
        ids = np.asarray(keys, dtype=np.int64)
        matrix = np.zeros((ids.size, n), dtype=np.float64)
        spread = np.isin(ids, spread_keys)
        rows = np.flatnonzero(~spread)
        matrix[rows, router.route(ids[rows], np.zeros(0))] = 1.0
        matrix[spread] = 1.0 / n
        return matrix

    return shares


def plan_candidate(plan: ChainPlan, name: CandidateName) -> Candidate:
    """A :class:`~keyplane.algorithms.locality_plan.ChainPlan` as a candidate."""
    n = plan.n_instances
    return Candidate(
        name,
        tuple(
            StageRouting(table_shares(table, plan.split_keys(stage), n))
            for stage, table in enumerate(plan.tables)
        ),
        n,
    )


def hash_chain(n_instances: int, stages: int, alpha: float = 1.03) -> ChainPlan:
    """Plain hash routing of a chain of ``stages`` as a plan: no tables, no split keys."""
    return ChainPlan(
        n_instances, alpha, ({},) * stages, ((),) * stages, 0.0, (1.0,) * stages
    )  # fmt: skip


@dataclass(frozen=True)
class ChosenPlan:
    """The plan :func:`choose_chain_plan` chose and the choice it came from."""

    plan: ChainPlan
    choice: Choice

    @property
    def candidate(self) -> CandidateName:
        return self.choice.candidate

    @property
    def promised_imbalance(self) -> float:
        return self.choice.promised_imbalance


def choose_chain_plan(
    statistics: ChainStatistics,
    n_instances: int,
    *,
    alpha: float = 1.03,
    headroom: float = DEFAULT_HEADROOM,
    current: ChosenPlan | None = None,
    cost: CostModel | None = None,
    max_table_entries: int | None = None,
    seed: int = 0,
    heavy_key_policy: HeavyKeyPolicy = "split",
    drift: Sequence[Drift] | None = None,
    followed: ChainStatistics | None = None,
) -> ChosenPlan:
    """The planner on a chain: the best of keeping ``current`` (when given), hash
    routing and a new :func:`~keyplane.algorithms.locality.build_chain_plan` built
    to :func:`planning_alpha` whose splits must pay under ``cost``.

    The choice and its promise are :func:`choose`'s. The calibration's ratios
    are those ``current`` carries, plus how ``current`` fared on ``followed``,
    the window that ran under it (:func:`promise_ratio`).
    """
    model = cost if cost is not None else CostModel()
    built = build_chain_plan(
        statistics,
        n_instances,
        alpha=planning_alpha(statistics, n_instances, alpha, headroom, drift),
        max_table_entries=max_table_entries,
        seed=seed,
        heavy_key_policy=heavy_key_policy,
        cost=model,
    )
    plans: list[tuple[CandidateName, ChainPlan]] = [
        ("hash", hash_chain(n_instances, statistics.n_stages, alpha)),
        ("plan", dataclasses.replace(built, alpha=alpha)),
    ]
    ratios: tuple[float, ...] = ()
    if current is not None:
        if current.plan.n_instances != n_instances:
            raise ValueError(
                f"the current plan has {current.plan.n_instances} instances, not {n_instances}"
            )
        plans.insert(0, ("current", current.plan))
        ratios = current.choice.promise_ratios
        if followed is not None:
            fared = score_candidate(plan_candidate(current.plan, "current"), followed, model)
            ratio = promise_ratio(max(fared.imbalances, default=1.0), current.choice.model_promise)
            if ratio is not None:
                ratios = (*ratios, ratio)
    choice = choose(
        [plan_candidate(plan, name) for name, plan in plans], statistics, model, drift, ratios
    )
    return ChosenPlan(plans[choice.index][1], choice)


def hash_plan(n_instances: int, alpha: float = 1.03) -> LocalityPlan:
    """Plain hash routing as a two-stage plan: no tables, no split keys."""
    return LocalityPlan(n_instances, alpha, {}, {}, (), (), 0.0, 1.0, 1.0, candidate="hash")


def _as_pair(
    plan: ChainPlan, scored: Scored, promised: float, ratios: tuple[float, ...]
) -> LocalityPlan:
    imbalance_a, imbalance_b = scored.imbalances
    return dataclasses.replace(
        LocalityPlan.of_chain(plan),
        predicted_locality=scored.locality,
        predicted_imbalance_a=imbalance_a,
        predicted_imbalance_b=imbalance_b,
        candidate=scored.name,
        predicted_throughput=scored.throughput,
        promised_imbalance=promised,
        model_promise=scored.model_promise,
        promise_ratios=ratios,
    )


def score(
    plan: LocalityPlan,
    window: PairStatistics,
    cost: CostModel,
    drift: tuple[Drift, Drift] | None = None,
) -> LocalityPlan:
    """``plan`` with its predictions measured on ``window``, its predicted
    throughput and its promise on the next window (:func:`score_candidate`)."""
    scored = score_candidate(
        plan_candidate(plan.as_chain(), plan.candidate), window.chain(), cost, drift
    )
    return _as_pair(plan.as_chain(), scored, scored.promised_imbalance, plan.promise_ratios)


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
    """:func:`choose_chain_plan` on stages A and B, as a
    :class:`~keyplane.algorithms.locality_plan.LocalityPlan` that carries its
    predictions, promise and calibration ratios to the next call (``current``;
    ``followed`` is the window that ran under it)."""
    previous = None
    if current is not None:
        carried = Scored(
            current.candidate,
            current.predicted_locality,
            (current.predicted_imbalance_a, current.predicted_imbalance_b),
            current.predicted_throughput,
            current.promised_imbalance,
            current.model_promise,
        )
        previous = ChosenPlan(
            current.as_chain(),
            Choice(0, (carried,), current.promised_imbalance, current.promise_ratios),
        )
    chosen = choose_chain_plan(
        pairs.chain(),
        n_instances,
        alpha=alpha,
        headroom=headroom,
        current=previous,
        cost=cost,
        max_table_entries=max_table_entries,
        seed=seed,
        heavy_key_policy=heavy_key_policy,
        drift=drift,
        followed=None if followed is None else followed.chain(),
    )
    return _as_pair(
        chosen.plan, chosen.choice.chosen, chosen.promised_imbalance, chosen.choice.promise_ratios
    )
