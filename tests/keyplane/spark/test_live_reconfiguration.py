"""Live reconfiguration of the running routed job (paper 000 §3.4), end to end.

Real broker, real SparkSession, the real routed job, and the real controller
over the control topic. While generated events stream in, v1 → v2 → v3 are
published: v2 moves keys of both stages and splits a hot key of each; v3
undoes stage A's split, moves keys again and splits another stage-B key. The
query is never restarted, every key's state ends on the instance v3 names
(observed from inside the stateful operators), and the merged counts equal
the generator's ground truth exactly.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from kafka import KafkaConsumer, TopicPartition

from keyplane.algorithms.partials import latest_partials
from keyplane.control.controller import Controller
from keyplane.control.operators import OPERATORS
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.migration_topic import read_moves
from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.handoff import routed_key_table
from keyplane.settings import KafkaSource
from keyplane.spark.counts_job import (
    read_output,
    read_partials,
    start_counts_query,
    stop_between_batches,
)
from keyplane.testing import (
    moved_off_hash,
    moved_off_hash_config,
    routed_job_settings,
    stage_keys_by_count,
    wait_for_records,
)

P = 4


def _records(broker: str, topic: str) -> list[dict]:
    consumer = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        out: list[dict[str, Any]] = []
        for _ in range(20):
            batch = consumer.poll(timeout_ms=500).get(tp, [])
            if not batch and out:
                break
            out += [json.loads(r.value) for r in batch]
        return out
    finally:
        consumer.close()


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("kafka", marks=pytest.mark.apache_kafka),
        pytest.param("kafka-connector", marks=[pytest.mark.apache_kafka, pytest.mark.slow]),
    ],
)
def engine_broker(request: pytest.FixtureRequest) -> str:
    """The conftest's engines, and in the slow suite Apache Kafka with Spark's connector
    reading the events (the conftest's ``kafka_source``)."""
    name = "broker" if request.param == "embedded" else "apache_kafka_broker"
    return str(request.getfixturevalue(name))


@pytest.mark.integration
def test_v1_v2_v3_go_live_without_restart_and_counts_stay_exact(
    spark, engine_broker: str, kafka_source: KafkaSource, topic_name: str, tmp_path: Path
) -> None:
    spec = ZipfEvolvingWorkload(n_keys=400, exponent=1.2, n_categories=12, n_events=40_000, seed=9)
    truth = expected_counts(spec)
    a_keys, b_keys = stage_keys_by_count(truth)
    store = tmp_path / "routing"
    settings = routed_job_settings(
        engine_broker,
        topic_name,
        tmp_path,
        parallelism=P,
        batch=2_000,
        trigger="0 seconds",
        source=kafka_source,
    )

    v1 = RoutingConfig.all_hash(P, OPERATORS)
    v2 = moved_off_hash_config(
        2,
        {"A": a_keys[1:9], "B": b_keys[1:4]},
        P,
        hot_keys={"A": {a_keys[0]: (0, 1, 3)}, "B": {b_keys[0]: (1, 2, 3)}},
    )
    v3 = RoutingConfig(
        version=3,
        parent_version=2,
        created_by="manual",
        operators={
            # A's split is undone (the hot key goes to one instance), keys move on again.
            "A": OperatorRouting(
                parallelism=P,
                table={**moved_off_hash(a_keys[1:9], P, 2), a_keys[0]: 2},
            ),
            # B keeps its split, moves its tabled keys and splits a second key.
            "B": OperatorRouting(
                parallelism=P,
                table=moved_off_hash(b_keys[2:4], P, 3),
                hot_keys={b_keys[0]: (1, 2, 3), b_keys[1]: (0, 2)},
            ),
        },
    )
    save(v1, store)

    producer = threading.Thread(
        target=produce_workload,
        args=(spec, engine_broker, topic_name),
        kwargs={"partitions": 2, "rate": 2_500},
    )
    producer.start()
    query = start_counts_query(spark, settings)
    run_id = query.runId
    try:
        wait_for_records(query, 4_000)
        with ControlChannel(engine_broker, settings.control_topic) as channel:
            controller = Controller(channel, tmp_path / "controller.json", store)
            for config in (v2, v3):
                save(config, store)
                result = controller.rollout(config.version, timeout_s=120)
                assert result.version == config.version
                assert query.isActive and query.runId == run_id
        producer.join()
        assert producer.is_alive() is False
        query.processAllAvailable()
        assert query.exception() is None
        assert {p["runId"] for p in query.recentProgress} == {str(run_id)}
    finally:
        stop_between_batches(query)
        producer.join()

    # The reconfigurations happened while events were still arriving.
    moved = pd.DataFrame(read_moves(engine_broker, settings.migration_topic))
    assert set(moved["operator"]) == {"A", "B"}
    switches = moved.groupby("marker")["operator"].agg(frozenset)
    assert len(switches) >= 2, "A and B moved in v2, again in v3"
    # One publish carries both PROPAGATEs, so both stages switch in one batch
    # (its plan id is the moves' marker); read at two boundaries, B would
    # switch one batch later, which is why only one rollout must show it.
    assert frozenset({"A", "B"}) in set(switches), switches
    metrics = _records(engine_broker, settings.metrics_topic)
    assert metrics[-1]["versions"] == {"A": 3, "B": 3}
    assert any(m["versions"] == {"A": 1, "B": 1} and m["rows"] > 0 for m in metrics)
    assert sum(m["rows"] for m in metrics if m["versions"] == {"A": 3, "B": 3}) > 0
    # Each record tells where its batch's time went, within the batch's duration.
    for m in metrics:
        phases = m["phases_ms"]
        assert {"latestOffset", "queryPlanning", "addBatch", "walCommit"} <= set(phases), m
        assert phases["addBatch"] > 0 and sum(phases.values()) <= m["duration_ms"], m

    # Every key's state lives where v3 puts it, as the operators themselves report.
    latest = latest_partials(read_partials(settings.output))
    live = latest[latest["count"] > 0]
    for stage in OPERATORS:
        table = routed_key_table(v3.operators[stage])
        rows = live[live["stage"] == stage]
        assert len(rows) > (50 if stage == "A" else 8)
        for key, routed, instance in rows[["key", "routed_key", "instance"]].itertuples(
            index=False
        ):
            assert routed in table.route(key), (stage, key, routed)
            assert instance == table.instance_of(routed), (stage, key, routed, instance)
    for key, instance in v3.operators["A"].table.items():
        held = live[(live["stage"] == "A") & (live["key"] == key)]
        assert held["instance"].tolist() == [instance], (key, held)
    split = live[(live["stage"] == "B") & (live["key"] == b_keys[0])]
    # The split key's tuples take the least loaded of its instances, so a
    # partial may stay empty when its instance is busy with other keys.
    assert len(set(split["instance"])) >= 2 and set(split["instance"]) <= {1, 2, 3}, split

    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == spec.n_events
    assert report.exact, report
