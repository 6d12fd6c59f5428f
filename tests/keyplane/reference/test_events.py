"""The event wire format: encoding, the one definition of a valid event, and batch decoding."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Sequence

import numpy as np
import pytest

from keyplane.reference.events import (
    MAX_EVENT_BYTES,
    MAX_NESTING_DEPTH,
    dead_letter_value,
    decode_events,
    decode_keys,
    encode_batch,
    parse_event,
)
from keyplane.reference.workloads import EventBatch, PairsWorkload

GOOD = b'{"seq":0,"a":"1","b":"2","ts":5}'


def nested(levels: int, inside: bytes = b"") -> bytes:
    """An event whose ``pad`` nests ``levels`` arrays, the event nested ``levels + 1`` deep."""
    return b'{"seq":1,"a":"1","b":"2","ts":5,"pad":' + b"[" * levels + inside + b"]" * levels + b"}"


DEEP = nested(30_000)
"""60 kB, inside the size limit, and deep past any recursion limit."""
BRACKETS = b"[" * 300
SHALLOW_ENOUGH = [
    nested(MAX_NESTING_DEPTH - 1),
    nested(MAX_NESTING_DEPTH - 1, b'"' + BRACKETS + b'"'),
    nested(MAX_NESTING_DEPTH - 1, b'"\\"' + BRACKETS + b'"'),
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":[' + b"[]," * 300 + b"[]]}",
]
"""256 levels deep, with more brackets than levels: in a string, after an escaped
quote in a string, in sibling arrays."""
TOO_DEEP = [
    nested(MAX_NESTING_DEPTH),
    nested(MAX_NESTING_DEPTH - 1, b'"\\\\",[],"x"'),
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":' + b'{"x":' * 256 + b"1" + b"}" * 256 + b"}",
]
"""257 levels deep: in arrays, in an array after a string that ends with an escaped
backslash, in objects."""

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
    # Nested as deep as allowed and one level deeper, in arrays or objects, and far
    # deeper; brackets in strings count no level; many brackets, shallow; deep and
    # not JSON.
    *SHALLOW_ENOUGH,
    *TOO_DEEP,
    DEEP,
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":' + b"[" * 30_000 + b"}",
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":"' + b"[" * 30_000,
    # seq and ts at and past the ranges the job holds: 64 bits, years 1 to 9999 in
    # epoch milliseconds; integers of more digits than Python converts by default.
    b'{"seq":9223372036854775807,"a":"1","b":"2","ts":5}',
    b'{"seq":-9223372036854775808,"a":"1","b":"2","ts":5}',
    b'{"seq":9223372036854775808,"a":"1","b":"2","ts":5}',
    b'{"seq":-9223372036854775809,"a":"1","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":"2","ts":253402300799999}',
    b'{"seq":1,"a":"1","b":"2","ts":253402300800000}',
    b'{"seq":1,"a":"1","b":"2","ts":-62135596800000}',
    b'{"seq":1,"a":"1","b":"2","ts":-62135596800001}',
    b'{"seq":1,"a":"1","b":"2","ts":1000000000000000}',
    b'{"seq":1,"a":"1","b":"2","ts":9223372036854775807}',
    b'{"seq":1,"a":"1","b":"2","ts":-9223372036854775809}',
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":' + b"9" * 5_000 + b"}",
    b'{"seq":1,"a":"1","b":"2","ts":5,"pad":[-' + b"9" * 60_000 + b"]}",
    b'{"seq":' + b"9" * 5_000 + b',"a":"1","b":"2","ts":5}',
    b'{"seq":1,"a":"1","b":"2","ts":' + b"9" * 5_000 + b"}",
    # Values that do not start with a brace: null, which Arrow's reader can crash on,
    # blank, and events with whitespace before them.
    b"null",
    b" \tnull ",
    b"\t",
    b' {"seq":1,"a":"1","b":"2","ts":5}',
    b'\t{"seq":1,"a":"1","b":"2","ts":5} ',
]


def keys(values: Sequence[bytes | None]) -> list[tuple[str | None, str | None]]:
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
    that the caller parses value by value and learns why a value is refused. Arrow's
    reader is given no value that starts with anything but a brace, nor one with more
    brackets than a value may be nested deep."""
    values = [GOOD, value, GOOD]
    table = decode_events(values)
    parsed = [parse_event(v)[0] for v in values]
    value_by_value = value is not None and (
        value[:1] != b"{" or value.count(b"[") + value.count(b"{") > MAX_NESTING_DEPTH
    )
    if any(event is None for event in parsed) or value_by_value:
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


