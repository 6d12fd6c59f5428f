"""Plans scored on the window that follows them, on drifting generated workloads.

A plan is trained on the statistics up to window t and judged on window t+1,
the window the running job sees. For each workload and seed this replays the
windows in time order and compares four policies:

* ``hash``: plain hash routing (Spark's placement), no plan;
* ``old``: the earlier planner: statistics that forget a key once its decayed
  weight is below 0.5, heavy keys decided by the cascading rule, and keys
  split until α holds on the training window (``split_rule="alpha"``);
* ``new``: :func:`keyplane.algorithms.plan_choice.choose_plan` on a pair
  history whose pairs weigh the cut while each stage's key loads, balanced
  apart from them, are their forecast for the next window
  (:func:`keyplane.algorithms.forecast.reweighted`, the memory chosen per
  stage by backtest) and the drift of those forecasts: the best of keeping
  the current plan, hash routing and a plan built with headroom, by expected
  next-window throughput under the default cost model. Two pair histories
  (``min_weight`` 0.05 and 0.5) each keep their own plan; the one whose plans
  did best on the recent windows (cost-model throughput of the window that
  followed each) is the one used;
* ``oracle``: the new planner trained on window t+1 itself (no drift).

Per policy it reports the mean next-window locality, the mean next-window
imbalance (the worse stage's max/mean), the share of windows whose imbalance
is within α and within the policy's own promise (``old`` promises α; the
others state ``promised_imbalance``, for ``hash`` under the new planner's
drift; the first window, before any drift is measured, promises under the
prior drift, :func:`keyplane.algorithms.costmodel.prior_drift`; the share of
windows with a promise is reported too), and, on
every ``--sim-every``-th window, the simulator's throughput relative to
hash routing next to what the cost model predicts from the same window's
locality and imbalance. Figures are the median over seeds, with the range
over seeds in brackets.

    python bench/plan_quality.py --quick
    python bench/plan_quality.py --out docs/bench-results/plan_quality.md
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from _output import emit

from keyplane.algorithms.costmodel import CostModel
from keyplane.algorithms.forecast import Backtest, WeightForecast, reweighted
from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import LocalityPlan
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import PairStatistics, aggregate_pairs
from keyplane.algorithms.plan_choice import choose_plan, hash_plan, score
from keyplane.sim import ClusterConfig, Stage, Trace, simulate, summarize

POLICIES = ("hash", "old", "new", "oracle")
SERVICE_TIME = 1e-5
"""Seconds per tuple on an instance of either stage."""
TUPLE_BYTES = 100
REMOTE_TIME = 1e-5
"""Seconds a remote tuple holds its server's outgoing link: the same as its
processing, the ratio of the cost model's defaults (1, 1, 1)."""

PAIR_MEMORIES = {"min_weight 0.05": 0.05, "min_weight 0.5": 0.5}
"""The pair histories the new planner backtests (decay 0.5 each)."""

Window = tuple[np.ndarray, np.ndarray]
T = TypeVar("T")
Generator = Callable[[np.random.Generator, int, int], list[Window]]


