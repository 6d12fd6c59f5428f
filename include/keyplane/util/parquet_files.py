"""Reading keyplane's own parquet files: by path, on the calling thread.

Every parquet file keyplane reads (stored configurations' tables, statistics
snapshots, the job's batch files) goes through :func:`read_table`, so that
one choice holds everywhere:

- ``ParquetFile`` rather than ``pq.read_table``: the latter imports
  ``pyarrow.dataset``, which costs every fresh Spark Python worker that
  routes a batch up to a second before its first row.
- By path, with ``use_threads=False``, rather than ``pd.read_parquet``:
  pandas hands pyarrow an open Python file, and pyarrow decodes on its
  thread pool. A short-lived process (a ``keyplane`` command) that did so
  can abort at interpreter exit, after its output is printed, with
  "terminate called without an active exception" while Arrow tears the pool
  down (apache/arrow#34314, #50482). keyplane's files are small; one thread
  reads them as fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import pandas as pd


def read_table(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    """One parquet file (``columns`` of it, else all) as an Arrow table.

    A directory is read as one file made of its ``part-*.parquet`` files in
    name order: the routed job's executors write a batch file that way, one
    part per task (:mod:`keyplane.spark.routed_sink`).
    """
    if path.is_dir():
        parts = sorted(path.glob("part-*.parquet"))
        if not parts:
            raise FileNotFoundError(f"{path}: a directory with no part-*.parquet file")
        # A part with no rows has untyped (null) text columns: promoted to the others' types.
        return pa.concat_tables([read_table(p, columns) for p in parts], promote_options="default")
    return pq.ParquetFile(path).read(columns=list(columns) if columns else None, use_threads=False)


def parquet_rows(path: Path) -> int:
    """The rows of a parquet file, or of a directory of parts, from their footers only."""
    if path.is_dir():
        return sum(parquet_rows(p) for p in path.glob("part-*.parquet"))
    return int(pq.ParquetFile(path).metadata.num_rows)


def read_frame(path: Path, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """One parquet file (``columns`` of it, else all) as a pandas frame."""
    return read_table(path, columns).to_pandas(use_threads=False)
