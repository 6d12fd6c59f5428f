"""SparkSession construction with the settings every keyplane job needs."""

from __future__ import annotations

import os
import sys

from py4j.protocol import Py4JJavaError
from pyspark.sql import SparkSession

from keyplane.settings import Settings
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
    Plane. In the switch batch they tripped those traps in Spark's generated
    projections and in the shuffle's sort: 33 deoptimizations in the stage
    that reads the source and 34 in stage A, against 0 to 3 per stage in
    other batches (Java Flight Recorder). Each sends a hot method back to
    the interpreter, and C2 compiles it again while the batch runs, on the
    cores the tasks use (1.07 s of compilation in that stage against
    0.27-0.35 s). With no trap budget C2 compiles those branches from the
    start: the source stage's share of a rollout's extra time fell from
    0.10-0.18 s to 0.02-0.04 s. But C2's code may then be a little slower
    everywhere, 1-3 % of every batch, so it is not the default
    (docs/benchmarks.md, "A live reconfiguration that moves 10k keys").
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
    (:mod:`keyplane.spark.jvm`); ``spark.jars`` in ``extra`` adds to it. Its
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
        # uploading a RocksDB snapshot: measured, the snapshot was ~70 % of a
        # stateful stage's time per batch. Snapshots are then made in the
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
    return the class set, or None if this Spark has none of :data:`FILE_SYSTEM_CHECKPOINT_MANAGERS`.

    keyplane's checkpoints are local paths (a shared volume on a cluster),
    where a ``FileSystem`` rename is atomic. Spark prefers ``FileContext``,
    whose rename can replace the target; Hadoop's local ``FileSystem`` rename
    refuses an existing one, which keyplane's own manager (below) mends. On
    the local file system the ``FileContext`` path was slow:
    each state store partition's commit, which writes one small changelog
    file, took 40-75 ms, about a third of a keyed stage's task; through
    ``FileSystem`` the same commits took 0-15 ms (docs/benchmarks.md,
    "Committing state").

    Where the session has keyplane's jar, its manager is Spark's ``FileSystem``
    one that creates local files in Java (``LocalCheckpointFileManager.java``):
    Hadoop's local file system, without its native library, starts a
    ``chmod`` process for every file it creates, 11-16 ms each, and a query
    creates one per stateful partition in each batch, and two on the driver
    (docs/benchmarks.md, "Creating checkpoint files without a process each").
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
