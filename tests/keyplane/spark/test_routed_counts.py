"""Routed stages: a static routing config places keys, splits a hot key, stays exact.

The streaming test runs the real two-stage job on the real broker with a
configuration that moves some keys of each stage to chosen instances and
splits one hot key per stage over three instances (paper 000 §3.3, paper 001
§4.1.2). Placement is checked from what the operators themselves report
(their task's partition id), and the merged counts against the generator's
ground truth. The partial-merge test is pure and needs neither.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import Row

from keyplane.aggregates import RunningCount, ValueCounts
from keyplane.algorithms.batchmetrics import traffic_metrics
from keyplane.algorithms.partials import latest_partials, merge_partials
from keyplane.algorithms.scaling import stage_shares
from keyplane.control.controller import Controller
from keyplane.control.operators import OPERATORS
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.reference.events import Forward
from keyplane.reference.verification import compare_counts, expected_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload, ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.handoff import routed_key_table
from keyplane.routing.routedkeys import spark_partition
from keyplane.settings import KafkaSource, SinkWriter
from keyplane.spark import routed_reads
from keyplane.spark.counts_job import (
    CountsJobSettings,
    read_output,
    read_partials,
    start_counts_query,
    stop_between_batches,
)
from keyplane.spark.routed_counts import (
    ROUTED_OUTPUT_SCHEMA,
    RoutedStageA,
    StageEngine,
    _output_row,
    _passed_through,
    routed_running_counts,
    take_installs,
)
from keyplane.spark.routed_sink import latest_partials_of_batch, merge_partial_states
from keyplane.testing import (
    WaitingCount,
    moved_off_hash_config,
    routed_job_settings,
    stage_keys_by_count,
)

P = 4
"""Instances per operator: the ``spark`` fixture's shuffle partitions."""
OPERATOR_NAMES = {"jvm": "TransformWithState", "python": "TransformWithStateInPySpark"}
"""The stateful operators Spark reports for each engine's stages."""


def test_merge_partials_sums_each_routed_keys_latest_partial_pure() -> None:
    rows = pd.DataFrame(
        [
            # hot key "h" split over three routed keys; partials grow across batches
            ("A", "h", "h#0", 0, 5, 1),
            ("A", "h", "h#0", 0, 9, 2),
            ("A", "h", "h#3", 1, 4, 1),
            ("A", "h", "h#3", 1, 7, 1),  # reported again in the same batch: the larger wins
            ("A", "h", "h#8", 3, 2, 2),
            # a tabled key: a single routed key, its partial is its count
            ("A", "t", "t#5", 2, 3, 1),
            # an unrouted key is its own routed key
            ("B", "u", "u", 1, 6, 1),
            ("B", "u", "u", 1, 8, 2),
            # the newest batch's report wins even when smaller (state moved away)
            ("B", "m", "m#1", 0, 10, 1),
            ("B", "m", "m#1", 0, 0, 2),
            ("B", "m", "m#4", 2, 10, 2),
        ],
        columns=["stage", "key", "routed_key", "instance", "count", "batch"],
    )
    merged = merge_partials(rows)
    assert merged.to_dict("records") == [
        {"stage": "A", "key": "h", "count": 9 + 7 + 2},
        {"stage": "A", "key": "t", "count": 3},
        {"stage": "B", "key": "m", "count": 10},
        {"stage": "B", "key": "u", "count": 8},
    ]
    latest = latest_partials(rows)
    assert latest.loc[latest["routed_key"] == "h#3", ["instance", "count"]].values.tolist() == [
        [1, 7]
    ]
    # Unrouted output (no routed_key, no batch column) merges to itself.
    plain = pd.DataFrame({"stage": ["A", "A", "B"], "key": ["x", "x", "y"], "count": [2, 3, 1]})
    assert merge_partials(plain).to_dict("records") == [
        {"stage": "A", "key": "x", "count": 3},
        {"stage": "B", "key": "y", "count": 1},
    ]


