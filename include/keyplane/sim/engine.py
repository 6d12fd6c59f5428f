"""The simulation engine: a keyed, multi-stage streaming application on a cluster.

The application is a chain of stateful stages, as in 000 §4.1 (a source and
two stateful operators grouping by field 1, then field 2) and 001 §6.1 (a
source and one stage of workers). Each stage routes every tuple with its own
:class:`~keyplane.algorithms.partitioner.Partitioner`, chunk by chunk in the order the
routing decisions are taken, so stateful and time-aware policies (FISH's
inferred waiting time, 001 §4.2) see a faithful stream:

* the first stage routes at source emission time;
* a later stage routes when the upstream instance finishes the tuple, i.e.
  in upstream departure order, with the departure time as ``times``.

A hop between instances on the same server is free (a pointer, 000 §2.2); a
remote hop queues on the sending server's outgoing link (FIFO, one tuple's
bytes over the link bandwidth) and then takes the network delay. The source
is not placed on a server, so its hop to the first stage is free for every
policy and only stage-to-stage locality is measured, as in 000 §3.1.

Routing never depends on simulated queue state (policies only see keys and
times), so each stage can be simulated for the whole stream at once with the
vectorised FIFO recurrence of ``keyplane.sim.queueing``: the result is exactly
that of a per-event simulation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.partitioner import Partitioner
from keyplane.sim.cluster import ClusterConfig
from keyplane.sim.queueing import fifo_completion_times
from keyplane.sim.result import SimulationResult, StageRecord
from keyplane.sim.trace import Trace

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class Stage:
    """One stateful operator: which field it groups by and how it routes.

    Attributes:
        router: the routing policy, used for this run only (it is stateful).
        key_field: index of the trace field that keys this stage.
        name: label in reports; defaults to the router's ``name``.
    """

    router: Partitioner
    key_field: int = 0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.key_field < 0:
            raise ValueError(f"key_field must be >= 0, got {self.key_field}")
        if not isinstance(self.router, Partitioner):
            raise TypeError(
                f"router must implement the Partitioner protocol, got {type(self.router)!r}"
            )

    @property
    def label(self) -> str:
        return self.name if self.name is not None else str(self.router.name)


def source_times(trace: Trace, cluster: ClusterConfig) -> FloatArray:
    """Emission time of every tuple: the trace's own, or ``i / source_rate``."""
    if trace.times is not None:
        return trace.times
    if cluster.source_rate is None:
        return np.zeros(len(trace), dtype=np.float64)
    return np.arange(len(trace), dtype=np.float64) / cluster.source_rate


def route_in_order(
    router: Partitioner,
    keys: IntArray,
    times: FloatArray,
    order: IntArray | None,
    chunk_size: int,
) -> IntArray:
    """Feed ``router`` the tuples chunk by chunk in ``order`` (None: as given).

    Returns the chosen instance of every tuple, aligned with ``keys``.
    """
    n = keys.shape[0]
    instances = np.empty(n, dtype=np.int64)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        if order is None:
            chunk_keys, chunk_times = keys[start:stop], times[start:stop]
        else:
            idx = order[start:stop]
            chunk_keys, chunk_times = keys[idx], times[idx]
        chosen = np.asarray(router.route(chunk_keys, chunk_times), dtype=np.int64)
        if chosen.shape != (stop - start,):
            raise ValueError(
                f"router {router.name!r} returned shape {chosen.shape} for a chunk "
                f"of {stop - start} tuples"
            )
        if order is None:
            instances[start:stop] = chosen
        else:
            instances[order[start:stop]] = chosen
    if n and (int(instances.min()) < 0 or int(instances.max()) >= router.n_workers):
        raise ValueError(
            f"router {router.name!r} returned an instance outside [0, {router.n_workers})"
        )
    return instances


def simulate(
    trace: Trace,
    stages: Sequence[Stage],
    cluster: ClusterConfig,
    *,
    chunk_size: int = 65_536,
    seed: int = 0,
) -> SimulationResult:
    """Run ``trace`` through ``stages`` on ``cluster`` and record every tuple.

    ``seed`` drives the only randomness the engine adds (exponential service
    times); routers carry their own seeds. Metrics are computed from the
    result by :func:`keyplane.sim.metrics.summarize`.
    """
    if not stages:
        raise ValueError("a simulation needs at least one stage")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    for stage in stages:
        if stage.key_field >= trace.n_fields:
            raise ValueError(
                f"stage {stage.label!r} groups by field {stage.key_field} but the "
                f"trace has {trace.n_fields} fields"
            )
        if stage.router.n_workers != cluster.n_instances:
            raise ValueError(
                f"stage {stage.label!r} routes over {stage.router.n_workers} workers but "
                f"the cluster has {cluster.n_instances} instances per stage"
            )

    rng = np.random.default_rng(seed)
    n = len(trace)
    servers = cluster.server_of_instance()
    mean_service = cluster.mean_service_times()
    sizes = (
        trace.sizes
        if trace.sizes is not None
        else np.full(n, float(cluster.tuple_bytes), dtype=np.float64)
    )
    emitted = source_times(trace, cluster)

    records: list[StageRecord] = []
    for position, stage in enumerate(stages):
        keys = trace.fields[stage.key_field]
        if position == 0:
            routed_at = emitted
            order: IntArray | None = None
        else:
            routed_at = records[-1].completions
            order = np.argsort(routed_at, kind="stable")
        routing_started = time.perf_counter()
        instances = route_in_order(stage.router, keys, routed_at, order, chunk_size)
        route_seconds = time.perf_counter() - routing_started

        if position == 0:
            arrivals = routed_at
        else:
            arrivals = hop_arrivals(
                routed_at, servers[records[-1].instances], servers[instances], sizes, cluster
            )

        services = mean_service[instances]
        if cluster.service_distribution == "exponential":
            services = services * rng.exponential(1.0, n)
        completions = fifo_completion_times(arrivals, services, instances, cluster.n_instances)
        records.append(
            StageRecord(
                name=stage.label,
                keys=keys,
                instances=instances,
                routed_at=routed_at,
                arrivals=arrivals,
                completions=completions,
                services=services,
                route_seconds=route_seconds,
            )
        )
    return SimulationResult(stages=tuple(records), source_times=emitted, server_of_instance=servers)


def hop_arrivals(
    departures: FloatArray,
    from_servers: IntArray,
    to_servers: IntArray,
    sizes: FloatArray,
    cluster: ClusterConfig,
) -> FloatArray:
    """When each tuple reaches the next stage after leaving the previous one.

    Same-server hops arrive at once. Remote hops first wait their turn on the
    sending server's outgoing link (when its bandwidth is limited), then take
    the network delay: the cost 000 §3.2 counts for every non-local pair.
    """
    arrivals = departures.copy()
    remote = from_servers != to_servers
    if not bool(remote.any()):
        return arrivals
    sent = departures[remote]
    if cluster.link_bandwidth is not None:
        sent = fifo_completion_times(
            sent, sizes[remote] / cluster.link_bandwidth, from_servers[remote], cluster.n_servers
        )
    arrivals[remote] = sent + cluster.network_delay
    return arrivals
