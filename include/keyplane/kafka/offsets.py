"""Offset ranges of a micro-batch, as pure functions.

A Structured Streaming source describes each micro-batch by a start and an end
offset per partition. The representation here is the one Spark checkpoints
for keyplane's Kafka source: ``{topic: {"<partition>": next_offset}}`` (JSON
object keys must be strings).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TypeAlias

PartitionOffsets: TypeAlias = dict[str, dict[str, int]]


class OffsetSpecError(ValueError):
    """startingOffsets is neither 'earliest', 'latest' nor a valid JSON object."""


def parse_starting_offsets(spec: str) -> str | PartitionOffsets:
    """'earliest', 'latest', or an explicit ``{"topic": {"0": 42}}`` JSON object."""
    if spec in ("earliest", "latest"):
        return spec
    try:
        value = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise OffsetSpecError(
            f"startingOffsets must be 'earliest', 'latest' or JSON like "
            f'{{"events": {{"0": 0}}}}; got {spec!r}'
        ) from exc
    if not isinstance(value, dict) or not all(
        isinstance(parts, dict) and all(isinstance(o, int) and o >= 0 for o in parts.values())
        for parts in value.values()
    ):
        raise OffsetSpecError(f"startingOffsets JSON must map topic -> partition -> offset: {spec}")
    return {t: {str(p): int(o) for p, o in parts.items()} for t, parts in value.items()}


def total_rows(start: Mapping[str, Mapping[str, int]], end: Mapping[str, Mapping[str, int]]) -> int:
    return sum(
        max(0, off - start.get(topic, {}).get(part, 0))
        for topic, parts in end.items()
        for part, off in parts.items()
    )


def cap_offsets(
    start: PartitionOffsets, latest: PartitionOffsets, max_rows: int
) -> PartitionOffsets:
    """End offsets that read at most ``max_rows`` records after ``start``.

    Like Spark's own Kafka source (``maxOffsetsPerTrigger``), the budget is
    shared in proportion to what each partition has available, so a lagging
    partition catches up at the rate of the others. Rounding remainders go to
    the partitions with the largest fractional share; a batch always makes
    progress while data is available.
    """
    if max_rows < 1:
        raise ValueError(f"maxOffsetsPerTrigger must be >= 1, got {max_rows}")
    avail = {
        (t, p): max(0, off - start.get(t, {}).get(p, 0))
        for t, parts in latest.items()
        for p, off in parts.items()
    }
    total = sum(avail.values())
    if total <= max_rows:
        return {t: dict(parts) for t, parts in latest.items()}
    exact = {tp: n * max_rows / total for tp, n in avail.items()}
    take = {tp: int(x) for tp, x in exact.items()}
    left = max_rows - sum(take.values())
    for tp in sorted(exact, key=lambda k: (take[k] - exact[k], k))[:left]:
        take[tp] += 1
    out: PartitionOffsets = {}
    for (t, p), n in take.items():
        out.setdefault(t, {})[p] = start.get(t, {}).get(p, 0) + min(n, avail[(t, p)])
    return out


NEW_CHECKPOINT_FIX = (
    "the broker lost records it had acknowledged (a broker on memory storage restarted?): "
    "bring its storage back, or start the job on a new checkpoint (move KEYPLANE_HOME/job "
    "aside, then `keyplane job start`)"
)


class CheckpointAheadError(RuntimeError):
    """A checkpoint has read a topic further than the topic now reaches (one line)."""


def check_not_ahead(
    topic: str,
    read_through: Mapping[str, int],
    ends: Mapping[str, int] | Mapping[int, int],
    reader: str = "the checkpoint",
) -> None:
    """Raise :class:`CheckpointAheadError` if a partition of ``read_through`` (the offsets a
    checkpoint has read up to) lies past its end in ``ends`` (the topic's high watermarks).
    ``reader`` names the checkpoint in the message.

    Why: the next batch would read from an offset the topic does not have, which Spark
    reports as an unrelated failure deep in a plan, and every restart repeats it. A
    partition missing from ``ends`` ends at 0: the topic itself is gone.
    """
    by_partition = {str(partition): int(end) for partition, end in ends.items()}
    for partition, offset in sorted(read_through.items(), key=lambda item: int(item[0])):
        end = by_partition.get(str(partition), 0)
        if int(offset) > end:
            raise CheckpointAheadError(
                f"{reader} has read topic {topic!r} partition {partition} up to offset "
                f"{int(offset)}, but the topic ends at offset {end}: {NEW_CHECKPOINT_FIX}"
            )
