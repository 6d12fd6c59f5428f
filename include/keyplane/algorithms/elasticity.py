"""Elasticity: which operator to grow and which machines to release (paper 003, Stela).

Stela decides scale-out and scale-in from two measured rates per operator and
nothing else (no hardware profiling, 003 §5.1): the rate at which tuples
arrive (the sum of the parents' emit rates) and the rate at which the operator
executes them. From these it derives

* congestion (003 §4.1): an operator is congested when its input rate exceeds
  its execute rate by more than a factor α (1.2 in the paper's experiments);
* the Expected Throughput Percentage, ETP (003 §4.2): the share of the
  workflow's throughput (the sum of the sinks' execute rates) that an
  operator can still influence, i.e. the sinks it reaches along paths free of
  congested operators;
* scale-out (003 §5.2): new instance slots go, one at a time, to the congested
  operator with the highest *projected* ETP, re-projecting the rates after
  each choice;
* scale-in (003 §5.3): the machines whose instances sum to the lowest ETP are
  released, and their instances are dealt round-robin to the remaining
  machines in increasing order of ETP sum.

In keyplane an operator instance is a partition of a stateful operator and a
machine is a Spark executor; the rates come from the metrics topic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

CONGESTION_THRESHOLD = 1.2
"""The congestion rate α used in the paper's experiments (003 §4.1)."""


def _check_threshold(threshold: float) -> None:
    if not (math.isfinite(threshold) and threshold >= 1.0):
        raise ValueError(
            f"congestion threshold must be a finite number >= 1.0 (paper 003 §4.1 recommends "
            f"values above 1 to absorb measurement noise), got {threshold!r}"
        )


