"""The sink's executor side gives the driver's rules' answers (real SparkSession, no broker).

:func:`batch_partials` must keep the latest partial per (stage, key, routed
key, instance) as :func:`latest_partials_of_batch` does, packed install
reports included; :func:`batch_summary` must give
:func:`traffic_metrics` the same metrics as the whole output does;
:func:`write_single_parquet` must leave one file with the batch file's
columns and types, empty batches included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from keyplane.algorithms.batchmetrics import TOP_PAIRS_PER_INSTANCE, traffic_metrics
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.ranges import offset_ranges, read_range
from keyplane.spark.counts_job import read_partials
from keyplane.spark.routed_counts import ROUTED_OUTPUT_SCHEMA
from keyplane.spark.routed_sink import (
    COUNT_COLUMNS,
    RoutedBatchWriter,
    batch_partials,
    batch_summary,
    latest_partials_of_batch,
    unpacked_partials,
    write_single_parquet,
)

pytestmark = pytest.mark.integration

FIELDS = [field.split()[0] for field in ROUTED_OUTPUT_SCHEMA.split(", ")]


def _batch(spark: Any, output: pd.DataFrame) -> Any:
    """``output`` as the stages' output DataFrame, nulls as nulls."""
    records = [
        tuple(None if pd.isna(v) else (int(v) if isinstance(v, float) else v) for v in row)
        for row in output.itertuples(index=False)
    ]
    return spark.createDataFrame(records, ROUTED_OUTPUT_SCHEMA)


def _sorted(frame: pd.DataFrame) -> list[dict[str, Any]]:
    records = [
        {k: (None if pd.isna(v) else v) for k, v in r.items()}
        for r in frame[COUNT_COLUMNS].to_dict("records")
    ]
    return sorted(records, key=lambda r: (r["stage"], r["key"], r["routed_key"], r["count"]))


OUTPUT = pd.DataFrame(
    [
        {"kind": "count", "stage": "A", "key": "k", "routed_key": "k#2", "instance": 3,
         "count": 45, "state": "45", "busy_ns": 2_000_000},
        {"kind": "count", "stage": "A", "key": "k", "routed_key": "k#2", "instance": 3,
         "count": 41, "state": "41", "busy_ns": 1_000_000},  # an earlier report, fewer tuples
        {"kind": "count", "stage": "B", "key": "\x00a", "routed_key": "\x00a", "instance": 1,
         "count": 2, "state": "2", "busy_ns": 500_000},
        {"kind": "count", "stage": "B", "key": "\x00b", "routed_key": "\x00b", "instance": 1,
         "count": 5, "state": "5", "busy_ns": 250_000},  # differs from the last after a NUL
        {"kind": "partials", "stage": "A", "count": 2, "state": json.dumps(
            [["A", "k", "k#1", None, 0, "0"], ["A", "m", "m#0", 0, 7, "7"]])},
        {"kind": "hop", "stage": "B", "instance": 1, "upstream": 3, "n": 7,
         "executor": "e1", "upstream_executor": "e1"},
        {"kind": "hop", "stage": "B", "instance": 0, "upstream": 0, "n": 4,
         "executor": "e0", "upstream_executor": "e1"},
        *({"kind": "pair", "stage": "B", "instance": 1, "key": f"b{i}", "detail": f"a{i}",
           "n": 100 - i} for i in range(TOP_PAIRS_PER_INSTANCE + 3)),
        {"kind": "pair", "stage": "B", "instance": 0, "key": "b", "detail": "a", "n": 9},
        {"kind": "moved", "stage": "A", "key": "k", "routed_key": "k#1", "target": "k#2",
         "count": 40, "state": "40", "marker": 2},
        {"kind": "moves", "stage": "A", "count": 3, "state": "{}"},
        {"kind": "invalid", "detail": json.dumps({"reason": "not json"})},
    ],
    columns=FIELDS,
)  # fmt: skip


def test_batch_partials_in_spark_equal_the_drivers_latest_partials(spark: Any) -> None:
    expected = latest_partials_of_batch(unpacked_partials(OUTPUT))
    got = batch_partials(_batch(spark, OUTPUT)).toPandas()

    assert list(got.columns) == COUNT_COLUMNS
    assert _sorted(got) == _sorted(expected)
    assert len(got) == 5  # k#2 once, at 45; the tombstone k#1 kept without an instance


