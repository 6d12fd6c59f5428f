"""The wire format of the events a keyed job consumes.

An event is a JSON object ``{"seq": int, "a": str, "b": str, "ts": int, "pad": str}``:
``a`` and ``b`` are the keys of the two consecutive stateful stages (paper 000
§4's two-field tuples), ``seq`` is the event's position in the generated
stream (ground truth for exactly-once checks), ``ts`` the event time in epoch
milliseconds and ``pad`` optional padding (000 §4.2 pads tuples to 0–20 kB to
make network transfer visible).

JSON keeps events readable with any Kafka tool. The streaming job parses them
with Spark's ``from_json`` against :data:`EVENT_DDL`; the statistics job, which
reads whole windows in Python tasks, with Arrow's JSON reader
(:func:`decode_keys`).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from keyplane.reference.workloads import EventBatch
from keyplane.settings import MAX_EVENT_BYTES

EVENT_DDL = "seq LONG, a STRING, b STRING, ts LONG, pad STRING"

EVENT_KEYS_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string())])


_REQUIRED_FIELDS: tuple[tuple[str, type], ...] = (
    ("seq", int),
    ("a", str),
    ("b", str),
    ("ts", int),
)
_FIELDS_SCHEMA = pa.schema(
    [("seq", pa.int64()), ("a", pa.string()), ("b", pa.string()), ("ts", pa.int64())]
)
_SEQ_RANGE = (-(1 << 63), (1 << 63) - 1)
"""A ``seq`` the job can hold: its ``seq`` columns are 64-bit (``LONG``)."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TS_RANGE_MS = (
    (datetime(1, 1, 1, tzinfo=UTC) - _EPOCH) // timedelta(milliseconds=1),
    (datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC) - _EPOCH) // timedelta(milliseconds=1),
)
"""A ``ts`` (epoch milliseconds) the job can turn into its event time: a ``TIMESTAMP``
holds years 1 to 9999, and so does Python's ``datetime``, which the job builds for a
forwarded tuple. A ``ts`` past them, even one a 64-bit integer holds, failed the task
that built its row on every retry."""
MAX_NESTING_DEPTH = 256
"""How deep an event may nest arrays and objects, its own object counting as one.

``json.loads`` recurses once per level, so a value nested some thousand levels
deep, a few kilobytes, raises ``RecursionError`` whatever the size limit, while
Arrow's reader takes any depth. A deeper value is refused by :func:`parse_event`
before it is parsed, and a batch that might hold one is read value by value
(:func:`_may_nest_deeper_than`). No event the job writes nests more than one level."""

MAX_PAD_BYTES = 20_000

Forward = Literal["pairs", "tuples"]
"""What the routed job's stage A sends stage B. ``pairs``: one row per
(field-1 routed key, field-2 key) and micro-batch, with its weight; the
padding stays behind. ``tuples``: every event, with its ``pad``, as the
application of paper 000 §4.1 forwards tuples, so that the shuffle between
the stages carries what §4.2's padding models (:mod:`keyplane.spark.routed_counts`)."""
FORWARD_MODES: tuple[Forward, ...] = get_args(Forward)


def key_name(key_id: int) -> str:
    """The string form of a generated key id, used on the wire and in state."""
    return str(key_id)


_PAD_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@functools.cache
def _random_pad_source() -> str:
    """1 MiB of seeded random characters that paddings are cut from.

    000 §4.2 pads tuples to model their size on the network. One repeated
    character models nothing once a shuffle or a topic is compressed (Spark
    compresses shuffle blocks by default: 8 kB of "x" become a few bytes), so
    ``pad_fill="random"`` cuts each padding from this text instead: 6 bits of
    entropy per character, which LZ4 and Snappy cannot shrink.
    """
    rng = np.random.default_rng(0x9AD)
    codes = rng.integers(0, len(_PAD_ALPHABET), size=1 << 20)
    return "".join(np.array(list(_PAD_ALPHABET))[codes].tolist())


def _random_pad(seq: int, length: int) -> str:
    """Event ``seq``'s padding of ``length`` characters: a slice of the source
    at an offset that differs from event to event, so that consecutive
    paddings do not repeat each other either."""
    source = _random_pad_source()
    offset = (seq * 2_654_435_761) % (len(source) - length + 1)
    return source[offset : offset + length]


