"""keyplane: a control plane for stateful Spark Structured Streaming jobs.

Declare a :class:`Pipeline` (a Kafka source, a chain of keyed stages, a
sink) and run it with ``keyplane job start --pipeline module:attribute``;
keyplane then routes its keys, splits its hot keys and moves its state while
the query runs. The algorithms (``keyplane.algorithms``) are pure Python and
Spark-free; Spark, Kafka and Airflow code lives at the edges
(``keyplane.spark``, ``keyplane.kafka``, ``keyplane.orchestration``).
"""

from keyplane.aggregates import KeyedAggregate, RunningCount, ValueCounts
from keyplane.pipeline import (
    OUTPUT_SCHEMA,
    BatchSink,
    KafkaSink,
    KafkaSource,
    ParquetSink,
    Pipeline,
    PipelineError,
    Stage,
    load_pipeline,
)

__version__ = "0.1.0"

__all__ = [
    "OUTPUT_SCHEMA",
    "BatchSink",
    "KafkaSink",
    "KafkaSource",
    "KeyedAggregate",
    "ParquetSink",
    "Pipeline",
    "PipelineError",
    "RunningCount",
    "Stage",
    "ValueCounts",
    "load_pipeline",
]
