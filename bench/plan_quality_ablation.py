"""Which ingredient of the new planner costs next-window locality: one swapped at a time.

``bench/plan_quality.py`` finds the new planner's mean next-window locality
on its ``daily`` workload a little below the previous planner's. The two
differ in the weights they balance (a forecast of the next window against the
decayed pair history), in the pair history they cut on (two, chosen by
backtest, against the one with ``min_weight`` 0.5), in their rules (splits
that pay and the mean heavy-key rule, against splitting until α holds and the
cascading rule), in the headroom they build to and in the choice among
keeping the current plan, hash routing and a new plan. This replays the same
workload, seeds, windows, instances and α and scores on each next window:

* ``previous`` and ``new``: ``plan_quality``'s ``old`` and ``new`` policies;
* ``new, pairs by locality``: the new policy with its two pair histories
  chosen by the locality their plans had on the window that followed, not by
  the cost model's throughput;
* ``new, pairs 0.5``: the new policy on the ``min_weight`` 0.5 pair history
  alone, the one the previous planner keeps;
* ``new, pairs 0.5, balance on pairs``: that, balancing the pair history's
  weights instead of the forecast;
* ``new, pairs 0.5, built to α``: that, with no headroom (``headroom=1``);
* ``plan, pairs 0.5, new rules`` and ``plan, pairs 0.5, previous rules``: the
  new plan itself (no choice among candidates), built with the new planner's
  rules or the previous planner's.

Per policy: next-window locality and imbalance (the worse stage's max/mean),
the cost model's throughput relative to hash routing on the next window,
the keys split or marked heavy per plan, the share of windows whose plan is a
new one (not the current plan kept or hash routing) and the share cut on the
``min_weight`` 0.05 pair history. Figures are the median over seeds of each
seed's mean, the range over seeds in brackets. Then, per seed, how the two
pair histories' plans differ on the next window (locality, summed imbalance,
which has the higher cost-model throughput): what the new policy's backtest
between them sees. Pure planning, no Spark.

    python bench/plan_quality_ablation.py --quick
    python bench/plan_quality_ablation.py --out docs/bench-results/plan_quality_ablation.md
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _output import emit
from plan_quality import PAIR_MEMORIES, WORKLOADS, _median_range, over_seeds, statistics_of

from keyplane.algorithms.costmodel import CostModel
from keyplane.algorithms.forecast import Backtest, WeightForecast, reweighted
from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import LocalityPlan
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.plan_choice import choose_plan, hash_plan, planning_alpha

POLICIES = (
    "previous",
    "new",
    "new, pairs by locality",
    "new, pairs 0.5",
    "new, pairs 0.5, balance on pairs",
    "new, pairs 0.5, built to α",
    "plan, pairs 0.5, new rules",
    "plan, pairs 0.5, previous rules",
)
LONG, SHORT = "min_weight 0.5", "min_weight 0.05"


@dataclass
class Series:
    """One policy's next-window figures over one run (one workload, one seed)."""

    locality: list[float] = field(default_factory=list)
    imbalance: list[float] = field(default_factory=list)
    model_effect: list[float] = field(default_factory=list)
    split: list[float] = field(default_factory=list)
    new_plan: list[float] = field(default_factory=list)
    short_pairs: list[float] = field(default_factory=list)


@dataclass
class Histories:
    """The two pair histories' plans side by side on each next window once they can differ
    (the third window on): the ``min_weight`` 0.05 history's figure less the 0.5 one's."""

    locality: list[float] = field(default_factory=list)
    imbalance_sum: list[float] = field(default_factory=list)
    short_faster: list[float] = field(default_factory=list)


