"""Next-window key weights from a job's recent windows, the memory chosen by backtest.

A plan balances the key weights it is trained on, and runs on the next
window's weights, so paper 000 §3.1's bound α holds only as far as the two
agree. :class:`~keyplane.algorithms.pair_history.PairHistory`'s decayed sum is
one forecast of the next window, and a lagging one when popularity trends (a
daily cycle moves a key the same way for hours). This module forecasts each
stage's key weights by exponential smoothing with an optional damped trend
(Holt's linear method) under several memories at once, and uses, per stage,
the memory whose forecasts of the recent windows erred least: a backtest on
the job's own windows, since no one memory suits every workload (a random
walk is best forecast by the last window, sampling noise by a long average,
a cycle by a trend).

The error is the squared error of the key shares summed over keys: an
instance's load error is the sum of its keys' errors, so its variance is
what that sum predicts. The chosen forecast's error against the window that
followed is measured as a :class:`~keyplane.algorithms.costmodel.Drift`, the
drift the planner leaves headroom for and states its promise under
(:func:`~keyplane.algorithms.plan_choice.choose_plan`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.costmodel import Drift, measure_drift
from keyplane.algorithms.pair_statistics import ChainStatistics, KeyWeights, PairStatistics
from keyplane.algorithms.partitioner import KeyArray

FloatArray = npt.NDArray[np.float64]

_TREND_GAIN = 0.5
"""Holt's β: how much of a level change enters the trend at once."""
_DRIFT_WEIGHT = 0.25
"""Weight of the newest window in the smoothed drift, as in ``PairHistory``."""


@dataclass(frozen=True)
class Memory:
    """One forecasting memory: ``carry`` is the share of the previous level kept
    each window (0: the last window alone; 0.5 halves a window's weight per
    window, the history's default) and ``trend`` the damping of the trend
    (0: none; 1: a trend goes on undamped)."""

    carry: float
    trend: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.carry < 1.0:
            raise ValueError(f"carry must lie in [0, 1), got {self.carry}")
        if not 0.0 <= self.trend <= 1.0:
            raise ValueError(f"trend must lie in [0, 1], got {self.trend}")

    @property
    def name(self) -> str:
        return f"carry {self.carry:g}" + (f", trend {self.trend:g}" if self.trend else "")


DEFAULT_MEMORIES = tuple(Memory(c, t) for c in (0.0, 0.5, 0.75) for t in (0.0, 0.8))
"""The memories backtested by default: the last window, a two-window and a
four-window average, each with and without a damped trend."""


@dataclass(frozen=True)
class ForecastSettings:
    """``memories``: the candidates; ``default``: the one used until a backtest
    has scored them; ``backtest_windows``: how many recent windows the choice
    is scored on; ``min_weight``: a key whose smoothed weight falls below it,
    and that the latest window did not see, is forgotten."""

    memories: tuple[Memory, ...] = DEFAULT_MEMORIES
    default: Memory = Memory(0.5)
    backtest_windows: int = 6
    min_weight: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "memories", tuple(self.memories))
        if not self.memories:
            raise ValueError("memories must hold at least one Memory")
        if len({m.name for m in self.memories}) != len(self.memories):
            raise ValueError("memories must be distinct")
        if self.default not in self.memories:
            raise ValueError(f"the default memory ({self.default.name}) is not among memories")
        if self.backtest_windows < 1:
            raise ValueError(f"backtest_windows must be ≥ 1, got {self.backtest_windows}")
        if not (np.isfinite(self.min_weight) and self.min_weight >= 0):
            raise ValueError(f"min_weight must be ≥ 0, got {self.min_weight}")


def share_error(forecast: KeyWeights, actual: KeyWeights) -> float:
    """Sum over keys of the squared difference of the two sides' shares (module
    docstring); a side with no weight has every share 0."""
    keys = np.union1d(forecast.keys, actual.keys)
    difference = np.zeros(keys.size)
    for side, sign in ((forecast, 1.0), (actual, -1.0)):
        total = float(side.weights.sum())
        if total > 0:
            difference[np.searchsorted(keys, side.keys)] += sign * side.weights / total
    return float((difference**2).sum())


