"""The sources of ``keyplane job status`` besides the job's own files: the end of the metrics
topic (a real broker, records written by hand) and the controller's state file (no Kafka)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.controller import ControllerFile
from keyplane.control.controller_protocol import ControllerProtocol
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.producer import make_producer
from keyplane.spark.job_status import read_metrics_topic, read_rollout


@pytest.mark.integration
def test_read_metrics_topic_gives_the_latest_record_and_the_last_busy_one(
    broker: str, topic_name: str
) -> None:
    assert read_metrics_topic(broker, topic_name) is None
    ensure_topic(broker, topic_name, 1)
    assert read_metrics_topic(broker, topic_name) is None
    busy = BatchMetrics(
        batch_id=4,
        versions={"A": 2, "B": 1},
        rows=300,
        rows_per_s=150.0,
        load={"A": {0: 200, 1: 100}, "B": {0: 300, 1: 0}},
        hops=300,
        local_hops=240,
    )
    idle = BatchMetrics(batch_id=5, versions={"A": 2, "B": 2}, input_lag=7)
    producer = make_producer(broker)
    for value in (busy.model_dump_json(), "not a metrics record", idle.model_dump_json()):
        producer.send(topic_name, value=value.encode(), partition=0)
    producer.send(topic_name, value=b"{}", partition=0)
    producer.flush()
    producer.close()

    snapshot = read_metrics_topic(broker, topic_name)

    assert snapshot is not None and snapshot.records == 4
    assert snapshot.latest == idle and snapshot.last_busy == busy
    assert snapshot.last_busy.locality == pytest.approx(0.8)
    assert snapshot.last_busy.imbalance("B") == pytest.approx(2.0)
    assert abs((datetime.now(UTC) - snapshot.latest_at).total_seconds()) < 60


def _controller_file(path: Path, protocol: ControllerProtocol) -> None:
    saved = ControllerFile(control_topic="c", read_offset=0, protocol=protocol.state)
    path.write_text(saved.model_dump_json())


def test_read_rollout_summarises_the_controller_state_without_kafka(tmp_path: Path) -> None:
    state_file = tmp_path / "controller.json"
    assert read_rollout(state_file) is None

    protocol = ControllerProtocol(OPERATORS, 1, "sum-v1")
    _controller_file(state_file, protocol)
    idle = read_rollout(state_file)
    protocol.prepare(2, "sum-v2")
    _controller_file(state_file, protocol)
    in_flight = read_rollout(state_file)
    protocol.abort()
    _controller_file(state_file, protocol)
    aborted = read_rollout(state_file)

    assert idle is not None and (idle.active_version, idle.in_flight) == (1, None)
    assert idle.last_version is None
    assert in_flight is not None and (in_flight.in_flight, in_flight.step) == (2, "waiting for ACK")
    assert aborted is not None and aborted.in_flight is None
    assert (aborted.active_version, aborted.last_version, aborted.last_outcome) == (1, 2, "ABORT")
