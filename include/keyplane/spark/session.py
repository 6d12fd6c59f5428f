"""SparkSession construction with the settings every keyplane job needs."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from keyplane.spark.jvm import available_jar


def build_session(
    app_name: str = "keyplane",
    master: str = "local[2]",
    *,
    shuffle_partitions: int = 4,
    extra: dict[str, str] | None = None,
) -> SparkSession:
    """A session whose Python workers run this interpreter (the project's venv).

    Without ``PYSPARK_PYTHON`` Spark would start workers with whatever
    ``python3`` is first on PATH, which does not have keyplane installed.
    The session carries the jar of keyplane's JVM stages where it can be had
    (:mod:`keyplane.spark.jvm`); ``spark.jars`` in ``extra`` adds to it.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        )
        # A commit writes the batch's changed rows (a changelog) instead of
        # uploading a RocksDB snapshot: measured, the snapshot was ~70 % of a
        # stateful stage's time per batch. Snapshots are then made in the
        # background. Existing checkpoints take it as they are.
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .config("spark.driver.memory", "2g")
    )
    settings = dict(extra or {})
    jar = available_jar()
    if jar is not None:
        settings["spark.jars"] = ",".join(filter(None, [str(jar), settings.get("spark.jars")]))
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
