"""A pipeline's sink gets each key's merged result, split hot keys and moved states included.

The pure test drives :class:`~keyplane.spark.pipeline_sink.MergedResults`
with batches of partials. The integration test runs the routed job on a
named pipeline (real broker, real SparkSession, the real controller): v1
splits a hot key of each stage, v2 goes live while the query runs, merging
stage A's split, changing stage B's and moving keys of both. The sink's
latest row per (stage, key) equals ground truth computed with pandas over
the records read back from the events topic, and the query's run id is
the same before and after the rollout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from keyplane.aggregates import RunningCount
from keyplane.control.controller import Controller
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import LongLivedProducer, produce_workload
from keyplane.kafka.ranges import offset_ranges, read_range
from keyplane.pipeline import BatchSink, KafkaSink
from keyplane.reference.workloads import GeoTagsWorkload
from keyplane.routing.config import save
from keyplane.spark.counts_job import start_counts_query, stop_between_batches
from keyplane.spark.pipeline_sink import MergedResults, read_parquet_results, write_results
from keyplane.spark.routed_sink import latest_partials_of_batch
from keyplane.testing import routed_job_settings, split_then_unsplit

P = 4
"""Instances per operator: the ``spark`` fixture's shuffle partitions."""

PIPELINE_MODULE = """
from keyplane import KafkaSource, ParquetSink, Pipeline, Stage
from keyplane.aggregates import DistinctCount, TopK
from keyplane.reference.pipeline import EVENT_SCHEMA

def tags():
    return Pipeline(
        "tags",
        KafkaSource({topic!r}, EVENT_SCHEMA),
        (
            Stage("A", key="a", value="b", aggregate=TopK(3)),
            Stage("B", key="b", value="a", aggregate=DistinctCount()),
        ),
        ParquetSink({sink!r}),
    )
"""


def _partials(rows: list[tuple[str, str, str, int | None, int, str]]) -> pd.DataFrame:
    """One batch's stage output rows: ``count`` partials (stage, key, routed key, instance,
    count, state), as :func:`latest_partials_of_batch` reads them."""
    frame = pd.DataFrame(
        rows, columns=["stage", "key", "routed_key", "instance", "count", "state"]
    ).assign(kind="count")
    return latest_partials_of_batch(frame)


def test_split_and_moved_partials_reach_the_sink_merged_pure(tmp_path: Path) -> None:
    """Batch 0: key x split over x and x#1; batch 1 updates x#1 only, and the sink still
    merges x's partial from batch 0; batch 2 moves x#1's state into x (its tombstone, the
    zero); a replay of batch 2 after a restart, from the batch files, gives the same rows."""
    count = RunningCount()
    merged = MergedResults({"A": count, "B": count}, tmp_path)
    batches = [
        _partials(
            [("A", "x", "x", 0, 3, "3"), ("A", "x", "x#1", 1, 2, "2"), ("B", "y", "y", 2, 5, "5")]
        ),
        _partials([("A", "x", "x#1", 1, 4, "4")]),
        _partials([("A", "x", "x#1", None, 0, "0"), ("A", "x", "x", 0, 7, "7")]),
    ]  # fmt: skip
    got = []
    for batch_id, partials in enumerate(batches):
        got.append(merged.batch(partials, batch_id).to_dict("records"))
        partials.to_parquet(tmp_path / f"batch-{batch_id:08d}.parquet")

    assert got == [
        [
            {"stage": "A", "key": "x", "result": "5", "batch_id": 0},
            {"stage": "B", "key": "y", "result": "5", "batch_id": 0},
        ],
        [{"stage": "A", "key": "x", "result": "7", "batch_id": 1}],
        [{"stage": "A", "key": "x", "result": "7", "batch_id": 2}],
    ]
    replayed = MergedResults({"A": count, "B": count}, tmp_path).batch(batches[2], 2)
    assert replayed.to_dict("records") == got[2]


def _records(broker: str, topic: str) -> pd.DataFrame:
    """Every event of ``topic`` as the producer wrote it, identified by (partition, offset)."""
    rows = []
    for part in offset_ranges(broker, topic, {}, high_watermarks(broker, topic)):
        for records in read_range(part):
            for offset, value in zip(
                records.column("offset").to_pylist(),
                records.column("value").to_pylist(),
                strict=True,
            ):
                rows.append({"partition": part.partition, "offset": offset, **json.loads(value)})
    return pd.DataFrame(rows)