def encode_batch(batch: EventBatch, ts_ms: int) -> Iterator[bytes]:
    """Encode every event of ``batch`` as UTF-8 JSON, in order."""
    random_fill = batch.pad_fill == "random"
    pads = {} if random_fill else {int(n): "x" * int(n) for n in set(batch.pad.tolist())}
    for i, (a, b, pad) in enumerate(
        zip(batch.a.tolist(), batch.b.tolist(), batch.pad.tolist(), strict=True)
    ):
        yield json.dumps(
            {
                "seq": batch.start + i,
                "a": key_name(a),
                "b": key_name(b),
                "ts": ts_ms,
                "pad": _random_pad(batch.start + i, pad) if random_fill else pads[pad],
            },
            separators=(",", ":"),
        ).encode()


def parse_event(
    value: bytes | None, max_bytes: int = MAX_EVENT_BYTES
) -> tuple[dict[str, Any] | None, str | None]:
    """An event's fields, or ``None`` and why the record is not a valid event.

    The one definition of a valid event: the routed job dead-letters what it
    refuses, and every reader that counts events (:func:`decode_keys`) counts
    exactly what the job counts. The size is checked before parsing, so an
    oversized record costs no JSON parse and cannot blow up a worker's memory.

    The value is decoded as strict UTF-8 before it is parsed: ``json.loads``
    of bytes would also take UTF-16, a byte order mark and encoded surrogates.
    A string with an unpaired surrogate escape (``"\\ud800"``) parses to a
    ``str`` that no UTF-8 writer accepts, so the first Arrow table built from
    it would fail the task on every retry; such a record is refused, wherever
    the string is, as Arrow's JSON reader refuses it.

    For the same reason a value nested deeper than :data:`MAX_NESTING_DEPTH`
    is refused before ``json.loads`` could exceed the recursion limit on it
    (``RecursionError``, caught too, should the caller's stack already be
    deep), and a ``seq`` or a ``ts`` is refused outside the range the job's
    columns hold (:data:`_SEQ_RANGE`, :data:`_TS_RANGE_MS`).
    """
    if value is None:
        return None, "empty record"
    if len(value) > max_bytes:
        return None, f"oversized: {len(value)} bytes > {max_bytes}"
    try:
        text = value.decode("utf-8")
        if nested_deeper_than(value, MAX_NESTING_DEPTH):
            return None, f"not JSON: nested deeper than {MAX_NESTING_DEPTH}"
        event = _json_value(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"not JSON: {error}"
    except RecursionError:
        return None, "not JSON: nested deeper than the parser's stack"
    if "\\u" in text and _holds_lone_surrogate(event):
        return (
            None,
            "not JSON: a string holds an unpaired surrogate escape, which UTF-8 cannot encode",
        )
    if not isinstance(event, dict):
        return None, "schema: not a JSON object"
    for field, kind in _REQUIRED_FIELDS:
        if not isinstance(event.get(field), kind) or isinstance(event.get(field), bool):
            return None, f"schema: field {field!r} missing or not {kind.__name__}"
    if not _SEQ_RANGE[0] <= event["seq"] <= _SEQ_RANGE[1]:
        return None, "schema: field 'seq' out of range: not a 64-bit integer"
    if not _TS_RANGE_MS[0] <= event["ts"] <= _TS_RANGE_MS[1]:
        return None, "schema: field 'ts' out of range: not epoch milliseconds in years 1 to 9999"
    return event, None


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


DEAD_LETTER_VALUE_BYTES = 1024
"""How much of a refused record's value its dead letter keeps."""


def dead_letter_value(value: bytes | None) -> dict[str, str]:
    """A refused record's value as its dead letter keeps it, at most
    :data:`DEAD_LETTER_VALUE_BYTES` of it: ``{"value": text}`` when the record is UTF-8,
    else ``{"value_base64": ...}`` of its bytes.

    Why base64: decoding with replacement characters would lose the very bytes
    that made the record invalid, and a dead letter is where one looks for them.
    """
    raw = value or b""
    kept = raw[:DEAD_LETTER_VALUE_BYTES]
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"value_base64": base64.b64encode(kept).decode("ascii")}
    # Valid UTF-8 cut at the limit may end inside a character: that piece is dropped.
    return {"value": kept.decode("utf-8", "ignore")}


