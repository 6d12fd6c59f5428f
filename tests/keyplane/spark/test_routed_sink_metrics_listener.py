"""The metrics listener's delivery when its producer breaks (fake producers: pure logic).

A broker restart can leave the listener's long-lived idempotent producer
unable to deliver anything again (the broker no longer knows its producer id);
the broker restart fault test on the real broker showed every later record
lost. The listener must replace such a producer, not keep using it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import keyplane.kafka.producer
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.kafka.producer import SAFE_DELIVERY, LongLivedProducer
from keyplane.spark.routed_sink import MetricsListener


@dataclass
class Writer:
    producer: LongLivedProducer = field(
        default_factory=lambda: LongLivedProducer("broker:9092", SAFE_DELIVERY)
    )
    metrics: dict[int, BatchMetrics] = field(default_factory=dict)


@dataclass
class Streams:
    """A session's ``streams`` as the listener uses it (fake: pure logic)."""

    listeners: list[Any] = field(default_factory=list)
    active: set[str] = field(default_factory=set)

    def addListener(self, listener: Any) -> None:
        self.listeners.append(listener)

    def get(self, query_id: str) -> object | None:
        return object() if query_id in self.active else None

    def removeListener(self, listener: Any) -> None:
        self.listeners.remove(listener)


def listener_with_fake_producers(
    fake_producers: Any, *delivers: int | None
) -> tuple[MetricsListener, list[Any]]:
    made = fake_producers(keyplane.kafka.producer, *delivers)
    return MetricsListener(Writer(), "job.metrics"), made


def test_a_producer_that_stops_delivering_is_replaced_and_the_record_sent_again_fake_producers(
    fake_producers: Any,
) -> None:
    listener, made = listener_with_fake_producers(fake_producers, 1, None)
    assert listener.publish(BatchMetrics(batch_id=1))
    assert listener.publish(BatchMetrics(batch_id=2))
    assert listener.publish(BatchMetrics(batch_id=3))

    broken, replacement = made
    assert [BatchMetrics.model_validate_json(v).batch_id for _, v in broken.sent] == [1]
    assert broken.closed and not replacement.closed
    assert [BatchMetrics.model_validate_json(v).batch_id for _, v in replacement.sent] == [2, 3]


def test_a_record_that_two_producers_cannot_deliver_is_reported_lost_fake_producers(
    fake_producers: Any,
) -> None:
    listener, made = listener_with_fake_producers(fake_producers, 0, 0)
    assert listener.publish(BatchMetrics(batch_id=7)) is False
    assert len(made) == 2 and all(p.closed for p in made)


def test_a_new_run_of_the_query_closes_the_previous_runs_producers_fake_producers(
    fake_producers: Any,
) -> None:
    """Removed before it hears its run end, the previous listener would leave both open."""
    made = fake_producers(keyplane.kafka.producer, None, None, None)
    spark = SimpleNamespace(streams=Streams(active={"query-restarted"}))
    query = SimpleNamespace(id="query-restarted", runId="run-1")
    writer = Writer()
    try:
        first = MetricsListener.attach(spark, query, writer, "job.metrics")
        assert first.publish(BatchMetrics(batch_id=1))
        assert writer.producer.send("job.migration", [(b"1", b"moves")]) == 1
        assert len(made) == 2 and not any(p.closed for p in made)

        query.runId = "run-2"
        second = MetricsListener.attach(spark, query, Writer(), "job.metrics")
        assert spark.streams.listeners == [second]
        assert all(p.closed for p in made)
        assert second.publish(BatchMetrics(batch_id=2))
        assert len(made) == 3 and not made[2].closed
    finally:
        MetricsListener._attached.pop("query-restarted", None)


def test_a_record_heard_after_the_listener_closed_opens_no_producer_fake_producers(
    fake_producers: Any,
) -> None:
    """A run's last progress event can reach the listener after a restart closed it; sending
    it would open a producer that no one closes (two were left open by the restart tests)."""
    listener, made = listener_with_fake_producers(fake_producers, None, None)
    assert listener.publish(BatchMetrics(batch_id=1))
    listener.close()
    assert listener.publish(BatchMetrics(batch_id=2)) is False
    assert len(made) == 1 and made[0].closed


def _attach(spark: Any, query_id: str, run_id: str) -> MetricsListener:
    """A listener attached for a new run of query ``query_id`` with a writer of its own."""
    query = SimpleNamespace(id=query_id, runId=run_id)
    return MetricsListener.attach(spark, query, Writer(), "job.metrics")


def test_a_new_query_removes_the_listeners_of_the_sessions_stopped_queries_fake_producers(
    fake_producers: Any,
) -> None:
    """A query its caller stopped keeps no listener once another query of the session starts."""
    made = fake_producers(keyplane.kafka.producer, None, None, None, None, None, None)
    spark = SimpleNamespace(streams=Streams(active={"q-stopped", "q-running"}))
    other_session = SimpleNamespace(streams=Streams())
    try:
        stopped = _attach(spark, "q-stopped", "r1")
        running = _attach(spark, "q-running", "r2")
        elsewhere = _attach(other_session, "q-elsewhere", "r3")
        for listener in (stopped, running, elsewhere):
            assert listener.publish(BatchMetrics(batch_id=1))
        assert len(made) == 3 and not any(p.closed for p in made)

        spark.streams.active.discard("q-stopped")  # the caller ran query.stop()
        newest = _attach(spark, "q-new", "r4")
        assert spark.streams.listeners == [running, newest]
        assert other_session.streams.listeners == [elsewhere]
        assert made[0].closed and not made[1].closed and not made[2].closed
        assert set(MetricsListener._attached) >= {"q-running", "q-elsewhere", "q-new"}
        assert "q-stopped" not in MetricsListener._attached
    finally:
        for query_id in ("q-stopped", "q-running", "q-elsewhere", "q-new"):
            MetricsListener._attached.pop(query_id, None)


def test_a_record_joins_the_sinks_measures_with_the_batchs_progress_fake_writer() -> None:
    """What the sink measured, with the progress report's figures, start time and routing."""
    writer = Writer()
    writer.metrics[7] = BatchMetrics(batch_id=7, hops=10, local_hops=4)
    listener = MetricsListener(writer, "job.metrics")
    progress = {
        "batchId": 7,
        "timestamp": "2026-11-29T09:52:22.244Z",
        "numInputRows": 30,
        "durationMs": {"triggerExecution": 2000, "addBatch": 1500},
        "sources": [
            {
                "endOffset": json.dumps(
                    {
                        "plan": 6,
                        "events": {"t": {"0": 900}},
                        "routing": {"A": 2, "B": 1},
                        "read": 300,
                    }
                ),
                "latestOffset": None,
                "numInputRows": 30,
            }
        ],
    }

    record = listener.record(progress)

    assert record is not None
    assert record.started_at == datetime(2026, 11, 29, 9, 52, 22, 244_000, tzinfo=UTC)
    assert (record.plan, record.versions, record.rows) == (6, {"A": 2, "B": 1}, 300)
    assert (record.duration_ms, record.phases_ms) == (2000, {"addBatch": 1500})
    assert (record.hops, record.local_hops) == (10, 4)
    assert listener.record(progress) is None  # once per batch
    again = BatchMetrics.model_validate_json(record.model_dump_json())
    assert again.started_at == record.started_at
