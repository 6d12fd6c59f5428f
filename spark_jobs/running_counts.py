"""Entry point of the reference two-stage counting job.

    spark-submit spark_jobs/running_counts.py --bootstrap-servers HOST:PORT \\
        --checkpoint DIR --output DIR [--max-offsets-per-trigger N]

The logic lives in :mod:`keyplane.spark.counts_job`; this file only gives
spark-submit (and Airflow's SparkSubmitOperator) a script to run. Each
finished micro-batch prints one line ``progress {json}`` on stdout.
"""

import sys

from keyplane.spark.counts_job import main

if __name__ == "__main__":
    sys.exit(main())
