"""SparkSession construction with the settings every keyplane job needs."""

from __future__ import annotations

import os
import sys

from py4j.protocol import Py4JJavaError
from pyspark.sql import SparkSession

from keyplane.spark.jvm import available_jar

CHECKPOINT_FILE_MANAGER_KEY = "spark.sql.streaming.checkpointFileManagerClass"
FILE_SYSTEM_CHECKPOINT_MANAGERS = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
    "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager",
)
"""Spark's checkpoint file manager over the ``FileSystem`` API, by its name in Spark 4.3 and
in earlier releases (the class moved to a ``checkpointing`` package)."""


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
    if spark.conf.get(CHECKPOINT_FILE_MANAGER_KEY, None) is None:  # a user's choice stands
        use_file_system_checkpoint_manager(spark)
    return spark


def use_file_system_checkpoint_manager(spark: SparkSession) -> str | None:
    """Write checkpoint files through Hadoop's ``FileSystem`` API rather than ``FileContext``;
    return the class set, or None if this Spark has neither name.

    keyplane's checkpoints are local paths (a shared volume on a cluster),
    where a ``FileSystem`` rename is the POSIX ``rename(2)``: atomic, and it
    replaces the target, which is all Spark's atomic file writes rely on.
    Spark prefers ``FileContext`` for HDFS, whose ``FileSystem`` rename does
    not replace. On the local file system the ``FileContext`` path was slow:
    each state store partition's commit, which writes one small changelog
    file, took 40-75 ms, about a third of a keyed stage's task; through
    ``FileSystem`` the same commits took 0-15 ms (docs/benchmarks.md,
    "Committing state").
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    for name in FILE_SYSTEM_CHECKPOINT_MANAGERS:
        try:
            jvm.java.lang.Class.forName(name)
        except Py4JJavaError:
            continue
        spark.conf.set(CHECKPOINT_FILE_MANAGER_KEY, name)
        return name
    return None
