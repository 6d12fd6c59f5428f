"""Reproduce Stela's scale-out comparison (paper 003 §7.2, Table 4) in a steady-state model.

Paper 003 scales the Star, Linear and Diamond micro-benchmarks out by one
machine and reports Stela's post-scale throughput 65 %, 45 % and 120 % above
Storm's default scheduler, which only moves executors and adds none (003 §7.2).
Their rates are not given, so this script compares the strategies in a
steady-state model instead of on a cluster:

* each operator instance executes at most ``capacity`` tuples/s; an operator
  passes on ``min(input, instances * capacity)``; every child receives every
  tuple its parent passes on; sources receive an offered rate. Throughput is
  the sum of what the sinks execute (003 §4.2). There is no backpressure: a
  congested operator queues, as ETP assumes;
* Stela sees only what it would measure (input and execute rate per
  operator) and plans ``new_instance_slots`` slots with ETP; the plan is then
  scored with the true capacities;
* baselines: Storm default (no new executors, so no gain in this model),
  round-robin new executors (averaged over every starting operator), and an
  oracle that tries every way to spend the slots.

Shapes and counts follow Table 4 (executors per component, tasks per
component as the parallelism cap, machines before/after); the Figure 6
layouts are not in the text, so the shapes are: Star = 3 sources → hub →
2 sinks, Linear = source → 3 bolts in a chain, Diamond = source → 4 parallel
bolts → sink. Run ``--draws`` random rate draws per shape to see how much the
result depends on the chosen rates.

    python bench/reproduce_stela.py [--quick] [--draws N] [--seed S] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from _output import emit

from keyplane.algorithms.elasticity import (
    Operator,
    OperatorDag,
    Stream,
    new_instance_slots,
    round_robin_scale_out,
    stela_scale_out,
)


@dataclass(frozen=True)
class Stage:
    """An operator as the model sees it: true per-instance capacity, hidden from Stela."""

    name: str
    instances: int
    capacity: float
    max_instances: int
    offered: float = 0.0


@dataclass(frozen=True)
class Topology:
    name: str
    stages: tuple[Stage, ...]
    streams: tuple[Stream, ...]
    machines_before: int
    machines_after: int
    paper_gain_over_default: float

    def dag_shape(self, rates: Mapping[str, tuple[float, float]]) -> OperatorDag:
        return OperatorDag(
            tuple(
                Operator(s.name, s.instances, *rates[s.name], max_parallelism=s.max_instances)
                for s in self.stages
            ),
            self.streams,
        )


def steady_state(topo: Topology, instances: Mapping[str, int]) -> dict[str, tuple[float, float]]:
    """(input, processed) per operator in the no-backpressure steady state."""
    order = OperatorDag(
        tuple(Operator(s.name, 1, 0.0, 0.0) for s in topo.stages), topo.streams
    ).topological_order
    stages = {s.name: s for s in topo.stages}
    state: dict[str, tuple[float, float]] = {}
    for name in order:
        stage = stages[name]
        parents = [s for s in topo.streams if s.target == name]
        arriving = stage.offered + sum(s.ratio * state[s.source][1] for s in parents)
        state[name] = (arriving, min(arriving, instances[name] * stage.capacity))
    return state


def throughput(topo: Topology, instances: Mapping[str, int]) -> float:
    state = steady_state(topo, instances)
    sinks = {s.name for s in topo.stages} - {s.source for s in topo.streams}
    return sum(state[n][1] for n in sinks)


def initial_instances(topo: Topology) -> dict[str, int]:
    return {s.name: s.instances for s in topo.stages}


def measured_dag(topo: Topology) -> OperatorDag:
    """What Stela measures: input rate and execute (processed) rate per operator."""
    return topo.dag_shape(steady_state(topo, initial_instances(topo)))


def with_added(base: Mapping[str, int], added: Sequence[str]) -> dict[str, int]:
    result = dict(base)
    for name in added:
        result[name] += 1
    return result


def slots_for(topo: Topology) -> int:
    total = sum(s.instances for s in topo.stages)
    return new_instance_slots(
        total, topo.machines_before, topo.machines_after - topo.machines_before
    )


def oracle_throughput(topo: Topology, slots: int) -> float:
    """The best throughput over every way to spend the slots (within the caps)."""
    base = initial_instances(topo)
    best = 0.0
    for combo in itertools.combinations_with_replacement([s.name for s in topo.stages], slots):
        trial = with_added(base, combo)
        if any(trial[s.name] > s.max_instances for s in topo.stages):
            continue
        best = max(best, throughput(topo, trial))
    return best


@dataclass(frozen=True)
class Outcome:
    before: float
    stela: float
    round_robin_mean: float
    round_robin_min: float
    round_robin_max: float
    oracle: float
    stela_choices: tuple[str, ...]


def evaluate(topo: Topology) -> Outcome:
    slots = slots_for(topo)
    base = initial_instances(topo)
    dag = measured_dag(topo)
    stela = stela_scale_out(dag, slots)
    rr = [
        throughput(topo, with_added(base, round_robin_scale_out(dag, slots, start=i).operators))
        for i in range(len(topo.stages))
    ]
    return Outcome(
        before=throughput(topo, base),
        stela=throughput(topo, with_added(base, stela.operators)),
        round_robin_mean=statistics.fmean(rr),
        round_robin_min=min(rr),
        round_robin_max=max(rr),
        oracle=oracle_throughput(topo, slots),
        stela_choices=stela.operators,
    )


def star() -> Topology:
    """Table 4 Star: 6 components x 2 executors (4 tasks each), 4 → 5 machines."""
    sources = tuple(Stage(f"s{i}", 2, 400.0, 4, offered=600.0) for i in (1, 2, 3))
    stages = (
        *sources,
        Stage("hub", 2, 500.0, 4),
        Stage("k1", 2, 700.0, 4),
        Stage("k2", 2, 700.0, 4),
    )
    streams = (
        *(Stream(s.name, "hub") for s in sources),
        Stream("hub", "k1"),
        Stream("hub", "k2"),
    )
    return Topology("Star", stages, streams, 4, 5, 0.65)


def linear() -> Topology:
    """Table 4 Linear: 4 components x 6 executors (12 tasks each), 6 → 7 machines."""
    stages = (
        Stage("src", 6, 600.0, 12, offered=3000.0),
        Stage("b1", 6, 700.0, 12),
        Stage("b2", 6, 300.0, 12),
        Stage("b3", 6, 500.0, 12),
    )
    streams = (Stream("src", "b1"), Stream("b1", "b2"), Stream("b2", "b3"))
    return Topology("Linear", stages, streams, 6, 7, 0.45)


def diamond() -> Topology:
    """Table 4 Diamond: 6 components x 4 executors (8 tasks each), 6 → 7 machines."""
    middles = (
        Stage("m1", 4, 150.0, 8),
        Stage("m2", 4, 200.0, 8),
        Stage("m3", 4, 300.0, 8),
        Stage("m4", 4, 300.0, 8),
    )
    stages = (Stage("src", 4, 400.0, 8, offered=1000.0), *middles, Stage("sink", 4, 1000.0, 8))
    streams = (
        *(Stream("src", m.name) for m in middles),
        *(Stream(m.name, "sink") for m in middles),
    )
    return Topology("Diamond", stages, streams, 6, 7, 1.20)


def random_rates(topo: Topology, rng: np.random.Generator) -> Topology:
    """The same shape and counts with per-instance capacities drawn from [50, 1000]
    tuples/s and each source offered 0.5–3 times what its instances can take."""
    stages = []
    for s in topo.stages:
        capacity = float(rng.uniform(50.0, 1000.0))
        offered = float(rng.uniform(0.5, 3.0)) * s.instances * capacity if s.offered > 0 else 0.0
        stages.append(replace(s, capacity=capacity, offered=offered))
    return replace(topo, stages=tuple(stages))


def pct(x: float) -> str:
    return f"{100.0 * x:+.0f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few random draws (smoke run)")
    parser.add_argument("--draws", type=int, default=500, help="random rate draws per shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the markdown tables to this file")
    args = parser.parse_args()
    draws = 20 if args.quick else args.draws

    lines = [
        "### Chosen rates (one scale-out by one machine, Table 4 counts)",
        "",
        "| topology | executors / machines | new slots | before (t/s) | Storm default "
        "| round-robin mean [min–max] | Stela | oracle | Stela's choices "
        "| Stela vs Storm default | paper: Stela vs Storm default |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for topo in (star(), linear(), diamond()):
        o = evaluate(topo)
        total = sum(s.instances for s in topo.stages)
        lines.append(
            f"| {topo.name} | {total} / {topo.machines_before}→{topo.machines_after} "
            f"| {slots_for(topo)} | {o.before:.0f} | {o.before:.0f} "
            f"| {o.round_robin_mean:.0f} [{o.round_robin_min:.0f}–{o.round_robin_max:.0f}] "
            f"| {o.stela:.0f} | {o.oracle:.0f} | {', '.join(o.stela_choices)} "
            f"| {pct(o.stela / o.before - 1)} | {pct(topo.paper_gain_over_default)} |"
        )

    rng = np.random.default_rng(args.seed)
    lines += [
        "",
        f"### Random rates ({draws} draws per shape, seed {args.seed})",
        "",
        "| topology | median Stela gain over Storm default | mean Stela / round-robin "
        "| draws with Stela ≥ round-robin | mean Stela / oracle | draws where Stela = oracle |",
        "|---|---|---|---|---|---|",
    ]
    for shape in (star(), linear(), diamond()):
        gains, vs_rr, vs_oracle = [], [], []
        for _ in range(draws):
            o = evaluate(random_rates(shape, rng))
            gains.append(o.stela / o.before - 1)
            vs_rr.append(o.stela / o.round_robin_mean)
            vs_oracle.append(o.stela / o.oracle)
        lines.append(
            f"| {shape.name} | {pct(statistics.median(gains))} "
            f"| {statistics.fmean(vs_rr):.2f} "
            f"| {100.0 * sum(r >= 1 - 1e-9 for r in vs_rr) / draws:.0f} % "
            f"| {statistics.fmean(vs_oracle):.2f} "
            f"| {100.0 * sum(r >= 1 - 1e-9 for r in vs_oracle) / draws:.0f} % |"
        )

    table = "\n".join(lines)
    emit(table, args.out)


if __name__ == "__main__":
    main()
