"""Write a generated workload to a Kafka topic, deterministically and at a set rate.

Event ``seq`` goes to partition ``seq % partitions`` so that a given spec
always lays out the same records in the same partitions, whatever the timing;
tests compare what Spark counted with this layout.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kafka import KafkaProducer
from kafka.errors import KafkaError

from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.security import client_config
from keyplane.reference.events import encode_batch
from keyplane.reference.workloads import WorkloadSpec

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int], object]


@dataclass(frozen=True)
class Delivery:
    """When a producer counts a record as written (paper 002 §IV: every guarantee has a price).

    ``acks="all"`` waits for every in-sync replica, ``"1"`` for the leader
    only, so a leader lost before replicating loses the record. An idempotent
    producer numbers its batches so that the broker drops a retried
    duplicate; Kafka allows it with ``acks="all"`` only. keyplane's default
    is both, the setting under which its exact counts are shown; the other
    settings exist to measure what they cost (bench/reliability_cost.py).
    """

    acks: Literal["1", "all"] = "all"
    idempotent: bool = True

    def __post_init__(self) -> None:
        if self.idempotent and self.acks != "all":
            raise ValueError("an idempotent producer needs acks='all' (Kafka refuses acks=1)")


SAFE_DELIVERY = Delivery()
"""acks=all and idempotent: the default of every keyplane producer."""


def make_producer(bootstrap_servers: str, delivery: Delivery = SAFE_DELIVERY) -> KafkaProducer:
    """A producer tuned for throughput, with ``delivery``'s guarantees and the
    process's security settings (:mod:`keyplane.kafka.security`)."""
    return KafkaProducer(
        **client_config(bootstrap_servers),
        acks=delivery.acks if delivery.acks == "all" else 1,
        enable_idempotence=delivery.idempotent,
        linger_ms=20,
        batch_size=512 * 1024,
        max_request_size=8 * 1024 * 1024,
    )


class DeliveryError(RuntimeError):
    """Records the broker did not acknowledge, even after the producer's own retries."""


def send_confirmed(
    producer: Any,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    *,
    partition: int | None = None,
    timeout_s: float | None = None,
) -> int:
    """Send every ``(key, value)`` of ``records`` to ``topic`` and wait until each is delivered.

    Returns the number of records. ``flush`` returns once every record is
    either acknowledged or given up on (the broker down longer than the
    producer's delivery timeout, a producer id the broker no longer knows):
    a failure shows only in the record's future. So every future is checked,
    and any failure raises :class:`DeliveryError` naming the topic, how many
    of how many records failed and the first failure. Raised from
    ``foreachBatch``, it fails the batch, which is replayed, instead of
    letting it commit with records lost.

    ``partition`` sends every record to that partition (the protocol topics
    have one); ``timeout_s`` bounds the wait, which is otherwise the
    producer's delivery timeout.
    """
    futures = [
        producer.send(topic, key=key, value=value, partition=partition) for key, value in records
    ]
    producer.flush(timeout=timeout_s)
    failures: list[KafkaError] = []
    for future in futures:
        try:
            future.get(timeout=0)
        except KafkaError as error:
            failures.append(error)
    if failures:
        raise DeliveryError(
            f"{len(failures)} of {len(futures)} records to topic {topic!r} were not delivered; "
            f"first failure: {failures[0]}"
        ) from failures[0]
    return len(futures)


