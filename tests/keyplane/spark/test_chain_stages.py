"""A user's chain of 1 to N stages runs under live reconfiguration, its sink exact.

Real broker, real SparkSession, the real controller. The three-stage
clickstream example (nested JSON, a sum, a distinct count and a top-k) and
the one-stage hot-merchant example run on v1 (all hash), then v2 goes live
(keys moved and a hot key split in every stage), then v3 (one split undone,
its partials merged), while the query runs. The sink's latest row per
(stage, key) equals ground truth computed with pandas over the records read
back from the topic, each event identified by its (partition, offset), and
the query's run id is the same throughout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from chain_runs import (
    P,
    clicks_truth,
    latest_results,
    produce,
    ranked_keys,
    raw_records,
    records,
    versions,
)

from examples.clickstream.pipeline import clicks
from examples.clickstream.produce import page_views
from examples.hot_merchant.pipeline import payments
from examples.hot_merchant.produce import payment_events
from keyplane.control.controller import Controller
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.migration_topic import read_moves
from keyplane.kafka.producer import LongLivedProducer
from keyplane.pipeline import ParquetSink, Pipeline
from keyplane.routing.config import save
from keyplane.settings import KafkaSource
from keyplane.spark.counts_job import read_partials, start_counts_query, stop_between_batches
from keyplane.spark.pipeline_sink import read_parquet_results
from keyplane.testing import events_read_by_connector, routed_job_settings


def run_live(
    spark: Any,
    broker: str,
    topic: str,
    work: Path,
    pipeline_spec: str,
    pipeline: Pipeline,
    batches: tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]],
    keys: Callable[[pd.DataFrame], dict[str, list[str]]],
    source: KafkaSource = "python",
) -> pd.DataFrame:
    """Run ``pipeline`` on v1 over the first events, roll out v2, write the second events,
    roll out v3, write the third; the sink's rows. ``source`` reads the events.

    Checks on the way that each rollout moved state in every stage and that v2's hot
    keys reported partials from three routed keys each."""
    assert produce(broker, topic, iter(batches[0])) == len(batches[0])
    store = work / "routing"
    ranked = keys(records(broker, topic))
    v1, v2, v3 = versions(pipeline.stage_names, ranked)
    save(v1, store)
    settings = routed_job_settings(
        broker, topic, work, parallelism=P, batch=1_000, trigger="0 seconds",
        pipeline=pipeline_spec, stage_engine="auto", source=source,
    )  # fmt: skip
    query = start_counts_query(spark, settings)
    try:
        query.processAllAvailable()
        run_id = query.runId
        with ControlChannel(broker, settings.control_topic) as channel:
            controller = Controller(channel, work / "controller.json", store)
            for config, events in ((v2, batches[1]), (v3, batches[2])):
                save(config, store)
                assert controller.rollout(config.version, timeout_s=120).version == config.version
                assert produce(broker, topic, iter(events)) == len(events)
                query.processAllAvailable()
        assert query.exception() is None
        assert query.runId == run_id
    finally:
        stop_between_batches(query)
    moves = pd.DataFrame(read_moves(broker, settings.migration_topic))
    assert set(moves["operator"]) == set(pipeline.stage_names)
    partials = read_partials(settings.output)
    for stage in pipeline.stage_names:
        key = ranked[stage][0]
        routed = partials[(partials["stage"] == stage) & (partials["key"] == key)]["routed_key"]
        assert routed.nunique() >= 3, (stage, key, sorted(set(routed)))
    assert isinstance(pipeline.sink, ParquetSink)
    return read_parquet_results(Path(pipeline.sink.path))


@pytest.mark.integration
@pytest.mark.parametrize(
    "engine_broker",
    [
        "embedded",
        pytest.param("kafka-connector", marks=[pytest.mark.apache_kafka, pytest.mark.slow]),
    ],
    indirect=True,
)
def test_a_three_stage_pipeline_stays_exact_through_moves_splits_and_an_unsplit(
    spark,
    engine_broker: str,
    kafka_source: KafkaSource,
    topic_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Also on Apache Kafka with Spark's connector reading the events: the offset log
    then holds the connector's offsets of every event, and keyplane's source read none."""
    broker = engine_broker
    monkeypatch.setenv("CLICKS_TOPIC", topic_name)
    monkeypatch.setenv("CLICKS_OUTPUT", str(tmp_path / "results"))
    monkeypatch.setenv("KEYPLANE_PIPELINE", "examples.clickstream.pipeline:clicks")
    views = list(page_views(4_500, users=60, seed=3))

    def keys(events: pd.DataFrame) -> dict[str, list[str]]:
        return {
            "sessions": ranked_keys(events, lambda e: e["session_id"]),
            "users": ranked_keys(events, lambda e: e["user_id"]),
            "categories": ranked_keys(events, lambda e: e["page"].map(lambda p: p["category"])),
        }

    rows = run_live(
        spark, broker, topic_name, tmp_path, "examples.clickstream.pipeline:clicks", clicks(),
        (views[:2_000], views[2_000:3_500], views[3_500:]), keys, kafka_source,
    )  # fmt: skip

    events = records(broker, topic_name)
    assert len(events) == 4_500
    assert latest_results(rows) == clicks_truth(events)
    assert rows["batch_id"].is_monotonic_increasing
    # None: keyplane's source read the topic's events itself.
    by_connector = events_read_by_connector(tmp_path / "checkpoint", topic_name)
    assert by_connector == (4_500 if kafka_source == "jvm" else None)


