"""The measures the papers report, computed from a simulation result.

* Locality (000 §3.1, §4.3): the share of stage-to-stage hops whose two
  instances sit on the same server; hash routing gives about ``1/n_servers``.
* Imbalance (000 §3.1, §4.3 Fig. 11b): the most loaded instance's tuple count
  over the average count of the stage's instances.
* Makespan, i.e. execution time (001 §6.1: "the processing time of loads"),
  and throughput (000 §4.2): time from the first emission to the last
  completion, and tuples per second over it.
* Latency (001 §2.3, §6.6): source emission to last-stage completion.
* Memory (001 §6.1, "memory overhead"): key replicas, the number of distinct
  (key, instance) pairs that hold state; fields grouping needs one per key,
  shuffle grouping up to one per instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import numpy.typing as npt
import pandas as pd

from keyplane.sim.result import SimulationResult, StageRecord

KeyArray = npt.NDArray[np.int64]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def locality(upstream: IntArray, downstream: IntArray, server_of_instance: IntArray) -> float:
    """Share of hops between instances on the same server (NaN if no hops)."""
    if upstream.shape[0] == 0:
        return float("nan")
    same = server_of_instance[upstream] == server_of_instance[downstream]
    return float(np.mean(same))


def instance_loads(
    instances: IntArray, n_instances: int, weights: FloatArray | None = None
) -> FloatArray:
    """Tuples (or summed ``weights``, e.g. busy seconds) of every instance."""
    return np.bincount(instances, weights=weights, minlength=n_instances).astype(np.float64)


def imbalance(loads: FloatArray) -> float:
    """Max load over mean load (1.0 is perfect; NaN when there is no load)."""
    mean = float(np.mean(loads)) if loads.shape[0] else 0.0
    if mean <= 0:
        return float("nan")
    return float(np.max(loads)) / mean


def key_replicas(keys: KeyArray, instances: IntArray, n_instances: int) -> int:
    """Distinct (key, instance) pairs: how many copies of key state exist."""
    if keys.shape[0] == 0:
        return 0
    low, high = int(keys.min()), int(keys.max())
    if low >= 0 and high < (np.iinfo(np.int64).max - n_instances) // n_instances:
        return int(pd.unique(keys * np.int64(n_instances) + instances).shape[0])
    pairs = np.stack([keys, instances], axis=1)
    return int(np.unique(pairs, axis=0).shape[0])


def distinct_keys(keys: KeyArray) -> int:
    return int(pd.unique(keys).shape[0])


@dataclass(frozen=True)
class StageMetrics:
    """Balance and memory of one stage.

    Attributes:
        name: the stage's label.
        imbalance: max/avg tuples per instance.
        work_imbalance: max/avg busy seconds per instance (differs from
            ``imbalance`` on heterogeneous or randomised service times).
        replicas: distinct (key, instance) pairs.
        keys: distinct keys.
    """

    name: str
    imbalance: float
    work_imbalance: float
    replicas: int
    keys: int

    @property
    def replication(self) -> float:
        """Replicas per distinct key (1.0 under fields grouping)."""
        return self.replicas / self.keys if self.keys else float("nan")


@dataclass(frozen=True)
class SimulationMetrics:
    """Everything the reproductions report about one run.

    Attributes:
        n_tuples: tuples in the trace.
        stages: per-stage balance and memory, in DAG order.
        hop_locality: locality of each stage-to-stage hop (``len(stages) - 1``).
        makespan: seconds from the first emission to the last completion.
        throughput: tuples per second over the makespan.
        latency_mean, latency_p50, latency_p99: end-to-end latency (seconds).
    """

    n_tuples: int
    stages: tuple[StageMetrics, ...]
    hop_locality: tuple[float, ...]
    makespan: float
    throughput: float
    latency_mean: float
    latency_p50: float
    latency_p99: float

    @property
    def locality(self) -> float:
        """Locality of the first hop (the only one in a two-stage chain)."""
        return self.hop_locality[0] if self.hop_locality else float("nan")

    @property
    def replicas(self) -> int:
        """Key replicas summed over stages."""
        return sum(stage.replicas for stage in self.stages)


def stage_metrics(record: StageRecord, n_instances: int) -> StageMetrics:
    return StageMetrics(
        name=record.name,
        imbalance=imbalance(instance_loads(record.instances, n_instances)),
        work_imbalance=imbalance(
            instance_loads(record.instances, n_instances, weights=record.services)
        ),
        replicas=key_replicas(record.keys, record.instances, n_instances),
        keys=distinct_keys(record.keys),
    )


def summarize(result: SimulationResult) -> SimulationMetrics:
    """Compute every reported measure of a run."""
    n = result.n_tuples
    stages = tuple(stage_metrics(record, result.n_instances) for record in result.stages)
    hops = tuple(
        locality(up.instances, down.instances, result.server_of_instance)
        for up, down in pairwise(result.stages)
    )
    if n == 0:
        nan = float("nan")
        return SimulationMetrics(0, stages, hops, 0.0, nan, nan, nan, nan)
    done = result.stages[-1].completions
    latencies = done - result.source_times
    makespan = float(done.max() - result.source_times.min())
    p50, p99 = np.percentile(latencies, [50.0, 99.0])
    return SimulationMetrics(
        n_tuples=n,
        stages=stages,
        hop_locality=hops,
        makespan=makespan,
        throughput=n / makespan if makespan > 0 else float("inf"),
        latency_mean=float(latencies.mean()),
        latency_p50=float(p50),
        latency_p99=float(p99),
    )
