"""The routed stages of the running count in the JVM: build, find and call them.

Both routed stages are stateful processors whose every state call crosses
from a Python worker to the executor's JVM, a socket round trip per group
that dominates a Python stage's cost, several times what a key of Spark's
own count costs. The reference application's aggregate, :class:`~keyplane.aggregates.RunningCount`,
keeps a number, so its stages run as Java ``StatefulProcessor``\\ s
(``RoutedStages.java`` beside this file) that speak the same protocol and
write the same rows as :mod:`keyplane.spark.routed_counts`, in Spark's own
state store. A user's own aggregate keeps running in Python.

The jar also carries :data:`CHECKPOINT_FILE_MANAGER`, the checkpoint file
manager that keyplane's sessions use (``LocalCheckpointFileManager.java``;
:func:`keyplane.spark.session.use_file_system_checkpoint_manager`).

The Java sources ship with the package and are compiled on first use against
the installed pyspark's jars (``javac``, a JDK, is needed once), into a jar
named by the hash of the sources and Spark version, so an upgrade of either
builds a new one. ``KEYPLANE_JVM_JAR`` names a jar built in advance (an
image's build step: ``python -m keyplane.spark.jvm --out PATH``), which is
then used as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SOURCE = Path(__file__).with_name("RoutedStages.java")
SOURCES = (
    SOURCE,
    Path(__file__).with_name("RoutedEvents.java"),
    Path(__file__).with_name("LocalCheckpointFileManager.java"),
)
"""Every Java source of the jar: the stages, the connector's event router, and the
checkpoint file manager."""
JAR_ENV = "KEYPLANE_JVM_JAR"
CACHE_ENV = "KEYPLANE_JVM_CACHE"
CLASS_NAME = "keyplane.spark.jvm.RoutedStages"
ROUTER_CLASS = "keyplane.spark.jvm.RoutedEvents"
"""Routes the events Spark's Kafka connector reads (:mod:`keyplane.spark.connector_events`)."""
CHECKPOINT_FILE_MANAGER = "keyplane.spark.jvm.LocalCheckpointFileManager"
"""A checkpoint file manager that creates local files without a ``chmod`` process each."""

log = logging.getLogger(__name__)


class JvmStagesUnavailable(RuntimeError):
    """The JVM stages can be neither found nor built here (one line, for a CLI)."""


def _spark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


def _fingerprint() -> str:
    import pyspark

    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(pyspark.__version__.encode())
    return digest.hexdigest()[:16]


def _javac() -> str:
    home = os.environ.get("JAVA_HOME")
    candidates = [str(Path(home) / "bin" / "javac")] if home else []
    candidates.append(shutil.which("javac") or "")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise JvmStagesUnavailable(
        "the JVM stages need a JDK once, to compile them: no javac on PATH or in JAVA_HOME "
        f"(or set {JAR_ENV} to a jar built with `python -m keyplane.spark.jvm --out PATH`)"
    )


