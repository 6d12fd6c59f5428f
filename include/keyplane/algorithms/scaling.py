"""Scale-out and scale-in of the routed job from its runtime metrics (paper 003, Stela).

Stela decides from two measured rates per operator (003 §4.1): the rate at
which tuples arrive and the rate at which the operator executes them. In
keyplane they come from the metrics topic (:class:`~keyplane.algorithms.batchmetrics.BatchMetrics`,
one record per micro-batch). A micro-batch runs its stages one after the
other on the same executors, so each batch is read as follows:

* the *offered* rate ``λ`` is what arrived for the batch, its rows plus the
  growth of the input lag, per second of wall-clock time: the time since
  the previous batch was reported, when the records' report times are known,
  and never less than the batch's duration or the trigger interval (a
  processing-time trigger starts a batch at most once per interval). Spark
  skips a trigger that finds no new data, so a job whose batches take longer
  than the interval but arrive seconds apart idles between them: only the
  time between reports shows that idle time;
* a stage's share of the batch's time is its share of the batch's critical
  path: a stage's tasks run in parallel and it finishes with its busiest
  instance, so stage X takes ``u_X = max_X / Σ_Y max_Y`` of the duration ``D``
  and executes ``E_X = tuples_X / (u_X · D)`` tuples/s while it runs. Stela
  measures an operator's execute rate from time (003 §4.1), so ``max_X`` is
  the busiest instance's measured milliseconds (``BatchMetrics.busy_ms``)
  when every stage reported them for the batch: a stage whose aggregate costs
  more per tuple then takes its true share. Otherwise (the JVM stages time
  nothing, and older records carry no time) ``max_X`` is the most loaded
  instance's tuples, which assumes every stage costs the same per tuple;
* X's input rate is the source's offered rate for A and A's processed rate
  ``min(λ, E_A)`` for B (every event goes through A then B, a stream ratio
  of 1), and its utilisation is ``ρ_X = λ / E_X``.

A saturated job never catches up: every batch of the window ends with at
least one batch's rows still waiting in the topic. With a steady backlog
what arrives equals what it processes, so no stage is congested, whichever
holds the batch. Yet the waiting tuples arrived faster than the job executes
them, which is Stela's congestion (003 §4.1: input speed above execution
speed). So in a saturated window the source is offered every tuple it could
have read during the batch, those it read plus those still waiting,
``λ = (rows + lag) / wall``, and the chain passes on ``min(λ, E_A)`` as
above: as in a topology whose spout drains a backlog as fast as it can, a
stage's input is bounded by its upstream's execute rate, and the stage that
holds most of the batch is congested once its upstream executes α times
faster than it does. This departs from the paper, whose input speed counts
only the parents' emits during the window, never a queue built before it: a
micro-batch job reads at most what it can process, so its queue is all that
shows its input outpacing it. A job held back by a read limit per trigger,
rather than by its stages, is judged saturated too; scaling it out does not
lift the limit.

An operator is congested when its input rate exceeds α times its execute
rate: it alone would need more than the whole time. A job that merely keeps
up, with no time to spare and no backlog, has ``Σ ρ = 1`` and nothing
congested; a job that idles between triggers has ``Σ ρ < 1``, which is what
auto mode scales in on. The rates are averaged over a window of batches by
:class:`~keyplane.algorithms.elasticity.CongestionDetector`
(003 §4.1, Algorithm 1) and fed to ETP (003 §4.2) and Stela's scale-out
(003 §5.2) and scale-in (003 §5.3).

What is scaled. Spark fixes the number of state partitions of a checkpoint,
so an operator's instances are its partitions and scaling changes which of
them are *active* (hold keys), never how many exist
(:class:`keyplane.routing.config.OperatorRouting`). A scale-out activates instances,
a scale-in deactivates the least loaded ones (least state to move, Stela's
own tie-break), always between 1 and the number of state partitions.

Everything here is pure: no Spark, Kafka or Airflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.elasticity import (
    DEFAULT_CONGESTION_SETTINGS,
    CongestionDetector,
    CongestionSettings,
    Operator,
    OperatorDag,
    Stream,
    congested_operators,
    etp_all,
    stela_scale_out,
)
from keyplane.routing.config import OperatorRouting
from keyplane.routing.handoff import routed_key_table
from keyplane.routing.routedkeys import fold_instance, spark_partition

ScaleMode = Literal["auto", "out", "in"]
ScaleAction = Literal["out", "in", "none"]


@dataclass(frozen=True)
class ScaleRequest:
    """What a run of the scale DAG asks for (its Params).

    ``mode`` ``auto`` lets the metrics decide; ``out``/``in`` scale on demand.
    ``operator`` names the operator to scale (None: Stela chooses, by ETP).
    ``instances`` is the target number of active instances (None: ``step``
    more or fewer). Auto mode scales in when nothing is congested and the
    job's utilisation ``Σ ρ`` stays below ``scale_in_utilisation``.
    """

    mode: ScaleMode = "auto"
    operator: str | None = None
    instances: int | None = None
    step: int = 1
    congestion: CongestionSettings = DEFAULT_CONGESTION_SETTINGS
    scale_in_utilisation: float = 0.5
    trigger_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.trigger_interval_s) and self.trigger_interval_s >= 0.0):
            raise ValueError(f"trigger_interval_s must be >= 0, got {self.trigger_interval_s}")
        if self.instances is not None and self.instances < 1:
            raise ValueError(f"instances must be at least 1, got {self.instances}")
        if self.step < 1:
            raise ValueError(f"step must be at least 1, got {self.step}")
        if self.mode == "auto" and self.instances is not None:
            raise ValueError("auto mode chooses the instance count; give instances with out/in")
        if not (
            math.isfinite(self.scale_in_utilisation) and 0.0 <= self.scale_in_utilisation < 1.0
        ):
            raise ValueError(
                f"scale_in_utilisation must lie in [0, 1), got {self.scale_in_utilisation}"
            )


@dataclass(frozen=True)
class WindowMeasurement:
    """The operator DAG measured over a window of batches.

    ``dag`` carries the window-averaged rates (tuples/s) and the active
    instance counts; ``utilisation`` is each operator's mean ρ; ``loads`` the
    tuples each instance processed in the window; ``batches`` how many
    batches were used (a window is judged only when full, 003 §4.1);
    ``timed_batches`` how many of them shared the batch's time by measured
    busy time rather than by tuples (:func:`stage_shares`); ``saturated``
    whether every one of them ended with at least its rows still waiting,
    ``backlog`` the smallest such lag (tuples), 0 when not saturated.
    """

    dag: OperatorDag
    congested: frozenset[str]
    utilisation: Mapping[str, float]
    loads: Mapping[str, Mapping[int, int]]
    batches: int
    full: bool
    timed_batches: int = 0
    saturated: bool = False
    backlog: int = 0


@dataclass(frozen=True)
class ScaleDecision:
    """What to scale, with the figures that decided it.

    ``active_before``/``active_after`` list each operator's active instances;
    ``etp`` is every operator's ETP on the measured rates (003 §4.2).
    """

    action: ScaleAction
    operator: str | None
    active_before: Mapping[str, tuple[int, ...]]
    active_after: Mapping[str, tuple[int, ...]]
    etp: Mapping[str, float]
    congested: tuple[str, ...]
    utilisation: Mapping[str, float]
    reason: str
    batches: int = 0
    rates: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    timed_batches: int = 0
    saturated: bool = False

    @property
    def instances_before(self) -> dict[str, int]:
        return {name: len(active) for name, active in self.active_before.items()}

    @property
    def instances_after(self) -> dict[str, int]:
        return {name: len(active) for name, active in self.active_after.items()}

    def to_record(self) -> dict[str, Any]:
        """A JSON-able record (the DAG's decision file and XCom)."""
        return {
            "action": self.action,
            "operator": self.operator,
            "active_before": {k: list(v) for k, v in self.active_before.items()},
            "active_after": {k: list(v) for k, v in self.active_after.items()},
            "instances_before": self.instances_before,
            "instances_after": self.instances_after,
            "etp": dict(self.etp),
            "congested": list(self.congested),
            "utilisation": dict(self.utilisation),
            "rates": {k: list(v) for k, v in self.rates.items()},
            "batches": self.batches,
            "timed_batches": self.timed_batches,
            "saturated": self.saturated,
            "reason": self.reason,
        }


def _stage_loads(record: BatchMetrics, operator: str) -> dict[int, int]:
    return {int(i): int(n) for i, n in record.load.get(operator, {}).items()}


def stage_shares(record: BatchMetrics, stages: Sequence[str]) -> tuple[dict[str, float], bool]:
    """Each stage's share ``u_X`` of ``record``'s duration, and whether it was measured.

    A stage finishes with its busiest instance, so its share is that
    instance's part of the critical path ``Σ_Y max_Y``. Measured busy time
    decides when every stage reported some for the batch (Stela's execute
    rates come from time, 003 §4.1); else the most loaded instance's tuples
    do, as if every stage cost the same per tuple. A batch with neither
    splits its time evenly.
    """
    timed = {name: max(record.busy_ms.get(name, {}).values(), default=0.0) for name in stages}
    measured = all(timed[name] > 0 for name in stages)
    critical: Mapping[str, float] = (
        timed
        if measured
        else {name: float(max(_stage_loads(record, name).values(), default=0)) for name in stages}
    )
    total = sum(critical.values())
    if total <= 0:
        return dict.fromkeys(stages, 1.0 / len(stages)), False
    return {name: critical[name] / total for name in stages}, measured


def is_saturated(records: Sequence[BatchMetrics]) -> bool:
    """Whether every batch of ``records`` ended with at least its own rows still waiting.

    Such a job never caught up during the window: each batch could have read
    another batch's worth. A batch that ends with fewer tuples waiting than
    it read has nearly caught up, so its window is not saturated.
    """
    return bool(records) and all(r.input_lag >= max(r.rows, 1) for r in records)


def measure_window(
    records: Sequence[BatchMetrics],
    active: Mapping[str, Sequence[int]],
    parallelism: int,
    settings: CongestionSettings = DEFAULT_CONGESTION_SETTINGS,
    trigger_interval_s: float = 0.0,
    reported_at_s: Sequence[float] | None = None,
) -> WindowMeasurement:
    """The measured chain of the newest ``settings.window`` batches (003 §4.1): one
    operator per key of ``active`` (each stage's active instances), in its order,
    upstream first, each feeding the next.

    ``records`` are oldest first. A batch counts when it routed tuples and
    ran for a measurable time; the batch before it gives the lag it started
    from, and the time it was reported, so the first record of ``records``
    only serves as that baseline. ``reported_at_s`` (one per record, seconds)
    is when each record reached the metrics topic, right after its batch
    ended: Stela's input rate is tuples per second of wall-clock time (003
    §4.1), and that time includes the triggers Spark skipped for want of data.
    In a saturated window (:func:`is_saturated`) the source is offered the
    tuples still waiting as well as those it read (see the module's notes).
    """
    if reported_at_s is not None and len(reported_at_s) != len(records):
        raise ValueError(
            f"reported_at_s needs one time per record: {len(reported_at_s)} for {len(records)}"
        )
    reported = list(reported_at_s) if reported_at_s is not None else [0.0] * len(records)
    detector = CongestionDetector(settings)
    usable: list[tuple[BatchMetrics, BatchMetrics, float]] = [
        (previous, record, since)
        for (previous, record), since in zip(
            pairwise(records), (b - a for a, b in pairwise(reported)), strict=True
        )
        if record.duration_ms > 0 and record.hops > 0
    ][-settings.window :]
    stages = tuple(active)
    utilisation_sum = dict.fromkeys(stages, 0.0)
    loads: dict[str, dict[int, int]] = {name: {} for name in stages}
    timed_batches = 0
    saturated = is_saturated([record for _, record, _ in usable])
    for previous, record, since_previous_s in usable:
        seconds = record.duration_ms / 1000.0
        wall = max(seconds, trigger_interval_s, since_previous_s)
        waiting_before = 0 if saturated else previous.input_lag
        offered = max(0, record.rows + record.input_lag - waiting_before) / wall
        stage = {name: _stage_loads(record, name) for name in stages}
        shares, timed = stage_shares(record, stages)
        timed_batches += timed
        upstream_processed = offered
        for name in stages:
            share = shares[name]
            tuples = sum(stage[name].values())
            execute = tuples / (share * seconds) if share > 0 else 0.0
            for instance, n in stage[name].items():
                loads[name][instance] = loads[name].get(instance, 0) + n
            detector.observe(name, upstream_processed, execute)
            utilisation_sum[name] += offered / execute if execute > 0 else 0.0
            upstream_processed = min(upstream_processed, execute)
    operators = []
    for name in stages:
        r_input, r_execute = detector.window_rates(name) if usable else (0.0, 0.0)
        operators.append(
            Operator(
                name=name,
                parallelism=len(active[name]),
                input_rate=r_input,
                execute_rate=r_execute,
                max_parallelism=parallelism,
            )
        )
    dag = OperatorDag(tuple(operators), tuple(Stream(*edge) for edge in pairwise(stages)))
    count = len(usable)
    return WindowMeasurement(
        dag=dag,
        congested=detector.congested(),
        utilisation={name: utilisation_sum[name] / count if count else 0.0 for name in stages},
        loads=loads,
        batches=count,
        full=count == settings.window,
        timed_batches=timed_batches,
        saturated=saturated,
        backlog=min(record.input_lag for _, record, _ in usable) if saturated else 0,
    )


def choose_active(
    current: Sequence[int], target: int, loads: Mapping[int, int], parallelism: int
) -> tuple[int, ...]:
    """The active instances after scaling ``current`` to ``target`` of them.

    Scale-in keeps the most loaded instances: the released ones hold the least
    state, so the hand-off moves least (003 §5.3 breaks ETPSum ties towards
    less to move; every instance of one operator has the same ETP). Scale-out
    activates the lowest-numbered idle instances.
    """
    if not 1 <= target <= parallelism:
        raise ValueError(f"target must lie in [1, {parallelism}] state partitions, got {target}")
    kept = sorted(set(current))
    if target < len(kept):
        ranked = sorted(kept, key=lambda i: (-loads.get(i, 0), i))
        return tuple(sorted(ranked[:target]))
    idle = [i for i in range(parallelism) if i not in kept]
    return tuple(sorted([*kept, *idle[: target - len(kept)]]))


def _none(
    active: Mapping[str, tuple[int, ...]],
    measured: WindowMeasurement,
    etp: Mapping[str, float],
    reason: str,
) -> ScaleDecision:
    return ScaleDecision(
        action="none",
        operator=None,
        active_before=dict(active),
        active_after=dict(active),
        etp=dict(etp),
        congested=tuple(sorted(measured.congested)),
        utilisation=dict(measured.utilisation),
        reason=reason,
        batches=measured.batches,
        rates=_rates(measured),
        timed_batches=measured.timed_batches,
        saturated=measured.saturated,
    )


def _saturation(measured: WindowMeasurement) -> str:
    """The reason's note on a saturated window; empty when it is not."""
    if not measured.saturated:
        return ""
    return (
        f"; saturated: input lag ≥ one batch's rows through the window "
        f"(at least {measured.backlog:,} waiting)"
    )


def _rates(measured: WindowMeasurement) -> dict[str, tuple[float, float]]:
    return {
        op.name: (round(op.input_rate, 3), round(op.execute_rate, 3))
        for op in measured.dag.operators
    }


def decide_scaling(
    records: Sequence[BatchMetrics],
    active: Mapping[str, Sequence[int]],
    parallelism: int,
    request: ScaleRequest,
    reported_at_s: Sequence[float] | None = None,
) -> ScaleDecision:
    """Stela's choice for one run: scale out, in, or leave the job as it is.

    * ``out``: the operator is the congested one with the highest projected
      ETP (:func:`keyplane.algorithms.elasticity.stela_scale_out`, 003 §5.2.2; a source
      when nothing is congested), unless ``request.operator`` names it; congestion
      is :func:`measure_window`'s, which offers a saturated job's backlog to its
      source;
    * ``in``: the operator with the smallest ETP (003 §5.3: its instances
      matter least to the sinks' throughput), ties to the lower utilisation,
      then to more active instances, unless ``request.operator`` names it;
    * ``auto``: ``out`` when the full window shows congestion, ``in`` when it
      shows none and the utilisation stays below ``scale_in_utilisation``,
      else nothing.

    Counts are bounded by [1, ``parallelism``]; a request that changes
    nothing returns ``none`` with the reason. ``reported_at_s`` is
    :func:`measure_window`'s.
    """
    if request.operator is not None and request.operator not in active:
        raise ValueError(
            f"operator {request.operator!r} is not a stage of the pipeline; its stages are "
            f"{', '.join(active)}"
        )
    before = {name: tuple(sorted(set(active[name]))) for name in active}
    measured = measure_window(
        records,
        before,
        parallelism,
        request.congestion,
        request.trigger_interval_s,
        reported_at_s,
    )
    threshold = request.congestion.threshold
    etp = etp_all(measured.dag, threshold)
    mode = request.mode
    if mode == "auto":
        if not measured.full:
            return _none(
                before,
                measured,
                etp,
                f"only {measured.batches} of {request.congestion.window} batches measured; "
                "a window is judged only when full (003 §4.1)",
            )
        utilisation = sum(measured.utilisation.values())
        if measured.congested:
            mode = "out"
        elif utilisation < request.scale_in_utilisation:
            mode = "in"
        else:
            return _none(
                before,
                measured,
                etp,
                f"no operator congested (α {threshold}) and utilisation {utilisation:.2f} ≥ "
                f"{request.scale_in_utilisation}{_saturation(measured)}",
            )
    operator = request.operator or _choose_operator(mode, measured, threshold, before, parallelism)
    if operator is None:
        return _none(before, measured, etp, f"no operator can scale {mode}")
    current = len(before[operator])
    wanted = request.instances
    if wanted is None:
        wanted = current + request.step if mode == "out" else current - request.step
    target = min(parallelism, max(1, wanted))
    if (mode == "out" and target <= current) or (mode == "in" and target >= current):
        return _none(
            before,
            measured,
            etp,
            f"{operator} has {current} active of {parallelism} state partitions; "
            f"scale-{mode} to {wanted} changes nothing",
        )
    after = dict(before)
    after[operator] = choose_active(
        before[operator], target, measured.loads.get(operator, {}), parallelism
    )
    why = (
        f"congested {sorted(measured.congested)}"
        if measured.congested
        else f"utilisation {sum(measured.utilisation.values()):.2f}"
    )
    timing = f"stage times measured in {measured.timed_batches} of {measured.batches} batches"
    origin = "requested" if request.mode != "auto" else "auto"
    return ScaleDecision(
        action=mode,
        operator=operator,
        active_before=before,
        active_after=after,
        etp=dict(etp),
        congested=tuple(sorted(measured.congested)),
        utilisation=dict(measured.utilisation),
        reason=(
            f"{origin} scale-{mode} of {operator}: {current} → {target} active instances "
            f"(ETP {etp[operator]:.2f}; {why}; {timing}{_saturation(measured)})"
        ),
        batches=measured.batches,
        rates=_rates(measured),
        timed_batches=measured.timed_batches,
        saturated=measured.saturated,
    )


def _choose_operator(
    mode: ScaleMode,
    measured: WindowMeasurement,
    threshold: float,
    active: Mapping[str, tuple[int, ...]],
    parallelism: int,
) -> str | None:
    dag = measured.dag
    if mode == "out":
        plan = stela_scale_out(dag, 1, threshold)
        return plan.choices[0].operator if plan.choices else None
    etp = etp_all(dag, threshold)
    congested = congested_operators(dag, threshold)
    candidates = [name for name in active if len(active[name]) > 1 and name not in congested]
    if not candidates:
        return None
    rank = {name: i for i, name in enumerate(active)}
    return min(
        candidates,
        key=lambda n: (etp[n], measured.utilisation[n], -len(active[n]), -rank[n]),
    )


def scaled_routing(
    routing: OperatorRouting, active: Sequence[int], key_loads: Mapping[str, float]
) -> OperatorRouting:
    """``routing`` over the ``active`` instances, moving as little state as it can.

    ``key_loads`` are the keys that hold state, with their weight. The
    routed job moves state only for keys its configurations name
    (:func:`keyplane.routing.handoff.state_moves`), so every key whose instance or
    grouping value would change is given a table entry:

    * a key on an instance that stays active stays there; it is tabled only
      when the new hash fallback (:func:`keyplane.routing.routedkeys.fold_instance`)
      would send it elsewhere;
    * a key on a released instance goes to the least loaded active instance,
      heaviest keys first (the greedy balance of 000 §3.1's α);
    * on scale-out, keys move from instances above the mean load to the newly
      active ones, heaviest first, while the move keeps the receiver at or
      below the mean;
    * a hot key keeps its active instances and replaces the released ones by
      their fold; it becomes a table key if fewer than two remain.
    """
    p = routing.parallelism
    new_active = tuple(sorted(set(active)))
    fold_instance(0, new_active, p)
    allowed = set(new_active)
    old_table = routed_key_table(routing)
    hot: dict[str, tuple[int, ...]] = {}
    table: dict[str, int] = {}
    load = dict.fromkeys(new_active, 0.0)
    for key, instances in routing.hot_keys.items():
        mapped: list[int] = []
        for i in instances:
            target = i if i in allowed else fold_instance(i, new_active, p)
            if target not in mapped:
                mapped.append(target)
        weight = key_loads.get(key, 0.0)
        if len(mapped) >= 2:
            hot[key] = tuple(mapped)
            for i in mapped:
                load[i] += weight / len(mapped)
        else:
            table[key] = mapped[0]
            load[mapped[0]] += weight
    displaced: list[tuple[float, str]] = []
    untabled: set[str] = set()
    for key, instance in routing.table.items():
        if instance in allowed:
            table[key] = instance
            load[instance] += key_loads.get(key, 0.0)
        else:
            displaced.append((key_loads.get(key, 0.0), key))
    for key, weight in key_loads.items():
        if key in routing.table or key in routing.hot_keys:
            continue
        current = old_table.fallback_instance(key)
        if current not in allowed:
            displaced.append((weight, key))
            continue
        load[current] += weight
        if fold_instance(spark_partition(key, p), new_active, p) != current:
            table[key] = current
        else:
            untabled.add(key)
    for weight, key in sorted(displaced, key=lambda item: (-item[0], item[1])):
        target = min(new_active, key=lambda i: (load[i], i))
        table[key] = target
        load[target] += weight
    fresh = [i for i in new_active if i not in set(routing.active)]
    if fresh:
        mean = sum(load.values()) / len(new_active)
        movable = sorted(
            ((key_loads.get(k, 0.0), k) for k in [*table, *untabled] if k not in hot),
            key=lambda item: (-item[0], item[1]),
        )
        for weight, key in movable:
            source = table.get(key, old_table.fallback_instance(key))
            if source in fresh or load[source] <= mean:
                continue
            target = min(fresh, key=lambda i: (load[i], i))
            if weight <= 0 or load[target] + weight > mean:
                continue
            table[key] = target
            load[source] -= weight
            load[target] += weight
    return OperatorRouting(
        parallelism=p,
        table=table,
        hot_keys=hot,
        active_instances=None if len(new_active) == p else new_active,
    )


def active_view(routing: OperatorRouting, key_loads: Mapping[str, float]) -> OperatorRouting:
    """``routing`` seen as an operator of its active instances only, for the quality suites.

    The active instances are renumbered ``0..k−1`` in order and every key of
    ``key_loads`` is tabled where the job routes it (hash fallback included,
    folded when scaled in), so a per-instance figure such as max/mean load
    compares the instances that hold keys, and a released instance, idle by
    design, is not counted as imbalance.
    """
    rank = {instance: j for j, instance in enumerate(routing.active)}
    table = routed_key_table(routing)
    tabled = {
        key: rank[routing.table[key] if key in routing.table else table.fallback_instance(key)]
        for key in key_loads
        if key not in routing.hot_keys
    }
    return OperatorRouting(
        parallelism=len(rank),
        table=tabled,
        hot_keys={k: tuple(rank[i] for i in inst) for k, inst in routing.hot_keys.items()},
    )