def _truth(events: pd.DataFrame) -> dict[tuple[str, str], object]:
    """Stage A: each a's three most frequent b (ties by b); stage B: each b's distinct a."""
    truth: dict[tuple[str, str], object] = {}
    pairs = events.groupby(["a", "b"]).size().reset_index(name="n")
    for a, group in pairs.groupby("a"):
        ranked = group.sort_values(["n", "b"], ascending=[False, True]).head(3)
        truth["A", str(a)] = [[b, int(n)] for b, n in zip(ranked["b"], ranked["n"], strict=True)]
    for b, distinct in events.groupby("b")["a"].nunique().items():
        truth["B", str(b)] = int(distinct)
    return truth


@pytest.mark.integration
def test_the_sink_holds_exact_merged_results_through_a_split_and_a_live_move(
    spark, broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = tmp_path / "results"
    (tmp_path / "sink_test_pipelines.py").write_text(
        PIPELINE_MODULE.format(topic=topic_name, sink=str(sink))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = GeoTagsWorkload(n_events=3_000, n_regions=12, n_tags=40, seed=21)
    after = GeoTagsWorkload(n_events=2_000, n_regions=12, n_tags=40, seed=22)
    assert produce_workload(before, broker, topic_name, partitions=2) == before.n_events
    counts = _records(broker, topic_name)
    a_keys = counts["a"].value_counts().index.tolist()
    b_keys = counts["b"].value_counts().index.tolist()
    store = tmp_path / "routing"
    v1, v2 = split_then_unsplit(a_keys, b_keys, P)
    save(v1, store)
    settings = routed_job_settings(
        broker,
        topic_name,
        tmp_path,
        parallelism=P,
        batch=1_000,
        trigger="0 seconds",
        pipeline="sink_test_pipelines:tags",
        stage_engine="auto",
    )
    try:
        query = start_counts_query(spark, settings)
        try:
            query.processAllAvailable()
            run_id = query.runId
            with ControlChannel(broker, settings.control_topic) as channel:
                controller = Controller(channel, tmp_path / "controller.json", store)
                save(v2, store)
                assert controller.rollout(2, timeout_s=120).version == 2
            assert produce_workload(after, broker, topic_name, partitions=2) == after.n_events
            query.processAllAvailable()
            assert query.exception() is None
            assert query.runId == run_id
        finally:
            stop_between_batches(query)
    finally:
        sys.modules.pop("sink_test_pipelines", None)

    rows = read_parquet_results(sink)
    assert rows["batch_id"].is_monotonic_increasing
    latest = rows.drop_duplicates(["stage", "key"], keep="last")
    observed = {(s, k): json.loads(r) for s, k, r in latest[["stage", "key", "result"]].values}
    events = _records(broker, topic_name)
    assert len(events) == before.n_events + after.n_events
    assert observed == _truth(events)
    # The hot keys were split, then merged or re-split, and still answer once each.
    assert rows[(rows["stage"] == "A") & (rows["key"] == a_keys[0])]["batch_id"].nunique() >= 2


@pytest.mark.integration
def test_kafka_and_batch_sinks_get_the_rows_as_documented(
    spark, broker: str, topic_name: str
) -> None:
    """A KafkaSink gets one record per row, key ``stage/key``, the row as JSON; a BatchSink
    a DataFrame of OUTPUT_SCHEMA and the batch id (real broker, real SparkSession)."""
    results = pd.DataFrame(
        [
            {"stage": "users", "key": "u1", "result": '{"n":2}', "batch_id": 4},
            {"stage": "pages", "key": "p/9", "result": "[1,2]", "batch_id": 4},
        ]
    )
    ensure_topic(broker, topic_name, 1)
    producer = LongLivedProducer(broker)
    try:
        write_results(KafkaSink(topic_name), results, 4, spark=spark, producer=producer)
    finally:
        producer.close()
    [part] = offset_ranges(broker, topic_name, {}, high_watermarks(broker, topic_name))
    records = [table.to_pylist() for table in read_range(part)]
    sent = [(r["key"].decode(), json.loads(r["value"])) for batch in records for r in batch]
    assert sent == [
        ("users/u1", {"stage": "users", "key": "u1", "result": '{"n":2}', "batch_id": 4}),
        ("pages/p/9", {"stage": "pages", "key": "p/9", "result": "[1,2]", "batch_id": 4}),
    ]

    handed: list[tuple[list[tuple], int, str]] = []

    def keep(frame, batch_id: int) -> None:
        handed.append(
            ([tuple(row) for row in frame.collect()], batch_id, frame.schema.simpleString())
        )

    write_results(BatchSink(keep), results, 4, spark=spark, producer=producer)
    assert handed == [
        (
            [("users", "u1", '{"n":2}', 4), ("pages", "p/9", "[1,2]", 4)],
            4,
            "struct<stage:string,key:string,result:string,batch_id:bigint>",
        )
    ]
