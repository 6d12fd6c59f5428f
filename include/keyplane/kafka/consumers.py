"""A process's idle Kafka consumers, lent out one reader at a time.

Why a pool. Every bounded read in keyplane (:func:`keyplane.kafka.ranges.read_range`)
assigns itself one partition, seeks, reads and stops; a fresh kafka-python
consumer for each read pays a connection, an API-version probe and a
metadata request first, a large part of a small range's read. A source
task reads several ranges per micro-batch (events, and during a rollout the
migration topic's), and Spark reuses its Python workers, so the same process
would open and close a consumer per range at every batch. Lent from here, a
worker's consumer connects once.

A lent consumer is its borrower's alone: the pool hands out an idle consumer
of the same topic or makes a new one. It is lent for one topic because
kafka-python keeps metadata only for the topics a consumer is assigned: a
consumer moved to another topic waits out a metadata refresh backoff
(``retry_backoff_ms``, 100 ms by default) before its first fetch. The borrower
assigns the partitions it reads and seeks to where it starts. It must not rely
on fetch state it did not set: kafka-python keeps a partition's state
(position, high watermark) when a consumer is assigned the same partitions
again, and records fetched for the last borrower are dropped only because
their offsets no longer match the position. A borrower that fails closes the
consumer instead of returning it (its state is unknown).
Consumers are per process: a forked child (Spark's Python workers are forked
from a daemon) never uses its parent's sockets, it starts a pool of its own.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kafka import KafkaConsumer

from keyplane.kafka.security import client_config

MAX_IDLE = 8
"""Idle consumers a process keeps; returning one more closes the longest idle."""

_Key = tuple[str, str, tuple[tuple[str, Any], ...]]

_lock = threading.Lock()
_idle: list[tuple[_Key, KafkaConsumer]] = []
"""Idle consumers, the longest idle first."""
_owner = os.getpid()


@contextmanager
def lent_consumer(bootstrap_servers: str, topic: str, **settings: Any) -> Iterator[KafkaConsumer]:
    """A consumer of ``bootstrap_servers`` with kafka-python ``settings``, to read ``topic``.

    The borrower assigns it the partitions it reads. Returned to the pool
    when the block ends normally; closed when it raises. Auto-commit is off:
    a lent consumer belongs to no group.
    """
    key: _Key = (bootstrap_servers, topic, tuple(sorted(settings.items())))
    consumer = _take(key)
    if consumer is None:
        consumer = KafkaConsumer(
            **client_config(bootstrap_servers), **{"enable_auto_commit": False, **settings}
        )
    try:
        yield consumer
    except BaseException:
        consumer.close()
        raise
    _give_back(key, consumer)


def close_idle() -> None:
    """Close every idle consumer of this process (at exit, and for tests)."""
    with _lock:
        _forget_if_forked()
        consumers = [c for _, c in _idle]
        _idle.clear()
    for consumer in consumers:
        consumer.close()


def idle_count() -> int:
    """How many consumers this process holds idle."""
    with _lock:
        _forget_if_forked()
        return len(_idle)


def _take(key: _Key) -> KafkaConsumer | None:
    with _lock:
        _forget_if_forked()
        for i in range(len(_idle) - 1, -1, -1):
            if _idle[i][0] == key:
                return _idle.pop(i)[1]
        return None


def _give_back(key: _Key, consumer: KafkaConsumer) -> None:
    with _lock:
        _forget_if_forked()
        _idle.append((key, consumer))
        excess = max(0, len(_idle) - MAX_IDLE)
        closing = [c for _, c in _idle[:excess]]
        del _idle[:excess]
    for stale in closing:
        stale.close()


def _forget_if_forked() -> None:
    """Drop, without closing, consumers inherited from a parent process: their sockets
    are the parent's. Called with the lock held."""
    global _owner
    if _owner != os.getpid():
        _idle.clear()
        _owner = os.getpid()


atexit.register(close_idle)
