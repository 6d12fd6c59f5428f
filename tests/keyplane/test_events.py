"""The event wire format: encoding, and decoding the keys of a batch of values."""

from __future__ import annotations

import json

import numpy as np

from keyplane.events import decode_keys, encode_batch
from keyplane.workloads import EventBatch


def keys(values: list[bytes | None]) -> list[tuple[str | None, str | None]]:
    table = decode_keys(values)
    return list(zip(table.column("a").to_pylist(), table.column("b").to_pylist(), strict=True))


def test_encoded_events_decode_to_their_keys_in_order() -> None:
    batch = EventBatch(
        start=10, a=np.array([3, 1, 3]), b=np.array([7, 7, 2]), pad=np.array([0, 5, 0])
    )
    values = list(encode_batch(batch, ts_ms=1_000))
    assert [json.loads(v)["seq"] for v in values] == [10, 11, 12]
    assert keys(values) == [("3", "7"), ("1", "7"), ("3", "2")]


def test_values_that_are_not_events_decode_to_nulls_and_their_neighbours_still_count() -> None:
    good = b'{"a":"1","b":"2","seq":0}'
    values: list[bytes | None] = [
        good,
        b"not json",
        None,
        b"",
        b'{"a": "1"}',
        b'{"a": 1, "b": "2"}',
        b"[1, 2]",
        b"\xff\xfe",
        b'{"a":"1","b":"2"}{"a":"3","b":"4"}',
        good,
    ]
    assert keys(values) == [
        ("1", "2"),
        (None, None),
        (None, None),
        (None, None),
        ("1", None),
        (None, "2"),
        (None, None),
        (None, None),
        (None, None),
        ("1", "2"),
    ]


def test_an_event_that_spans_lines_is_one_event() -> None:
    assert keys([b'{"a": "x",\n "b": "y"}', b'{"a":"1",\r\n"b":"2"}', b"  "]) == [
        ("x", "y"),
        ("1", "2"),
        (None, None),
    ]


def test_an_empty_batch_decodes_to_an_empty_table() -> None:
    table = decode_keys([])
    assert (table.num_rows, table.column_names) == (0, ["a", "b"])
