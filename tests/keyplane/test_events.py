"""The event wire format: encoding, the one definition of a valid event, and batch decoding."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from keyplane.events import (
    MAX_EVENT_BYTES,
    decode_events,
    decode_keys,
    encode_batch,
    parse_event,
)
from keyplane.workloads import EventBatch, PairsWorkload

GOOD = b'{"seq":0,"a":"1","b":"2","ts":5}'

# Values the job refuses (parse_event) or accepts, each written on one line, so that
# a batch of them takes Arrow's path unless Arrow itself refuses the batch.
ONE_LINE_VALUES: list[bytes | None] = [
    GOOD,
    b'{"seq":1,"a":"x","b":"y","ts":5,"pad":"zz","extra":[1]}',
    b"not json",
    None,
    b"",
    b'{"a":"1","b":"2","ts":5}',
    b'{"seq":1,"a":"1","ts":5}',
    b'{"seq":1,"a":1,"b":"2","ts":5}',
    b'{"seq":"1","a":"1","b":"2","ts":5}',
    b'{"seq":1.5,"a":"1","b":"2","ts":5}',
    b'{"seq":1.0,"a":"1","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":"2","ts":1e3}',
    b'{"seq":123456789012345678901234567890,"a":"1","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":{"x":1},"ts":5}',
    b'{"seq":true,"a":"1","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":"2","ts":null}',
    b'{"seq":1,"a":null,"b":"2","ts":5}',
    b"[1, 2]",
    b'"a string"',
    b"\xff\xfe",
    b'{"seq":1,"a":"1","b":"2","ts":5}{"seq":2,"a":"3","b":"4","ts":5}',
    b"   ",
    # Arrow's reader copies strings as bytes, parse_event reads strict UTF-8: not
    # UTF-8 in a key or an ignored field, overlong, an encoded surrogate, past
    # U+10FFFF, cut short; an unpaired surrogate escape, which no UTF-8 holds, in a
    # key, the padding or a name; a pair, an escaped backslash, valid non-ASCII and a
    # mark inside a string; a byte order mark, UTF-16.
    b'{"seq":1,"a":"\xff","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":"\xff"}',
    b'{"seq":1,"a":"\xc0\xaf","b":"2","ts":5}',
    b'{"seq":1,"a":"\xed\xa0\x80","b":"2","ts":5}',
    b'{"seq":1,"a":"\xf4\x90\x80\x80","b":"2","ts":5}',
    b'{"seq":1,"a":"1\xe6\x97","b":"2","ts":5}',
    b'{"seq":1,"a":"\\ud800","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":"\\udc00x","ts":5}',
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":"\\ud800\\u0041"}',
    b'{"seq":1,"a":"1","b":"2","ts":5,"extra":[{"\\udfff":1}]}',
    b'{"seq":1,"a":"\\ud83d\\ude00","b":"\\\\ud800","ts":5}',
    b'{"seq":1,"a":"\xe6\x97\xa5\xc3\xa9","b":"\xf0\x9f\x98\x80","ts":5,"pad":"\xef\xbb\xbf"}',
    b'\xef\xbb\xbf{"seq":1,"a":"1","b":"2","ts":5}',
    '{"seq":1,"a":"1","b":"2","ts":5}'.encode("utf-16"),
]


def keys(values: list[bytes | None]) -> list[tuple[str | None, str | None]]:
    table = decode_keys(values)
    return list(zip(table.column("a").to_pylist(), table.column("b").to_pylist(), strict=True))


def expected(value: bytes | None) -> tuple[str | None, str | None]:
    event, _ = parse_event(value)
    return (None, None) if event is None else (event["a"], event["b"])


def test_encoded_events_are_valid_and_decode_to_their_keys_in_order() -> None:
    batch = EventBatch(
        start=10, a=np.array([3, 1, 3]), b=np.array([7, 7, 2]), pad=np.array([0, 5, 0])
    )
    values = list(encode_batch(batch, ts_ms=1_000))
    assert [parse_event(v)[0]["seq"] for v in values] == [10, 11, 12]
    assert keys(values) == [("3", "7"), ("1", "7"), ("3", "2")]


@pytest.mark.parametrize("value", ONE_LINE_VALUES)
def test_decoding_a_batch_agrees_with_parse_event_on_every_value(value: bytes | None) -> None:
    """Between two good events: Arrow's path where it takes the batch, the value-by-value
    path where it does not; either way the job's verdict on each value."""
    assert keys([GOOD, value, GOOD]) == [("1", "2"), expected(value), ("1", "2")]


