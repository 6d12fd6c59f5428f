"""Write a generated workload to a Kafka topic, deterministically and at a set rate.

Event ``seq`` goes to partition ``seq % partitions`` so that a given spec
always lays out the same records in the same partitions, whatever the timing;
tests compare what Spark counted with this layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kafka import KafkaProducer

from keyplane.events import encode_batch
from keyplane.kafka.admin import ensure_topic
from keyplane.workloads import WorkloadSpec

ProgressCallback = Callable[[int], object]


def make_producer(bootstrap_servers: str, *, idempotent: bool = True) -> KafkaProducer:
    """A producer tuned for throughput; idempotent so retries never duplicate."""
    return KafkaProducer(
        bootstrap_servers=bootstrap_servers,
        acks="all",
        enable_idempotence=idempotent,
        linger_ms=20,
        batch_size=512 * 1024,
        max_request_size=8 * 1024 * 1024,
    )


def produce_workload(
    spec: WorkloadSpec,
    bootstrap_servers: str,
    topic: str,
    *,
    partitions: int = 8,
    rate: float | None = None,
    chunk_size: int = 10_000,
    on_progress: ProgressCallback | None = None,
) -> int:
    """Send every event of ``spec`` to ``topic``; return the number sent.

    ``rate`` caps events per second (None: as fast as possible). The call
    returns only after the broker acknowledged every event.
    """
    n_parts = ensure_topic(bootstrap_servers, topic, partitions)
    producer = make_producer(bootstrap_servers)
    sent = 0
    started = time.monotonic()
    try:
        for batch in spec.batches(chunk_size):
            ts_ms = int(time.time() * 1000)
            for seq, value in enumerate(encode_batch(batch, ts_ms), start=batch.start):
                producer.send(topic, value=value, partition=seq % n_parts)
            sent += len(batch)
            if on_progress is not None:
                on_progress(len(batch))
            if rate:
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush()
    finally:
        producer.close(timeout=10)
    return sent
