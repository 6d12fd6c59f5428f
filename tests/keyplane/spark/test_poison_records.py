"""A poison record is dead-lettered after two failures, never retried forever.

The routed job runs as its own process on the real broker, its stage A
aggregate :class:`keyplane.testing.RaisesOnPoison`, which raises on every try
of a batch that adds the field-2 key ``"poison"``, and with no restarts of
its own (``--restarts 0``). Three such events sit among a generated workload.
The job fails the batch twice, quarantines those events to the dead-letter
topic with the aggregate's error, goes on, and counts every other event
exactly; later events of the same pair are dead-lettered without a failure.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from keyplane.control.operators import OPERATORS
from keyplane.control.quarantine import QUARANTINE_FILE
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.producer import make_producer, produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.counts_job import read_output
from keyplane.testing import (
    POISON_VALUE,
    routed_job_settings,
    start_job_process,
    wait_while_job_runs,
)

P = 4


def _send_poison(broker: str, topic: str, seqs: range) -> None:
    producer = make_producer(broker)
    for seq in seqs:
        event = {"seq": seq, "a": "sick", "b": POISON_VALUE, "ts": 1_700_000_000_000}
        producer.send(topic, value=json.dumps(event).encode(), partition=1)
    producer.flush()
    producer.close()


def _dead_letters(broker: str, topic: str) -> list[dict]:
    consumer = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = high_watermarks(broker, topic).get(0, 0)
        records: list[dict] = []
        while consumer.position(tp) < end:
            records += [json.loads(r.value) for r in consumer.poll(timeout_ms=1000).get(tp, [])]
        return records
    finally:
        consumer.close()


@pytest.mark.integration
def test_a_record_the_aggregate_always_raises_on_is_dead_lettered_and_the_job_goes_on(
    broker: str, tmp_path: Path
) -> None:
    topic = "poison-records"
    spec = ZipfEvolvingWorkload(n_keys=200, exponent=1.1, n_categories=10, n_events=4_000, seed=3)
    assert produce_workload(spec, broker, topic, partitions=2) == spec.n_events
    _send_poison(broker, topic, range(10**6, 10**6 + 3))
    save(RoutingConfig.all_hash(P, OPERATORS), tmp_path / "routing")
    settings = routed_job_settings(
        broker,
        topic,
        tmp_path,
        parallelism=P,
        batch=100_000,
        trigger="1 second",
        stage_a_aggregate="keyplane.testing:RaisesOnPoison",
        restarts=0,
    )
    truth = expected_counts(spec)
    log = tmp_path / "job.log"
    job = start_job_process(settings, log)

    def all_counted() -> bool:
        return compare_counts(truth, read_output(settings.output)).exact

    try:
        wait_while_job_runs(all_counted, "every good event", job, log, timeout_s=400)
        # The pair stays quarantined: a later event of it is dead-lettered at once.
        _send_poison(broker, topic, range(2 * 10**6, 2 * 10**6 + 1))
        wait_while_job_runs(
            lambda: sum(high_watermarks(broker, settings.dead_letter_topic).values()) == 4,
            "the fourth dead letter", job, log,
        )  # fmt: skip
        assert job.poll() is None
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert compare_counts(truth, read_output(settings.output)).exact
    text = log.read_text()
    assert text.count("a stage's aggregate failed the batch; starting it again") == 2
    letters = _dead_letters(broker, settings.dead_letter_topic)
    assert len(letters) == 4
    assert {letter["source"] for letter in letters} == {f"{topic}[1]"}
    assert all(
        letter["reason"]
        == "poison: stage A's aggregate raised ValueError: cannot count 'poison' on this event "
        "in two tries of its batch"
        for letter in letters
    )
    assert sorted(json.loads(letter["value"])["seq"] for letter in letters) == [
        10**6, 10**6 + 1, 10**6 + 2, 2 * 10**6,
    ]  # fmt: skip
    assert len({letter["offset"] for letter in letters}) == 4
    quarantined = json.loads((settings.checkpoint / QUARANTINE_FILE).read_text())
    assert [(p["a"], p["b"]) for p in quarantined["pairs"]] == [("sick", POISON_VALUE)]