def _run_to_end(spark, settings: CountsJobSettings) -> list[str]:
    """Run the job over the topic; its physical plan's stateful operators, in plan order."""
    query = start_counts_query(spark, settings)
    try:
        query.processAllAvailable()
        plan = query._jsq.explainInternal(False)
        # The connector's events are routed in the JVM, by no Python function.
        assert ("MapInArrow" in plan, "MapPartitions" in plan) == (False, settings.source == "jvm")
        return re.findall(r"TransformWithState(?:InPySpark)?\b", plan)
    finally:
        stop_between_batches(query)


def _run_with_rollout(
    spark,
    broker: str,
    settings: CountsJobSettings,
    tmp_path: Path,
    config: RoutingConfig,
    then: Callable[[], object],
) -> list[str]:
    """Run the job over the topic, roll ``config`` out through the controller, call
    ``then`` (to send more events), run to the end; the plan's stateful operators."""
    store = settings.routing_store
    assert store is not None
    query = start_counts_query(spark, settings)
    try:
        query.processAllAvailable()
        save(config, store)
        with ControlChannel(broker, settings.control_topic) as channel:
            controller = Controller(channel, tmp_path / "controller.json", store)
            assert controller.rollout(config.version, timeout_s=300).version == config.version
        then()
        query.processAllAvailable()
        assert query.exception() is None
        return re.findall(r"TransformWithState(?:InPySpark)?\b", query._jsq.explainInternal(False))
    finally:
        stop_between_batches(query)


def _settings(
    broker: str,
    topic: str,
    tmp_path: Path,
    routing_store: Path | None = None,
    forward: Forward = "pairs",
    stage_engine: StageEngine = "auto",
    max_event_bytes: int | None = None,
    sink_writer: SinkWriter = "executors",
    source: KafkaSource = "python",
) -> CountsJobSettings:
    routed_only = {} if max_event_bytes is None else {"max_event_bytes": max_event_bytes}
    routed_only |= {"sink_writer": sink_writer, "source": source}
    return routed_job_settings(
        broker,
        topic,
        tmp_path,
        parallelism=P,
        batch=1_000,
        trigger="0 seconds",
        forward=forward,
        stage_engine=stage_engine,
        **routed_only,
        routing_store=routing_store,
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("engine", "writer", "source"),
    [
        ("jvm", "executors", "python"),
        ("python", "executors", "python"),
        ("jvm", "auto", "python"),
        pytest.param("jvm", "executors", "jvm", marks=pytest.mark.apache_kafka),
        pytest.param("python", "executors", "jvm", marks=pytest.mark.apache_kafka),
    ],
)
def test_routed_job_places_keys_splits_hot_keys_and_counts_exactly(
    request: pytest.FixtureRequest,
    spark,
    topic_name: str,
    tmp_path: Path,
    engine: StageEngine,
    writer: SinkWriter,
    source: KafkaSource,
) -> None:
    """Either engine (:mod:`keyplane.spark.jvm` or Python) places, splits and counts the
    same, whether the tasks write the batch output (a directory of parts per batch) or the
    driver does (one file) after the first batch (``auto``), and whether keyplane's source
    reads the events or Spark's connector does (source ``jvm``, on Apache Kafka: the
    connector's latest offsets come short on the embedded broker)."""
    broker = _source_broker(request, source)
    spec = ZipfEvolvingWorkload(n_keys=300, exponent=1.2, n_categories=12, n_events=4_000, seed=5)
    assert produce_workload(spec, broker, topic_name, partitions=2) == spec.n_events
    truth = expected_counts(spec)
    a_keys, b_keys = stage_keys_by_count(truth)
    hot_a, hot_b = a_keys[0], b_keys[0]
    config = moved_off_hash_config(
        1,
        {"A": a_keys[1:9], "B": b_keys[1:5]},
        P,
        hot_keys={"A": {hot_a: (0, 1, 3)}, "B": {hot_b: (1, 2, 3)}},
    )
    save(config, tmp_path / "routing")
    settings = _settings(
        broker,
        topic_name,
        tmp_path,
        routing_store=tmp_path / "routing",
        stage_engine=engine,
        sink_writer=writer,
        source=source,
    )
    operators = _run_to_end(spark, settings)
    assert operators == [OPERATOR_NAMES[engine]] * 2

    batch_files = sorted(settings.output.glob("batch-*.parquet"))
    # The tasks write a directory of parts, the driver one file; auto has the tasks write
    # the run's first batch and the driver the rest, as every batch here is small.
    written_by_tasks = [path.is_dir() for path in batch_files]
    assert written_by_tasks == [writer != "driver"] + [writer == "executors"] * (
        len(batch_files) - 1
    )
    partials = read_partials(settings.output)
    assert partials["batch"].nunique() >= 4, "several batches: partials merge across batches"
    for stage, key in (("A", hot_a), ("B", hot_b)):
        assert (
            partials.loc[(partials["stage"] == stage) & (partials["key"] == key), "batch"].nunique()
            >= 2
        )
    # Each routed key's state lives on exactly one instance, the one its hash selects.
    tables = {stage: routed_key_table(config.operators[stage]) for stage in OPERATORS}
    placements = partials.groupby(["stage", "routed_key"], as_index=False)["instance"].agg(set)
    for stage, routed, instances in placements.itertuples(index=False):
        assert instances == {tables[stage].instance_of(routed)}, (stage, routed, instances)

    for stage in OPERATORS:
        routing = config.operators[stage]
        table = routed_key_table(routing)
        rows = partials[partials["stage"] == stage]
        observed = rows.groupby("key")["instance"].agg(set)
        routed_keys = rows.groupby("key")["routed_key"].agg(set)
        # (a) every tabled key is observed on its configured instance only
        for key, instance in routing.table.items():
            assert observed[key] == {instance}, (stage, key, observed[key], instance)
            assert spark_partition(key, P) != instance, "the table really moves the key"
        # (b) the hot key's partials are observed on exactly its three instances
        for key, instances in routing.hot_keys.items():
            assert observed[key] == set(instances), (stage, key, observed[key])
            assert routed_keys[key] == set(table.route(key))
        # (c) every other key keeps its natural hash partition, grouped by itself
        special = set(routing.table) | set(routing.hot_keys)
        plain = [key for key in observed.index if key not in special]
        assert len(plain) >= 5
        for key in plain:
            assert observed[key] == {spark_partition(key, P)}, (stage, key)
            assert routed_keys[key] == {key}

    # (d) merging the partials gives every key's exact count
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == spec.n_events
    assert report.exact, report


