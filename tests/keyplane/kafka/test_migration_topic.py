"""The migration topic's records: moved states packed many to a record."""

from __future__ import annotations

import json

import pytest
from kafka import KafkaProducer

from keyplane.kafka import migration_topic
from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.migration_topic import count_moved_states, move_records, moves_of


def _move(i: int, state: str = "5") -> dict:
    return {
        "operator": "A", "key": f"k{i}", "source": f"k{i}#1", "target": f"k{i}#3",
        "count": 5, "state": state, "marker": 7,
    }  # fmt: skip


def test_moves_pack_under_the_budget_and_read_back_in_order_pure(monkeypatch) -> None:
    monkeypatch.setattr(migration_topic, "MAX_RECORD_BYTES", 1_000)
    moves = [_move(i) for i in range(100)]
    records = list(move_records(moves))
    assert 1 < len(records) < len(moves)
    assert all(len(r) <= 1_000 + len('{"moves":[]}') for r in records)
    assert [m for r in records for m in moves_of(r)] == moves


def test_a_move_larger_than_the_budget_travels_alone_pure(monkeypatch) -> None:
    monkeypatch.setattr(migration_topic, "MAX_RECORD_BYTES", 100)
    big = _move(1, state="x" * 500)
    records = list(move_records([_move(0), big, _move(2)]))
    assert [[m["key"] for m in moves_of(r)] for r in records] == [["k0"], ["k1"], ["k2"]]


def test_a_record_that_is_not_a_list_of_moves_is_refused_pure() -> None:
    with pytest.raises(ValueError, match="a migration record is a JSON object"):
        moves_of(json.dumps(_move(4)).encode())
    with pytest.raises(ValueError, match="a migration record is a JSON object"):
        moves_of(b"[]")
    assert list(move_records([])) == []


def test_the_topic_counts_moves_not_records(broker: str, topic_name: str) -> None:
    ensure_topic(broker, topic_name, 1)
    producer = KafkaProducer(bootstrap_servers=broker)
    for value in move_records([_move(i) for i in range(1_200)]):
        producer.send(topic_name, value=value)
    producer.flush()
    producer.close()
    assert count_moved_states(broker, topic_name) == 1_200
