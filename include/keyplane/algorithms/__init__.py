"""Pure, Spark-free algorithms, each citing the paper it implements.

Sketches and hot keys (001), locality-aware partitioning (000), elasticity
(003), placement (004), and the statistics and cost model they plan from.
Nothing here imports Spark, Kafka or Airflow.
"""