@pytest.mark.integration
def test_without_routing_the_job_keeps_its_plain_output(
    spark, broker: str, topic_name: str, tmp_path: Path
) -> None:
    """No configuration: plain keys, the same ``stage, key, count`` files as before."""
    spec = ZipfEvolvingWorkload(n_keys=300, exponent=1.2, n_categories=12, n_events=2_000, seed=6)
    assert produce_workload(spec, broker, topic_name, partitions=2) == spec.n_events
    settings = _settings(broker, topic_name, tmp_path)
    _run_to_end(spark, settings)

    batch_files = sorted(settings.output.glob("batch-*.parquet"))
    assert batch_files
    assert all(list(pd.read_parquet(f).columns) == ["stage", "key", "count"] for f in batch_files)
    report = compare_counts(expected_counts(spec), read_output(settings.output))
    assert report.expected_events == spec.n_events
    assert report.exact, report


def test_take_installs_is_idempotent_per_marker_and_source_pure() -> None:
    # Two partials of one split key arrive, one of them twice (a replayed batch).
    installs = [("h#1", ("5", 5), 7), ("h#4", ("3", 3), 7), ("h#1", ("5", 5), 7)]
    assert take_installs(installs, installed_marker=-1) == (
        [("5", 5), ("3", 3)],
        7,
        ["h#1", "h#4"],
    )
    # Already installed at marker 7: a later replay of the same records adds nothing.
    assert take_installs(installs, installed_marker=7) == ([], 7, [])
    # A newer hand-off (marker 9) applies on top.
    assert take_installs([("h#2", ("4", 4), 9)], installed_marker=7) == ([("4", 4)], 9, ["h#2"])


def test_output_rows_carry_every_field_of_the_output_schema_in_order_pure() -> None:
    """Stage B's rows name every output column, in the schema's order, and leave the
    fields a kind has no use for null, as Spark converts rows to the schema by position."""
    names = [field.split()[0] for field in ROUTED_OUTPUT_SCHEMA.split(", ")]
    row = _output_row(kind="hop", instance=1, upstream=0, n=5)
    assert list(row.asDict()) == names
    assert row.asDict() == {
        **dict.fromkeys(names),
        "kind": "hop", "instance": 1, "upstream": 0, "n": 5,
    }  # fmt: skip