def build_jar(out: Path) -> Path:
    """Compile :data:`SOURCES` against the installed pyspark into the jar ``out``."""
    with tempfile.TemporaryDirectory(prefix="keyplane-jvm-") as tmp:
        classes = Path(tmp) / "classes"
        classes.mkdir()
        command = [
            _javac(),
            "--release", "17",
            "-encoding", "UTF-8",
            "-nowarn",
            "-cp", f"{_spark_jars()}/*",
            "-d", str(classes),
            *map(str, SOURCES),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            names = ", ".join(source.name for source in SOURCES)
            raise JvmStagesUnavailable(f"javac failed on {names}:\n{done.stderr.strip()}")
        out.parent.mkdir(parents=True, exist_ok=True)
        # Written beside ``out`` under a name of its own and renamed into place,
        # so neither a reader nor a second process building at once sees half a jar.
        handle, name = tempfile.mkstemp(dir=out.parent, suffix=".partial")
        os.close(handle)
        with zipfile.ZipFile(name, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        os.replace(name, out)
    return out


@cache
def stages_jar() -> Path:
    """The jar of the JVM stages: ``KEYPLANE_JVM_JAR``, or built once into the cache."""
    given = os.environ.get(JAR_ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise JvmStagesUnavailable(f"{JAR_ENV}={given}: no such file")
        return path
    cache_dir = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "keyplane" / "jvm")
    jar = cache_dir / f"keyplane-stages-{_fingerprint()}.jar"
    if not jar.is_file():
        log.info("compiling the JVM routed stages into %s", jar)
        build_jar(jar)
    return jar


def available_jar() -> Path | None:
    """:func:`stages_jar`, or None (logged once) where it can be neither found nor built."""
    try:
        return stages_jar()
    except JvmStagesUnavailable as exc:
        _log_unavailable(str(exc))
        return None


@cache
def _log_unavailable(reason: str) -> None:
    log.warning("routed stages run in Python: %s", reason)


def loaded(spark: SparkSession) -> bool:
    """Whether the session's JVM has the stages (its ``spark.jars`` held the jar)."""
    return class_loaded(spark, CLASS_NAME)


def class_loaded(spark: SparkSession, name: str) -> bool:
    """Whether the session's JVM can load class ``name`` (a jar of its classpath holds it)."""
    from py4j.java_gateway import JavaClass

    return isinstance(getattr(spark._jvm, name, None), JavaClass)


def routed_running_counts_jvm(inputs: DataFrame, parallelism: int, tuples: bool) -> DataFrame:
    """Both routed stages of the running count, in the JVM (module docstring).

    ``inputs`` are the routed source's rows with, for every event, stage B's
    routed key in ``rb``; the output is
    :data:`~keyplane.spark.routed_counts.ROUTED_OUTPUT_SCHEMA`, with ``busy_ns`` null:
    these stages do not time their groups, so the metrics judge their share of a
    batch by tuples (:func:`keyplane.algorithms.scaling.stage_shares`).
    """
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from keyplane.reference.pipeline import FIRST_STAGE
    from keyplane.spark.routed_partitions import control_groups

    spark = inputs.sparkSession
    jvm = spark._jvm
    assert jvm is not None
    groups = jvm.java.util.ArrayList()
    for group in control_groups(FIRST_STAGE, parallelism):
        groups.add(group)
    stages = getattr(jvm, CLASS_NAME)
    counts = DataFrame(stages.runningCounts(inputs._jdf, tuples, groups), spark)
    return counts.withColumn("busy_ns", F.lit(None).cast("long"))


PROBE_KEYS = ("", " ", "a", "zz#3", "#", "\x00", "\x01", "é", "\uffff", "\U0010fffe", "\U0010ffff")
"""Keys whose grouping values the start-up probe sends through the stages' operator: the
empty key, escaped keys, and keys at both ends of the code points."""

ProbeRow = tuple[str, int, int, bool]
"""A group call the probe saw: (grouping value, partition, call index in its task, whether
``atKey`` pointed the state calls at another key and back)."""


def probe_values(parallelism: int) -> list[str]:
    """The grouping values of the start-up probe: :data:`PROBE_KEYS`' and every control
    group's, so that each of the ``parallelism`` partitions sees both kinds."""
    from keyplane.control.operators import OPERATORS
    from keyplane.routing.routedkeys import RoutedKeyTable
    from keyplane.spark.routed_partitions import control_groups, evict_groups, install_groups

    table = RoutedKeyTable(n_instances=parallelism, routing={})
    values = {value for key in PROBE_KEYS for value in table.route(key)}
    for stage in OPERATORS:
        values.update(install_groups(stage, parallelism), evict_groups(stage, parallelism))
    for stage in (*OPERATORS, "I"):
        values.update(control_groups(stage, parallelism))
    return sorted(values)


def spark_behaviour_problems(spark: SparkSession, parallelism: int) -> list[str]:
    """What the JVM stages rely on in Spark and this session does not do (empty: all holds).

    The stages take a rollout's moves per instance, in control groups that must run
    before (installs) or after (evictions) every key's group of their task, so they rely
    on Spark calling a task's groups in ascending grouping-value order, on
    ``ImplicitGroupingKeyTracker`` pointing their state calls at a moved key, and, as
    every routed stage does, on Spark's hash partitioning of a grouping value
    (:func:`keyplane.routing.routedkeys.spark_partition`). None of it is an API, so the job
    checks it when it starts, with the stages' own operator on a small batch query
    (``RoutedStages.probe``), rather than count wrong after a Spark upgrade. Adaptive
    execution, which a streaming query never uses, is off while it runs, so that its
    partitions are the shuffle's own.
    """
    from pyspark.sql import DataFrame

    jvm = spark._jvm
    assert jvm is not None
    values = probe_values(parallelism)
    frame = spark.createDataFrame([(value,) for value in values], "value STRING")
    adaptive = spark.conf.get("spark.sql.adaptive.enabled")
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    try:
        probed = DataFrame(getattr(jvm, CLASS_NAME).probe(frame._jdf), spark).collect()
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", adaptive or "true")
    rows = [(r["group"], r["partition"], r["call"], r["redirected"]) for r in probed]
    return behaviour_problems(rows, values, parallelism)


def behaviour_problems(rows: list[ProbeRow], values: list[str], parallelism: int) -> list[str]:
    """The problems :func:`spark_behaviour_problems` reports, from the probe's rows."""
    from keyplane.routing.routedkeys import spark_partition

    problems: list[str] = []
    called = sorted(row[0] for row in rows)
    if called != sorted(values):
        problems.append(
            f"transformWithState called {len(called)} groups for {len(values)} grouping values"
        )
    for value, partition, _, _ in rows:
        expected = spark_partition(value, parallelism)
        if partition != expected:
            problems.append(
                f"Spark put grouping value {value!r} on partition {partition}, not on "
                f"{expected} as keyplane.routing.routedkeys computes it, so keys would not land "
                "where the routing says"
            )
            break
    by_task: dict[int, list[ProbeRow]] = {}
    for row in rows:
        by_task.setdefault(row[1], []).append(row)
    for partition, calls in sorted(by_task.items()):
        order = [row[0] for row in sorted(calls, key=lambda row: row[2])]
        for before, after in itertools.pairwise(order):
            if before.encode() > after.encode():
                problems.append(
                    f"transformWithState called group {before!r} before {after!r} in the task "
                    f"of partition {partition}, out of grouping-value order, which the stages' "
                    "per-instance hand-offs need"
                )
                break
    if not all(row[3] for row in rows):
        problems.append(
            "the state calls did not follow ImplicitGroupingKeyTracker.setImplicitKey, with "
            "which the stages install and evict moved states"
        )
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the JVM routed stages' jar.")
    parser.add_argument("--out", type=Path, help="write the jar here (default: the cache)")
    args = parser.parse_args()
    print(build_jar(args.out) if args.out else stages_jar())
