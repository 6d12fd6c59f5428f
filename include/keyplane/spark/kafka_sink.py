"""Write a micro-batch to Kafka from ``foreachBatch``.

PySpark's Python streaming sinks support append mode only, so stateful
output goes through ``foreachBatch``. Each Spark partition sends its rows
through its Python worker's producer, kept across tasks
(:func:`keyplane.kafka.producer.executor_producer`): idempotent
(``acks=all``) by default, so broker-side retries never duplicate a record;
the job's ``producer_acks`` and ``producer_idempotent`` settings relax it to
measure the cost (:class:`keyplane.kafka.producer.Delivery`). Every record's
delivery is checked (:func:`keyplane.kafka.producer.send_confirmed`): a
record the producer gave up on fails the batch instead of being lost.
A replayed micro-batch is re-sent: consumers of keyplane's result topics key
by (stage, key) and keep the latest count, which makes replays harmless.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from pyspark.sql import DataFrame, Row

from keyplane.kafka.producer import SAFE_DELIVERY, Delivery, executor_producer


def _send_partition(
    rows: Iterator[Row], bootstrap_servers: str, topic: str, key_column: str, delivery: Delivery
) -> None:
    executor_producer(bootstrap_servers, delivery).send(
        topic,
        (
            (
                str(record[key_column]).encode(),
                json.dumps(record, default=str, separators=(",", ":")).encode(),
            )
            for record in (row.asDict() for row in rows)
        ),
    )


def write_to_kafka(
    df: DataFrame,
    bootstrap_servers: str,
    topic: str,
    key_column: str,
    delivery: Delivery = SAFE_DELIVERY,
) -> None:
    """Send every row of ``df`` as a JSON value keyed by ``key_column``.

    ``delivery`` travels to the executors with the function; credentials do
    not (each executor reads its own, :mod:`keyplane.kafka.security`). A
    record that is not delivered fails its partition's task with
    :class:`~keyplane.kafka.producer.DeliveryError`.
    """
    df.foreachPartition(
        lambda rows: _send_partition(rows, bootstrap_servers, topic, key_column, delivery)
    )
