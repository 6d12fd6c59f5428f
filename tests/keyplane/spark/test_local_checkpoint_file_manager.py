"""keyplane's checkpoint file manager, driven through Spark's own interface in a real JVM.

It changes how a local checkpoint file is created (``LocalCheckpointFileManager.java``),
so these tests hold it to what Spark's atomic writes rely on: nothing under the
final name until the stream closes, nothing left behind by a cancelled write, no
silent overwrite, the mode Hadoop would have given the file, and checkpoints
that either manager reads after the other wrote them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from py4j.protocol import Py4JJavaError

from keyplane.spark import jvm as keyplane_jvm
from keyplane.spark.session import (
    CHECKPOINT_FILE_MANAGER_KEY,
    SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def manager(spark: Any, tmp_path: Path) -> Any:
    """keyplane's manager for ``tmp_path``, made as Spark makes the one a query uses."""
    if not keyplane_jvm.loaded(spark):
        pytest.skip("the session has no keyplane jar (no JDK to build it)")
    jvm = spark.sparkContext._jvm
    conf = jvm.org.apache.hadoop.conf.Configuration(spark.sparkContext._jsc.hadoopConfiguration())
    conf.set(CHECKPOINT_FILE_MANAGER_KEY, keyplane_jvm.CHECKPOINT_FILE_MANAGER)
    made = jvm.org.apache.spark.sql.execution.streaming.checkpointing.CheckpointFileManager.create(
        jvm.org.apache.hadoop.fs.Path(tmp_path.as_uri()), conf
    )
    assert made.getClass().getName() == keyplane_jvm.CHECKPOINT_FILE_MANAGER
    return made


def _path(spark: Any, path: Path) -> Any:
    return spark.sparkContext._jvm.org.apache.hadoop.fs.Path(path.as_uri())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_atomic_write_appears_under_its_name_only_when_closed(
    spark: Any, manager: Any, tmp_path: Path
) -> None:
    target = tmp_path / "state" / "1" / "7.changelog"  # parent directories not there yet
    stream = manager.createAtomic(_path(spark, target), True)
    stream.write(b"first batch")
    assert not target.exists()
    stream.close()
    assert target.read_bytes() == b"first batch"
    assert [p.name for p in target.parent.iterdir()] == ["7.changelog"]  # no temp file, no .crc
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()


def test_a_cancelled_write_leaves_nothing(spark: Any, manager: Any, tmp_path: Path) -> None:
    stream = manager.createAtomic(_path(spark, tmp_path / "offsets" / "3"), True)
    stream.write(b"half a record")
    stream.cancel()
    assert list((tmp_path / "offsets").iterdir()) == []


def test_a_write_that_may_not_overwrite_fails_and_keeps_the_file(
    spark: Any, manager: Any, tmp_path: Path
) -> None:
    target = tmp_path / "commits" / "0"
    target.parent.mkdir()
    target.write_bytes(b"batch 0 committed")
    stream = manager.createAtomic(_path(spark, target), False)
    stream.write(b"a second writer")
    with pytest.raises(Py4JJavaError, match="FileAlreadyExistsException"):
        stream.close()
    assert target.read_bytes() == b"batch 0 committed"
    assert [p.name for p in target.parent.iterdir()] == ["0"]


def test_an_overwrite_replaces_the_file(spark: Any, manager: Any, tmp_path: Path) -> None:
    target = tmp_path / "metadata"
    for text in (b"v1", b"v2 longer"):
        stream = manager.createAtomic(_path(spark, target), True)
        stream.write(text)
        stream.close()
    assert target.read_bytes() == b"v2 longer"


@pytest.fixture
def restore_manager(spark: Any) -> Iterator[None]:
    chosen = spark.conf.get(CHECKPOINT_FILE_MANAGER_KEY)
    yield
    spark.conf.set(CHECKPOINT_FILE_MANAGER_KEY, chosen)


def _count_files_so_far(spark: Any, inbox: Path, checkpoint: Path) -> dict[str, int]:
    """Run Spark's own stateful ``groupBy`` count over every file in ``inbox``; its counts."""
    from pyspark.sql.streaming import StreamingQuery

    counts: dict[str, int] = {}

    def collect(batch: Any, _batch_id: int) -> None:
        for row in batch.collect():
            counts[row["key"]] = int(row["count"])

    stream = spark.readStream.schema("key string").parquet(str(inbox))
    query: StreamingQuery = (
        stream.groupBy("key")
        .count()
        .writeStream.outputMode("update")
        .option("checkpointLocation", str(checkpoint))
        .foreachBatch(collect)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    return counts


def test_a_checkpoint_written_by_either_manager_is_taken_up_by_the_other(
    spark: Any, tmp_path: Path, restore_manager: None
) -> None:
    """An existing job's checkpoint keeps its state when the session's manager changes,
    both ways: the files' layout is Spark's, only their creation differs."""
    if not keyplane_jvm.loaded(spark):
        pytest.skip("the session has no keyplane jar (no JDK to build it)")
    inbox, checkpoint = tmp_path / "inbox", tmp_path / "checkpoint"
    inbox.mkdir()
    managers = [
        SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS[0],
        keyplane_jvm.CHECKPOINT_FILE_MANAGER,
        SPARK_FILE_SYSTEM_CHECKPOINT_MANAGERS[0],
    ]
    truth: dict[str, int] = {}
    for run, manager in enumerate(managers):
        keys = [f"k{(run * 7 + i) % 5}" for i in range(12)]
        pd.DataFrame({"key": keys}).to_parquet(inbox / f"part-{run}.parquet", index=False)
        for key in keys:
            truth[key] = truth.get(key, 0) + 1
        spark.conf.set(CHECKPOINT_FILE_MANAGER_KEY, manager)
        updated = _count_files_so_far(spark, inbox, checkpoint)
        assert updated == {key: truth[key] for key in set(keys)}, f"run {run} ({manager})"
    assert sorted(p.name for p in (checkpoint / "commits").iterdir() if p.name.isdigit()) == [
        "0",
        "1",
        "2",
    ]
