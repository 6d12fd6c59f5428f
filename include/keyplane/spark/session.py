"""SparkSession construction with the settings every keyplane job needs."""

from __future__ import annotations

import os
import sys

from py4j.protocol import Py4JJavaError
from pyspark.sql import SparkSession

from keyplane.settings import Settings
from keyplane.spark.connector import installed_connector_jars
from keyplane.spark.jvm import CHECKPOINT_FILE_MANAGER, available_jar

CHECKPOINT_FILE_MANAGER_KEY = "spark.sql.streaming.checkpointFileManagerClass"
SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
    "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager",
)
"""Spark's checkpoint file manager over the ``FileSystem`` API, by its name in Spark 4.3 and
in earlier releases (the class moved to a ``checkpointing`` package)."""
FILE_SYSTEM_CHECKPOINT_MANAGERS = (CHECKPOINT_FILE_MANAGER, *SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS)
"""The managers a session may take, the first it can load: keyplane's (in the jar of
:mod:`keyplane.spark.jvm`), else Spark's."""


def jit_options() -> str:
    """HotSpot options for the driver and executors: ``KEYPLANE_JVM_JIT_OPTIONS``, else none.

    Why a job may want :data:`keyplane.settings.NO_TRAP_JIT_OPTIONS`: C2
    compiles a hot method on its profile and replaces each branch the
    profile never saw taken with an uncommon trap (``unstable_if``). A
    rollout's hand-off rows are rows the job's hot code never saw: non-null
    columns that every event row leaves null, JSON strings long enough to
    grow the row buffer, control-group values outside the Basic Multilingual
    Plane. In the switch batch they trip those traps in Spark's generated
    projections and in the shuffle's sort, many times more than in other
    batches. Each sends a hot method back to the interpreter, and C2
    compiles it again while the batch runs, on the cores the tasks use.
    With no trap budget C2 compiles those branches from the start, which
    shrinks a rollout's extra time. But C2's code may then be a little
    slower everywhere, in every batch, so it is not the default.
    """
    return Settings().jvm_jit_options


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
    (:mod:`keyplane.spark.jvm`) and Spark's Kafka connector where it is installed
    (:mod:`keyplane.spark.connector`); ``spark.jars`` in ``extra`` adds to them. Its
    JVMs run with :func:`jit_options`; ``spark.driver.extraJavaOptions`` and
    ``spark.executor.extraJavaOptions`` in ``extra`` add to them (the driver's
    apply only if this call starts the JVM).
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
        # uploading a RocksDB snapshot, which would be most of a stateful
        # stage's time per batch. Snapshots are then made in the
        # background. Existing checkpoints take it as they are.
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .config("spark.driver.memory", "2g")
    )
    settings = dict(extra or {})
    jit = jit_options()
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        options = " ".join(filter(None, [jit, settings.get(key)]))
        if options:
            settings[key] = options
    jars = [str(jar) for jar in [available_jar(), *installed_connector_jars()] if jar]
    given = settings.get("spark.jars", "").split(",")
    if any(jars + given):
        settings["spark.jars"] = ",".join(dict.fromkeys(filter(None, [*jars, *given])))
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if spark.conf.get(CHECKPOINT_FILE_MANAGER_KEY, None) is None:  # a user's choice stands
        use_file_system_checkpoint_manager(spark)
    return spark


def use_file_system_checkpoint_manager(spark: SparkSession) -> str | None:
    """Write checkpoint files through Hadoop's ``FileSystem`` API rather than ``FileContext``;
    return the class set, or None if this Spark has none of :data:`FILE_SYSTEM_CHECKPOINT_MANAGERS`.

    keyplane's checkpoints are local paths (a shared volume on a cluster),
    where a ``FileSystem`` rename is atomic. Spark prefers ``FileContext``,
    whose rename can replace the target; Hadoop's local ``FileSystem`` rename
    refuses an existing one, which keyplane's own manager (below) mends. On
    the local file system the ``FileContext`` path is slow: each state store
    partition's commit, which writes one small changelog file, costs a large
    share of a keyed stage's task, several times what it costs through
    ``FileSystem``.

    Where the session has keyplane's jar, its manager is Spark's ``FileSystem``
    one that creates local files in Java (``LocalCheckpointFileManager.java``):
    Hadoop's local file system, without its native library, starts a
    ``chmod`` process for every file it creates, and a query creates one per
    stateful partition in each batch, and two on the driver.
    Checkpoints written by either manager are read by the other.
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    for name in FILE_SYSTEM_CHECKPOINT_MANAGERS:
        try:
            # As Spark loads the class it names: jars added to the session count.
            jvm.org.apache.spark.util.Utils.classForName(name, True, False)
        except Py4JJavaError:
            continue
        spark.conf.set(CHECKPOINT_FILE_MANAGER_KEY, name)
        return name
    return None