def test_a_batch_with_more_brackets_in_a_value_than_the_depth_bound_is_read_value_by_value() -> (
    None
):
    """A value with no more brackets than the bound cannot be nested deeper; a batch of
    values with a few brackets each still takes Arrow's path, counted line by line."""
    shallow = b'{"seq":1,"a":"1","b":"2","ts":5,"extra":[[1]]}'
    too_deep = nested(MAX_NESTING_DEPTH)
    assert parse_event(too_deep)[1] == "not JSON: nested deeper than 256"
    assert decode_events([shallow] * 400) is not None
    for at in (0, 200, 400):
        values = [shallow] * 400
        values.insert(at, too_deep)
        assert keys(values) == [(None, None) if i == at else ("1", "2") for i in range(401)]
        assert decode_events(values) is None


def test_the_depth_bound_counts_levels_not_brackets() -> None:
    assert [parse_event(v)[1] for v in SHALLOW_ENOUGH] == [None] * len(SHALLOW_ENOUGH)
    assert [parse_event(v)[1] for v in TOO_DEEP] == ["not JSON: nested deeper than 256"] * 3
    assert keys(SHALLOW_ENOUGH + TOO_DEEP) == [("1", "2")] * 4 + [(None, None)] * 3


def test_a_value_nested_deeper_than_the_callers_stack_allows_is_refused_not_raised() -> None:
    """The depth bound keeps ``json.loads`` far from Python's recursion limit; should a
    caller's stack be deep already, the ``RecursionError`` is a refusal too."""
    value = nested(MAX_NESTING_DEPTH - 1)
    depth = 0
    while sys._getframe(depth).f_back is not None:
        depth += 1
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 100)
    try:
        event, problem = parse_event(value)
    finally:
        sys.setrecursionlimit(limit)
    assert (event, problem) == (None, "not JSON: nested deeper than the parser's stack")
    assert parse_event(value)[1] is None


def test_a_blank_value_does_not_let_a_line_of_two_objects_pass_for_two_events() -> None:
    """Arrow reads no row for a blank line and two for a line of two objects: rows and
    values were as many, and two events were counted that the job refuses."""
    two = b'{"seq":1,"a":"1","b":"2","ts":5}{"seq":2,"a":"3","b":"4","ts":5}'
    for blank in (b"   ", b"\t"):
        assert keys([blank, two]) == [(None, None), (None, None)]
        assert decode_events([two, blank, GOOD]) is None


def test_a_value_of_null_is_refused_and_does_not_crash_arrows_reader() -> None:
    """Arrow's reader dereferences a null pointer on a line of ``null`` that starts a
    block: the batch's first line, or the first after 1 MiB (values of 1,023 bytes
    put a block boundary after every 1,024th line). Run apart, so that a crash fails
    this test rather than ending the run."""
    code = textwrap.dedent(
        """
        from keyplane.reference.events import decode_events, decode_keys

        good = b'{"seq":0,"a":"1","b":"2","ts":5,"pad":"' + b"x" * 982 + b'"}'
        for null in (b"null", b" \\tnull "):
            for at in (0, 1, 1023, 1024, 1025):
                values = [good] * 1100
                values[at] = null
                expected = [(None, None) if i == at else ("1", "2") for i in range(1100)]
                table = decode_keys(values)
                assert list(zip(*table.to_pydict().values())) == expected, at
                assert decode_events(values) is None
        print("read")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (run.returncode, run.stdout) == (0, "read\n"), run.stderr[-2000:]
    assert parse_event(b"null")[1] == "schema: not a JSON object"


def test_seq_and_ts_are_refused_outside_the_jobs_ranges() -> None:
    def event(seq: int | str, ts: int | str) -> bytes:
        return f'{{"seq":{seq},"a":"1","b":"2","ts":{ts}}}'.encode()

    for seq in (2**63, -(2**63) - 1, "9" * 5_000):
        assert "field 'seq'" in (parse_event(event(seq, 5))[1] or "")
    for ts in (253402300800000, -62135596800001, 10**15, 2**63, "9" * 5_000):
        assert "field 'ts'" in (parse_event(event(1, ts))[1] or "")
    values = [event(2**63 - 1, 253402300799999), event(-(2**63), -62135596800000)]
    assert [parse_event(v)[1] for v in values] == [None, None]
    table = decode_events(values)
    assert table is not None and table.column("ts").to_pylist() == [
        253402300799999,
        -62135596800000,
    ]
    assert keys([GOOD, event(1, 10**15), GOOD]) == [("1", "2"), (None, None), ("1", "2")]


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


def test_a_dead_letter_keeps_the_bytes_of_a_record_that_is_not_utf8() -> None:
    assert dead_letter_value(b'{"a":"\xe2\x82\xac"}') == {"value": '{"a":"\u20ac"}'}
    assert dead_letter_value(None) == {"value": ""}
    assert dead_letter_value(b"\xff\xfe{") == {"value_base64": "//57"}
    long = "\u20ac".encode() * 400  # 1,200 bytes: cut inside a character at 1,024
    assert dead_letter_value(long) == {"value": "\u20ac" * 341}
    assert dead_letter_value(b"\xff" * 2000) == {
        "value_base64": base64.b64encode(b"\xff" * 1024).decode()
    }
