"""Who writes a batch under each setting of ``KEYPLANE_SINK_WRITER`` (pure logic)."""

from __future__ import annotations

import pytest

from keyplane.spark.routed_sink import AUTO_DRIVER_ROWS, writer_for_batch


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
