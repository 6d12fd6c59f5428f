"""A fast model of a keyed, multi-stage streaming cluster.

The simulator replays a stream (generated or recorded) through a chain of
stateful stages, each routed by any :class:`keyplane.algorithms.partitioner.Partitioner`,
on servers with per-instance FIFO queues and a cost per remote hop. It reports
what papers 000 (§4) and 001 (§6) measure: locality, imbalance, makespan,
throughput, latency and key replicas.
"""

from keyplane.sim.cluster import ClusterConfig
from keyplane.sim.engine import Stage, simulate
from keyplane.sim.metrics import SimulationMetrics, StageMetrics, summarize
from keyplane.sim.queueing import fifo_completion_times
from keyplane.sim.result import SimulationResult, StageRecord
from keyplane.sim.trace import Trace

__all__ = [
    "ClusterConfig",
    "SimulationMetrics",
    "SimulationResult",
    "Stage",
    "StageMetrics",
    "StageRecord",
    "Trace",
    "fifo_completion_times",
    "simulate",
    "summarize",
]
