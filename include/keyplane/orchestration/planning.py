"""Plans, predictions, backtests and the publish decision, from a statistics snapshot (pure).

Nothing here touches Kafka, Spark, Airflow or the disk: the steps of the
DAGs (``keyplane.orchestration.*_steps``) load and store, these functions decide.

Keys are strings at this boundary (the configuration's and the job's) and
integer ids inside the algorithms: :class:`KeyCodec` maps one to the other,
per stage.

The stages are a chain, upstream first: the pipeline's
(:attr:`keyplane.pipeline.Pipeline.stage_names`). Functions that need the
chain's order take it as ``stages``; without it they take the order of the
configuration's operators, which is the order the configuration was created
in (:meth:`keyplane.routing.config.RoutingConfig.all_hash`). A snapshot's pairs are
keyed by their upstream stage (:data:`keyplane.algorithms.statistics.PAIR_COLUMNS`).

How predictions are made. Every figure (locality, per-instance load, state
moved) is computed by routing the snapshot's keys exactly as the job routes
them (:func:`keyplane.routing.routedkeys.routed_shares` and
:func:`~keyplane.routing.routedkeys.predicted_instance_loads`: table entry, hot key
spread over its d instances, else Spark's hash folded onto the active
instances), so the new and the current configuration are scored by the same
ruler, the one the configuration gate checks them with.
:func:`keyplane.algorithms.locality.build_plan` is given no table budget by default, so
every key it sees is tabled; with ``max_table_entries`` it is given the job's
own hash fallback for the keys it leaves out (:func:`_hash_parts`), so its
balance is the job's.

What is chosen. The new configuration is one of three candidates: the
planner's (built with balance headroom, splitting a key only when the split
pays), keeping hash routing, and keeping the current configuration. The
choice is :func:`keyplane.algorithms.plan_choice.choose`'s, the rule the
planner's benchmark measures: each candidate is scored on the training
statistics by the same ruler at its expected next-window imbalance, and the
:class:`~keyplane.algorithms.costmodel.CostModel` turns locality and
imbalance into a predicted throughput; the highest wins, so the result is
never predicted slower than hash routing. The chosen one states
``promised_imbalance``, the bound the next window is expected to keep given
the drift measured from the training statistics to the hold-out, calibrated
on how earlier rollouts' promises held; with no hold-out it is made under a
wide prior drift (:func:`keyplane.algorithms.costmodel.prior_drift`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Literal

import numpy as np
import pandas as pd

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.costmodel import CostModel, Drift, measure_drift
from keyplane.routing.config import CreatedBy, OperatorRouting, RoutingConfig
from keyplane.routing.routedkeys import (
    fallback_instances,
    fold_instance,
    predicted_instance_loads,
    routed_shares,
    spark_partitions,
)

if TYPE_CHECKING:
    from keyplane.algorithms.forecast import ForecastSettings
    from keyplane.algorithms.locality import HashParts
    from keyplane.algorithms.plan_choice import Candidate as ChainCandidate
    from keyplane.algorithms.plan_choice import StageRouting

Column = Literal["train", "holdout", "count"]
HistoryWindow = Literal["decay", "reset"]
Candidate = Literal["plan", "hash", "current"]


@dataclass(frozen=True)
class KeyCodec:
    """String keys of one stage ↔ the dense integer ids the algorithms take."""

    keys: tuple[str, ...]

    @classmethod
    def of(cls, keys: Iterable[str]) -> KeyCodec:
        return cls(tuple(sorted(set(keys))))

    def encode(self, keys: Iterable[str]) -> np.ndarray:
        index = {key: i for i, key in enumerate(self.keys)}
        return np.fromiter((index[k] for k in keys), dtype=np.int64)

    def decode(self, key_id: int) -> str:
        return self.keys[key_id]


def stable_key_id(key: str) -> int:
    """An integer for a key that does not change between runs, for FISH's ring (001 §5).

    Consistent hashing keeps a hot key's candidates from run to run only if
    the key maps to the same ring position every time; dense codec ids change
    with the key set. Decimal keys (the generators') are their own id.
    """
    if key.isdigit() and len(key) < 18:
        return int(key)
    return zlib.crc32(key.encode())


def stage_loads(frequencies: pd.DataFrame, stage: str, column: Column) -> dict[str, float]:
    """Each key's weight in ``column`` for one stage (keys with no weight left out)."""
    rows = frequencies[(frequencies["stage"] == stage) & (frequencies[column] > 0)]
    return {str(k): float(w) for k, w in zip(rows["key"], rows[column], strict=True)}


def pair_weights(pairs: pd.DataFrame, window: HistoryWindow) -> pd.Series:
    """What a plan is trained on: decayed history plus the window (``decay``), or the
    window's older part alone (``reset``, paper 000 §3.2)."""
    if window == "reset":
        train_raw = pairs["count"] - pairs["holdout"]
        return train_raw.clip(lower=0).astype(np.float64)
    return pairs["train"].astype(np.float64)


def frequency_weights(frequencies: pd.DataFrame, window: HistoryWindow) -> pd.Series:
    if window == "reset":
        return (frequencies["count"] - frequencies["holdout"]).clip(lower=0).astype(np.float64)
    return frequencies["train"].astype(np.float64)


@dataclass(frozen=True)
class PlanParams:
    """The knobs of one re-plan, from the DAG's Params.

    ``alpha`` is 000 §3.1's imbalance bound; ``operators`` the operators to
    re-plan (the others keep their current routing; None: every stage of the
    pipeline); ``parallelism`` the
    instance count (None: the current one); ``window`` the history policy;
    ``max_table_entries`` the routing table budget per operator (None: every
    key of the statistics); ``d_min`` FISH's fewest instances per hot key;
    ``max_moves_per_wave`` the most keys one version may move (None: the
    whole change in one version; else :mod:`keyplane.routing.waves` splits it);
    ``headroom`` the share of ``α − 1`` a plan may use on its training
    statistics (:data:`keyplane.algorithms.plan_choice.DEFAULT_HEADROOM`), the rest being
    left for the next window's drift.
    """

    alpha: float = 1.03
    operators: tuple[str, ...] | None = None
    parallelism: int | None = None
    window: HistoryWindow = "decay"
    max_table_entries: int | None = None
    d_min: int = 2
    seed: int = 0
    max_moves_per_wave: int | None = None
    headroom: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom <= 1.0:
            raise ValueError(f"headroom must lie in [0, 1], got {self.headroom}")
        if self.max_moves_per_wave is not None and self.max_moves_per_wave < 1:
            raise ValueError(f"max_moves_per_wave must be ≥ 1, got {self.max_moves_per_wave}")
        if not (math.isfinite(self.alpha) and self.alpha >= 1.0):
            raise ValueError(f"alpha must be ≥ 1, got {self.alpha}")
        if self.operators is not None and not self.operators:
            raise ValueError("operators must name at least one stage (None: every stage)")

    def planned(self, stages: Sequence[str]) -> tuple[str, ...]:
        """The operators to re-plan, checked against the pipeline's ``stages``."""
        if self.operators is None:
            return tuple(stages)
        unknown = [name for name in self.operators if name not in stages]
        if unknown:
            raise ValueError(
                f"operator(s) {', '.join(unknown)} are not stages of the pipeline; "
                f"its stages are {', '.join(stages)}"
            )
        return self.operators


@dataclass(frozen=True)
class OperatorForecast:
    """What a configuration is predicted to do for one operator on some statistics."""

    imbalance: float
    locality: float
    key_loads: Mapping[str, float] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Plan:
    """A new configuration and its predictions on the training statistics.

    ``candidate`` says which candidate won (module docstring) and
    ``throughputs`` what the cost model predicted for each.
    ``promised_imbalance`` is the bound the chosen configuration expects the
    next window's worse operator to keep with
    :data:`~keyplane.algorithms.costmodel.PROMISE_CONFIDENCE`, under the drift measured
    from the training statistics to the hold-out, calibrated on
    ``promise_ratios`` (:func:`keyplane.algorithms.plan_choice.choose`). When no
    drift could be measured (no hold-out) the training statistics' own
    imbalance is no bound on the next window, so the promise is made under the
    prior drift (:func:`keyplane.algorithms.costmodel.prior_drift`) and is not
    calibrated. ``model_promise`` is the measured drift model's bound before
    calibration (0: none was measured). α stays the
    target, the promise is what to expect.
    """

    config: RoutingConfig
    predicted_locality: float
    predicted_imbalance: dict[str, float]
    current_locality: float
    key_loads: dict[str, dict[str, float]]
    hot_keys: dict[str, int]
    candidate: Candidate = "plan"
    throughputs: dict[str, float] = field(default_factory=dict)
    cost: CostModel = field(default_factory=CostModel)
    promised_imbalance: float = 0.0
    model_promise: float = 0.0
    promise_ratios: tuple[float, ...] = ()

    @property
    def predicted_throughput(self) -> float:
        return self.throughputs.get(self.candidate, 0.0)


def chain_of(config: RoutingConfig, stages: Sequence[str] | None) -> tuple[str, ...]:
    """The chain's stages, upstream first: ``stages``, else the configuration's order."""
    return tuple(config.operators) if stages is None else tuple(stages)


def locality(
    config: RoutingConfig,
    pairs: pd.DataFrame,
    weights: pd.Series,
    stages: Sequence[str] | None = None,
) -> float:
    """Share of pair weight, over every consecutive pair of stages, whose two
    instances coincide (000 §3.2); 0 for a one-stage chain.

    With hot keys the two sides are spread independently, so a pair is local
    with probability ``Σ_i share_a[i] · share_b[i]``.
    """
    total = float(weights.sum())
    if total <= 0:
        return 0.0
    local_weight = 0.0
    values = weights.to_numpy(np.float64)
    for upstream, downstream in pairwise(chain_of(config, stages)):
        rows = (pairs["stage"] == upstream).to_numpy()
        if not rows.any():
            continue
        share_a = routed_shares(config.operators[upstream], pairs["a"][rows].astype(str).tolist())
        share_b = routed_shares(config.operators[downstream], pairs["b"][rows].astype(str).tolist())
        local_weight += float(((share_a * share_b).sum(axis=1) * values[rows]).sum())
    return local_weight / total


instance_loads = predicted_instance_loads
"""Each active instance's predicted load:
:func:`keyplane.routing.routedkeys.predicted_instance_loads`."""


def imbalance(loads: np.ndarray) -> float:
    """max / mean instance load (000 §3.1); 1 when there is no load."""
    total = float(loads.sum())
    return 1.0 if total <= 0 else float(loads.max()) / (total / loads.size)


def _hot_keys(
    heavy: Iterable[int],
    codec: KeyCodec,
    weights: Mapping[str, float],
    n: int,
    d_min: int,
    previous: Mapping[str, tuple[int, ...]],
) -> dict[str, tuple[int, ...]]:
    """Instances for the keys too heavy for α (001 §4.1.2 and §5).

    ``d = clamp(ceil(n·f/f_max), d_min, n)``
    (:func:`keyplane.algorithms.hotkeys.hot_key_worker_count`),
    candidates clockwise on FISH's consistent-hash ring, and a key keeps its
    previous instances while they are at least d (001: d never shrinks while
    a key stays hot, so no partial state is stranded).
    """
    from keyplane.algorithms.hotkeys import hot_key_worker_count
    from keyplane.algorithms.ring import make_placement

    keys = [codec.decode(k) for k in heavy]
    if not keys or n < 2:
        return {}
    placement = make_placement("ring", n)
    f_max = max(weights[k] for k in keys)
    chosen: dict[str, tuple[int, ...]] = {}
    for key in keys:
        d = hot_key_worker_count(weights[key], f_max, n, max(2, d_min))
        before = previous.get(key)
        if before is not None and len(before) >= d:
            chosen[key] = tuple(before)
        else:
            chosen[key] = tuple(int(i) for i in placement.candidates(stable_key_id(key), d))
    return chosen


def _active_parts(
    current: RoutingConfig, operators: Iterable[str], n: int
) -> tuple[int, dict[str, list[int]]]:
    """How many parts METIS cuts, and the instance each part goes to, per operator.

    Scaling (003) leaves only some instances active
    (:class:`~keyplane.routing.config.OperatorRouting`). When the re-planned operators
    share their active instances, METIS partitions into that many parts and
    part ``j`` goes to the ``j``-th active instance of both, so co-located
    pairs stay co-located (000 §3.3). When they differ, it partitions into
    the ``n`` state partitions and each operator folds a part onto its active
    instances as its hash fallback does (:func:`keyplane.routing.routedkeys.fold_instance`).
    """
    names = [name for name in current.operators if name in operators]
    actives = {name: current.operators[name].active for name in names}
    if len(set(actives.values())) == 1:
        (shared,) = set(actives.values())
        return len(shared), {name: list(shared) for name in current.operators}
    return n, {
        name: [fold_instance(g, current.operators[name].active, n) for g in range(n)]
        for name in current.operators
    }


def _hash_parts(
    codecs: Mapping[str, KeyCodec],
    instance_of: Mapping[str, list[int]],
    parts: int,
    n: int,
    stages: Sequence[str],
) -> HashParts:
    """Where the job's hash fallback puts each key of a stage, as the planner's parts.

    With a table budget the planner leaves keys to the fallback and counts
    their load where it lands, so it must land where Spark's hash sends it,
    not where a model of a hash would: otherwise the plan's predicted balance
    is not the job's. With ``n`` parts, part ``g`` is state partition ``g``,
    which each operator folds onto its active instances as its fallback does,
    so a key's part is its natural partition. With fewer, part ``j`` is the
    ``j``-th shared active instance (:func:`_active_parts`).
    """
    part_of: dict[int, np.ndarray] = {}
    for index, stage in enumerate(stages):
        keys = list(codecs[stage].keys)
        if parts == n:
            part_of[index] = spark_partitions(keys, n)
        else:
            active = instance_of[stage]
            rank = np.full(n, -1, dtype=np.int64)
            rank[active] = np.arange(len(active))
            part_of[index] = rank[fallback_instances(keys, n, active)]
    return lambda index, ids: part_of[index][ids]


FORECAST_WINDOWS = 8
"""How many recent windows a forecast is fitted and backtested on."""
MIN_FORECAST_WINDOWS = 3
"""Fewest windows a forecast is used with: two backtest scores of each memory."""


@dataclass(frozen=True)
class LoadForecast:
    """Each stage's key weights forecast for the next window (string keys), the
    drift of the forecasts that came before, and the memory the backtest chose
    (:mod:`keyplane.algorithms.forecast`)."""

    key_loads: dict[str, dict[str, float]]
    drift: dict[str, Drift]
    memories: dict[str, str]


def forecast_loads(
    windows: Sequence[pd.DataFrame],
    stages: Sequence[str],
    n_instances: int,
    settings: ForecastSettings | None = None,
) -> LoadForecast:
    """Forecast the next window's key weights of ``stages`` from recent windows'
    counts (frames with ``stage``, ``key`` and ``count``, oldest first), each
    stage under the memory its backtest on these windows chose."""
    if not windows:
        raise ValueError("forecasting needs at least one window of counts")
    from keyplane.algorithms.forecast import ForecastSettings, StageForecast
    from keyplane.algorithms.pair_statistics import KeyWeights

    loads: dict[str, dict[str, float]] = {}
    drift: dict[str, Drift] = {}
    memories: dict[str, str] = {}
    chosen = settings if settings is not None else ForecastSettings()
    for stage in stages:
        rows = [w.loc[(w["stage"] == stage) & (w["count"] > 0), ["key", "count"]] for w in windows]
        codec = KeyCodec.of(str(k) for r in rows for k in r["key"])
        forecast = StageForecast(chosen, n_instances)
        for r in rows:
            forecast.add(
                KeyWeights(codec.encode(r["key"].astype(str)), r["count"].to_numpy(np.float64))
            )
        ahead = forecast.forecast()
        loads[stage] = {
            codec.decode(int(k)): float(w) for k, w in zip(ahead.keys, ahead.weights, strict=True)
        }
        drift[stage] = forecast.drift
        memories[stage] = forecast.memory.name
    return LoadForecast(loads, drift, memories)


def _stage_weights(weights: pd.DataFrame, stage: str) -> dict[str, float]:
    """A stage's positive key weights from a frame with ``stage``, ``key`` and ``weight``."""
    rows = weights.loc[(weights["stage"] == stage) & (weights["weight"] > 0), ["key", "weight"]]
    return {str(k): float(w) for k, w in rows.itertuples(index=False)}


def plan_configuration(
    pairs: pd.DataFrame,
    frequencies: pd.DataFrame,
    current: RoutingConfig,
    params: PlanParams,
    *,
    version: int,
    created_by: CreatedBy = "schedule",
    cost: CostModel | None = None,
    stages: Sequence[str] | None = None,
    forecast: LoadForecast | None = None,
    promise_ratios: Sequence[float] = (),
) -> Plan:
    """A new configuration from a snapshot: METIS tables (000 §3.3) and FISH hot keys (001 §4).

    With a ``forecast`` (:func:`forecast_loads`) the keys are balanced on their
    forecast next-window weights instead of the snapshot's training column,
    while the snapshot's pair weights, unscaled, weigh the cut
    (:func:`keyplane.algorithms.forecast.reweighted_chain`), and a stage's drift
    is that of its forecasts where they have been measured: the plan balances,
    is scored on and promises under what the next window is expected to bring.

    The k-partite key graph of the chain ``stages`` (upstream first; default
    the configuration's order) is partitioned jointly by
    :func:`keyplane.algorithms.locality.build_chain_plan` under
    :func:`keyplane.algorithms.plan_choice.planning_alpha`, whose drift is the
    one measured from the training statistics to the hold-out; the keys it
    finds too heavy for α become hot keys (:func:`_hot_keys`). If spreading a
    hot key over only d instances pushes an instance over α, that operator's
    hot keys are widened to every instance: a load spread evenly over all
    instances can only lower max/mean. Operators not in ``params.operators``
    keep their current routing.

    This plan, hash routing and the current configuration are the candidates
    of :func:`keyplane.algorithms.plan_choice.choose`, the one planner's rule:
    the highest predicted next-window throughput under ``cost`` (default: the
    documented defaults of :class:`~keyplane.algorithms.costmodel.CostModel`)
    wins, and its promise is calibrated on ``promise_ratios``, how earlier
    rollouts' measured imbalance compared with their promise
    (:func:`keyplane.algorithms.plan_choice.promise_ratio`, oldest first).
    """
    from keyplane.algorithms.forecast import reweighted_chain
    from keyplane.algorithms.locality import build_chain_plan
    from keyplane.algorithms.pair_statistics import ChainStatistics, KeyPairs, KeyWeights
    from keyplane.algorithms.plan_choice import choose, planning_alpha

    chain = chain_of(current, stages)
    missing = [name for name in chain if name not in current.operators]
    if missing:
        raise ValueError(
            f"the current configuration routes no stage {', '.join(missing)}; "
            f"it routes {', '.join(current.operators)}"
        )
    planned = params.planned(chain)
    parallelism = {name: routing.parallelism for name, routing in current.operators.items()}
    n = params.parallelism or parallelism[chain[0]]
    if any(p != n for p in parallelism.values()):
        raise ValueError(
            f"the running query has {sorted(set(parallelism.values()))} instances per operator; "
            f"a live re-plan keeps them (Spark fixes state partitions per checkpoint), "
            f"so parallelism {n} cannot be rolled out without a new checkpoint"
        )
    pair_w = pair_weights(pairs, params.window)
    freq_w = frequencies.assign(weight=frequency_weights(frequencies, params.window))
    trained = {stage: _stage_weights(freq_w, stage) for stage in chain}
    ahead = {}
    if forecast is not None:
        ahead = {s: forecast.key_loads[s] for s in chain if s in forecast.key_loads}
    upstream_of = dict(zip(chain[1:], chain, strict=False))
    codecs = {
        stage: KeyCodec.of(
            [
                *pairs.loc[pairs["stage"] == stage, "a"].astype(str),
                *pairs.loc[pairs["stage"] == upstream_of.get(stage), "b"].astype(str),
                *trained[stage],
                *ahead.get(stage, {}),
            ]
        )
        for stage in chain
    }

    def stage_weights(loads: Mapping[str, float], stage: str) -> KeyWeights:
        return KeyWeights(codecs[stage].encode(loads), np.fromiter(loads.values(), np.float64))

    keep = pair_w.to_numpy() > 0

    def link(upstream: str, downstream: str) -> KeyPairs:
        rows = keep & (pairs["stage"] == upstream).to_numpy()
        return KeyPairs(
            codecs[upstream].encode(pairs.loc[rows, "a"].astype(str)),
            codecs[downstream].encode(pairs.loc[rows, "b"].astype(str)),
            pair_w.to_numpy()[rows],
        )

    statistics = ChainStatistics(
        tuple(stage_weights(trained[stage], stage) for stage in chain),
        tuple(link(upstream, downstream) for upstream, downstream in pairwise(chain)),
    )
    key_loads = {stage: ahead.get(stage, trained[stage]) for stage in chain}
    if ahead:
        statistics = reweighted_chain(
            statistics,
            [stage_weights(ahead[s], s) if s in ahead else None for s in chain],
        )
    parts, instance_of = _active_parts(current, planned, n)
    model = cost if cost is not None else CostModel()
    drift = {
        stage: _holdout_drift(key_loads[stage], stage_loads(frequencies, stage, "holdout"), n)
        for stage in chain
    }
    if forecast is not None:
        drift.update({s: d for s, d in forecast.drift.items() if s in drift and d.windows > 0})
    stage_drift = tuple(drift[stage] for stage in chain)
    bound = planning_alpha(statistics, parts, params.alpha, params.headroom, stage_drift)
    plan = build_chain_plan(
        statistics,
        parts,
        alpha=bound,
        max_table_entries=params.max_table_entries,
        seed=params.seed,
        hash_parts=_hash_parts(codecs, instance_of, parts, n, chain),
        cost=model,
    )
    tables = dict(zip(chain, plan.tables, strict=True))
    heavy = dict(zip(chain, plan.heavy_keys, strict=True))
    operators: dict[str, OperatorRouting] = {}
    for name, routing in current.operators.items():
        if name not in planned:
            operators[name] = routing
            continue
        codec = codecs[name]
        to_instance = instance_of[name]
        table = {codec.decode(k): to_instance[int(i)] for k, i in tables[name].items()}
        scaled = routing.active_instances is not None
        hot = {
            key: tuple(dict.fromkeys(to_instance[i] for i in parts_of_key))
            for key, parts_of_key in _hot_keys(
                heavy[name], codec, key_loads[name], parts, params.d_min,
                {} if scaled else routing.hot_keys,
            ).items()
        }  # fmt: skip
        for key in [k for k, inst in hot.items() if len(inst) < 2]:
            table[key] = hot.pop(key)[0]
        candidate = OperatorRouting(
            parallelism=n,
            table=table,
            hot_keys=hot,
            active_instances=routing.active_instances,
        )
        if imbalance(instance_loads(candidate, key_loads[name])) > params.alpha and hot:
            everywhere = routing.active
            candidate = candidate.model_copy(update={"hot_keys": dict.fromkeys(hot, everywhere)})
        operators[name] = candidate
    hashed = {
        name: (
            routing.model_copy(update={"table": {}, "hot_keys": {}}) if name in planned else routing
        )
        for name, routing in current.operators.items()
    }
    candidates: dict[Candidate, dict[str, OperatorRouting]] = {
        "current": dict(current.operators),
        "hash": hashed,
        "plan": operators,
    }
    choice = choose(
        [
            _routed_candidate(name, routings, codecs, chain, n)
            for name, routings in candidates.items()
        ],
        statistics,
        model,
        stage_drift,
        promise_ratios,
    )
    chosen = choice.chosen
    config = RoutingConfig(
        version=version,
        parent_version=current.version,
        created_by=created_by,
        operators=candidates[chosen.name],
    )
    return Plan(
        config=config,
        predicted_locality=chosen.locality,
        predicted_imbalance=dict(zip(chain, chosen.imbalances, strict=True)),
        current_locality=choice.scores[0].locality,
        key_loads=key_loads,
        hot_keys={name: len(config.operators[name].hot_keys) for name in config.operators},
        candidate=chosen.name,
        throughputs=choice.throughputs,
        cost=model,
        promised_imbalance=choice.promised_imbalance,
        model_promise=chosen.model_promise,
        promise_ratios=choice.promise_ratios,
    )


def _routed_candidate(
    name: Candidate,
    operators: Mapping[str, OperatorRouting],
    codecs: Mapping[str, KeyCodec],
    chain: Sequence[str],
    n: int,
) -> ChainCandidate:
    """A configuration's operators as a candidate of
    :func:`keyplane.algorithms.plan_choice.choose`: each stage's integer key ids
    decoded and routed as the job routes them
    (:func:`~keyplane.routing.routedkeys.routed_shares`), over its active instances."""
    from keyplane.algorithms.plan_choice import Candidate as ChainCandidate
    from keyplane.algorithms.plan_choice import StageRouting

    def stage(routing: OperatorRouting, codec: KeyCodec) -> StageRouting:
        keys = np.array(codec.keys, dtype=object)

        def shares(ids: np.ndarray) -> np.ndarray:
            return routed_shares(routing, keys[np.asarray(ids, dtype=np.int64)].tolist())

        return StageRouting(shares, routing.active_instances)

    return ChainCandidate(name, tuple(stage(operators[s], codecs[s]) for s in chain), n)


def _holdout_drift(train: Mapping[str, float], holdout: Mapping[str, float], n: int) -> Drift:
    """How the keys' shares moved from the training statistics to the hold-out."""
    return measure_drift(
        list(train), np.fromiter(train.values(), np.float64, len(train)),
        list(holdout), np.fromiter(holdout.values(), np.float64, len(holdout)),
        n,
    )  # fmt: skip


@dataclass(frozen=True)
class Forecast:
    """A configuration scored on some statistics: locality, imbalance per operator."""

    locality: float
    imbalance: dict[str, float]

    @property
    def worst_imbalance(self) -> float:
        return max(self.imbalance.values(), default=1.0)


def forecast(
    config: RoutingConfig,
    pairs: pd.DataFrame,
    frequencies: pd.DataFrame,
    column: Column,
    stages: Sequence[str] | None = None,
) -> Forecast:
    """Locality and per-operator imbalance of ``config`` on one column of a snapshot."""
    loads = {stage: stage_loads(frequencies, stage, column) for stage in config.operators}
    return Forecast(
        locality=locality(config, pairs, pairs[column].astype(np.float64), stages),
        imbalance={
            name: imbalance(instance_loads(routing, loads.get(name, {})))
            for name, routing in config.operators.items()
        },
    )


def moved_share(
    old: RoutingConfig, new: RoutingConfig, frequencies: pd.DataFrame, column: Column
) -> float:
    """Share of the operators' state that a rollout from ``old`` to ``new`` migrates.

    Paper 000 §3.4 moves the state of every key whose instance changes; a
    key's state is taken as proportional to its tuples, so the share is the
    key weight whose instance shares change, ``½ Σ |share_new − share_old|``
    per key, over the total weight of both operators.
    """
    moved = total = 0.0
    for name, routing in new.operators.items():
        loads = stage_loads(frequencies, name, column)
        if not loads or name not in old.operators:
            continue
        keys = list(loads)
        weights = np.fromiter(loads.values(), dtype=np.float64, count=len(keys))
        before = routed_shares(old.operators[name], keys)
        after = routed_shares(routing, keys)
        changed = 0.5 * np.abs(after - before).sum(axis=1)
        moved += float((weights * changed).sum())
        total += float(weights.sum())
    return moved / total if total > 0 else 0.0


@dataclass(frozen=True)
class Backtest:
    """The new and the current configuration scored on the snapshot's hold-out."""

    new: Forecast
    current: Forecast
    moved_share: float
    holdout_tuples: float


def backtest(
    new: RoutingConfig,
    current: RoutingConfig,
    pairs: pd.DataFrame,
    frequencies: pd.DataFrame,
    stages: Sequence[str] | None = None,
) -> Backtest:
    """Score both configurations on the newest part of the window, unseen by the plan
    (paper 000 §4.3 scores a table trained on one window on the next).

    The hold-out's tuples are its events: every stage counts each event once,
    so it is the largest stage total (pairs do not exist in a one-stage chain).
    """
    per_stage = frequencies.groupby("stage")["holdout"].sum() if not frequencies.empty else None
    return Backtest(
        new=forecast(new, pairs, frequencies, "holdout", stages),
        current=forecast(current, pairs, frequencies, "holdout", stages),
        moved_share=moved_share(current, new, frequencies, "train"),
        holdout_tuples=float(per_stage.max()) if per_stage is not None else 0.0,
    )


@dataclass(frozen=True)
class DecisionRule:
    """When a new configuration is worth its migration (a DAG Param each).

    The expected gain on the hold-out is the locality gained plus the
    worst-operator imbalance removed, ``(L_new − L_cur) + (I_cur − I_new)``,
    both in shares of the stream: one point of locality keeps 1 % of the
    tuples between consecutive stages on their server, and one point of
    imbalance is 1 % of the mean load taken off the bottleneck instance. The cost is the share of
    state the rollout migrates times ``migration_cost``, the gain a full
    migration must buy to repay its pause (000 §3.4 buffers tuples while
    state moves). Publish when ``gain − cost ≥ min_gain``, or when forced.
    """

    min_gain: float = 0.01
    migration_cost: float = 0.05
    force: bool = False


@dataclass(frozen=True)
class Decision:
    publish: bool
    gain: float
    cost: float
    reason: str


def decide(result: Backtest, rule: DecisionRule) -> Decision:
    """Apply :class:`DecisionRule` to a backtest."""
    locality_gain = result.new.locality - result.current.locality
    balance_gain = result.current.worst_imbalance - result.new.worst_imbalance
    gain = locality_gain + balance_gain
    cost = rule.migration_cost * result.moved_share
    figures = (
        f"locality {result.current.locality:.3f} → {result.new.locality:.3f}, "
        f"worst imbalance {result.current.worst_imbalance:.3f} → "
        f"{result.new.worst_imbalance:.3f}, {result.moved_share:.1%} of state moves: "
        f"gain {gain:+.4f} vs cost {cost:.4f} (min_gain {rule.min_gain})"
    )
    if rule.force:
        return Decision(True, gain, cost, f"forced; {figures}")
    if result.holdout_tuples <= 0:
        return Decision(False, gain, cost, "no hold-out tuples to judge the new configuration")
    if gain - cost >= rule.min_gain:
        return Decision(True, gain, cost, f"publish: {figures}")
    return Decision(False, gain, cost, f"skip: {figures}")


def rollback_config(previous: RoutingConfig, active: RoutingConfig, version: int) -> RoutingConfig:
    """A new version with ``previous``'s routing, replacing ``active``.

    Versions only grow (000 §3.4 as keyplane runs it: a finished version is
    never prepared again), so a rollback is published as a new version.
    """
    return RoutingConfig(
        version=version,
        parent_version=active.version,
        created_by="rollback",
        operators=dict(previous.operators),
    )


@dataclass(frozen=True)
class Measured:
    """What a run of batches measured (:class:`~keyplane.algorithms.batchmetrics.BatchMetrics`).

    ``locality`` is the share of the tuples between consecutive stages that stayed on one executor
    (000 §2), ``imbalance`` the worst operator's max/mean of the loads summed
    over the batches (000 §3.1), ``lag`` the mean input lag in records and
    ``lag_growth`` how much the lag grew from one batch to the next, on
    average (negative: the job catches up; None with fewer than 2 batches).
    """

    batches: int
    rows: int
    locality: float | None
    imbalance: float | None
    lag: float | None
    lag_growth: float | None = None


def measured_imbalance(records: Iterable[BatchMetrics]) -> dict[str, float]:
    """Each operator's max/mean of the tuples its instances took over ``records``."""
    loads: dict[str, dict[int, int]] = {}
    for record in records:
        for operator, per_instance in record.load.items():
            summed = loads.setdefault(operator, {})
            for instance, tuples in per_instance.items():
                summed[int(instance)] = summed.get(int(instance), 0) + int(tuples)
    return {
        operator: imbalance(np.fromiter(summed.values(), dtype=np.float64))
        for operator, summed in loads.items()
        if summed
    }


def measure(records: Iterable[BatchMetrics]) -> Measured:
    batches = list(records)
    if not batches:
        return Measured(0, 0, None, None, None)
    hops = sum(r.hops for r in batches)
    local = sum(r.local_hops for r in batches)
    worst = list(measured_imbalance(batches).values())
    ordered = sorted(batches, key=lambda r: r.batch_id)
    return Measured(
        batches=len(batches),
        rows=sum(r.rows for r in batches),
        locality=local / hops if hops else None,
        imbalance=max(worst) if worst else None,
        lag=float(np.mean([r.input_lag for r in batches])),
        lag_growth=(
            (ordered[-1].input_lag - ordered[0].input_lag) / (len(ordered) - 1)
            if len(ordered) > 1
            else None
        ),
    )


@dataclass(frozen=True)
class VerifyTolerances:
    """How much worse the new version may measure before it is rolled back.

    ``locality``: points of locality it may lose (default 0.05; the executor
    a task lands on varies from batch to batch). ``imbalance``: relative
    growth of the worst max/mean allowed (default 0.25), and never a
    regression while within ``alpha``. ``lag_factor`` and ``lag_slack``: the
    lag's growth per batch may reach ``lag_factor × before + lag_slack``
    records, ``before`` counted as 0 when the job was catching up (default
    2× + 5 000).

    Lag is judged by how fast it grows, not by its level. The level right
    after DONE still holds what built up during the rollout (a migration
    pauses the moved keys for a batch, 000 §3.4) and before it, so a job
    already behind its input would always look worse afterwards, and a
    rollback would only add another rollout. A version that makes the job
    slower makes it fall behind faster.
    """

    locality: float = 0.05
    imbalance: float = 0.25
    alpha: float = 1.03
    lag_factor: float = 2.0
    lag_slack: float = 5_000.0


def verdict(before: Measured, after: Measured, tolerances: VerifyTolerances) -> str | None:
    """Why ``after`` regressed against ``before``, or None when it did not.

    A figure missing on either side (no batches before, no hops between stages) is
    not judged.
    """
    reasons = []
    if (
        before.locality is not None
        and after.locality is not None
        and after.locality < before.locality - tolerances.locality
    ):
        reasons.append(f"locality fell from {before.locality:.3f} to {after.locality:.3f}")
    if (
        before.imbalance is not None
        and after.imbalance is not None
        and after.imbalance > tolerances.alpha
        and after.imbalance > before.imbalance * (1 + tolerances.imbalance)
    ):
        reasons.append(f"imbalance rose from {before.imbalance:.3f} to {after.imbalance:.3f}")
    if (
        before.lag_growth is not None
        and after.lag_growth is not None
        and after.lag_growth
        > tolerances.lag_factor * max(before.lag_growth, 0.0) + tolerances.lag_slack
    ):
        reasons.append(
            f"lag grew {after.lag_growth:,.0f} records a batch, against "
            f"{before.lag_growth:,.0f} before"
        )
    return "; ".join(reasons) or None