def test_sink_keeps_each_partials_latest_state_and_readers_merge_it_pure() -> None:
    """A batch's rows → one partial per routed key; batches' partials → the aggregate's answer."""
    counts = ValueCounts()

    def row(stage: str, key: str, rk: str, instance: int | None, values: list[str]) -> dict:
        state = counts.add(counts.zero(), values)
        return {
            "kind": "count", "stage": stage, "key": key, "routed_key": rk,
            "instance": instance, "count": len(values), "state": counts.encode(state),
        }  # fmt: skip

    batch_1 = pd.DataFrame(
        [
            # stage A's partial reaches the sink once per downstream group: the fullest wins
            row("A", "h", "h#0", 0, ["x"]),
            row("A", "h", "h#0", 0, ["x", "y"]),
            row("A", "h", "h#3", 1, ["y", "y", "z"]),
            row("A", "m", "m#1", 2, ["x"]),
            {"kind": "hop", "n": 3},
        ]
    )
    batch_2 = pd.DataFrame(
        [
            # m moved from m#1 to m#2: the tombstone is the zero and must not count
            row("A", "m", "m#1", None, []),
            row("A", "m", "m#2", 3, ["x", "w"]),
        ]
    )
    partials = pd.concat(
        [
            latest_partials_of_batch(batch).assign(batch=batch_id)
            for batch_id, batch in ((1, batch_1), (2, batch_2))
        ],
        ignore_index=True,
    )
    assert len(partials) == 5
    merged = merge_partial_states(partials, {"A": counts})
    assert merged.to_dict("records") == [
        {"stage": "A", "key": "h", "result": {"x": 1, "y": 3, "z": 1}},
        {"stage": "A", "key": "m", "result": {"w": 1, "x": 1}},
    ]
    # The tuple counts merge to the same totals as the running count would give.
    assert merge_partials(partials)["count"].tolist() == [5, 2]


SOURCES = ["python", pytest.param("jvm", marks=pytest.mark.apache_kafka)]
"""Who reads the events: keyplane's source on the embedded broker, or Spark's connector on
Apache Kafka (:func:`_source_broker`)."""


def _source_broker(request: pytest.FixtureRequest, source: KafkaSource) -> str:
    """The broker a test of ``source`` runs on: Spark's connector reads Apache Kafka (the
    embedded broker answers its admin client's latest offsets short)."""
    return str(request.getfixturevalue("apache_kafka_broker" if source == "jvm" else "broker"))