def nested_deeper_than(value: bytes, depth: int) -> bool:
    """Whether ``value`` opens more than ``depth`` arrays or objects inside one another.

    Each level opens with a bracket, so a value with no more than ``depth``
    brackets (``[`` and ``{``), every usual event, costs two counts. Otherwise
    its strings are cut out, ending where ``json.loads`` ends them, and the
    depth is the running sum of its opening (+1) and closing (-1) brackets,
    taken with NumPy rather than by recursion. In a value that is not JSON
    this counts at least the levels ``json.loads`` reaches before it fails.
    ``[`` and ``{`` differ from each other only by the bit 32, as do ``]``
    and ``}``, and no other bytes do.
    """
    if value.count(b"[") + value.count(b"{") <= depth:
        return False
    folded = np.frombuffer(_JSON_STRING.sub(b"", value), np.uint8) | 32
    steps = (folded == ord("{")).astype(np.int32) - (folded == ord("}"))
    return int(np.cumsum(steps).max(initial=0)) > depth


def _json_integer(digits: str) -> int | float:
    """A JSON integer as ``int``, or as a ``float`` (``inf`` past about 1e308, as
    ``json`` reads ``1e400``) when it has more digits than Python converts to an
    ``int`` (``sys.get_int_max_str_digits()``, 4,300 by default)."""
    try:
        return int(digits)
    except ValueError:
        return float(digits)


_LONG_INTEGERS = json.JSONDecoder(parse_int=_json_integer)