class Backtest:
    """Named candidates scored on each window as it arrives; the best over the
    recent windows is the one in use (``default`` until one is scored)."""

    def __init__(
        self, names: Sequence[str], default: str, windows: int, *, lower_is_better: bool
    ) -> None:
        if default not in names:
            raise ValueError(f"the default {default!r} is not among the candidates {list(names)}")
        if windows < 1:
            raise ValueError(f"windows must be ≥ 1, got {windows}")
        self.names = tuple(names)
        self.default = default
        self.lower_is_better = lower_is_better
        self._scores = {name: deque[float](maxlen=windows) for name in self.names}

    def record(self, scores: Mapping[str, float]) -> None:
        """One window's score of every candidate."""
        if set(scores) != set(self.names):
            raise ValueError(f"expected scores of {list(self.names)}, got {sorted(scores)}")
        for name, value in scores.items():
            if not np.isfinite(value):
                raise ValueError(f"the score of {name!r} is not finite: {value}")
            self._scores[name].append(float(value))

    def means(self) -> dict[str, float]:
        """Each candidate's mean score over the recent windows (none scored yet: empty)."""
        return {name: float(np.mean(s)) for name, s in self._scores.items() if s}

    @property
    def chosen(self) -> str:
        means = self.means()
        if not means:
            return self.default
        sign = 1.0 if self.lower_is_better else -1.0
        return min(self.names, key=lambda name: sign * means[name])


class _Smoother:
    """Holt's linear method per key under one :class:`Memory`."""

    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self.keys = np.zeros(0, np.int64)
        self.level = np.zeros(0)
        self.slope = np.zeros(0)
        self.windows = 0

    def forecast(self) -> KeyWeights:
        ahead = np.maximum(self.level + self.memory.trend * self.slope, 0.0)
        keep = ahead > 0
        return KeyWeights(self.keys[keep], ahead[keep])

    def add(self, window: KeyWeights, min_weight: float) -> None:
        keys = np.union1d(self.keys, window.keys)
        seen = np.zeros(keys.size)
        seen[np.searchsorted(keys, window.keys)] = window.weights
        level = np.zeros(keys.size)
        slope = np.zeros(keys.size)
        at = np.searchsorted(keys, self.keys)
        level[at] = self.level
        slope[at] = self.slope
        if self.windows == 0:
            new_level, new_slope = seen, np.zeros(keys.size)
        else:
            carry, trend = self.memory.carry, self.memory.trend
            new_level = (1.0 - carry) * seen + carry * (level + trend * slope)
            new_slope = _TREND_GAIN * (new_level - level) + (1.0 - _TREND_GAIN) * trend * slope
        keep = (seen > 0) | (new_level >= max(min_weight, 1e-300))
        self.keys, self.level, self.slope = keys[keep], new_level[keep], new_slope[keep]
        self.windows += 1


class StageForecast:
    """One stage's key weights forecast under every memory, the best by backtest in use."""

    def __init__(self, settings: ForecastSettings, n_instances: int) -> None:
        self.settings = settings
        self.n_instances = n_instances
        self._smoothers = [_Smoother(memory) for memory in settings.memories]
        self._backtest = Backtest(
            [m.name for m in settings.memories],
            settings.default.name,
            settings.backtest_windows,
            lower_is_better=True,
        )
        self.drift = Drift()
        """The chosen forecasts' drift to the windows that followed them, smoothed."""

    @property
    def memory(self) -> Memory:
        """The memory in use: least mean error over the recent windows scored."""
        chosen = self._backtest.chosen
        return next(m for m in self.settings.memories if m.name == chosen)

    def backtest(self) -> dict[str, float]:
        """Each memory's mean error over the recent windows scored (none yet: empty)."""
        return self._backtest.means()

    def forecast(self) -> KeyWeights:
        """The next window's key weights under :attr:`memory`."""
        return self._smoothers[self.settings.memories.index(self.memory)].forecast()

    def add(self, window: KeyWeights) -> None:
        """Score every memory's forecast of ``window``, measure the used one's drift,
        then fold ``window`` in."""
        if self._smoothers[0].windows > 0:
            used = self.forecast()
            self.drift = self.drift.blend(
                measure_drift(used.keys, used.weights, window.keys, window.weights,
                              self.n_instances),
                _DRIFT_WEIGHT,
            )  # fmt: skip
            self._backtest.record(
                {s.memory.name: share_error(s.forecast(), window) for s in self._smoothers}
            )
        for smoother in self._smoothers:
            smoother.add(window, self.settings.min_weight)


