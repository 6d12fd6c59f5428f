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

import io
import json
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.json as pa_json

from keyplane.workloads import EventBatch

EVENT_DDL = "seq LONG, a STRING, b STRING, ts LONG, pad STRING"

EVENT_KEYS_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string())])

MAX_PAD_BYTES = 20_000


def key_name(key_id: int) -> str:
    """The string form of a generated key id, used on the wire and in state."""
    return str(key_id)


def encode_batch(batch: EventBatch, ts_ms: int) -> Iterator[bytes]:
    """Encode every event of ``batch`` as UTF-8 JSON, in order."""
    pads = {int(n): "x" * int(n) for n in set(batch.pad.tolist())}
    for i, (a, b, pad) in enumerate(
        zip(batch.a.tolist(), batch.b.tolist(), batch.pad.tolist(), strict=True)
    ):
        yield json.dumps(
            {
                "seq": batch.start + i,
                "a": key_name(a),
                "b": key_name(b),
                "ts": ts_ms,
                "pad": pads[pad],
            },
            separators=(",", ":"),
        ).encode()


def decode_keys(values: Sequence[bytes | None]) -> pa.Table:
    """The ``a`` and ``b`` of each value, in order, null where a value is not an event.

    A window of a million events is parsed in one call to Arrow's JSON reader,
    one line per value: :func:`encode_batch` never writes a line break inside
    an event. When that does not hold for a batch (a value that spans lines or
    is blank, one that is not a JSON object, a key that is not a string), the
    batch is parsed again value by value, so a malformed event costs its batch
    speed and is skipped alone: its neighbours are counted all the same.
    """
    if not any(b"\n" in v or b"\r" in v for v in values if v):
        lines = b"\n".join(v or b"{}" for v in values)
        try:
            table = pa_json.read_json(
                io.BytesIO(lines),
                parse_options=pa_json.ParseOptions(
                    explicit_schema=EVENT_KEYS_SCHEMA, unexpected_field_behavior="ignore"
                ),
            )
        except pa.ArrowInvalid:
            table = None
        if table is not None and table.num_rows == len(values):
            return table.select(EVENT_KEYS_SCHEMA.names)
    keys = [_keys_of_one(v) for v in values]
    return pa.table(
        {"a": [k[0] for k in keys], "b": [k[1] for k in keys]}, schema=EVENT_KEYS_SCHEMA
    )


def _keys_of_one(value: bytes | None) -> tuple[str | None, str | None]:
    try:
        event = json.loads(value or b"")
    except ValueError:
        return None, None
    if not isinstance(event, dict):
        return None, None
    a, b = event.get("a"), event.get("b")
    return (a if isinstance(a, str) else None), (b if isinstance(b, str) else None)
