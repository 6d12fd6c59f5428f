"""What one micro-batch of the routed job tells the control plane (the metrics topic).

The routed job reports, per batch, the tuples that went from each stage-A
instance to each stage-B instance and the executors both ran on (``hop`` rows
of :mod:`keyplane.spark.routed_counts`). From that traffic matrix follow the
numbers the papers steer by:

* the load of every instance (tuples processed), hence the imbalance
  max/mean that paper 000 bounds by α (§3.2);
* the time every instance was busy, from the ``busy_ns`` the Python stages
  put on their ``count`` rows: Stela's execute rate is measured from time,
  not inferred from tuples (003 §4.1);
* locality: the share of tuples between consecutive stages that stayed on one executor (000 §2, the
  quantity its routing tables maximise; 004 §4 calls the same matrix the
  task-to-task traffic);
* the heaviest key pairs per instance, a bounded sample of what the next
  statistics run will partition;
* what the batch refused: malformed events (dead-lettered) and control
  messages the driver would not act on, by reason, so a forged or stale
  message is visible on a dashboard and not only in the driver's log.

Pure pandas: each task of the sink computes its share of the batch on the
executor that ran it (:func:`traffic_metrics`), the driver adds the shares up
(:func:`combined_metrics`), and tests feed both by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import pandas as pd
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

TOP_PAIRS_PER_INSTANCE = 5


class PairCount(BaseModel):
    model_config = ConfigDict(frozen=True)

    a: str
    b: str
    n: int


class BatchMetrics(BaseModel):
    """One metrics-topic record: a micro-batch as the control plane sees it."""

    model_config = ConfigDict(frozen=True)

    batch_id: int
    started_at: AwareDatetime | None = Field(
        default=None,
        description="when the batch started (Spark's progress timestamp); None in records "
        "written before this field",
    )
    plan: int | None = None
    versions: dict[str, int] = Field(default_factory=dict)
    rows: int = 0
    rows_per_s: float = 0.0
    duration_ms: int = 0
    phases_ms: dict[str, int] = Field(
        default_factory=dict,
        description="Spark's phase → its milliseconds in this batch (latestOffset, "
        "queryPlanning, addBatch, walCommit, commitOffsets, ...): where duration_ms went",
    )
    input_lag: int = 0
    load: dict[str, dict[int, int]] = Field(
        default_factory=dict, description="operator → instance → tuples processed"
    )
    executors: dict[str, dict[int, str]] = Field(
        default_factory=dict, description="operator → instance → executor it ran on"
    )
    busy_ms: dict[str, dict[int, float]] = Field(
        default_factory=dict,
        description="operator → instance → milliseconds its task spent on the batch's key "
        "groups (their state and the aggregate's work); only operators whose stages measure "
        "it (not the JVM stages, nor records written before this field)",
    )
    hops: int = 0
    local_hops: int = 0
    top_pairs: dict[int, list[PairCount]] = Field(
        default_factory=dict, description="stage-B instance → heaviest (a, b) pairs"
    )
    moved_states: int = 0
    invalid_events: int = 0
    rejected_control: dict[str, int] = Field(
        default_factory=dict,
        description="reason → control messages refused at this batch's boundary: "
        "not authentic (keyplane.control.messages.RejectReason) or not applicable "
        "(keyplane.control.messages.IgnoreReason)",
    )

    @property
    def locality(self) -> float | None:
        """Share of A→B tuples whose two instances ran on the same executor."""
        return self.local_hops / self.hops if self.hops else None

    def imbalance(self, operator: str) -> float | None:
        """max / mean instance load of ``operator`` in this batch (000 §3.2)."""
        loads = list(self.load.get(operator, {}).values())
        if not loads or sum(loads) == 0:
            return None
        return max(loads) / (sum(loads) / len(loads))


def traffic_metrics(
    batch_id: int, output: pd.DataFrame, parallelism: Mapping[str, int]
) -> BatchMetrics:
    """Loads, executors, locality and top pairs of one batch's routed output.

    ``parallelism`` holds each stage's instances, in chain order. A ``hop``
    row counts tuples that reached an instance of the stage its ``stage``
    column names from an instance of the stage before it in the chain; a
    hop with no stage goes into the chain's first pair. A stage's load is
    the tuples its hops bring it; the first stage's, the tuples its hops take
    out. Every instance of a stage appears in ``load`` (0 when idle), so the imbalance counts idle
    instances as the paper does.

    ``busy_ms`` sums the ``busy_ns`` of each stage's ``count`` rows per
    instance (:func:`instance_busy_ms`).
    """
    chain = list(parallelism)
    hops = output[output["kind"] == "hop"]
    downstream = (
        hops["stage"].fillna(chain[min(1, len(chain) - 1)]).tolist()
        if "stage" in hops.columns
        else [chain[min(1, len(chain) - 1)]] * len(hops)
    )
    load: dict[str, dict[int, int]] = {
        op: dict.fromkeys(range(n), 0) for op, n in parallelism.items()
    }
    executors: dict[str, dict[int, str]] = {op: {} for op in parallelism}
    local = total = 0
    for stage, up, up_ex, inst, ex, n in zip(
        downstream,
        hops["upstream"].tolist(),
        hops["upstream_executor"].tolist(),
        hops["instance"].tolist(),
        hops["executor"].tolist(),
        hops["n"].tolist(),
        strict=True,
    ):
        n = int(n)
        upstream = chain[chain.index(stage) - 1]
        if upstream == chain[0]:
            # Every tuple reaches every stage: a later stage's load is what its hops bring it.
            load[upstream][int(up)] = load[upstream].get(int(up), 0) + n
        load[stage][int(inst)] = load[stage].get(int(inst), 0) + n
        executors[upstream][int(up)] = str(up_ex)
        executors[stage][int(inst)] = str(ex)
        total += n
        local += n if up_ex == ex else 0
    pairs = output[output["kind"] == "pair"]
    top: dict[int, list[PairCount]] = {}
    for instance, group in pairs.groupby(pairs["instance"].astype("int64")):
        heaviest = group.nlargest(TOP_PAIRS_PER_INSTANCE, "n")
        top[cast(int, instance)] = [
            PairCount(a=str(a), b=str(b), n=int(n))
            for a, b, n in zip(
                heaviest["detail"].tolist(),
                heaviest["key"].tolist(),
                heaviest["n"].tolist(),
                strict=True,
            )
        ]
    return BatchMetrics(
        batch_id=batch_id,
        load=load,
        executors=executors,
        busy_ms=instance_busy_ms(output, parallelism),
        hops=total,
        local_hops=local,
        top_pairs=top,
        moved_states=moved_states(output),
        invalid_events=int((output["kind"] == "invalid").sum()),
    )


def combined_metrics(
    batch_id: int, parts: Sequence[BatchMetrics], parallelism: Mapping[str, int]
) -> BatchMetrics:
    """One batch's metrics from the :func:`traffic_metrics` of each part of its output.

    The parts split the batch's rows between them (one per task of the
    sink), so loads, busy times, hops and counts add up; an instance keeps
    the heaviest pairs of all parts together. The result is what
    :func:`traffic_metrics` gives on the whole output, so the driver never
    needs the rows themselves.
    """
    load: dict[str, dict[int, int]] = {
        op: dict.fromkeys(range(n), 0) for op, n in parallelism.items()
    }
    executors: dict[str, dict[int, str]] = {op: {} for op in parallelism}
    busy: dict[str, dict[int, float]] = {}
    pairs: dict[int, list[PairCount]] = {}
    for part in parts:
        for op, loads in part.load.items():
            for instance, n in loads.items():
                load.setdefault(op, {})[instance] = load.get(op, {}).get(instance, 0) + n
        for op, placed in part.executors.items():
            executors.setdefault(op, {}).update(placed)
        for op, times in part.busy_ms.items():
            instances = busy.setdefault(op, dict.fromkeys(range(parallelism.get(op, 0)), 0.0))
            for instance, ms in times.items():
                instances[instance] = instances.get(instance, 0.0) + ms
        for instance, heaviest in part.top_pairs.items():
            pairs.setdefault(instance, []).extend(heaviest)
    return BatchMetrics(
        batch_id=batch_id,
        load=load,
        executors=executors,
        busy_ms=busy,
        hops=sum(part.hops for part in parts),
        local_hops=sum(part.local_hops for part in parts),
        top_pairs={
            instance: sorted(heaviest, key=lambda pair: -pair.n)[:TOP_PAIRS_PER_INSTANCE]
            for instance, heaviest in sorted(pairs.items())
        },
        moved_states=sum(part.moved_states for part in parts),
        invalid_events=sum(part.invalid_events for part in parts),
    )


def moved_states(output: pd.DataFrame) -> int:
    """The states a batch moved out: a ``moved`` row holds one, a ``moves`` row (the
    JVM stages' packed migration record) ``count`` of them."""
    packed = output[output["kind"] == "moves"]
    one_each = int((output["kind"] == "moved").sum())
    return one_each + (int(packed["count"].sum()) if len(packed) else 0)


def instance_busy_ms(
    output: pd.DataFrame, parallelism: Mapping[str, int]
) -> dict[str, dict[int, float]]:
    """Stage → instance → milliseconds of work, from the ``busy_ns`` of ``count`` rows.

    Each Python stage times its work on a key group and reports it on the
    group's ``count`` row; a task handles its instance's groups one after
    the other, so their sum is the instance's busy time in the batch, what
    Stela's execute rate divides by (003 §4.1). A stage is present only if
    some row of it carries a time (the JVM stages carry none); then every
    one of its instances is, 0 when idle, as in ``load``.
    """
    if "busy_ns" not in output.columns or "stage" not in output.columns:
        return {}
    counts = output[(output["kind"] == "count") & output["busy_ns"].notna()]
    counts = counts[counts["instance"].notna() & counts["stage"].isin(list(parallelism))]
    if counts.empty:
        return {}
    busy: dict[str, dict[int, float]] = {}
    for stage, instance, ns in zip(
        counts["stage"].astype(str).tolist(),
        counts["instance"].astype("int64").tolist(),
        counts["busy_ns"].astype("int64").tolist(),
        strict=True,
    ):
        instances = busy.setdefault(stage, dict.fromkeys(range(parallelism[stage]), 0.0))
        instances[instance] = instances.get(instance, 0.0) + ns / 1e6
    return busy