@pytest.mark.parametrize("value", ONE_LINE_VALUES)
def test_decoding_whole_events_takes_a_batch_only_when_parse_event_takes_every_value(
    value: bytes | None,
) -> None:
    """The routed source's fast path: a table of every event's fields, or ``None`` so
    that the caller parses value by value and learns why a value is refused."""
    values = [GOOD, value, GOOD]
    table = decode_events(values)
    parsed = [parse_event(v)[0] for v in values]
    beyond_arrow = value is not None and b"123456789012345678901234567890" in value
    if any(event is None for event in parsed) or beyond_arrow:
        assert table is None
    else:
        assert table is not None
        assert table.to_pylist() == [
            {name: event[name] for name in ("seq", "a", "b", "ts")} for event in parsed
        ]


def test_a_batch_of_only_good_events_and_empty_values_takes_arrows_path() -> None:
    values = [GOOD, None, b'{"seq":1,"a":"1","ts":5}', GOOD]
    assert (
        keys(values)
        == [expected(v) for v in values]
        == [
            ("1", "2"),
            (None, None),
            (None, None),
            ("1", "2"),
        ]
    )


def test_an_event_that_spans_lines_is_one_event_and_an_oversized_one_is_none() -> None:
    spanning = b'{"seq": 1, "a": "x",\n "b": "y",\r\n "ts": 5}'
    oversized = b'{"seq":1,"a":"1","b":"2","ts":5,"pad":"' + b"x" * MAX_EVENT_BYTES + b'"}'
    assert keys([spanning, oversized, GOOD]) == [("x", "y"), (None, None), ("1", "2")]
    assert parse_event(oversized)[1] == f"oversized: {len(oversized)} bytes > {MAX_EVENT_BYTES}"


def test_a_byte_order_mark_is_refused_also_where_arrows_reader_skips_it() -> None:
    """Arrow skips a mark at the start of its input and of each block (1 MiB) it
    parses; in the middle of a block it refuses the batch. A value of 1,023 bytes
    puts a block boundary after every 1,024th line."""
    good = b'{"seq":0,"a":"1","b":"2","ts":5,"pad":"' + b"x" * 982 + b'"}'
    marked = b'\xef\xbb\xbf{"seq":0,"a":"1","b":"2","ts":5,"pad":"' + b"x" * 979 + b'"}'
    assert len(good) == len(marked) == 1023
    assert parse_event(marked)[1] is not None and parse_event(marked[3:])[1] is None
    for at in [0, *range(1020, 1030)]:
        values: list[bytes | None] = [good] * 1100
        values[at] = marked
        assert keys(values) == [(None, None) if i == at else ("1", "2") for i in range(1100)]
        assert decode_events(values) is None


def test_an_empty_batch_decodes_to_an_empty_table() -> None:
    table = decode_keys([])
    assert (table.num_rows, table.column_names) == (0, ["a", "b"])


def test_encoded_values_are_compact_json_objects() -> None:
    batch = EventBatch(start=0, a=np.array([1]), b=np.array([2]), pad=np.array([3]))
    (value,) = encode_batch(batch, ts_ms=7)
    assert json.loads(value) == {"seq": 0, "a": "1", "b": "2", "ts": 7, "pad": "xxx"}
    assert b"\n" not in value and b" " not in value


def test_random_padding_has_its_length_differs_per_event_and_does_not_compress() -> None:
    spec = PairsWorkload(n_events=400, n_keys=20, pad_min=8_000, pad_max=8_000, pad_fill="random")
    values = [v for batch in spec.batches(150) for v in encode_batch(batch, ts_ms=0)]
    pads = [json.loads(v)["pad"] for v in values]
    assert {len(p) for p in pads} == {8_000}
    assert len(set(pads)) == len(pads)
    assert pads == [json.loads(v)["pad"] for v in encode_batch(spec.events(0, 400), ts_ms=0)]
    blob = b"".join(values)
    assert len(zlib.compress(blob)) > 0.7 * len(blob)

    repeated = spec.model_copy(update={"pad_fill": "repeated"})
    plain = b"".join(v for batch in repeated.batches(150) for v in encode_batch(batch, ts_ms=0))
    assert len(plain) == len(blob)
    assert len(zlib.compress(plain)) < 0.05 * len(plain)
    assert [parse_event(v)[0] is not None for v in values] == [True] * len(values)