class LongLivedProducer:
    """One producer for a component's sends, made at the first and replaced after a failure.

    Why keep one: making a producer opens a connection and fetches the
    cluster's metadata (on a cluster that requires TLS and SASL, a handshake
    and a login too), and a streaming job's sink sends every micro-batch.

    Why replace it: after a broker restart, an idempotent producer whose id
    the broker no longer knows fails every later send, and every later
    record would be lost. So a send that
    fails closes the producer and sends its records once more through a new
    one; only if that fails too does :meth:`send` raise. Records the first
    producer delivered before it failed may then arrive twice, which every
    topic keyplane writes tolerates: installs are idempotent per marker and
    source, every step of the control protocol is idempotent (000 §3.4), and
    results, dead letters and metrics are at least once.
    """

    def __init__(self, bootstrap_servers: str, delivery: Delivery = SAFE_DELIVERY) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.delivery = delivery
        self._producer: KafkaProducer | None = None

    def send(
        self,
        topic: str,
        records: Iterable[tuple[bytes | None, bytes]],
        *,
        partition: int | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """:func:`send_confirmed` through the kept producer, then once more through a new one.

        Returns the number of records; raises the second attempt's
        :class:`DeliveryError` (or Kafka error) if both fail.
        """
        pending = list(records)
        try:
            return self._send_once(topic, pending, partition, timeout_s)
        except (KafkaError, DeliveryError) as error:
            log.warning("sending to %s failed, retrying with a new producer: %s", topic, error)
        return self._send_once(topic, pending, partition, timeout_s)

    def _send_once(
        self,
        topic: str,
        records: list[tuple[bytes | None, bytes]],
        partition: int | None,
        timeout_s: float | None,
    ) -> int:
        if self._producer is None:
            self._producer = make_producer(self.bootstrap_servers, self.delivery)
        try:
            return send_confirmed(
                self._producer, topic, records, partition=partition, timeout_s=timeout_s
            )
        except BaseException:
            self.close(timeout_s=1.0)
            raise

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the producer, if one is open; the next :meth:`send` makes a new one."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close(timeout=timeout_s)


_EXECUTOR_PRODUCERS: dict[tuple[str, Delivery], LongLivedProducer] = {}
"""One producer per broker and delivery in each Python worker, kept across its tasks."""


def executor_producer(bootstrap_servers: str, delivery: Delivery) -> LongLivedProducer:
    """This worker's producer for ``bootstrap_servers``: a task does not pay a connection."""
    key = (bootstrap_servers, delivery)
    if key not in _EXECUTOR_PRODUCERS:
        _EXECUTOR_PRODUCERS[key] = LongLivedProducer(bootstrap_servers, delivery)
    return _EXECUTOR_PRODUCERS[key]


def check_workload_options(rate: float | None, partitions: int) -> None:
    """Refuse, with a ValueError, a ``rate`` or ``partitions`` that :func:`produce_workload`
    cannot honour.

    A rate of 0, negative or NaN once read as "no limit", and infinity means
    that too: None is the one way to say it. A topic of no partitions is
    created by tansu and can never be repaired (it cannot add partitions).
    """
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive, finite number of events per second, not {rate}")
    if partitions < 1:
        raise ValueError(f"a topic needs 1 partition or more, not {partitions}")


RATE_STEPS_PER_S = 50
"""How often per second a rate-limited :func:`produce_workload` checks its pace: a rate is
kept over steps of about 20 ms, so the broker sees a steady stream, not bursts."""


class WorkloadNotDelivered(DeliveryError):
    """Some events of a workload were not acknowledged; ``delivered`` counts those that were.

    The events are numbered and laid out per partition (``seq % partitions``),
    but which of them failed is known only per record, so the count is what a
    user can act on: the topic holds ``delivered`` of the ``attempted`` events.
    """

    def __init__(self, message: str, *, delivered: int, attempted: int) -> None:
        super().__init__(message)
        self.delivered = delivered
        self.attempted = attempted


class _Confirmations:
    """The futures of records sent and not yet settled, drained as they settle.

    Checking each send's result as it comes keeps memory bounded over a long
    workload and stops the sending at the first failure, instead of
    reporting every later record as lost too.
    """

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.delivered = 0
        self.failures: list[BaseException] = []

    def add(self, future: Any) -> None:
        self.pending.append(future)

    def drain(self) -> None:
        still: list[Any] = []
        for future in self.pending:
            if not future.is_done:
                still.append(future)
            elif future.failed():
                self.failures.append(future.exception)
            else:
                self.delivered += 1
        self.pending = still

    def settle(self) -> None:
        """Wait for every pending future (after a flush, they are all done)."""
        for future in self.pending:
            try:
                future.get(timeout=0)
            except KafkaError as error:
                self.failures.append(error)
            else:
                self.delivered += 1
        self.pending = []


def produce_workload(
    spec: WorkloadSpec,
    bootstrap_servers: str,
    topic: str,
    *,
    partitions: int = 8,
    topic_partitions: int | None = None,
    rate: float | None = None,
    chunk_size: int = 10_000,
    on_progress: ProgressCallback | None = None,
) -> int:
    """Send every event of ``spec`` to ``topic``; return the number delivered, which is all.

    Each send's result is checked: a record the broker refused (a broker
    restarted under the producer forgets its producer id; one down longer
    than the delivery timeout) raises :class:`WorkloadNotDelivered`, which
    counts the events the broker did acknowledge. Sending stops at the first
    failure seen. ``rate`` caps events per second (None: as fast as
    possible), kept over steps of about 1/:data:`RATE_STEPS_PER_S` s. Both
    options are checked first (:func:`check_workload_options`). The topic is
    created with ``partitions`` unless it exists (:func:`ensure_topic`); a
    caller that has just done so passes the count it got as
    ``topic_partitions``, and the topic is not asked for again.
    """
    check_workload_options(rate, partitions)
    if topic_partitions is None:
        n_parts = ensure_topic(bootstrap_servers, topic, partitions)
    else:
        check_workload_options(None, topic_partitions)
        n_parts = topic_partitions
    step = chunk_size if rate is None else max(1, min(chunk_size, int(rate / RATE_STEPS_PER_S)))
    producer = make_producer(bootstrap_servers)
    confirmations = _Confirmations()
    attempted = 0
    started = time.monotonic()
    try:
        for batch in spec.batches(chunk_size):
            ts_ms = int(time.time() * 1000)
            values = list(encode_batch(batch, ts_ms))
            for first in range(0, len(values), step):
                for offset, value in enumerate(values[first : first + step]):
                    seq = batch.start + first + offset
                    confirmations.add(producer.send(topic, value=value, partition=seq % n_parts))
                sent_now = min(step, len(values) - first)
                attempted += sent_now
                if on_progress is not None:
                    on_progress(sent_now)
                confirmations.drain()
                if confirmations.failures:
                    break
                if rate is not None:
                    ahead = attempted / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
            if confirmations.failures:
                break
        producer.flush()
        confirmations.settle()
    finally:
        producer.close(timeout=10)
    if confirmations.failures:
        total = spec.n_events
        first_failure = confirmations.failures[0]
        raise WorkloadNotDelivered(
            f"only {confirmations.delivered:,} of {total:,} events reached topic {topic!r}: "
            f"{len(confirmations.failures):,} of the {attempted:,} sent were refused "
            f"(first: {type(first_failure).__name__}: {first_failure}) and the rest were "
            "not sent",
            delivered=confirmations.delivered,
            attempted=attempted,
        ) from first_failure
    return confirmations.delivered


class WorkloadTrickle(threading.Thread):
    """Chunks of a workload, one after the other, until stopped: a stream that keeps arriving.

    The demo and the end-to-end tests run one beside a job, so that a new
    routing version has batches to run on. ``chunk(i)`` is the spec of the
    i-th chunk, called just before it is sent, so a caller can change what
    comes next (a flash hot key); ``specs`` lists what was sent, the ground
    truth of the counts; ``pause_s``, the pause after each chunk, may be
    changed while it runs (to let a job idle). An error in the thread is kept
    in ``error``; :meth:`finish` stops the thread and raises it.
    """

    def __init__(
        self,
        chunk: Callable[[int], WorkloadSpec],
        bootstrap_servers: str,
        topic: str,
        *,
        partitions: int = 2,
        pause_s: float = 2.0,
    ) -> None:
        super().__init__(daemon=True, name=f"trickle-{topic}")
        self.chunk, self.bootstrap_servers, self.topic = chunk, bootstrap_servers, topic
        self.partitions = partitions
        self.pause_s = pause_s
        self.specs: list[WorkloadSpec] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                spec = self.chunk(len(self.specs))
                produce_workload(
                    spec, self.bootstrap_servers, self.topic, partitions=self.partitions
                )
                self.specs.append(spec)
                self.stop.wait(self.pause_s)
        except BaseException as exc:  # surfaced by finish()
            self.error = exc

    def finish(self, timeout_s: float = 60.0) -> list[WorkloadSpec]:
        """Stop after the chunk in flight; return what was sent, or raise the thread's error."""
        self.stop.set()
        if self.ident is not None:  # started
            self.join(timeout=timeout_s)
        if self.is_alive():
            raise TimeoutError(f"the trickle to {self.topic!r} did not stop in {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return list(self.specs)
