"""Pure, Spark-free algorithms, each citing the paper it implements.

Sketches and hot keys (001), locality-aware partitioning (000), elasticity
(003), and the statistics and cost model they plan from. ``placement`` (004,
and 002's system tasks) serves the benchmarks only: at run time Spark places
the state partitions on executors, and keyplane observes where.
Nothing here imports Spark, Kafka or Airflow.
"""
