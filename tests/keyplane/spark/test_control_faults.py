"""Control-message faults against the running routed job (paper 000 §3.4), in one job run.

The routed job runs as its own process on v2, so its log can be read. On a
stream of events, the control topic receives, with the real
:class:`~keyplane.kafka.control.ControlChannel` and a raw Kafka producer:

* an unsigned PREPARE and one signed with another key;
* a PREPARE of a version the configuration store does not hold, a PROPAGATE
  of a version older than the active one, a PREPARE of the active version
  (not newer);
* PREPAREs of stored versions the job must refuse by itself: a manifest that
  is not a configuration (sealed, so only the schema is wrong), a data file
  modified after it was saved, a configuration over 8 instances when the
  query has 4 state partitions, and a valid version announced with another
  checksum.

The job refuses each one: no ACK, one log line naming the reason, a count by
reason in its metrics topic, and it keeps routing on v2. Each PREPARE it could
read but will not take (not the forged ones, and not the PREPARE of the version
it runs, a retried step) earns a REFUSED reply with the reason. Then v6 is rolled
out with its messages reordered (a PROPAGATE before its PREPARE) and
duplicated (PREPARE, PROPAGATE, DONE twice): the job ends on v6 and every
count is exact.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, TopicPartition

from keyplane.control.controller import Controller
from keyplane.control.messages import ControlMessage, encode
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import make_producer, produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, checksum, save, version_path
from keyplane.spark.counts_job import read_output
from keyplane.testing import (
    moved_off_hash,
    routed_job_settings,
    stage_keys_by_count,
    start_job_process,
    wait_while_job_runs,
)

pytestmark = pytest.mark.integration

P = 4
WAIT_S = 600
"""Generous: the machine is shared; every wait is for a condition, never a fixed time."""

EXPECTED_REFUSALS = {
    "missing_signature": 1,
    "bad_signature": 1,
    "unknown_checksum": 5,
    "stale_version": 2,
}


def _topic_values(broker: str, topic: str) -> list[dict[str, Any]]:
    """Every record of ``topic`` up to its high watermark, as JSON, partition by partition."""
    marks = high_watermarks(broker, topic)
    consumer = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
    try:
        out: list[dict[str, Any]] = []
        for partition, end in sorted(marks.items()):
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            while consumer.position(tp) < end:
                out += [json.loads(r.value) for r in consumer.poll(timeout_ms=500).get(tp, [])]
        return out
    finally:
        consumer.close()


def _reseal(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` with file hashes and a checksum that verify, as a broken producer
    that seals what it wrote would."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    body["files"] = {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in body["files"]
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    sealed = {**body, "checksum": hashlib.sha256(canonical.encode()).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(sealed, indent=2))


def _plain(version: int, parent: int | None, table: dict[str, int] | None = None) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_by="initial" if parent is None else "manual",
        operators={
            "A": OperatorRouting(parallelism=P, table=table or {}),
            "B": OperatorRouting(parallelism=P),
        },
    )


def _prepare(version: int, digest: str, previous: int = 2) -> ControlMessage:
    return ControlMessage(
        type="PREPARE",
        config_version=version,
        previous_version=previous,
        checksum=digest,
        sender="controller",
    )


def test_the_job_refuses_forged_stale_and_unloadable_control_messages_and_stays_exact(
    broker: str, topic_name: str, tmp_path: Path
) -> None:
    spec = ZipfEvolvingWorkload(n_keys=300, exponent=1.2, n_categories=12, n_events=16_000, seed=13)
    truth = expected_counts(spec)
    a_keys, b_keys = stage_keys_by_count(truth)
    store = tmp_path / "routing"
    save(_plain(1, None), store)
    save(_plain(2, 1, moved_off_hash(a_keys[:6], P)), store)

    # v3: sealed, but its manifest is not a configuration (parallelism "four").
    save(_plain(3, 2), store)
    manifest = json.loads((version_path(store, 3) / "manifest.json").read_text())
    manifest["operators"][0]["parallelism"] = "four"
    _reseal(version_path(store, 3), manifest)
    # v4: a data file modified after it was saved.
    save(_plain(4, 2, {a_keys[0]: 1}), store)
    table_file = version_path(store, 4) / "operator-000.table.parquet"
    pq.write_table(
        pa.table({"key": pa.array([a_keys[0]]), "instance": pa.array([3], pa.int32())}),
        table_file,
    )
    # v5: a valid configuration over 8 instances; the query has 4 state partitions.
    save(
        RoutingConfig(
            version=5,
            parent_version=2,
            created_by="manual",
            operators={
                "A": OperatorRouting(parallelism=8, table={a_keys[0]: 6}),
                "B": OperatorRouting(parallelism=8),
            },
        ),
        store,
    )
    v6 = RoutingConfig(
        version=6,
        parent_version=2,
        created_by="manual",
        operators={
            "A": OperatorRouting(parallelism=P, table=moved_off_hash(a_keys[:6], P, 2)),
            "B": OperatorRouting(parallelism=P, table=moved_off_hash(b_keys[:3], P)),
        },
    )
    save(v6, store)

    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=P, batch=2_000, trigger="1 second", version=2
    )
    log = tmp_path / "job.log"
    producer = threading.Thread(
        target=produce_workload,
        args=(spec, broker, topic_name),
        kwargs={"partitions": 2, "rate": 1_000},
    )
    producer.start()
    job = start_job_process(settings, log)
    try:

        def metrics() -> list[dict[str, Any]]:
            return _topic_values(broker, settings.metrics_topic)

        def batches_written() -> bool:
            return len(list(settings.output.glob("batch-*.parquet"))) >= 2

        wait_while_job_runs(batches_written, "two batches", job, log, timeout_s=WAIT_S)
        wait_while_job_runs(
            lambda: len(metrics()) >= 2, "two metrics records", job, log, timeout_s=WAIT_S
        )
        with ControlChannel(broker, settings.control_topic) as channel:
            channel.ensure()
            raw = make_producer(broker)
            unsigned = _prepare(6, checksum(store, 6)).model_dump(mode="json")
            raw.send(settings.control_topic, value=json.dumps(unsigned).encode(), partition=0)
            forged = encode(_prepare(6, checksum(store, 6)), key="not-the-job-key")
            raw.send(settings.control_topic, value=forged, partition=0)
            raw.flush()
            raw.close()
            channel.send(
                [
                    _prepare(99, "0" * 64),
                    ControlMessage(
                        type="PROPAGATE",
                        config_version=1,
                        operator="A",
                        checksum=checksum(store, 1),
                        sender="controller",
                    ),
                    _prepare(2, checksum(store, 2), previous=1),
                    _prepare(3, checksum(store, 3)),
                    _prepare(4, checksum(store, 4)),
                    _prepare(5, checksum(store, 5)),
                    _prepare(6, "f" * 64),
                ]
            )

            def refusals() -> Counter[str]:
                total: Counter[str] = Counter()
                for record in metrics():
                    total.update(record["rejected_control"])
                return total

            wait_while_job_runs(
                lambda: sum(refusals().values()) >= sum(EXPECTED_REFUSALS.values()),
                "the refusals in the metrics topic",
                job,
                log,
                timeout_s=WAIT_S,
            )
            assert dict(refusals()) == EXPECTED_REFUSALS
            assert all(m["versions"] == {"A": 2, "B": 2} for m in metrics())
            lines = [line for line in log.read_text().splitlines() if " refused (" in line]
            assert Counter(re.findall(r"refused \((\w+)\)", "\n".join(lines))) == Counter(
                EXPECTED_REFUSALS
            ), lines
            named = "\n".join(lines)
            assert "v99" in named and "no configuration version 99" in named
            assert "ValidationError" in named, "v3's manifest is not a configuration"
            assert "modified after it was saved" in named, "v4's data file"
            assert "over 8 instances" in named, "v5 does not fit the query"

            # A good rollout, reordered and duplicated, still goes through.
            channel.send(
                [
                    ControlMessage(
                        type="PROPAGATE",
                        config_version=6,
                        previous_version=2,
                        operator="A",
                        checksum=checksum(store, 6),
                        sender="controller",
                    )
                ]
            )
            controller = Controller(channel, tmp_path / "controller.json", store)
            channel.send([controller.prepare(6)])
            controller.wait_ack(timeout_s=WAIT_S)
            channel.send([controller.propagate("A")])
            controller.wait_migrated("A", timeout_s=WAIT_S)
            channel.send([controller.propagate("B")])
            controller.wait_migrated("B", timeout_s=WAIT_S)
            channel.send([controller.done()])
        producer.join()
        produced = sum(high_watermarks(broker, topic_name).values())

        def all_counted() -> bool:
            frame = read_output(settings.output)
            return int(frame.loc[frame["stage"] == "A", "count"].sum()) == produced

        wait_while_job_runs(all_counted, "every event", job, log, timeout_s=WAIT_S)
        wait_while_job_runs(
            lambda: max(metrics(), key=lambda m: m["batch_id"])["versions"] == {"A": 6, "B": 6},
            "v6 everywhere",
            job,
            log,
            timeout_s=WAIT_S,
        )
        assert job.poll() is None, "the job kept running through every fault"
    finally:
        producer.join()
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]

    # Nothing refused was acknowledged; the duplicates earned the replies the originals did.
    with ControlChannel(broker, settings.control_topic) as reader:
        read = reader.read(0)
    assert sorted(why.reason for _, why in read.rejected) == ["bad_signature", "missing_signature"]
    everything = [message for _, message in read.messages if message.sender == "job"]
    refused = [m for m in everything if m.type == "REFUSED"]
    unusable = [(99, "0" * 64), (6, "f" * 64)]
    unusable += [(version, checksum(store, version)) for version in (3, 4, 5)]
    assert sorted((m.config_version, m.checksum) for m in refused) == sorted(unusable)
    assert all(m.reason is not None and m.reason.startswith("unknown_checksum: ") for m in refused)
    assert any(m.reason is not None and "over 8 instances" in m.reason for m in refused)
    replies = [m for m in everything if m.type != "REFUSED"]
    assert {m.config_version for m in replies} == {6}
    assert {(m.type, m.operator) for m in replies} == {
        ("ACK", None),
        ("MIGRATED", "A"),
        ("MIGRATED", "B"),
    }
    assert len({m.message_id for m in replies}) == 3
    assert [m.type for m in replies].count("ACK") == 2, "the duplicated PREPARE, acknowledged again"
    assert dict(sum((Counter(m["rejected_control"]) for m in metrics()), Counter())) == (
        EXPECTED_REFUSALS
    )

    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == spec.n_events
    assert report.exact, report
