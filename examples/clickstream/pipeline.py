"""A three-stage clickstream pipeline over nested JSON events.

Each event is a page view::

    {"user_id": "u17", "session_id": "u17-s3",
     "page": {"category": "shoes", "path": "/shoes/42"}, "dwell_ms": 5400}

Three keyed stages, upstream first. A session belongs to one user, and a
user keeps to a few categories, so the keys of consecutive stages are
correlated: keyplane's routing tables can keep a session's user, and a
user's favourite categories, on the same executor.

Run it with ``keyplane job start --pipeline examples.clickstream.pipeline:clicks``.
"""

from __future__ import annotations

import os

from examples.clickstream.aggregates import DistinctCount, Sum, TopK
from keyplane import KafkaSource, ParquetSink, Pipeline, Stage

SCHEMA = (
    "user_id STRING, session_id STRING, page STRUCT<category: STRING, path: STRING>, dwell_ms LONG"
)


def clicks() -> Pipeline:
    """The pipeline; the topic and output folder come from the environment, with defaults."""
    return Pipeline(
        name="clicks",
        source=KafkaSource(topics=(os.environ.get("CLICKS_TOPIC", "clicks"),), schema=SCHEMA),
        stages=(
            # Total dwell time of each session.
            Stage("sessions", key="session_id", value="dwell_ms", aggregate=Sum()),
            # How many page categories each user has seen.
            Stage("users", key="user_id", value="page.category", aggregate=DistinctCount()),
            # The three users who view each category most.
            Stage("categories", key="page.category", value="user_id", aggregate=TopK(3)),
        ),
        sink=ParquetSink(os.environ.get("CLICKS_OUTPUT", "var/clicks/results")),
    )
