"""The routed source's event size limit (``max.event.bytes``), pure: no broker, no Spark.

An oversized record is dead-lettered before it is parsed, so one huge record
cannot exhaust a Python worker's memory; the limit is an option of the source,
validated when the query is defined rather than when the first big record
arrives.
"""

from __future__ import annotations

import json

import pytest

from keyplane.reference.events import MAX_EVENT_BYTES, parse_event
from keyplane.spark.kafka_source import KafkaSourceOptionError
from keyplane.spark.routed_source import RoutedEventsReader

OPTIONS = {
    "kafka.bootstrap.servers": "127.0.0.1:1",
    "subscribe": "events",
    "control.topic": "control",
    "migration.topic": "migration",
    "routing.store": "/nonexistent/store",
    "state.partitions": "4",
    "initial.version": "1",
}


def test_the_limit_is_the_configured_one_pure() -> None:
    event = json.dumps({"seq": 1, "a": "x", "b": "y", "ts": 5, "pad": "p" * 200}).encode()
    assert parse_event(event)[1] is None
    parsed, problem = parse_event(event, max_bytes=100)
    assert parsed is None
    assert problem == f"oversized: {len(event)} bytes > 100"
    assert parse_event(event, max_bytes=len(event))[1] is None


def test_the_option_defaults_and_is_validated_pure() -> None:
    assert RoutedEventsReader(OPTIONS).max_event_bytes == MAX_EVENT_BYTES
    assert RoutedEventsReader({**OPTIONS, "max.event.bytes": "2048"}).max_event_bytes == 2048
    for wrong in ("0", "-5", "64k", ""):
        with pytest.raises(KafkaSourceOptionError, match=r"max\.event\.bytes"):
            RoutedEventsReader({**OPTIONS, "max.event.bytes": wrong})
