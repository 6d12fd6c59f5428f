"""The reference pipeline: paper 000's evaluation application (§4.1) with the public API.

Each event ``{"seq", "a", "b", "ts", "pad"}`` is counted twice: by its
field ``a`` in the first stage and by its field ``b`` in the second. The
pairs (a, b) are what makes the two stages' keys correlated, so that a
locality-aware routing table can keep them on one executor (000 §3).
"""

from __future__ import annotations

from keyplane.aggregates import RunningCount
from keyplane.pipeline import KafkaSource, ParquetSink, Pipeline, Stage
from keyplane.settings import Settings

REFERENCE_PIPELINE = "keyplane.reference.pipeline:counts"
"""The reference pipeline as ``module:attr``: the managed job's default, which reads the
configured events topic and keeps its results where the job's output is."""
EVENT_SCHEMA = "seq LONG, a STRING, b STRING, ts DOUBLE, pad STRING"
"""The reference events' fields, as :mod:`keyplane.reference.events` writes them."""
FIRST_STAGE = "A"
"""The reference pipeline's first stage, which counts by field ``a``.

The fixed-shape reference engine (:mod:`keyplane.spark.routed_source` and its
stages) names its two stages with these constants; code that follows the
configured pipeline reads :attr:`keyplane.pipeline.Pipeline.stage_names` instead.
"""
SECOND_STAGE = "B"
"""The reference pipeline's second stage, which counts by field ``b``."""


def counts() -> Pipeline:
    """The two-stage running count over the configured events topic."""
    settings = Settings()
    return Pipeline(
        name="counts",
        source=KafkaSource(topics=(settings.events_topic,), schema=EVENT_SCHEMA),
        stages=(
            Stage(FIRST_STAGE, key="a", value="b", aggregate=RunningCount()),
            Stage(SECOND_STAGE, key="b", value="a", aggregate=RunningCount()),
        ),
        sink=ParquetSink(str(settings.home / "results")),
    )