def _partners(rng: np.random.Generator, n_a: int, n_b: int, fanout: int) -> np.ndarray:
    """``fanout`` stage-B partners per stage-A key, from its community of 30 B keys."""
    community = (np.arange(n_a) * n_b // n_a // 30) * 30
    offsets = rng.integers(0, 30, size=(n_a, fanout))
    return np.minimum(community[:, None] + offsets, n_b - 1)


def _events(
    rng: np.random.Generator, shares: np.ndarray, partners: np.ndarray, size: int, noise: float
) -> Window:
    a = rng.choice(shares.size, size=size, p=shares / shares.sum())
    b = partners[a, rng.integers(0, partners.shape[1], size)]
    random = rng.random(size) < noise
    b[random] = rng.integers(0, int(partners.max()) + 1, int(random.sum()))
    return a.astype(np.int64), b.astype(np.int64) + 1_000_000


def few_keys(rng: np.random.Generator, windows: int, size: int) -> list[Window]:
    """16 stage-A keys, the top one near 17 % of the load; shares drift as a random walk."""
    n_keys = 16
    log_share = np.log(np.arange(1, n_keys + 1, dtype=np.float64) ** -0.6)
    partners = rng.permutation(n_keys)[:, None]
    out = []
    for _ in range(windows):
        out.append(_events(rng, np.exp(log_share), partners, size, noise=0.15))
        log_share = log_share + rng.normal(0.0, 0.15, n_keys)
    return out


def heavy_tail(rng: np.random.Generator, windows: int, size: int) -> list[Window]:
    """Zipf 1.1 over 20,000 stage-A keys; 2 % of the ranks trade places every window."""
    n_a, n_b = 20_000, 5_000
    base = np.arange(1, n_a + 1, dtype=np.float64) ** -1.1
    rank = rng.permutation(n_a)
    partners = _partners(rng, n_a, n_b, 3)
    out = []
    for _ in range(windows):
        shares = np.empty(n_a)
        shares[rank] = base
        out.append(_events(rng, shares, partners, size, noise=0.1))
        swap = rng.choice(n_a, size=n_a // 50, replace=False)
        rank[swap] = rank[rng.permutation(swap)]
    return out


def daily(rng: np.random.Generator, windows: int, size: int) -> list[Window]:
    """3,000 stage-A keys, Zipf 0.9, each key's popularity on a 24-window cycle of its own phase."""
    n_a, n_b = 3_000, 1_500
    base = rng.permutation(np.arange(1, n_a + 1, dtype=np.float64) ** -0.9)
    phase = rng.random(n_a)
    partners = _partners(rng, n_a, n_b, 3)
    return [
        _events(rng, base * (1.0 + 0.9 * np.sin(2 * np.pi * (t / 24 + phase))), partners, size, 0.1)
        for t in range(windows)
    ]


WORKLOADS: dict[str, Generator] = {"few-keys": few_keys, "heavy-tail": heavy_tail, "daily": daily}


def statistics_of(window: Window) -> PairStatistics:
    a, b, counts = aggregate_pairs(window[0], window[1], np.ones(window[0].size))
    return PairStatistics(a, b, counts)


def simulated_throughput(plan: LocalityPlan, window: Window, n: int) -> float:
    """Tuples per second of the window's events routed by ``plan`` in the simulator."""
    router_a, router_b = plan.routers()
    cluster = ClusterConfig(
        n_servers=n,
        service_time=SERVICE_TIME,
        tuple_bytes=TUPLE_BYTES,
        link_bandwidth=TUPLE_BYTES / REMOTE_TIME,
    )
    trace = Trace(fields=(window[0], window[1]))
    result = simulate(trace, [Stage(router_a, 0, "A"), Stage(router_b, 1, "B")], cluster)
    return summarize(result).throughput


@dataclass
class Series:
    """One policy's next-window figures over one run (one workload, one seed)."""

    locality: list[float]
    imbalance: list[float]
    promise: list[float]
    sim_effect: list[float]
    model_effect: list[float]
    predicted_effect: list[float]
    seconds: list[float]
    memories: list[str]


def run(
    generator: Generator, seed: int, windows: int, size: int, n: int, alpha: float, sim_every: int
) -> dict[str, Series]:
    rng = np.random.default_rng(seed)
    data = generator(rng, windows, size)
    stats = [statistics_of(w) for w in data]
    old_history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.5))
    pair_histories = {
        name: PairHistory(HistoryPolicy(decay=0.5, min_weight=floor), n)
        for name, floor in PAIR_MEMORIES.items()
    }
    pair_backtest = Backtest(list(PAIR_MEMORIES), "min_weight 0.05", 6, lower_is_better=False)
    chains: dict[str, LocalityPlan] = {}
    cost = CostModel()
    series = {name: Series([], [], [], [], [], [], [], []) for name in POLICIES}
    forecast = WeightForecast(2, n)
    for t in range(windows - 1):
        old_history.add(stats[t])
        following = stats[t + 1]
        plans: dict[str, LocalityPlan] = {}
        started = time.perf_counter()
        plans["hash"] = hash_plan(n, alpha)
        series["hash"].seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        plans["old"] = build_plan(
            old_history.statistics, n, alpha=alpha, split_rule="alpha", heavy_rule="cascade"
        )
        series["old"].seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        forecast.add((stats[t].stage_weights("a"), stats[t].stage_weights("b")))
        if chains:
            pair_backtest.record(
                {name: cost.throughput(*plan.evaluate(stats[t])) for name, plan in chains.items()}
            )
        drift_a, drift_b = forecast.drift
        for name, history in pair_histories.items():
            history.add(stats[t])
            chains[name] = choose_plan(
                reweighted(history.statistics, *forecast.forecasts()),
                n,
                alpha=alpha,
                current=chains.get(name),
                cost=cost,
                drift=(drift_a, drift_b),
                followed=stats[t],
            )
        chosen = pair_backtest.chosen
        plans["new"] = chains[chosen]
        training = reweighted(pair_histories[chosen].statistics, *forecast.forecasts())
        series["new"].memories.append(
            " / ".join(m.name for m in forecast.memories) + f", pairs {chosen}"
        )
        series["new"].seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        plans["oracle"] = choose_plan(following, n, alpha=alpha, cost=cost)
        series["oracle"].seconds.append(time.perf_counter() - started)
        measured = {name: plan.evaluate(following) for name, plan in plans.items()}
        promises = {
            "hash": score(plans["hash"], training, cost, (drift_a, drift_b)).promised_imbalance,
            "old": alpha,
            "new": plans["new"].promised_imbalance,
            "oracle": plans["oracle"].promised_imbalance,
        }
        for name, figures in measured.items():
            series[name].promise.append(promises[name])
            series[name].locality.append(figures.locality)
            series[name].imbalance.append(max(figures.imbalance_a, figures.imbalance_b))
        if t % sim_every == sim_every - 1:
            hash_tput = simulated_throughput(plans["hash"], data[t + 1], n)
            hash_model = cost.throughput(*measured["hash"])
            trained_on = {
                "hash": training,
                "old": old_history.statistics,
                "new": training,
                "oracle": following,
            }
            for name, plan in plans.items():
                tput = hash_tput if name == "hash" else simulated_throughput(plan, data[t + 1], n)
                series[name].sim_effect.append(tput / hash_tput)
                series[name].model_effect.append(cost.throughput(*measured[name]) / hash_model)
                training = trained_on[name]
                series[name].predicted_effect.append(
                    cost.throughput(*plan.evaluate(training))
                    / cost.throughput(*plans["hash"].evaluate(training))
                )
    return series