@pytest.mark.integration
def test_a_one_stage_pipeline_with_a_hot_key_stays_exact_through_a_split_and_an_unsplit(
    spark, broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also: records that cannot be keyed reach the dead-letter topic with their reasons,
    and a key that starts with NUL (what control rows start with) counts like any other."""
    monkeypatch.setenv("PAYMENTS_TOPIC", topic_name)
    monkeypatch.setenv("PAYMENTS_OUTPUT", str(tmp_path / "results"))
    monkeypatch.setenv("KEYPLANE_PIPELINE", "examples.hot_merchant.pipeline:payments")
    bad = [b"{not json", b'{"merchant": null, "cents": 5}', b'{"merchant": "m1", "cents": "x"}']
    ensure_topic(broker, topic_name, 2)
    producer = LongLivedProducer(broker)
    try:
        producer.send(topic_name, [(None, value) for value in bad])
    finally:
        producer.close()
    sent = [*payment_events(3_000, seed=5), {"merchant": "\x00m", "cents": 7}]
    pipeline = payments()
    stage = pipeline.stages[0]

    def keys(events: pd.DataFrame) -> dict[str, list[str]]:
        return {stage.name: ranked_keys(events, lambda e: e["merchant"])}

    rows = run_live(
        spark, broker, topic_name, tmp_path, "examples.hot_merchant.pipeline:payments", pipeline,
        (sent[:1_200], sent[1_200:2_200], sent[2_200:]), keys,
    )  # fmt: skip

    events = records(broker, topic_name)
    good = events[events["merchant"].notna() & events["cents"].map(lambda c: isinstance(c, int))]
    assert len(good) == 3_001
    grouped = good.groupby("merchant")["cents"]
    expected = {
        (stage.name, str(m)): {"cents": int(total), "payments": int(n)}
        for (m, total), n in zip(grouped.sum().items(), grouped.size(), strict=True)
    }
    assert ("merchants", "\x00m") in expected
    assert latest_results(rows) == expected
    hot = good["merchant"].value_counts().index[0]
    # The hot merchant was split over three instances and then not: still one answer per batch.
    assert rows[(rows["key"] == hot)]["batch_id"].is_unique
    letters = [json.loads(v) for _, _, v in raw_records(broker, f"{topic_name}.dead-letter")]
    assert sorted((letter["reason"], letter.get("value")) for letter in letters) == sorted(
        [
            ("the value does not parse against the source schema", bad[0].decode()),
            ("stage 'merchants': the key 'merchant' is null", bad[1].decode()),
            # A field of the wrong type makes the whole value fail the schema.
            ("the value does not parse against the source schema", bad[2].decode()),
        ]
    )
