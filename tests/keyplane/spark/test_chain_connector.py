"""A pipeline's records read by Spark's connector take their batch's versions from the
offset log (a real log file; the batch id is a fake's, since no Spark runs here: the
pipeline runs on the connector and Apache Kafka in test_chain_stages.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from keyplane.spark import chain_connector
from keyplane.spark.chain_connector import ChainConnectorRecords
from keyplane.spark.routed_partitions import control_group

PLAN = {"plan": 6, "protocol": {"format": 1}, "routing": {"sessions": 3, "users": 1}}
STAGES = ("sessions", "users")


def test_records_carry_their_batchs_versions_and_an_oversized_one_is_dead_lettered_fake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offsets = tmp_path / "offsets"
    offsets.mkdir()
    lines = ["v1", json.dumps({"batchWatermarkMs": 0}), json.dumps(PLAN), '{"clicks":{"0":2}}']
    (offsets / "5").write_text("\n".join(lines))
    monkeypatch.setattr(chain_connector, "running_batch_id", lambda: 5)
    records = ChainConnectorRecords(str(tmp_path), str(tmp_path / "store"), 4, STAGES, 8)
    chunk = pa.RecordBatch.from_pydict(
        {
            "topic": ["clicks"] * 3,
            "partition": [1, 1, 0],
            "offset": [40, 41, 7],
            "value": [b'{"u":1}', b'{"u":"123456"}', b"{}"],
        }
    )

    rows = pa.Table.from_batches(list(records(iter([chunk])))).to_pylist()

    events = [r for r in rows if r["kind"] == "event"]
    assert [(r["partition"], r["offset"], r["value"]) for r in events] == [
        (1, 40, b'{"u":1}'),
        (0, 7, b"{}"),
    ]
    assert all(r["versions"] == [3, 1] and r["topic"] == "clicks" for r in events)
    [invalid] = [r for r in rows if r["kind"] == "invalid"]
    detail = json.loads(invalid["detail"])
    assert (detail["source"], detail["offset"], detail["reason"]) == ("clicks[1]", 41, "oversized")
    assert invalid["routes"] == [control_group(stage, "clicks[1]", 4) for stage in STAGES]
