"""``bench/against_revision.py``: which sink wrote a run (pure, on hand-made output)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def against(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("against_revision")


def test_a_runs_sink_is_told_by_its_last_batch_file_pure(
    against: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match="no batch file"):
        against.sink_shape(tmp_path)
    (out / "batch-00000000.parquet").write_bytes(b"")
    assert against.sink_shape(tmp_path) == "file"
    (out / "batch-00000001.parquet").mkdir()
    assert against.sink_shape(tmp_path) == "parts"