class WeightForecast:
    """Forecasts of every stage of a chain (upstream first), one window at a time."""

    def __init__(
        self, n_stages: int, n_instances: int, settings: ForecastSettings | None = None
    ) -> None:
        if n_stages < 1:
            raise ValueError(f"a chain has at least one stage, got {n_stages}")
        if n_instances < 1:
            raise ValueError(f"n_instances must be ≥ 1, got {n_instances}")
        chosen = settings if settings is not None else ForecastSettings()
        self.stages = tuple(StageForecast(chosen, n_instances) for _ in range(n_stages))

    def add(self, windows: Sequence[KeyWeights]) -> None:
        """Fold in one window: each stage's key weights, upstream first."""
        if len(windows) != len(self.stages):
            raise ValueError(f"expected {len(self.stages)} stages' weights, got {len(windows)}")
        for stage, window in zip(self.stages, windows, strict=True):
            stage.add(window)

    @property
    def drift(self) -> tuple[Drift, ...]:
        return tuple(stage.drift for stage in self.stages)

    @property
    def memories(self) -> tuple[Memory, ...]:
        return tuple(stage.memory for stage in self.stages)

    def forecasts(self) -> tuple[KeyWeights, ...]:
        return tuple(stage.forecast() for stage in self.stages)


def forecast_weights(history: KeyWeights, ahead: KeyWeights, paired: KeyArray) -> KeyWeights:
    """A stage's loads to balance: ``ahead`` (a forecast), and every key of ``paired``
    it has no weight for (a tail key the forecast has forgotten, or forecast to
    vanish) at its ``history`` weight times the forecast's overall scale: its
    weight barely moves an instance, and its pairs still say where it goes
    should it return."""
    scale = float(ahead.weights.sum()) / max(float(history.weights.sum()), 1e-300)
    missing = np.setdiff1d(paired, ahead.keys)
    known = np.isin(history.keys, missing)
    keys = np.concatenate([ahead.keys, history.keys[known]])
    weights = np.concatenate([ahead.weights, history.weights[known] * scale])
    order = np.argsort(keys, kind="stable")
    return KeyWeights(keys[order], weights[order])


def reweighted_chain(chain: ChainStatistics, ahead: Sequence[KeyWeights | None]) -> ChainStatistics:
    """``chain`` (e.g. the decayed history, which knows which keys go together) with
    each stage's loads replaced by its forecast (``None``: the stage keeps its
    weights), set apart from the pairs
    (:data:`~keyplane.algorithms.pair_statistics.StageWeighting`).

    The pair counts stay as the history has them, so the cut (000 §3.3's edge
    weights) keeps the history's longer memory of which keys go together, while
    the balance (000 §3.1) is the forecast's: a key forecast to fade weighs
    little on its instance but its pairs still weigh what they were seen to,
    so the partitioner does not cut it from its partners first.
    """
    if len(ahead) != chain.n_stages:
        raise ValueError(
            f"give one forecast (or None) per stage: {chain.n_stages}, got {len(ahead)}"
        )
    loads = tuple(
        chain.stage_weights(stage)
        if forecast is None
        else forecast_weights(chain.stage_weights(stage), forecast, chain.paired_keys(stage))
        for stage, forecast in enumerate(ahead)
    )
    return ChainStatistics(loads, chain.links, "frequencies")


def reweighted(pairs: PairStatistics, weight_a: KeyWeights, weight_b: KeyWeights) -> PairStatistics:
    """:func:`reweighted_chain` of stages A and B, as pair statistics."""
    chain = reweighted_chain(pairs.chain(), (weight_a, weight_b))
    freq_a, freq_b = chain.frequencies
    return PairStatistics(
        pairs.a_keys, pairs.b_keys, pairs.counts, freq_a=freq_a, freq_b=freq_b,
        weighting="frequencies",
    )  # fmt: skip
