"""The raw outcome of one simulation: per-stage, per-tuple arrays.

The engine keeps every tuple's instance, arrival and completion time per stage
so that any metric (locality, imbalance, latency, replicas; see
``keyplane.sim.metrics``) can be computed afterwards, and so tests can check
exact completion times on hand-computed cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

KeyArray = npt.NDArray[np.int64]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class StageRecord:
    """What happened to every tuple at one stage (arrays in tuple order).

    Attributes:
        name: the stage's name (usually its router's name).
        keys: the key each tuple was grouped by at this stage.
        instances: the instance each tuple was routed to.
        routed_at: when the routing decision was taken (source emission for
            the first stage, upstream completion for the others).
        arrivals: when the tuple entered the instance's queue.
        completions: when the instance finished processing it.
        services: the processing time it took.
        route_seconds: wall-clock seconds the router spent on this stage
            (the part of a run the simulator does not control; see
            ``bench/sim_speed.py``).
    """

    name: str
    keys: KeyArray
    instances: IntArray
    routed_at: FloatArray
    arrivals: FloatArray
    completions: FloatArray
    services: FloatArray
    route_seconds: float = 0.0


@dataclass(frozen=True, eq=False)
class SimulationResult:
    """Every stage's record plus the cluster layout needed to interpret it.

    Attributes:
        stages: one record per stage, in DAG order.
        source_times: when the source emitted each tuple.
        server_of_instance: server index of each instance.
    """

    stages: tuple[StageRecord, ...]
    source_times: FloatArray
    server_of_instance: IntArray

    @property
    def n_tuples(self) -> int:
        return int(self.source_times.shape[0])

    @property
    def n_instances(self) -> int:
        return int(self.server_of_instance.shape[0])
