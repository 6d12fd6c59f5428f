"""The settings every keyplane session carries, read back from a real SparkSession."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from keyplane.settings import NO_TRAP_JIT_OPTIONS
from keyplane.spark import jvm as keyplane_jvm
from keyplane.spark.session import (
    CHECKPOINT_FILE_MANAGER_KEY,
    FILE_SYSTEM_CHECKPOINT_MANAGERS,
    SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS,
    use_file_system_checkpoint_manager,
)

pytestmark = pytest.mark.integration


def test_checkpoint_files_go_through_a_file_system_manager_this_spark_has(spark) -> None:
    """A class name Spark cannot load fails every query at start; the session names one it has:
    keyplane's where the session carries keyplane's jar, else Spark's."""
    chosen = spark.conf.get(CHECKPOINT_FILE_MANAGER_KEY)
    assert chosen in FILE_SYSTEM_CHECKPOINT_MANAGERS
    loaded = spark.sparkContext._jvm.org.apache.spark.util.Utils.classForName(chosen, True, False)
    assert loaded.getName() == chosen
    assert use_file_system_checkpoint_manager(spark) == chosen
    if keyplane_jvm.loaded(spark):
        assert chosen == keyplane_jvm.CHECKPOINT_FILE_MANAGER
    else:
        assert chosen in SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS


def test_jit_options_from_the_environment_reach_the_driver_and_executors(tmp_path) -> None:
    """A job started with ``KEYPLANE_JVM_JIT_OPTIONS`` runs its HotSpot with them (a new JVM)."""
    script = (
        "from keyplane.spark.session import build_session\n"
        "spark = build_session('jit-options', 'local[1]')\n"
        "jvm = spark.sparkContext._jvm\n"
        "bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(\n"
        "    jvm.java.lang.Class.forName('com.sun.management.HotSpotDiagnosticMXBean'))\n"
        "print('trap-limit', bean.getVMOption('PerMethodTrapLimit').getValue())\n"
        "print('executors', spark.conf.get('spark.executor.extraJavaOptions'))\n"
        "spark.stop()\n"
    )
    env = {**os.environ, "KEYPLANE_JVM_JIT_OPTIONS": NO_TRAP_JIT_OPTIONS}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trap-limit 0\n" in done.stdout
    assert f"executors {NO_TRAP_JIT_OPTIONS}\n" in done.stdout


def test_the_session_leaves_the_jit_as_the_jvm_has_it_by_default(spark) -> None:
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    assert bean.getVMOption("PerMethodTrapLimit").getValue() != "0"