def test_batch_summary_gives_the_metrics_of_the_whole_output(spark: Any) -> None:
    parallelism = {"A": 4, "B": 4}
    summary = batch_summary(_batch(spark, OUTPUT)).toPandas()

    assert traffic_metrics(7, summary, parallelism) == traffic_metrics(7, OUTPUT, parallelism)
    assert (summary["kind"] == "pair").sum() == TOP_PAIRS_PER_INSTANCE + 1
    assert (summary["kind"] == "count").sum() == 2  # one per (stage, instance)
    assert summary["kind"].value_counts()[["moved", "moves", "invalid"]].tolist() == [1, 1, 1]


def test_a_single_parquet_file_keeps_the_batch_files_columns(spark: Any, tmp_path: Path) -> None:
    write_single_parquet(batch_partials(_batch(spark, OUTPUT)), tmp_path / "batch-00000001.parquet")
    empty = OUTPUT[OUTPUT["kind"] == "hop"]
    write_single_parquet(batch_partials(_batch(spark, empty)), tmp_path / "batch-00000002.parquet")

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "batch-00000001.parquet",
        "batch-00000002.parquet",
    ]
    partials = read_partials(tmp_path)
    assert list(partials.columns) == [*COUNT_COLUMNS, "batch"]
    assert partials["batch"].tolist() == [1] * 5
    assert str(partials["instance"].dtype) == "Int32"
    assert str(partials["count"].dtype) == "int64"
    expected = latest_partials_of_batch(unpacked_partials(OUTPUT))
    assert _sorted(partials) == _sorted(expected)


def _topic(broker: str, topic: str) -> list[tuple[str, Any]]:
    """Every record of ``topic``: (key, value as JSON)."""
    out = []
    for part in offset_ranges(broker, topic, {}, high_watermarks(broker, topic)):
        for records in read_range(part):
            for key, value in zip(
                records.column("key").to_pylist(), records.column("value").to_pylist(), strict=True
            ):
                out.append((key.decode(), json.loads(value)))
    return out


def test_the_writer_sends_every_topics_records_and_writes_the_batch_file(
    spark: Any, broker: str, topic_name: str, tmp_path: Path
) -> None:
    """One ``foreachBatch`` call on a real batch: the executors' file and results records,
    the driver's moves, dead letters and metrics."""
    topics = {name: f"{topic_name}-{name}" for name in ("moves", "dead", "results")}
    for name in topics.values():
        ensure_topic(broker, name, 2)
    writer = RoutedBatchWriter(
        output=tmp_path / "out",
        bootstrap_servers=broker,
        migration_topic=topics["moves"],
        dead_letter_topic=topics["dead"],
        parallelism=4,
        stages=("A", "B"),
        results_topic=topics["results"],
    )
    try:
        writer(_batch(spark, OUTPUT), 3)
        writer(_batch(spark, OUTPUT), 3)  # a replay rewrites the same file
    finally:
        writer.producer.close()

    expected = _sorted(latest_partials_of_batch(unpacked_partials(OUTPUT)))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["batch-00000003.parquet"]
    assert _sorted(read_partials(tmp_path / "out")) == expected
    results = _topic(broker, topics["results"])
    assert len(results) == 2 * len(expected)  # at least once: the replay sent them again
    assert all(key == f"{value['stage']}:{value['key']}" for key, value in results)
    assert all(list(value) == COUNT_COLUMNS for _, value in results)  # the key column left out
    twice = _sorted(pd.DataFrame([value for _, value in results]))
    assert twice[::2] == twice[1::2] == expected
    moves = _topic(broker, topics["moves"])
    assert [key for key, _ in moves] == ["3"] * 4  # one moved and one packed record, twice
    assert [value for _, value in _topic(broker, topics["dead"])] == [{"reason": "not json"}] * 2
    parallelism = {"A": 4, "B": 4}
    assert writer.metrics[3] == traffic_metrics(3, OUTPUT, parallelism)