def _json_value(text: str) -> Any:
    """``json.loads(text)``, which raises a bare ``ValueError`` on an integer of more
    digits than Python converts: such an integer, in a field the job ignores, is valid
    JSON that Arrow's reader takes. Only then is ``text`` parsed again with the
    slower :func:`_json_integer`, so that ``seq`` or ``ts`` holding it is not an
    ``int`` and the event fails the schema."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:
        return _LONG_INTEGERS.decode(text)


def _holds_lone_surrogate(event: Any) -> bool:
    """Whether a string of a parsed JSON value, a name or a value at any depth, holds
    a surrogate without its pair. Only a ``\\u`` escape can make one in a text decoded
    as strict UTF-8, so :func:`parse_event` walks only a text with an escape. Walked
    with a list rather than by recursion, so a value nested as deep as ``json.loads``
    reaches cannot exceed the recursion limit."""
    pending = [event]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            pending.extend(node)
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, str) and not node.isascii():
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


_UTF8_BOM = b"\xef\xbb\xbf"


def _reads_as_parse_event_does(lines: bytes) -> bool:
    """Whether Arrow's JSON reader takes ``lines`` as :func:`parse_event` takes each line.

    Arrow copies strings without checking their encoding and skips a byte
    order mark at the start of each block it parses; :func:`parse_event`
    refuses both. An ASCII batch, the usual one, has neither, and
    ``isascii`` tells in one fast pass. Otherwise
    Arrow's validator checks the bytes in place: it refuses what Python's
    strict codec refuses (overlong forms, encoded surrogates, code points
    past U+10FFFF), without decoding the batch into a ``str`` as large. The
    search for a mark runs only where its first byte occurs: a multi-byte
    pattern is searched several times slower than one byte.
    """
    if lines.isascii():
        return True
    if lines.startswith(_UTF8_BOM) or (_UTF8_BOM[:1] in lines and b"\n" + _UTF8_BOM in lines):
        return False
    offsets = pa.py_buffer(np.array([0, len(lines)], dtype=np.int64))
    text = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(lines)])
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


_OPEN_BRACE = ord("{")


def _read_json_lines(values: Sequence[bytes | None], max_bytes: int) -> pa.Table | None:
    """Every value's required fields in one call to Arrow's JSON reader, one line per
    value (:func:`encode_batch` never writes a line break inside an event), null where
    a field is missing; ``None`` when the values do not fit that path.

    Arrow checks the fields' types against an explicit schema and fails the
    whole batch on a mismatch; a value that spans lines, does not start with
    ``{`` or is oversized does not fit either, nor does a batch that is not
    UTF-8 or has a value that starts with a byte order mark
    (:func:`_reads_as_parse_event_does`), or one with a value that may be
    nested deeper than :data:`MAX_NESTING_DEPTH` (:func:`_may_nest_deeper_than`).
    A caller then parses the batch value by value with :func:`parse_event`,
    so a malformed event costs its batch speed and is refused alone.

    Every line starts with ``{`` (an empty value is read as ``{}``, a row of
    nulls). Arrow reads no row for a blank line, which let a line of two
    objects (``{...}{...}``), refused by :func:`parse_event`, pass for two
    events in the rows of two values; and a line of ``null`` that starts one
    of the blocks it parses (1 MiB each, the first line's included) crashes
    the process on a null pointer (apache/arrow#47409). An event with
    whitespace before its object is parsed value by value, as it is valid.
    """
    if not all(
        not v or (v[0] == _OPEN_BRACE and len(v) <= max_bytes and b"\n" not in v and b"\r" not in v)
        for v in values
    ):
        return None
    lines = b"\n".join(v or b"{}" for v in values)
    if not _reads_as_parse_event_does(lines):
        return None
    try:
        table = pa_json.read_json(
            io.BytesIO(lines),
            parse_options=pa_json.ParseOptions(
                explicit_schema=_FIELDS_SCHEMA, unexpected_field_behavior="ignore"
            ),
        )
    except pa.ArrowInvalid:
        return None
    if table.num_rows != len(values) or _may_nest_deeper_than(
        lines, len(values), MAX_NESTING_DEPTH
    ):
        return None
    return table


_SCAN_BYTES = 1 << 18
"""The slice of a batch :func:`_may_nest_deeper_than` scans at a time: its
temporary arrays stay in the processor's cache."""


def _may_nest_deeper_than(lines: bytes, rows: int, depth: int) -> bool:
    """Whether one of the ``rows`` lines of ``lines``, each starting with ``{``, has
    more than ``depth`` opening brackets (``[``, ``{``), which bound its depth.

    Counting each line's brackets takes finding the lines; counting the
    batch's takes one vectorised pass (``[`` folded onto ``{``, as in
    :func:`nested_deeper_than`).
    Every other line holds a brace, so no line holds more than the batch's
    count less one per other line. Only when that bound exceeds ``depth``
    (a batch of arrays or nested objects in ignored fields) are the brackets
    counted line by line. pyarrow's ``count_substring`` is slower than
    either.
    """
    codes = np.frombuffer(lines, np.uint8)
    folded = np.empty(min(len(codes), _SCAN_BYTES), np.uint8)
    opening = 0
    for start in range(0, len(codes), _SCAN_BYTES):
        part = folded[: min(_SCAN_BYTES, len(codes) - start)]
        np.bitwise_or(codes[start : start + _SCAN_BYTES], 32, out=part)
        opening += int(np.count_nonzero(part == _OPEN_BRACE))
    if opening - (rows - 1) <= depth:
        return False
    ends = np.flatnonzero(codes == ord("\n"))
    line_of = np.searchsorted(ends, np.flatnonzero((codes | 32) == _OPEN_BRACE))
    return int(np.bincount(line_of).max()) > depth


def _complete(table: pa.Table) -> pa.ChunkedArray:
    """Which rows of a :func:`_read_json_lines` table hold every required field."""
    valid = pc.is_valid(table.column("seq"))
    for name in ("a", "b", "ts"):
        valid = pc.and_(valid, pc.is_valid(table.column(name)))
    ts = table.column("ts")
    in_range = pc.and_(pc.greater_equal(ts, _TS_RANGE_MS[0]), pc.less_equal(ts, _TS_RANGE_MS[1]))
    return pc.and_(valid, pc.fill_null(in_range, False))


def decode_keys(values: Sequence[bytes | None], max_bytes: int = MAX_EVENT_BYTES) -> pa.Table:
    """The ``a`` and ``b`` of each value, in order; null where :func:`parse_event` refuses it.

    A window of a million events is parsed in one call to Arrow's JSON
    reader (:func:`_read_json_lines`); a window that does not fit that path
    is parsed value by value.
    """
    table = _read_json_lines(values, max_bytes)
    if table is not None:
        valid = _complete(table)
        return pa.table(
            {
                name: pc.if_else(valid, table.column(name), pa.scalar(None, pa.string()))
                for name in EVENT_KEYS_SCHEMA.names
            },
            schema=EVENT_KEYS_SCHEMA,
        )
    keys: list[tuple[str | None, str | None]] = []
    for value in values:
        event, _ = parse_event(value, max_bytes)
        keys.append((None, None) if event is None else (event["a"], event["b"]))
    return pa.table(
        {"a": [k[0] for k in keys], "b": [k[1] for k in keys]}, schema=EVENT_KEYS_SCHEMA
    )


def decode_events(
    values: Sequence[bytes | None], max_bytes: int = MAX_EVENT_BYTES
) -> pa.Table | None:
    """``seq``, ``a``, ``b`` and ``ts`` of every value, in order, when all are valid events.

    ``None`` when one is not (or the values do not fit Arrow's path,
    :func:`_read_json_lines`): the caller parses them value by value with
    :func:`parse_event`, which says why each refused one is refused.
    """
    table = _read_json_lines(values, max_bytes)
    if table is None or not pc.all(_complete(table)).as_py():
        return None
    return table
