"""What a key costs a Python ``transformWithState`` stage before any keyplane code runs.

Stage A of the routed job is a Python ``transformWithState`` (Spark allows
no second ``applyInPandasWithState`` after a first one). PySpark serves
each of its state calls with a socket round trip to a state server in the
executor's JVM: one to set the grouping key, one per ``get``, one per
``update``. This bench measures that floor, side by side in one session on
the same micro-batches, with three stateful counts of the same keys:

* ``spark-count``: Spark's own streaming ``groupBy(k).count()``, whose state
  never leaves the JVM;
* ``tws-no-state``: a Python ``transformWithState`` that counts its rows and
  emits one row per key, with no state call of its own;
* ``tws-get-update``: the same plus one ``get`` and one ``update`` per key,
  as stage A makes for every routed key in a batch.

The input is a file stream of ``--files`` Parquet files, one per batch, each
``--rows`` rows over ``--keys`` keys drawn uniformly. Each variant runs
``--repeats`` times, the variants taking turns; the first batch of a run is
not counted. Reported: the median batch duration and the cost per key of a
batch, and each variant against Spark's count.

    python bench/state_rpc_floor.py [--rows 20000] [--keys 9000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from _output import emit
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from keyplane.spark.session import build_session

SCHEMA = "k STRING, v LONG"


class CountRows(StatefulProcessor):
    """Counts a key's rows in a batch; with ``use_state``, also its running count in state."""

    def __init__(self, use_state: bool) -> None:
        self.use_state = use_state

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n LONG")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:
        n = sum(1 for _ in rows)
        if self.use_state:
            stored = self.count.get()
            n += stored[0] if stored else 0
            self.count.update((n,))
        yield Row(k=key[0], n=n)

    def close(self) -> None:
        pass


def variant(name: str, events: DataFrame) -> DataFrame:
    """The stateful count ``name`` over ``events``."""
    if name == "spark-count":
        return events.groupBy("k").count()
    return events.groupBy("k").transformWithState(
        CountRows(use_state=name == "tws-get-update"), "k STRING, n LONG", "Update", "None"
    )


VARIANTS = ("spark-count", "tws-no-state", "tws-get-update")


def batch_seconds(spark: SparkSession, name: str, source: Path, checkpoint: Path) -> list[float]:
    """Run ``name`` over the files of ``source``: each batch's ``addBatch`` s but the first."""
    events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        variant(name, events)
        .writeStream.format("noop")
        .outputMode("update")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return [p["durationMs"]["addBatch"] / 1000 for p in query.recentProgress][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=9_000)
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spark = build_session("keyplane-bench-state-rpc")
    rng = np.random.default_rng(7)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        source = tmp / "events"
        source.mkdir()
        keys_per_batch = []
        for i in range(args.files):
            keys = rng.integers(0, args.keys, args.rows)
            keys_per_batch.append(len(np.unique(keys)))
            frame = pd.DataFrame({"k": keys.astype(str), "v": np.ones(args.rows, dtype=np.int64)})
            frame.to_parquet(source / f"batch-{i:03d}.parquet", index=False)
        for run in range(args.repeats):
            for name in VARIANTS:
                seconds[name] += batch_seconds(spark, name, source, tmp / f"ck-{name}-{run}")
    spark.stop()

    keys = statistics.median(keys_per_batch)
    base = statistics.median(seconds["spark-count"])
    lines = [
        f"{args.rows:,} rows per batch over {args.keys:,} keys ({keys:,.0f} distinct per batch), "
        f"{args.files} batches per run, {args.repeats} runs per variant, local[2], RocksDB state",
        "",
        "| stateful count | median batch s | µs per key and batch | vs Spark's count |",
        "|---|---:|---:|---:|",
    ]
    for name in VARIANTS:
        median = statistics.median(seconds[name])
        lines.append(
            f"| {name} | {median:.2f} | {median / keys * 1e6:,.0f} | {median / base:.1f}× |"
        )
    get_update = statistics.median(seconds["tws-get-update"])
    no_state = statistics.median(seconds["tws-no-state"])
    lines += [
        "",
        f"one get and one update per key: {(get_update - no_state) / keys * 1e6:,.0f} µs "
        "per key and batch of wall time on 2 cores",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