@pytest.mark.integration
@pytest.mark.parametrize("source", SOURCES)
def test_malformed_records_are_dead_lettered_with_a_reason_and_counts_stay_exact(
    request: pytest.FixtureRequest, spark, source: KafkaSource, topic_name: str, tmp_path: Path
) -> None:
    broker = _source_broker(request, source)
    from kafka import KafkaConsumer, TopicPartition

    from keyplane.kafka.admin import high_watermarks
    from keyplane.kafka.producer import make_producer

    spec = ZipfEvolvingWorkload(n_keys=200, exponent=1.1, n_categories=10, n_events=3_000, seed=7)
    assert produce_workload(spec, broker, topic_name, partitions=2) == spec.n_events
    bad = [
        b"{not json",
        b'{"seq": 1, "b": "x", "ts": 5}',
        b'{"seq": "7", "a": "x", "b": "y", "ts": 5}',
        b"x" * 70_000,
        # Valid, but over the job's configured bound (below the default one).
        json.dumps({"seq": 9, "a": "x", "b": "y", "ts": 5, "pad": "p" * 5_000}).encode(),
    ]
    producer = make_producer(broker)
    for value in bad:
        producer.send(topic_name, value=value, partition=1)
    producer.flush()
    producer.close()
    save(
        RoutingConfig(
            version=1,
            created_by="initial",
            operators={s: OperatorRouting(parallelism=P) for s in OPERATORS},
        ),
        tmp_path / "routing",
    )
    settings = _settings(
        broker,
        topic_name,
        tmp_path,
        routing_store=tmp_path / "routing",
        max_event_bytes=4_096,
        source=source,
    )
    _run_to_end(spark, settings)

    report = compare_counts(expected_counts(spec), read_output(settings.output))
    assert report.exact, report
    dead_letters = settings.dead_letter_topic
    assert sum(high_watermarks(broker, dead_letters).values()) == len(bad)
    consumer = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
    tp = TopicPartition(dead_letters, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    records: list[dict[str, Any]] = []
    while len(records) < len(bad):
        records += [json.loads(r.value) for r in consumer.poll(timeout_ms=1000).get(tp, [])]
    consumer.close()
    reasons = sorted(r["reason"].split(":")[0] for r in records)
    assert reasons == ["not JSON", "oversized", "oversized", "schema", "schema"]
    assert {r["source"] for r in records} == {f"{topic_name}[1]"}

    # Each one is counted in the metrics record of the batch that read it.
    def invalid_in_metrics() -> int:
        ends = high_watermarks(broker, settings.metrics_topic)
        reader = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
        total = 0
        for partition, end in ends.items():
            tp = TopicPartition(settings.metrics_topic, partition)
            reader.assign([tp])
            reader.seek_to_beginning(tp)
            while reader.position(tp) < end:
                for record in reader.poll(timeout_ms=500).get(tp, []):
                    total += json.loads(record.value)["invalid_events"]
        reader.close()
        return total

    deadline = time.monotonic() + 60
    while invalid_in_metrics() < len(bad) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert invalid_in_metrics() == len(bad)


def test_stage_a_sends_one_row_per_pair_or_every_tuple_with_its_padding_pure() -> None:
    """``pairs``: a weight per (field-2 key, routed key of B); ``tuples``: each tuple and
    its padding, on the route the source chose. No row carries the group's partial: that
    travels apart, once per group and batch, not once per field-2 key."""
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    events = [
        Row(b=b, rb=rb, watermark_ts=ts, n=1, pad=pad)
        for b, rb, pad in (("x", "x#1", "p"), ("y", "y#0", "qq"), ("x", "x#1", "r"))
    ]

    def sent(forward: Forward) -> list[dict]:
        stage = RoutedStageA(P, RunningCount(), forward)
        rows = stage._to_stage_b("k#3", "k", events, (3, "host:1"))
        return [row.asDict() for row in rows]

    pairs = sent("pairs")
    assert [(r["b"], r["rb"], r["n"], r["ctl"]) for r in pairs] == [
        ("x", "x#1", 2, None),
        ("y", "y#0", 1, None),
    ]
    assert all("pad" not in r for r in pairs)
    tuples = sent("tuples")
    assert [(r["b"], r["rb"], r["n"], r["pad"], r["ctl"]) for r in tuples] == [
        ("x", "x#1", 1, "p", None),
        ("y", "y#0", 1, "qq", None),
        ("x", "x#1", 1, "r", None),
    ]
    assert {r["ia"] for r in pairs + tuples} == {3}


def test_stage_a_reports_its_busy_time_through_stage_b_to_the_sink_pure() -> None:
    """Stage A's partial reaches the sink as a ``count`` row through stage B's control
    groups; the busy time of its group travels in the report's packed control fields and
    lands in the row's ``busy_ns``. A tombstone carries none."""
    stage = RoutedStageA(P, RunningCount())
    report = stage._report("report", "k", "k#3", count=4, state="4", instance=2, busy_ns=7_000)
    tombstone = stage._report("report", "k", "k#1", count=0, state="0")
    rows = [_passed_through(r) for r in (report, tombstone)]
    assert [(r.kind, r.stage, r.routed_key, r.instance, r["count"], r.busy_ns) for r in rows] == [
        ("count", "A", "k#3", 2, 4, 7_000),
        ("count", "A", "k#1", None, 0, None),
    ]


def _locality_config(
    version: int, warm: PairsWorkload, hot_a: tuple[int, ...], shift: int
) -> RoutingConfig:
    """Each field-1 key and the field-2 key it pairs with most on one instance, the
    heaviest field-1 key split over ``hot_a``, the heaviest field-2 key over three."""
    batch = warm.events(0, warm.n_events)
    pairs = Counter(zip(batch.a.tolist(), batch.b.tolist(), strict=True))
    partner = {a: str(b) for (a, b), _ in reversed(pairs.most_common())}
    a_keys = [str(a) for a, _ in Counter(batch.a.tolist()).most_common()]
    b_keys = [str(b) for b, _ in Counter(batch.b.tolist()).most_common()]
    table_a = {str(a): (a + shift) % P for a in partner if str(a) != a_keys[0]}
    table_b = {b: (a + shift) % P for a, b in partner.items() if b != b_keys[0]}
    return RoutingConfig(
        version=version,
        parent_version=version - 1 if version > 1 else None,
        created_by="initial" if version == 1 else "manual",
        operators={
            "A": OperatorRouting(parallelism=P, table=table_a, hot_keys={a_keys[0]: hot_a}),
            "B": OperatorRouting(parallelism=P, table=table_b, hot_keys={b_keys[0]: (1, 2, 3)}),
        },
    )


@pytest.mark.integration
def test_forwarding_tuples_keeps_counts_exact_through_a_locality_table_split_and_move(
    spark, broker: str, topic_name: str, tmp_path: Path
) -> None:
    """``forward="tuples"``: stage B counts each forwarded tuple once, stage A's partials
    still reach the sink, and a live rollout moves both stages' states exactly."""
    warm, main = (
        PairsWorkload(
            n_events=n, n_keys=40, locality=0.8, pad_min=100, pad_max=2_000, seed=s, relabel_b=True
        )
        for n, s in ((3_000, 31), (2_000, 32))
    )
    store = tmp_path / "routing"
    v1 = _locality_config(1, warm, (0, 1, 3), shift=0)
    v2 = _locality_config(2, warm, (1, 2), shift=1)
    save(v1, store)
    assert produce_workload(warm, broker, topic_name, partitions=2) == warm.n_events
    settings = _settings(broker, topic_name, tmp_path, routing_store=store, forward="tuples")
    _run_with_rollout(
        spark,
        broker,
        settings,
        tmp_path,
        v2,
        lambda: produce_workload(main, broker, topic_name, partitions=2),
    )

    # Every key's state, split ones included, lives where v2 puts it.
    latest = latest_partials(read_partials(settings.output))
    live = latest[latest["count"] > 0]
    for stage in OPERATORS:
        table = routed_key_table(v2.operators[stage])
        rows = live[live["stage"] == stage]
        assert len(rows) >= 40
        for key, routed, instance in rows[["key", "routed_key", "instance"]].itertuples(
            index=False
        ):
            assert instance == table.instance_of(routed), (stage, key, routed, instance)
        for key, instances in v2.operators[stage].hot_keys.items():
            assert set(rows.loc[rows["key"] == key, "instance"]) == set(instances)
    truth = expected_counts_of((warm, main))
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == warm.n_events + main.n_events
    assert report.exact, report


@pytest.mark.integration
@pytest.mark.parametrize("source", SOURCES)
def test_keys_outside_ascii_move_exactly_through_the_jvm_stages_per_instance_hand_off(
    request: pytest.FixtureRequest, spark, source: KafkaSource, topic_name: str, tmp_path: Path
) -> None:
    """Cyrillic, CJK, accented and astral-plane keys: the JVM stages evict them in packed
    migration records (JSON with non-ASCII escaped, so a record's length is its size in
    bytes), the source regroups them per target instance, and the stages install them.
    Read by Spark's connector, the events route on the versions of each batch's offset in
    Spark's log through the rollout's switch and install batches."""
    broker = _source_broker(request, source)
    from keyplane.kafka.admin import ensure_topic
    from keyplane.kafka.migration_topic import read_moves
    from keyplane.kafka.producer import make_producer

    names = ["ключ", "鍵", "🔑", "naïve", "Ωmega\u00a0x"]
    keys_a = [f"{name}-{i}" for name in names for i in range(8)]
    keys_b = [f"{name}/b" for name in names]

    def events(first: int, count: int) -> list[dict[str, object]]:
        return [
            {"seq": seq, "a": keys_a[seq % 40], "b": keys_b[seq % 5], "ts": 1_700_000_000_000}
            for seq in range(first, first + count)
        ]

    def produce(batch: list[dict[str, object]]) -> None:
        producer = make_producer(broker)
        for i, event in enumerate(batch):
            producer.send(topic_name, value=json.dumps(event).encode(), partition=i % 2)
        producer.flush()
        producer.close()

    ensure_topic(broker, topic_name, 2)
    store = tmp_path / "routing"
    v1 = RoutingConfig.all_hash(P, OPERATORS)
    v2 = moved_off_hash_config(2, {"A": keys_a, "B": keys_b}, P)
    save(v1, store)
    before, after = events(0, 800), events(800, 400)
    produce(before)
    settings = _settings(
        broker, topic_name, tmp_path, routing_store=store, stage_engine="jvm", source=source
    )
    operators = _run_with_rollout(spark, broker, settings, tmp_path, v2, lambda: produce(after))
    assert operators == ["TransformWithState"] * 2

    moved = read_moves(broker, settings.migration_topic)
    assert sorted((m["operator"], m["key"]) for m in moved) == sorted(
        [("A", key) for key in keys_a] + [("B", key) for key in keys_b]
    )
    latest = latest_partials(read_partials(settings.output))
    live = latest[latest["count"] > 0]
    for stage, keys in (("A", keys_a), ("B", keys_b)):
        table = routed_key_table(v2.operators[stage])
        rows = live[live["stage"] == stage]
        assert sorted(rows["key"]) == sorted(keys)
        for key, routed, instance in rows[["key", "routed_key", "instance"]].itertuples(
            index=False
        ):
            assert routed in table.route(key) and instance == table.instance_of(routed)
    truth = (
        pd.DataFrame(
            [("A", e["a"]) for e in before + after] + [("B", e["b"]) for e in before + after],
            columns=["stage", "key"],
        )
        .value_counts()
        .rename("count")
        .reset_index()
    )
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == len(before) + len(after)
    assert report.exact, report


WAIT_PER_TUPLE_S = 0.01
"""What stage B's aggregate waits per tuple in the busy-time test."""


@pytest.mark.integration
def test_a_stage_that_costs_more_per_tuple_reports_more_busy_time(spark, tmp_path: Path) -> None:
    """Both Python stages get the same 200 tuples; stage B's aggregate waits 10 ms for each
    (:class:`~keyplane.testing.WaitingCount`), A's counts them. The batch's metrics show
    equal loads, at least B's waits as its busy time, B's busiest instance far busier than
    A's, and the share of the batch Stela gives B (003 §4.1) from that measured time."""
    a_keys = [f"a{i}" for i in range(40)]
    b_keys = [f"p{i % 8}" for i in range(40)]
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    events = routed_reads._rows(
        "pairs", len(a_keys), kind=["event"] * len(a_keys), a=a_keys, b=b_keys, ra=a_keys,
        rb=b_keys, vb=pa.array([1] * len(a_keys), pa.int32()), n=[5] * len(a_keys),
        ts=[moment] * len(a_keys),
    )  # fmt: skip
    inputs = tmp_path / "in"
    inputs.mkdir()
    pq.write_table(pa.Table.from_batches([events]), inputs / "part-0.parquet")
    rows = spark.readStream.schema(routed_reads.ROUTED_INPUT_SCHEMA).parquet(str(inputs))
    batches: list[pd.DataFrame] = []
    query = (
        routed_running_counts(
            rows, P, RunningCount(), WaitingCount(WAIT_PER_TUPLE_S), engine="python"
        )
        .writeStream.foreachBatch(lambda df, _: batches.append(df.toPandas()))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    [output] = batches

    metrics = traffic_metrics(0, output, dict.fromkeys(OPERATORS, P))
    tuples = 5 * len(a_keys)
    assert [sum(metrics.load[stage].values()) for stage in OPERATORS] == [tuples, tuples]
    busy_a, busy_b = (metrics.busy_ms[stage] for stage in OPERATORS)
    assert set(busy_a) == set(busy_b) == set(range(P))
    assert sum(busy_b.values()) >= tuples * WAIT_PER_TUPLE_S * 1000
    assert max(busy_b.values()) > 5 * max(busy_a.values()) > 0
    shares, timed = stage_shares(metrics, OPERATORS)
    assert timed and shares["B"] > 5 / 6
