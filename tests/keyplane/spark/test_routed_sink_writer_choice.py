"""Who writes a batch under each setting of ``KEYPLANE_SINK_WRITER`` (pure logic), and what
either writer clears that the other left when a run was killed mid-batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.spark.routed_sink import AUTO_DRIVER_ROWS, remove_leftover, writer_for_batch


@pytest.mark.parametrize(
    ("rows_before", "expected"),
    [
        (None, "executors"),  # a run's first batch: perhaps a restart's backlog
        (0, "driver"),
        (AUTO_DRIVER_ROWS, "driver"),
        (AUTO_DRIVER_ROWS + 1, "executors"),
    ],
)
def test_auto_takes_the_driver_only_after_a_small_batch_pure(
    rows_before: int | None, expected: str
) -> None:
    assert writer_for_batch("auto", rows_before) == expected


@pytest.mark.parametrize("rows_before", [None, 0, 10 * AUTO_DRIVER_ROWS])
@pytest.mark.parametrize("setting", ["executors", "driver"])
def test_an_explicit_writer_writes_every_batch_pure(setting: str, rows_before: int | None) -> None:
    assert writer_for_batch(setting, rows_before) == setting


def test_a_replay_clears_the_unfinished_output_the_other_writer_left(tmp_path: Path) -> None:
    """A run killed while the driver wrote batch 1 left a file where the tasks of the next
    run's first batch, its replay, make a directory of parts, and the reverse; either
    leftover once stopped the job for good (``FileExistsError``)."""
    by_driver = tmp_path / ".batch-00000001.parquet.tmp"
    by_driver.write_bytes(b"PAR1 unfinished")
    by_tasks = tmp_path / ".batch-00000002.parquet.tmp"
    (by_tasks / "sub").mkdir(parents=True)
    (by_tasks / "part-00000.parquet").write_bytes(b"PAR1")
    keep = tmp_path / "batch-00000000.parquet"
    keep.write_bytes(b"PAR1 committed")

    for path in (by_driver, by_tasks, tmp_path / ".batch-00000003.parquet.tmp"):
        remove_leftover(path)
    by_driver.mkdir()  # as the tasks' writer then does

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".batch-00000001.parquet.tmp",
        "batch-00000000.parquet",
    ]
    assert by_driver.is_dir() and keep.read_bytes() == b"PAR1 committed"
