"""The metrics topic as the dashboard reads it: with a deadline, then per version.

The routed job writes one :class:`~keyplane.algorithms.batchmetrics.BatchMetrics` record
per micro-batch. The dashboard reads the newest ones, asking first whether
Kafka answers at all (a web request must not hang on a stopped broker: a
Kafka client waits 30 s for a dead bootstrap by default) and giving up on a
read that stalls; it returns *why* it has none instead of raising, so the
page says "metrics unavailable" and still shows everything read from disk.

Per-version figures use the same definitions as the DAG's ``verify`` step
(:func:`keyplane.orchestration.planning.measure`): locality is the share of
tuples between consecutive stages that stayed on one executor (000 §2), imbalance the worst
operator's max/mean instance load (000 §3.1) over the instances the batch's
version keeps active (a scaled-in operator's released instances hold no keys,
and counting their zero loads would read a balanced job as skewed), lag the
input lag in records.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from keyplane.algorithms.batchmetrics import BatchMetrics

READ_TIMEOUT_S = 3.0
"""Longest a page load waits for Kafka: long enough for a local broker to
answer a few fetches, short enough that the UI stays responsive."""

MAX_RECORDS = 2_000
"""Newest records read per partition: a few hours of batches, a bounded fetch."""

MIGRATING = "migrating"
"""Series label of batches whose operators ran on different versions (mid-rollout)."""


@dataclass(frozen=True)
class MetricsRead:
    """What one read of the metrics topic found; ``problem`` says why it found nothing."""

    records: tuple[BatchMetrics, ...]
    problem: str | None = None

    @property
    def available(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class BatchPoint:
    """One micro-batch on the plots.

    ``version`` is the version every operator routed with, or ``None`` for a
    batch in the middle of a migration (operators on different versions).
    """

    batch_id: int
    version: int | None
    locality: float | None
    imbalance: float | None
    rows_per_s: float
    input_lag: int


@dataclass(frozen=True)
class VersionSummary:
    """A version's batches summed as the DAG's verify step sums them."""

    version: int
    batches: int
    rows: int
    locality: float | None
    imbalance: float | None
    rows_per_s: float | None
    lag: float | None


def batch_version(record: BatchMetrics) -> int | None:
    """The version all operators routed this batch with, or None if they differ or none is known."""
    versions = set(record.versions.values())
    return versions.pop() if len(versions) == 1 else None


ActiveInstances = Mapping[int, Mapping[str, Sequence[int]]]
"""version → operator → the instances that version keeps active."""


def active_instances(
    routing_store: Path, versions: Iterable[int]
) -> dict[int, dict[str, tuple[int, ...]]]:
    """Each of ``versions``' active instances per operator, read from the store.

    A version the store cannot give (pruned, unreadable) is left out: its
    batches are then judged over every instance they report.
    """
    from keyplane.routing import config as config_store

    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for version in set(versions):
        try:
            config = config_store.load(routing_store, version)
        except (config_store.ConfigStoreError, OSError, ValueError):
            continue
        found[version] = {name: routing.active for name, routing in config.operators.items()}
    return found


def on_active_instances(record: BatchMetrics, active: ActiveInstances | None) -> BatchMetrics:
    """``record`` with each operator's loads restricted to its version's active instances.

    A batch in the middle of a migration (operators on different versions)
    keeps each operator's loads over that operator's version's instances.
    """
    if not active:
        return record
    load: dict[str, dict[int, int]] = {}
    for operator, per_instance in record.load.items():
        version = record.versions.get(operator)
        kept = None if version is None else active.get(version, {}).get(operator)
        if kept is None:
            load[operator] = dict(per_instance)
        else:
            allowed = set(kept)
            load[operator] = {i: n for i, n in per_instance.items() if int(i) in allowed}
    return record.model_copy(update={"load": load})


def worst_imbalance(record: BatchMetrics) -> float | None:
    """The worst operator's max/mean load in one batch (000 §3.1)."""
    values = [v for v in (record.imbalance(op) for op in record.load) if v is not None]
    return max(values) if values else None


def points(
    records: Iterable[BatchMetrics], active: ActiveInstances | None = None
) -> list[BatchPoint]:
    """Batches that routed events (rows or hops between stages), in batch order.

    Idle batches are left out: their locality and imbalance are undefined and
    their zero throughput would drown the plot of a job that waits for input.
    """
    busy = sorted((r for r in records if r.rows > 0 or r.hops > 0), key=lambda r: r.batch_id)
    return [
        BatchPoint(
            batch_id=r.batch_id,
            version=batch_version(r),
            locality=r.locality,
            imbalance=worst_imbalance(on_active_instances(r, active)),
            rows_per_s=r.rows_per_s,
            input_lag=r.input_lag,
        )
        for r in busy
    ]


