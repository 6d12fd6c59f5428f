"""The wire format of the events a keyed job consumes.

An event is a JSON object ``{"seq": int, "a": str, "b": str, "ts": int, "pad": str}``:
``a`` and ``b`` are the keys of the two consecutive stateful stages (paper 000
§4's two-field tuples), ``seq`` is the event's position in the generated
stream (ground truth for exactly-once checks), ``ts`` the event time in epoch
milliseconds and ``pad`` optional padding (000 §4.2 pads tuples to 0–20 kB to
make network transfer visible).

JSON keeps events readable with any Kafka tool; the Spark side parses them with
``from_json`` against :data:`EVENT_DDL`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from keyplane.workloads import EventBatch

EVENT_DDL = "seq LONG, a STRING, b STRING, ts LONG, pad STRING"

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
