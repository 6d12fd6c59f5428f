"""The simulated cluster: servers, operator instances, service and network costs.

Paper 000 §2.2 and §4.1 model a stateful application as operators whose
instances (POIs) sit on servers; a tuple passed between two instances on the
same server costs a pointer, while a tuple sent to another server crosses the
network, which becomes the bottleneck as tuples grow (000 §4.2, Figs. 7–9).
Paper 001 §6.1 simulates workers with a per-tuple processing time and, for
its heuristic worker assignment (001 §6.4, Fig. 16), workers of different
speeds. This config captures exactly those knobs, validated at construction so
a bad experiment fails before it runs.

Every stage of a simulated application has ``n_servers * instances_per_server``
instances; instance ``i`` lives on server ``i // instances_per_server`` (block
placement), so with one instance per server instance ``i`` is on server ``i``
as in 000 §4.1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

ServiceDistribution = Literal["constant", "exponential"]


@dataclass(frozen=True)
class ClusterConfig:
    """Servers, instances and the costs of processing and moving one tuple.

    Attributes:
        n_servers: number of servers (executors) hosting instances.
        instances_per_server: instances of each stage on every server.
        service_time: seconds one instance needs per tuple; one value for all
            instances, or one value per instance (heterogeneous workers,
            001 §6.4).
        service_distribution: ``"constant"`` uses ``service_time`` as is;
            ``"exponential"`` draws each tuple's time with that mean (seeded).
        network_delay: seconds a remote hop adds (propagation, 000 §2.2).
        link_bandwidth: bytes per second of each server's outgoing link;
            remote tuples queue on it in FIFO order. ``None`` is unlimited.
        tuple_bytes: size of a tuple on the wire when the trace gives none.
        source_rate: tuples per second emitted by the source; ``None`` emits
            the whole stream at time 0 (a saturation run measuring makespan).
    """

    n_servers: int
    instances_per_server: int = 1
    service_time: float | tuple[float, ...] = 1e-5
    service_distribution: ServiceDistribution = "constant"
    network_delay: float = 0.0
    link_bandwidth: float | None = None
    tuple_bytes: int = 0
    source_rate: float | None = None

    def __post_init__(self) -> None:
        if self.n_servers < 1:
            raise ValueError(f"n_servers must be >= 1, got {self.n_servers}")
        if self.instances_per_server < 1:
            raise ValueError(f"instances_per_server must be >= 1, got {self.instances_per_server}")
        if isinstance(self.service_time, tuple):
            if len(self.service_time) != self.n_instances:
                raise ValueError(
                    f"service_time has {len(self.service_time)} values but the cluster "
                    f"has {self.n_instances} instances per stage"
                )
            times = self.service_time
        else:
            times = (self.service_time,)
        for value in times:
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"service times must be finite and > 0, got {value}")
        if self.service_distribution not in ("constant", "exponential"):
            raise ValueError(
                "service_distribution must be 'constant' or 'exponential', "
                f"got {self.service_distribution!r}"
            )
        if not (math.isfinite(self.network_delay) and self.network_delay >= 0):
            raise ValueError(f"network_delay must be finite and >= 0, got {self.network_delay}")
        if self.link_bandwidth is not None and not (
            math.isfinite(self.link_bandwidth) and self.link_bandwidth > 0
        ):
            raise ValueError(f"link_bandwidth must be > 0 or None, got {self.link_bandwidth}")
        if self.tuple_bytes < 0:
            raise ValueError(f"tuple_bytes must be >= 0, got {self.tuple_bytes}")
        if self.source_rate is not None and not (
            math.isfinite(self.source_rate) and self.source_rate > 0
        ):
            raise ValueError(f"source_rate must be > 0 or None, got {self.source_rate}")

    @property
    def n_instances(self) -> int:
        """Instances per stage, i.e. the ``n_workers`` every router must use."""
        return self.n_servers * self.instances_per_server

    def server_of_instance(self) -> npt.NDArray[np.int64]:
        """Server index of each instance (block placement)."""
        return np.arange(self.n_instances, dtype=np.int64) // self.instances_per_server

    def mean_service_times(self) -> npt.NDArray[np.float64]:
        """Mean seconds per tuple of each instance."""
        if isinstance(self.service_time, tuple):
            return np.asarray(self.service_time, dtype=np.float64)
        return np.full(self.n_instances, self.service_time, dtype=np.float64)

    def stage_capacity(self) -> float:
        """Tuples per second one stage can process when perfectly balanced."""
        return float(np.sum(1.0 / self.mean_service_times()))