def summaries(
    records: Sequence[BatchMetrics], active: ActiveInstances | None = None
) -> list[VersionSummary]:
    """Per-version figures over the batches with hops between stages that ran wholly on that
    version, each operator's imbalance over the instances ``active`` says that version keeps."""
    from keyplane.orchestration.planning import measure

    by_version: dict[int, list[BatchMetrics]] = {}
    for record in records:
        version = batch_version(record)
        if version is not None and record.hops > 0:
            by_version.setdefault(version, []).append(on_active_instances(record, active))
    result = []
    for version in sorted(by_version):
        batch = by_version[version]
        measured = measure(batch)
        result.append(
            VersionSummary(
                version=version,
                batches=measured.batches,
                rows=measured.rows,
                locality=measured.locality,
                imbalance=measured.imbalance,
                rows_per_s=sum(r.rows_per_s for r in batch) / len(batch),
                lag=measured.lag,
            )
        )
    return result


@dataclass(frozen=True)
class SwitchWindow:
    """The batches during which the job moved from one version to ``version``.

    From the first batch in which some operator routed with ``version`` to
    the first in which all did: the job-side length of the migration (state
    evicted, carried over the migration topic, installed; 000 §3.4).
    """

    version: int
    first_batch: int
    last_batch: int
    batches: int
    seconds: float


def switch_windows(records: Iterable[BatchMetrics]) -> dict[int, SwitchWindow]:
    """Each version's switch window, measured from the batches' versions and durations."""
    ordered = sorted(records, key=lambda r: r.batch_id)
    windows: dict[int, SwitchWindow] = {}
    started: dict[int, int] = {}
    for index, record in enumerate(ordered):
        versions = set(record.versions.values())
        for version in versions:
            started.setdefault(version, index)
        if len(versions) == 1:
            version = next(iter(versions))
            if version not in windows and version in started:
                span = ordered[started[version] : index + 1]
                windows[version] = SwitchWindow(
                    version=version,
                    first_batch=span[0].batch_id,
                    last_batch=record.batch_id,
                    batches=len(span),
                    seconds=sum(r.duration_ms for r in span) / 1000.0,
                )
    return windows


def read_metrics(
    bootstrap_servers: str,
    topic: str,
    *,
    timeout_s: float = READ_TIMEOUT_S,
    max_records: int = MAX_RECORDS,
) -> MetricsRead:
    """The newest ``max_records`` records of every partition of ``topic``.

    Never raises for Kafka trouble: an unreachable broker, a missing topic or
    a read that stalls for ``timeout_s`` give an empty read with the reason.
    Records that are not metrics are skipped. The range read is the one every
    reader of the topic uses (:func:`keyplane.kafka.metrics_topic.read_metrics`).
    """
    from kafka.errors import KafkaError

    from keyplane.kafka.admin import TopicError, partitions_of, tail_offsets
    from keyplane.kafka.broker import answers_kafka
    from keyplane.kafka.metrics_topic import read_metrics as read_topic

    if not answers_kafka(bootstrap_servers, timeout_s=min(2.0, timeout_s)):
        return MetricsRead((), f"Kafka at {bootstrap_servers} did not answer")
    try:
        parts = partitions_of(bootstrap_servers, topic, timeout_s=min(1.0, timeout_s))
    except TopicError:
        return MetricsRead((), f"no metrics topic {topic!r} yet")
    try:
        starts, ends = tail_offsets(bootstrap_servers, topic, max_records, parts)
        read = read_topic(bootstrap_servers, topic, starts, ends, idle_timeout_s=timeout_s)
    except (KafkaError, TopicError, OSError) as error:
        return MetricsRead((), f"reading {topic!r} failed: {type(error).__name__}")
    records = (record.metrics for record in read)
    return MetricsRead(tuple(sorted(records, key=lambda r: r.batch_id)))


class CachedMetrics:
    """The last read of the metrics topic, reused for ``ttl_s`` seconds.

    One page view fetches the page and each plot: without a cache that is
    one Kafka read per image, and the images could disagree with the table.
    Thread-safety is not needed for correctness: two concurrent misses read
    twice and the later read wins.
    """

    def __init__(self, bootstrap_servers: str, topic: str, ttl_s: float = 10.0) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.ttl_s = ttl_s
        self._read: MetricsRead | None = None
        self._at = 0.0

    def get(self) -> MetricsRead:
        now = time.monotonic()
        if self._read is None or now - self._at > self.ttl_s:
            self._read = read_metrics(self.bootstrap_servers, self.topic)
            self._at = now
        return self._read