def run(
    workload: str, seed: int, windows: int, size: int, n: int, alpha: float
) -> tuple[dict[str, Series], Histories]:
    data = WORKLOADS[workload](np.random.default_rng(seed), windows, size)
    stats = [statistics_of(w) for w in data]
    cost = CostModel()
    old_history = PairHistory(HistoryPolicy(decay=0.5, min_weight=0.5))
    histories = {
        name: PairHistory(HistoryPolicy(decay=0.5, min_weight=floor), n)
        for name, floor in PAIR_MEMORIES.items()
    }
    by_throughput = Backtest(list(PAIR_MEMORIES), SHORT, 6, lower_is_better=False)
    by_locality = Backtest(list(PAIR_MEMORIES), SHORT, 6, lower_is_better=False)
    forecast = WeightForecast(2, n)
    chains: dict[str, LocalityPlan] = {}
    kept: dict[str, LocalityPlan] = {}
    series = {name: Series() for name in POLICIES}
    apart = Histories()
    for t in range(windows - 1):
        old_history.add(stats[t])
        forecast.add((stats[t].stage_weights("a"), stats[t].stage_weights("b")))
        if chains:
            figures = {name: plan.evaluate(stats[t]) for name, plan in chains.items()}
            by_throughput.record({name: cost.throughput(*f) for name, f in figures.items()})
            by_locality.record({name: f.locality for name, f in figures.items()})
        drift = forecast.drift
        ahead = forecast.forecasts()
        for name, history in histories.items():
            history.add(stats[t])
            chains[name] = choose_plan(
                reweighted(history.statistics, *ahead), n, alpha=alpha,
                current=chains.get(name), cost=cost, drift=drift, followed=stats[t],
            )  # fmt: skip
        pairs = histories[LONG].statistics
        training = reweighted(pairs, *ahead)
        for name, statistics, headroom in (
            ("new, pairs 0.5, balance on pairs", pairs, None),
            ("new, pairs 0.5, built to α", training, 1.0),
        ):
            kept[name] = choose_plan(
                statistics, n, alpha=alpha, current=kept.get(name), cost=cost, drift=drift,
                followed=stats[t], **({} if headroom is None else {"headroom": headroom}),
            )  # fmt: skip
        bound = planning_alpha(training, n, alpha, drift=drift)
        plans = {
            "previous": build_plan(
                old_history.statistics, n, alpha=alpha, split_rule="alpha", heavy_rule="cascade"
            ),
            "new": chains[by_throughput.chosen],
            "new, pairs by locality": chains[by_locality.chosen],
            "new, pairs 0.5": chains[LONG],
            **kept,
            "plan, pairs 0.5, new rules": build_plan(training, n, alpha=bound, cost=cost),
            "plan, pairs 0.5, previous rules": build_plan(
                training, n, alpha=bound, split_rule="alpha", heavy_rule="cascade", cost=cost
            ),
        }
        short = {
            "new": by_throughput.chosen == SHORT,
            "new, pairs by locality": by_locality.chosen == SHORT,
        }
        following = stats[t + 1]
        hash_model = cost.throughput(*hash_plan(n, alpha).evaluate(following))
        for name, plan in plans.items():
            figures = plan.evaluate(following)
            s = series[name]
            s.locality.append(figures.locality)
            s.imbalance.append(max(figures.imbalance_a, figures.imbalance_b))
            s.model_effect.append(cost.throughput(*figures) / hash_model)
            s.split.append(len(plan.split_keys_a) + len(plan.split_keys_b))
            s.new_plan.append(float(plan.candidate == "plan"))
            s.short_pairs.append(float(short.get(name, False)))
        if t >= 2:
            short_figures, long_figures = (chains[k].evaluate(following) for k in (SHORT, LONG))
            apart.locality.append(short_figures.locality - long_figures.locality)
            apart.imbalance_sum.append(sum(short_figures[1:]) - sum(long_figures[1:]))
            apart.short_faster.append(
                float(cost.throughput(*short_figures) > cost.throughput(*long_figures))
            )
    return series, apart


def report(
    results: dict[str, list[tuple[dict[str, Series], Histories]]],
    alpha: float,
    command: str,
    elapsed: float,
) -> str:
    lines = [
        "# Next-window plan quality: one ingredient swapped at a time",
        "",
        f"Command: `{command}` ({elapsed:.0f} s); α = {alpha}. Median over seeds [range over "
        "seeds] of each seed's mean over its next windows. `model` is the cost model's "
        "throughput relative to hash routing on the next window; `split` the keys split or "
        "marked heavy per plan (both stages); `new plan` the share of windows whose plan is "
        "a new one, not the current plan kept or hash routing; `pairs 0.05` the share cut "
        "on the `min_weight` 0.05 pair history.",
        "",
    ]
    for workload, outcomes in results.items():
        runs = [series for series, _ in outcomes]
        lines += [
            f"## {workload}",
            "",
            "| policy | locality | imbalance | model | split | new plan | pairs 0.05 | "
            "locality per seed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for policy in POLICIES:

            def means(
                attribute: str, policy: str = policy, runs: list[dict[str, Series]] = runs
            ) -> list[float]:
                return [float(np.mean(getattr(r[policy], attribute))) for r in runs]

            seeds = " ".join(f"{value:.4f}" for value in means("locality"))
            lines.append(
                f"| {policy} | {_median_range(means('locality'), 4)} | "
                f"{_median_range(means('imbalance'))} | {_median_range(means('model_effect'))} | "
                f"{_median_range(means('split'), 1)} | {_median_range(means('new_plan'), 2)} | "
                f"{_median_range(means('short_pairs'), 2)} | {seeds} |"
            )
        lines += [
            "",
            "The two pair histories' plans on each next window from the third on, the "
            "`min_weight` 0.05 history's less the 0.5 one's, per seed: locality difference "
            "mean (standard deviation); difference of the stages' summed imbalance, mean "
            "(standard deviation); share of windows where the 0.05 plan has the higher "
            "cost-model throughput.",
            "",
            *(
                f"* seed {seed}: {np.mean(a.locality):+.4f} ({np.std(a.locality):.4f}); "
                f"{np.mean(a.imbalance_sum):+.4f} ({np.std(a.imbalance_sum):.4f}); "
                f"{np.mean(a.short_faster):.2f}"
                for seed, (_, a) in enumerate(outcomes)
                if a.locality
            ),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 windows of 20k events")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--window-events", type=int, default=100_000)
    parser.add_argument("--instances", type=int, default=6)
    parser.add_argument("--alpha", type=float, default=1.03)
    parser.add_argument("--workloads", nargs="+", default=["daily"], choices=WORKLOADS)
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.windows, args.window_events = 1, 8, 20_000
    command = "python bench/plan_quality_ablation.py" + (" --quick" if args.quick else "")
    started = time.perf_counter()
    results = over_seeds(
        args.workloads,
        args.seeds,
        lambda workload, seed: run(
            workload, seed, args.windows, args.window_events, args.instances, args.alpha
        ),
    )
    emit(report(results, args.alpha, command, time.perf_counter() - started), args.out)


if __name__ == "__main__":
    main()
