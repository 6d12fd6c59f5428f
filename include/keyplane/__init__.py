"""keyplane: a control plane for stateful Spark Structured Streaming jobs.

The algorithms (sketches, routing, hot keys, migration, elasticity, placement)
are pure Python and Spark-free; Spark, Kafka and Airflow code lives at the
edges (``keyplane.spark``, ``keyplane.kafka``, ``dags/``).
"""

__version__ = "0.1.0"