def _check_rate(what: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{what} must be a finite rate >= 0 tuples/s, got {value!r}")


@dataclass(frozen=True)
class Operator:
    """One logical operator with its measured rates (003 §3.1, §4.1).

    ``input_rate`` is the sum of the parents' emit rates into this operator;
    for a source it is the rate offered by the outside world (in keyplane the
    produce rate of its Kafka partitions), so a source that cannot keep up is
    congested too. ``execute_rate`` is the rate at which all instances together
    execute tuples. ``max_parallelism`` caps the instance count (Storm's task
    count, a stateful operator's partition count in keyplane); ``None`` means
    no cap.
    """

    name: str
    parallelism: int
    input_rate: float
    execute_rate: float
    max_parallelism: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("operator name must be a non-empty string")
        if self.parallelism < 1:
            raise ValueError(
                f"operator {self.name!r}: parallelism must be >= 1, got {self.parallelism}"
            )
        if self.max_parallelism is not None and self.max_parallelism < self.parallelism:
            raise ValueError(
                f"operator {self.name!r}: max_parallelism {self.max_parallelism} is below "
                f"its parallelism {self.parallelism}"
            )
        _check_rate(f"operator {self.name!r} input_rate", self.input_rate)
        _check_rate(f"operator {self.name!r} execute_rate", self.execute_rate)

    @property
    def congestion_ratio(self) -> float:
        """``input_rate / execute_rate``: infinite when tuples arrive but none execute."""
        if self.execute_rate > 0.0:
            return self.input_rate / self.execute_rate
        return math.inf if self.input_rate > 0.0 else 0.0

    @property
    def processed_rate(self) -> float:
        """The rate the operator actually passes downstream: it cannot execute more than arrives."""
        return min(self.input_rate, self.execute_rate)

    @property
    def can_grow(self) -> bool:
        return self.max_parallelism is None or self.parallelism < self.max_parallelism


@dataclass(frozen=True)
class Stream:
    """A directed edge ``source → target``.

    ``ratio`` is the number of tuples the target receives per tuple the source
    processes. It folds in the source's selectivity and how its output is
    split among children; the default 1.0 is Storm's stream semantics (every
    subscriber receives every tuple of a selectivity-1 operator). It is only
    used to project how a faster parent raises its children's input rates
    (003 §5.2.2).
    """

    source: str
    target: str
    ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.source == self.target:
            raise ValueError(f"stream {self.source!r} → {self.target!r} is a self-loop")
        _check_rate(f"stream {self.source!r} → {self.target!r} ratio", self.ratio)


@dataclass(frozen=True)
class OperatorDag:
    """A workflow: operators connected by streams, validated to be a DAG (003 §3.1).

    Sources are operators without parents, sinks operators without children.
    """

    operators: tuple[Operator, ...]
    streams: tuple[Stream, ...]
    _by_name: dict[str, Operator] = field(init=False, repr=False, compare=False)
    _children: dict[str, tuple[Stream, ...]] = field(init=False, repr=False, compare=False)
    _parents: dict[str, tuple[Stream, ...]] = field(init=False, repr=False, compare=False)
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.operators:
            raise ValueError("a workflow needs at least one operator")
        by_name: dict[str, Operator] = {}
        for op in self.operators:
            if op.name in by_name:
                raise ValueError(f"operator name {op.name!r} appears twice")
            by_name[op.name] = op
        children: dict[str, list[Stream]] = {name: [] for name in by_name}
        parents: dict[str, list[Stream]] = {name: [] for name in by_name}
        seen_edges: set[tuple[str, str]] = set()
        for s in self.streams:
            for end in (s.source, s.target):
                if end not in by_name:
                    raise ValueError(
                        f"stream {s.source!r} → {s.target!r}: unknown operator {end!r}"
                    )
            if (s.source, s.target) in seen_edges:
                raise ValueError(f"stream {s.source!r} → {s.target!r} appears twice")
            seen_edges.add((s.source, s.target))
            children[s.source].append(s)
            parents[s.target].append(s)
        indegree = {name: len(parents[name]) for name in by_name}
        ready = deque(name for name in by_name if indegree[name] == 0)
        order: list[str] = []
        while ready:
            name = ready.popleft()
            order.append(name)
            for s in children[name]:
                indegree[s.target] -= 1
                if indegree[s.target] == 0:
                    ready.append(s.target)
        if len(order) != len(by_name):
            cyclic = sorted(name for name, d in indegree.items() if d > 0)
            raise ValueError(f"streams form a cycle through {cyclic}; a workflow must be a DAG")
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_children", {k: tuple(v) for k, v in children.items()})
        object.__setattr__(self, "_parents", {k: tuple(v) for k, v in parents.items()})
        object.__setattr__(self, "_order", tuple(order))

    def operator(self, name: str) -> Operator:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no operator named {name!r} in the workflow") from None

    def children(self, name: str) -> tuple[Stream, ...]:
        self.operator(name)
        return self._children[name]

    def parents(self, name: str) -> tuple[Stream, ...]:
        self.operator(name)
        return self._parents[name]

    @property
    def topological_order(self) -> tuple[str, ...]:
        return self._order

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(n for n in self._order if not self._parents[n])

    @property
    def sinks(self) -> tuple[str, ...]:
        return tuple(n for n in self._order if not self._children[n])

    @property
    def total_instances(self) -> int:
        return sum(op.parallelism for op in self.operators)

    @property
    def throughput(self) -> float:
        """Throughput_workflow: the sum of the sinks' execute rates (003 §4.2)."""
        return sum(self._by_name[n].execute_rate for n in self.sinks)

    def with_operators(self, updated: Iterable[Operator]) -> OperatorDag:
        """A copy with some operators replaced by name (streams unchanged)."""
        new = {op.name: op for op in updated}
        unknown = set(new) - set(self._by_name)
        if unknown:
            raise KeyError(f"cannot replace unknown operators {sorted(unknown)}")
        return OperatorDag(tuple(new.get(op.name, op) for op in self.operators), self.streams)


def is_congested(op: Operator, threshold: float = CONGESTION_THRESHOLD) -> bool:
    """Algorithm 1 of 003 §4.1 for one operator: ``R_input / R_execute > α``."""
    _check_threshold(threshold)
    return op.congestion_ratio > threshold


def congested_operators(
    dag: OperatorDag, threshold: float = CONGESTION_THRESHOLD
) -> frozenset[str]:
    """The CongestedMap of 003 §4.1, Algorithm 1."""
    _check_threshold(threshold)
    return frozenset(op.name for op in dag.operators if op.congestion_ratio > threshold)


def effective_reachable_sinks(
    dag: OperatorDag, name: str, threshold: float = CONGESTION_THRESHOLD
) -> frozenset[str]:
    """The sinks whose throughput a change of ``name``'s execute rate would move (003 §4.2).

    Algorithm 2 explores the descendants depth first and gives up the whole
    substructure below a congested child: a saturated operator would only
    queue the extra tuples. A sink is kept when at least one path to it is free
    of congested operators (the operator itself excepted). The paper's
    recursion sums sink rates per path, which counts a sink twice when a DAG
    reaches it along two uncongested paths; the definition ("the sum of the
    execution speed of the sinks, only if the sink can be reached by one or
    more uncongested path(s)") counts it once, which is what this returns and
    keeps ETP within [0, 1]. On trees, such as the example of 003 §4.3, both
    agree.
    """
    congested = congested_operators(dag, threshold)
    if not dag.children(name):
        return frozenset({name})
    sinks: set[str] = set()
    seen: set[str] = {name}
    stack = [name]
    while stack:
        current = stack.pop()
        for stream in dag.children(current):
            child = stream.target
            if child in congested or child in seen:
                continue
            seen.add(child)
            if dag.children(child):
                stack.append(child)
            else:
                sinks.add(child)
    return frozenset(sinks)


def etp(dag: OperatorDag, name: str, threshold: float = CONGESTION_THRESHOLD) -> float:
    """ETP_x = Throughput_EffectiveReachableSinks / Throughput_workflow (003 §4.2).

    A fraction in [0, 1]; 0 when the workflow has no throughput yet.
    """
    total = dag.throughput
    if total <= 0.0:
        return 0.0
    reached = effective_reachable_sinks(dag, name, threshold)
    return sum(dag.operator(s).execute_rate for s in reached) / total


def etp_all(dag: OperatorDag, threshold: float = CONGESTION_THRESHOLD) -> dict[str, float]:
    """ETP of every operator, in topological order."""
    return {name: etp(dag, name, threshold) for name in dag.topological_order}


def project_added_instance(dag: OperatorDag, name: str) -> OperatorDag:
    """The rates Stela expects after giving ``name`` one more instance (003 §5.2.2).

    The target's execute rate grows proportionally, ``E' = E·(k+1)/k``. Its
    extra output raises the input rates of its descendants (through each
    stream's ``ratio``), and each descendant passes on at most its execute
    rate. Other execute rates stay as measured: without profiling, Stela has
    no other estimate of an operator's capacity, so a descendant whose input
    grows past α times its measured execute rate becomes congested in the
    projection and competes for the next slot.
    """
    target = dag.operator(name)
    if not target.can_grow:
        raise ValueError(
            f"operator {name!r} is already at its max_parallelism {target.max_parallelism}"
        )
    k = target.parallelism
    grown = replace(target, parallelism=k + 1, execute_rate=target.execute_rate * (k + 1) / k)
    delta_processed: dict[str, float] = {name: grown.processed_rate - target.processed_rate}
    updated: dict[str, Operator] = {name: grown}
    order = dag.topological_order
    for current in order[order.index(name) + 1 :]:
        delta_input = sum(
            s.ratio * delta_processed[s.source]
            for s in dag.parents(current)
            if s.source in delta_processed
        )
        if delta_input == 0.0:
            continue
        op = dag.operator(current)
        moved = replace(op, input_rate=max(0.0, op.input_rate + delta_input))
        updated[current] = moved
        delta_processed[current] = moved.processed_rate - op.processed_rate
    return dag.with_operators(updated.values())


def new_instance_slots(current_instances: int, current_machines: int, new_machines: int) -> int:
    """ΔI·ΔM: the slots to fill on the new machines (003 §5.2.1).

    ΔI = I_pre / M_pre keeps the average number of instances per machine
    unchanged; it is rounded to the nearest integer (halves up) and is at
    least 1 so that a scale-out always adds capacity.
    """
    if current_instances < 1 or current_machines < 1:
        raise ValueError(
            f"need at least one instance and one machine before scaling out, got "
            f"{current_instances} instances on {current_machines} machines"
        )
    if new_machines < 0:
        raise ValueError(f"new_machines must be >= 0, got {new_machines}")
    per_machine = max(1, math.floor(current_instances / current_machines + 0.5))
    return per_machine * new_machines


ChoiceReason = Literal["highest_etp", "source_fallback", "round_robin"]


@dataclass(frozen=True)
class ScaleOutChoice:
    """One instance slot: the operator that gets it and why.

    ``projected_etp`` is the operator's (projected) ETP at the moment it was
    chosen, the PETP of 003 §5.2.2.
    """

    operator: str
    projected_etp: float
    reason: ChoiceReason


@dataclass(frozen=True)
class ScaleOutPlan:
    """The ordered choices of a scale-out and the rates projected after them.

    ``choices`` is shorter than the number of requested slots only when every
    candidate operator had reached its ``max_parallelism``.
    """

    choices: tuple[ScaleOutChoice, ...]
    projected: OperatorDag

    @property
    def operators(self) -> tuple[str, ...]:
        return tuple(c.operator for c in self.choices)

    def added_instances(self) -> dict[str, int]:
        added: dict[str, int] = {}
        for c in self.choices:
            added[c.operator] = added.get(c.operator, 0) + 1
        return added


def _check_slots(slots: int) -> None:
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")


def stela_scale_out(
    dag: OperatorDag, slots: int, threshold: float = CONGESTION_THRESHOLD
) -> ScaleOutPlan:
    """Algorithm 3 of 003 §5.2.2: fill ``slots`` new instance slots one at a time.

    Each iteration re-runs congestion detection on the projected rates, picks
    the congested operator with the highest projected ETP, and projects its
    new execute rate ``E·(k+1)/k`` (see :func:`project_added_instance`) before
    the next iteration. When nothing is congested, a source gets the slot so
    that more tuples enter the workflow; among sources the one with the
    highest ETP wins.

    The paper does not say how ties are broken. Ties in ETP are frequent (every
    congested parent of the same uncongested sinks has the same ETP), so ties
    go to the more congested operator (higher input/execute ratio), then to
    the one with fewer instances, then to topological order. Operators at
    their ``max_parallelism`` are not candidates.
    """
    _check_threshold(threshold)
    _check_slots(slots)
    rank = {name: i for i, name in enumerate(dag.topological_order)}
    choices: list[ScaleOutChoice] = []
    current = dag
    for _ in range(slots):
        congested = congested_operators(current, threshold)
        candidates = [n for n in congested if current.operator(n).can_grow]
        reason: ChoiceReason = "highest_etp"
        if not congested:
            candidates = [n for n in current.sources if current.operator(n).can_grow]
            reason = "source_fallback"
        if not candidates:
            break
        ranked = sorted(
            (
                -etp(current, n, threshold),
                -current.operator(n).congestion_ratio,
                current.operator(n).parallelism,
                rank[n],
                n,
            )
            for n in candidates
        )
        negative_etp, *_, target = ranked[0]
        choices.append(ScaleOutChoice(target, -negative_etp, reason))
        current = project_added_instance(current, target)
    return ScaleOutPlan(tuple(choices), current)


def round_robin_scale_out(
    dag: OperatorDag, slots: int, start: int = 0, threshold: float = CONGESTION_THRESHOLD
) -> ScaleOutPlan:
    """The baseline: deal new slots to operators in turn, in topological order.

    This is the even spread a scheduler that ignores congestion gives (Storm's
    default scheduler places executors round-robin, 003 §6.1.2). ``start`` is
    the position in topological order that receives the first slot; operators
    at their ``max_parallelism`` are skipped. The projection is the same as
    Stela's so that both plans can be compared on the same terms.
    """
    _check_threshold(threshold)
    _check_slots(slots)
    order = dag.topological_order
    if not 0 <= start < len(order):
        raise ValueError(f"start must index the {len(order)} operators, got {start}")
    choices: list[ScaleOutChoice] = []
    current = dag
    position = start
    for _ in range(slots):
        for _attempt in range(len(order)):
            name = order[position % len(order)]
            position += 1
            if current.operator(name).can_grow:
                break
        else:
            break
        choices.append(ScaleOutChoice(name, etp(current, name, threshold), "round_robin"))
        current = project_added_instance(current, name)
    return ScaleOutPlan(tuple(choices), current)


@dataclass(frozen=True, order=True)
class Instance:
    """One instance (Storm executor; keyplane partition) of an operator."""

    operator: str
    index: int


@dataclass(frozen=True)
class InstanceMove:
    instance: Instance
    from_machine: str
    to_machine: str


@dataclass(frozen=True)
class ScaleInPlan:
    """The machines Stela releases and where their instances go (003 §5.3).

    ``etp_sums`` is the ETPSum of every machine before scale-in; ``layout``
    maps each remaining machine to its instances after the moves.
    """

    removed_machines: tuple[str, ...]
    moves: tuple[InstanceMove, ...]
    layout: Mapping[str, tuple[Instance, ...]]
    etp_sums: Mapping[str, float]


def _check_layout(dag: OperatorDag, layout: Mapping[str, Sequence[Instance]]) -> None:
    seen: set[Instance] = set()
    for machine, instances in layout.items():
        for inst in instances:
            dag.operator(inst.operator)
            if inst in seen:
                raise ValueError(f"instance {inst} is placed twice (again on {machine!r})")
            seen.add(inst)


def etp_sum_by_machine(
    dag: OperatorDag,
    layout: Mapping[str, Sequence[Instance]],
    threshold: float = CONGESTION_THRESHOLD,
) -> dict[str, float]:
    """ETPSum(machine) = Σ over its instances of their operator's ETP (003 §5.3)."""
    _check_layout(dag, layout)
    scores = etp_all(dag, threshold)
    return {m: sum(scores[i.operator] for i in instances) for m, instances in layout.items()}


def stela_scale_in(
    dag: OperatorDag,
    layout: Mapping[str, Sequence[Instance]],
    machines_to_remove: int,
    threshold: float = CONGESTION_THRESHOLD,
) -> ScaleInPlan:
    """Algorithm 4 of 003 §5.3: release the machines with the lowest ETPSum.

    Their instances matter least to the sinks' throughput, so moving them
    disturbs the workflow least. The released instances are dealt round-robin
    to the remaining machines, starting from the lowest ETPSum: round-robin
    keeps the load balanced, and when the count does not divide evenly the
    extra instances land where they disturb the least. Ties in ETPSum go to
    the machine with fewer instances (less to move), then to machine name.
    Every instance survives: the instance count is conserved.
    """
    if not 0 <= machines_to_remove < len(layout):
        raise ValueError(
            f"machines_to_remove must be in [0, {len(layout) - 1}] for a cluster of "
            f"{len(layout)} machines (at least one must remain), got {machines_to_remove}"
        )
    sums = etp_sum_by_machine(dag, layout, threshold)
    ranked = sorted(layout, key=lambda m: (sums[m], len(layout[m]), m))
    removed = tuple(ranked[:machines_to_remove])
    receivers = ranked[machines_to_remove:]
    new_layout: dict[str, list[Instance]] = {m: list(layout[m]) for m in receivers}
    moves: list[InstanceMove] = []
    turn = 0
    for machine in removed:
        for inst in layout[machine]:
            target = receivers[turn % len(receivers)]
            turn += 1
            new_layout[target].append(inst)
            moves.append(InstanceMove(inst, machine, target))
    return ScaleInPlan(
        removed_machines=removed,
        moves=tuple(moves),
        layout={m: tuple(v) for m, v in new_layout.items()},
        etp_sums=sums,
    )


@dataclass(frozen=True)
class CongestionSettings:
    """How congestion is judged (003 §4.1).

    ``threshold`` is the congestion rate α (the paper uses 1.2). ``window`` is
    the number of time slots W the rates are averaged over; the paper leaves W
    open, and 5 slots (e.g. five micro-batches) smooths a single slow batch
    without hiding a sustained backlog for long.
    """

    threshold: float = CONGESTION_THRESHOLD
    window: int = 5

    def __post_init__(self) -> None:
        _check_threshold(self.threshold)
        if self.window < 1:
            raise ValueError(f"window must be at least one time slot, got {self.window}")


DEFAULT_CONGESTION_SETTINGS = CongestionSettings()


class CongestionDetector:
    """Sliding-window congestion detection (003 §4.1, Algorithm 1).

    Feed it, per time slot and operator, the input rate (the sum of the
    parents' emit rates) and the execute rate. Over the last W slots it
    averages both, R_input = Σ_j Σ_i T_i,j,emit / W and R_execute = T_execute / W,
    and reports an operator as congested when R_input / R_execute > α. An
    operator is only judged once its window is full, so a restart or a single
    slow slot does not trigger a scale decision.
    """

    def __init__(self, settings: CongestionSettings = DEFAULT_CONGESTION_SETTINGS) -> None:
        self.settings = settings
        self._windows: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, operator: str, input_rate: float, execute_rate: float) -> None:
        _check_rate(f"operator {operator!r} input_rate", input_rate)
        _check_rate(f"operator {operator!r} execute_rate", execute_rate)
        window = self._windows.setdefault(operator, deque(maxlen=self.settings.window))
        window.append((input_rate, execute_rate))

    def is_ready(self, operator: str) -> bool:
        window = self._windows.get(operator)
        return window is not None and len(window) == self.settings.window

    def window_rates(self, operator: str) -> tuple[float, float]:
        """(R_input, R_execute) averaged over the samples currently in the window."""
        window = self._windows.get(operator)
        if not window:
            raise KeyError(f"no samples observed for operator {operator!r}")
        n = len(window)
        return (sum(s[0] for s in window) / n, sum(s[1] for s in window) / n)

    def is_congested(self, operator: str) -> bool:
        if not self.is_ready(operator):
            return False
        r_input, r_execute = self.window_rates(operator)
        if r_execute > 0.0:
            return r_input / r_execute > self.settings.threshold
        return r_input > 0.0

    def congested(self) -> frozenset[str]:
        """The CongestedMap: every operator with a full window judged congested."""
        return frozenset(op for op in self._windows if self.is_congested(op))

    def measured_dag(self, dag: OperatorDag) -> OperatorDag:
        """``dag`` with the window-averaged rates of every operator whose window is full."""
        updated = []
        for op in dag.operators:
            if self.is_ready(op.name):
                r_input, r_execute = self.window_rates(op.name)
                updated.append(replace(op, input_rate=r_input, execute_rate=r_execute))
        return dag.with_operators(updated)
