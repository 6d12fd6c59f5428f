"""The routed source's record validation (pure: no broker, no Spark)."""

from __future__ import annotations

import json

import pytest

from keyplane.events import MAX_EVENT_BYTES, parse_event
from keyplane.spark.routed_source import control_group


def test_a_valid_event_parses_pure() -> None:
    raw = json.dumps({"seq": 3, "a": "x", "b": "y", "ts": 1000, "pad": ""}).encode()
    event, problem = parse_event(raw)
    assert problem is None
    assert event is not None and (event["seq"], event["a"], event["b"]) == (3, "x", "y")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "empty record"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"seq": 1, "b": "y", "ts": 5}).encode(), "field 'a'"),
        (json.dumps({"seq": "1", "a": "x", "b": "y", "ts": 5}).encode(), "field 'seq'"),
        (json.dumps({"seq": True, "a": "x", "b": "y", "ts": 5}).encode(), "field 'seq'"),
        (b"\xff\xfe", "not JSON"),
        (b"{" + b" " * MAX_EVENT_BYTES + b"}", "oversized"),
    ],
)
def test_invalid_records_say_why_pure(raw: bytes | None, reason: str) -> None:
    event, problem = parse_event(raw)
    assert event is None
    assert problem is not None and reason in problem


def test_control_groups_cannot_collide_with_keys_pure() -> None:
    assert control_group("B", "k").startswith("\x00")
    assert control_group("A", "k") != control_group("B", "k")
