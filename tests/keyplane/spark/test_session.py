"""The settings every keyplane session carries, read back from a real SparkSession."""

from __future__ import annotations

import pytest

from keyplane.spark.session import (
    CHECKPOINT_FILE_MANAGER_KEY,
    FILE_SYSTEM_CHECKPOINT_MANAGERS,
    use_file_system_checkpoint_manager,
)

pytestmark = pytest.mark.integration


def test_checkpoint_files_go_through_a_file_system_manager_this_spark_has(spark) -> None:
    """A class name Spark cannot load fails every query at start; the session names one it has."""
    chosen = spark.conf.get(CHECKPOINT_FILE_MANAGER_KEY)
    assert chosen in FILE_SYSTEM_CHECKPOINT_MANAGERS
    assert spark.sparkContext._jvm.java.lang.Class.forName(chosen).getName() == chosen
    assert use_file_system_checkpoint_manager(spark) == chosen
