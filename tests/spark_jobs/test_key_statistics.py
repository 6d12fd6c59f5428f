"""The statistics job (``spark_jobs/key_statistics.py``) on the real broker and a real SparkSession.

The DAG's end-to-end test runs the job through ``spark-submit`` once per
scheduled run; this one checks what the job reads, in seconds: exact key-pair
counts of the events window with malformed events counted apart, the metrics
window read on the driver with a malformed record skipped, a rerun of the same
run id that reads nothing, and the statistics of a three-stage pipeline over
nested JSON, against counts computed with pandas from the produced records.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from keyplane.algorithms import statistics as stats
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer, produce_workload
from keyplane.reference.workloads import PairsWorkload

pytestmark = pytest.mark.integration

JOB = Path(__file__).resolve().parents[2] / "spark_jobs" / "key_statistics.py"


def statistics_job() -> ModuleType:
    spec = importlib.util.spec_from_file_location("statistics_job", JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def produce_values(broker: str, topic: str, values: list[bytes], partition: int = 0) -> None:
    ensure_topic(broker, topic, 1)
    producer = make_producer(broker)
    try:
        for value in values:
            producer.send(topic, value=value, partition=partition)
        producer.flush()
    finally:
        producer.close(timeout=10)


# Values that are not events of the pipeline (not JSON objects, or a stage's key null):
# counted apart, while the events around them are counted.
MALFORMED_EVENTS = [
    b"not json",
    b'{"a": "1"}',
    b"[1, 2]",
    b"",
]
# An event that spans lines is still one event.
MULTILINE_EVENT = b'{"seq": 0, "a": "x",\n "b": "y", "ts": 0}'


def test_a_window_of_events_and_metrics_becomes_an_exact_snapshot_and_a_rerun_reads_nothing(
    broker: str, spark: object, topic_name: str, tmp_path: Path
) -> None:
    events_topic, metrics_topic = f"{topic_name}-events", f"{topic_name}-metrics"
    spec = PairsWorkload(n_keys=40, n_events=3_000, locality=0.8, seed=5)
    ensure_topic(broker, events_topic, 2)
    produce_workload(spec, broker, events_topic, partitions=2)
    produce_values(broker, events_topic, [*MALFORMED_EVENTS, MULTILINE_EVENT], partition=1)
    batches = [BatchMetrics(batch_id=i, versions={"A": v, "B": v}) for i, v in enumerate((1, 1, 2))]
    produce_values(
        broker,
        metrics_topic,
        [batches[0].model_dump_json().encode(), b"{not a metrics record"]
        + [record.model_dump_json().encode() for record in batches[1:]],
    )
    job = statistics_job()
    args = job.parse_args(
        [
            "--bootstrap-servers",
            broker,
            "--events-topic",
            events_topic,
            "--metrics-topic",
            metrics_topic,
            "--snapshots",
            str(tmp_path / "snapshots"),
            "--run-id",
            "run-1",
        ]
    )

    folder = job.collect(spark, args)

    snapshot = stats.read_snapshot(tmp_path / "snapshots", "run-1")
    assert snapshot.path == folder
    manifest = snapshot.manifest
    assert (manifest.n_events, manifest.n_metrics_records) == (3_000 + 1, 3)
    assert manifest.unparsed_events == len(MALFORMED_EVENTS)
    assert manifest.metrics.end == {0: 4}
    assert manifest.job_version == 2
    events = spec.events(0, spec.n_events)
    truth = Counter(zip(events.a.astype(str).tolist(), events.b.astype(str).tolist(), strict=True))
    truth["x", "y"] += 1
    counted = {
        (a, b): int(n)
        for stage, a, b, n in snapshot.pairs[["stage", "a", "b", "count"]].itertuples(index=False)
        if n > 0 and stage == "A"
    }
    assert counted == dict(truth)

    # The same run id again: its snapshot exists, so nothing is read or rewritten.
    manifest_file = folder / stats.MANIFEST_NAME
    written = manifest_file.stat().st_mtime_ns
    produce_workload(spec, broker, events_topic, partitions=2)
    assert job.collect(spark, args) == folder
    assert manifest_file.stat().st_mtime_ns == written


def _page_views(count: int, seed: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    views: list[dict[str, object]] = []
    for _ in range(count):
        user = int(rng.integers(0, 30))
        views.append(
            {
                "user_id": f"u{user}",
                "session_id": f"u{user}-s{int(rng.integers(0, 3))}",
                "page": {"category": f"c{user % 7 if rng.random() < 0.8 else rng.integers(7)}"},
                "dwell_ms": int(rng.integers(100, 9_000)),
            }
        )
    return views


def test_a_three_stage_pipeline_over_nested_json_counts_every_stage_and_consecutive_pair(
    broker: str,
    spark: object,
    topic_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The clickstream example: sessions → users → categories, the last keyed by the
    nested ``page.category``. Values that do not parse, or lack a stage's key, are
    counted apart; the good events' counts are exact."""
    import pandas as pd

    events_topic, metrics_topic = f"{topic_name}-clicks", f"{topic_name}-metrics"
    monkeypatch.setenv("CLICKS_TOPIC", events_topic)
    ensure_topic(broker, events_topic, 2)
    ensure_topic(broker, metrics_topic, 1)
    views = _page_views(1_200, seed=3)
    for partition in (0, 1):
        produce_values(
            broker,
            events_topic,
            [json.dumps(v).encode() for v in views[partition::2]],
            partition=partition,
        )
    # The job dead-letters each of these, so the statistics must not count them: one that
    # does not parse, one without a stage's key, one whose key has the wrong type, and one
    # with every key but no value for the first stage.
    bad = [
        b"not json",
        b'{"user_id": "u1", "session_id": "u1-s0"}',
        b'{"page": 3}',
        b'{"user_id": "u1", "session_id": "u1-s0", "page": {"category": "c1"}}',
    ]
    produce_values(broker, events_topic, bad, partition=1)

    job = statistics_job()
    args = job.parse_args(
        [
            "--bootstrap-servers",
            broker,
            "--pipeline",
            "examples.clickstream.pipeline:clicks",
            "--metrics-topic",
            metrics_topic,
            "--snapshots",
            str(tmp_path / "snapshots"),
            "--run-id",
            "run-1",
            "--holdout-fraction",
            "0.25",
        ]
    )
    job.collect(spark, args)
    snapshot = stats.read_snapshot(tmp_path / "snapshots", "run-1")

    truth = pd.DataFrame(
        {
            "sessions": [v["session_id"] for v in views],
            "users": [v["user_id"] for v in views],
            "categories": [v["page"]["category"] for v in views],  # type: ignore[index]
        }
    )
    assert snapshot.manifest.n_events == len(views)
    assert snapshot.manifest.unparsed_events == len(bad)
    assert [w.topic for w in snapshot.manifest.events] == [events_topic]
    frequencies = {
        (stage, key): int(n)
        for stage, key, n in snapshot.frequencies[["stage", "key", "count"]].itertuples(index=False)
    }
    expected = {
        (stage, key): int(n)
        for stage in ("sessions", "users", "categories")
        for key, n in truth[stage].value_counts().items()
    }
    assert frequencies == expected
    pairs = {
        (stage, a, b): int(n)
        for stage, a, b, n in snapshot.pairs[["stage", "a", "b", "count"]].itertuples(index=False)
    }
    expected_pairs = {
        (upstream, a, b): int(n)
        for upstream, downstream in (("sessions", "users"), ("users", "categories"))
        for a, b, n in truth.groupby([upstream, downstream])
        .size()
        .reset_index()
        .itertuples(index=False)
    }
    assert pairs == expected_pairs
    # The hold-out is each partition's newest quarter; partition 1's newest three are bad.
    newest = [len(views[0::2]) // 4, (len(views[1::2]) + len(bad)) // 4 - len(bad)]
    held = snapshot.frequencies.groupby("stage")["holdout"].sum()
    assert set(held.round().astype(int)) == {sum(newest)}