def _median_range(values: list[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    low, mid, high = np.min(values), np.median(values), np.max(values)
    return f"{mid:.{digits}f} [{low:.{digits}f}–{high:.{digits}f}]"


def _promised(series: Series) -> tuple[np.ndarray, np.ndarray]:
    """Next-window imbalances and promises (plus a rounding hair) of the windows with a promise."""
    promise = np.asarray(series.promise)
    finite = np.isfinite(promise)
    return np.asarray(series.imbalance)[finite], promise[finite] + 1e-12


def report(
    results: dict[str, list[dict[str, Series]]], alpha: float, command: str, elapsed: float
) -> str:
    lines = [
        "# Next-window plan quality",
        "",
        f"Command: `{command}` ({elapsed:.0f} s). Median over seeds [range over seeds] of each "
        "seed's mean over its windows. `≤ α` is the share of windows whose next-window "
        f"imbalance is within α = {alpha}, `≤ promise` the share within the policy's own "
        "promise (`promise`, its mean; the old planner promises α) of the windows with a "
        "promise, `promised` the share of windows with one (a first plan, before a drift has "
        "been measured, promises under the prior drift). `sim` is the "
        "simulator's throughput relative to hash "
        "routing on the sampled windows, `model` the cost model's figure from the same "
        "window's locality and imbalance, `predicted` the cost model's prediction from the "
        "plan's training statistics (what the planner chose by).",
        "",
    ]
    verdicts = []
    for workload, runs in results.items():
        lines += [
            f"## {workload}",
            "",
            "| policy | locality | imbalance | ≤ α | promise | ≤ promise | promised | sim "
            "| model | predicted | plan s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        per: dict[str, dict[str, list[float]]] = {}
        for policy in POLICIES:
            figures = {
                "locality": [float(np.mean(r[policy].locality)) for r in runs],
                "imbalance": [float(np.mean(r[policy].imbalance)) for r in runs],
                "within": [float(np.mean(np.array(r[policy].imbalance) <= alpha)) for r in runs],
                "promise": [float(np.mean(_promised(r[policy])[1])) for r in runs],
                "kept": [float(np.mean(np.less_equal(*_promised(r[policy])))) for r in runs],
                "promised": [float(np.mean(np.isfinite(r[policy].promise))) for r in runs],
                "kept_of_all": [
                    float(np.sum(np.less_equal(*_promised(r[policy]))) / len(r[policy].promise))
                    for r in runs
                ],
                "sim": [float(np.mean(r[policy].sim_effect)) for r in runs if r[policy].sim_effect],
                "model": [
                    float(np.mean(r[policy].model_effect)) for r in runs if r[policy].model_effect
                ],
                "predicted": [
                    float(np.mean(r[policy].predicted_effect))
                    for r in runs
                    if r[policy].predicted_effect
                ],
                "seconds": [float(np.mean(r[policy].seconds)) for r in runs],
            }
            per[policy] = figures
            lines.append(
                f"| {policy} | {_median_range(figures['locality'])} | "
                f"{_median_range(figures['imbalance'])} | {_median_range(figures['within'], 2)} | "
                f"{_median_range(figures['promise'])} | {_median_range(figures['kept'], 2)} | "
                f"{_median_range(figures['promised'], 2)} | "
                f"{_median_range(figures['sim'])} | {_median_range(figures['model'])} | "
                f"{_median_range(figures['predicted'])} | {np.median(figures['seconds']):.3f} |"
            )
        lines += [
            "",
            "Forecast memory in use on the last window (stage A / stage B), per seed: "
            + "; ".join(r["new"].memories[-1] for r in runs if r["new"].memories)
            + ".",
            "",
        ]
        new = float(np.median(per["new"]["locality"]))
        rival = max(float(np.median(per[p]["locality"])) for p in ("hash", "old"))
        oracle = float(np.median(per["oracle"]["locality"]))
        within = float(np.median(per["new"]["within"]))
        kept = float(np.median(per["new"]["kept"]))
        promised = float(np.median(per["new"]["promised"]))
        verdicts += [
            f"* {workload}: new ≥ better of hash and old ({new:.3f} vs {rival:.3f}): "
            f"{'met' if new >= rival else 'NOT MET'}; new ≥ 0.7× oracle ({new:.3f} vs "
            f"{0.7 * oracle:.3f}): {'met' if new >= 0.7 * oracle else 'NOT MET'}; "
            f"next-window imbalance ≤ the plan's promise in ≥ 90 % of the windows with one "
            f"({kept:.1%} of the {promised:.1%} of windows with a promise, mean promise "
            f"{float(np.median(per['new']['promise'])):.3f}; counting a window without one "
            f"as missed: {float(np.median(per['new']['kept_of_all'])):.1%}): "
            f"{'met' if kept >= 0.9 else 'NOT MET'}; "
            f"≤ α in ≥ 90 % of windows ({within:.1%}): {'met' if within >= 0.9 else 'NOT MET'}",
        ]
    return "\n".join([*lines, "## Goals", "", *verdicts])


def over_seeds(
    workloads: Sequence[str], seeds: int, run_one: Callable[[str, int], T]
) -> dict[str, list[T]]:
    """``run_one(workload, seed)`` for every workload and seeds ``0..seeds-1``, in that order,
    each run's time printed as it ends."""
    results: dict[str, list[T]] = {}
    for workload in workloads:
        results[workload] = []
        for seed in range(seeds):
            begun = time.perf_counter()
            results[workload].append(run_one(workload, seed))
            print(f"  {workload} seed {seed}: {time.perf_counter() - begun:.1f}s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 windows of 20k events")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--window-events", type=int, default=100_000)
    parser.add_argument("--instances", type=int, default=6)
    parser.add_argument("--alpha", type=float, default=1.03)
    parser.add_argument("--sim-every", type=int, default=7)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.windows, args.window_events, args.sim_every = 1, 8, 20_000, 3
    command = "python bench/plan_quality.py" + (" --quick" if args.quick else "")
    started = time.perf_counter()
    results = over_seeds(
        args.workloads,
        args.seeds,
        lambda workload, seed: run(
            WORKLOADS[workload],
            seed,
            args.windows,
            args.window_events,
            args.instances,
            args.alpha,
            args.sim_every,
        ),
    )
    emit(report(results, args.alpha, command, time.perf_counter() - started), args.out)


if __name__ == "__main__":
    main()
