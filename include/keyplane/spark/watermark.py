"""The stages' watermark: an event-time column on which no row is ever late.

Why the stages have a watermark at all. Stage A of both counting jobs
(:mod:`keyplane.spark.routed_counts`, :mod:`keyplane.spark.running_counts`) is a
``transformWithState`` in event-time mode, and event-time mode needs a watermark.
Spark fixes an operator's time mode for the life of its checkpoint (a restart
that changes it fails with ``STATE_STORE_INVALID_CONFIG_AFTER_RESTART``; checked
on PySpark 4.3), so every checkpoint the jobs have written keeps that mode. It
was chosen because Spark was thought to let a second stateful operator follow
only one with an event-time column; PySpark 4.3 chains two ``transformWithState``
stages without one, but a single mode for every checkpoint keeps one code path.

Neither stage sets a timer or keeps state by time: the watermark does nothing
for them. What it can do is drop rows. Spark drops each input row of an
event-time ``transformWithState`` whose event time is at or below the previous
batch's watermark. On the events' own times (``ts``), that dropped every event
more than the delay behind the newest one of an earlier batch (a producer whose
clock is behind, partitions read out of step, a backfill), while the batch's
metrics counted it as read. The application counts every tuple (paper 000
§4.1), so counts must stay exact whatever the events' times.

So the watermark follows :data:`WATERMARK_COLUMN`, which holds one time on every
row (:func:`watermark_ms`). Spark's watermark is the newest time seen minus
:data:`WATERMARK_DELAY`, so it stays below that time and no row is ever at or
below it. The events keep their own ``ts`` as data.

The time is the same in every batch and every run of a checkpoint,
:data:`BASE_MS`, so a batch replayed after a crash gets the value it first had.
Only a checkpoint written while the watermark followed the events' times can
hold a watermark above it (a future-dated event puts it anywhere up to the year
9999): such a checkpoint takes the time just above its watermark, and keeps it,
since its watermark then stays where it was. Its watermark is read from Spark's
offset log (:func:`checkpoint_watermark_ms`).

A side effect: the watermark moves once in a checkpoint's life, so Spark would
run its batch without input for an advanced watermark once, not after every
batch (:func:`keyplane.spark.counts_job._no_batches_without_data`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

WATERMARK_COLUMN = "watermark_ts"
"""The column the stages' watermark follows; stage A passes it on as its output's event time."""
WATERMARK_DELAY = "1 minute"
"""Any positive delay would do: the watermark must stay strictly below the column's time."""
BASE_MS = 946_684_800_000
"""2000-01-01T00:00:00Z in epoch milliseconds: the column's time for a checkpoint whose
watermark is below it. Any time would do; a round one reads as what it is in Spark's
progress reports."""
DELAY_KEY = "spark.watermarkDelayMs"
"""The column metadata by which Spark marks a watermark's column."""


def checkpoint_watermark_ms(checkpoint: Path | None) -> int:
    """The watermark Spark recorded with ``checkpoint``'s newest planned batch; 0 for none.

    Spark restores its watermark from that entry of the offset log when the
    query starts again, and the watermark never goes down after.
    """
    offsets = None if checkpoint is None else checkpoint / "offsets"
    if offsets is None or not offsets.is_dir():
        return 0
    batches = [int(entry.name) for entry in offsets.iterdir() if entry.name.isdigit()]
    if not batches:
        return 0
    entry = offsets / str(max(batches))
    lines = entry.read_text().splitlines()
    try:
        return int(json.loads(lines[1])["batchWatermarkMs"])
    except (IndexError, KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{entry}: no batchWatermarkMs in Spark's offset log entry ({error!r}); "
            "the stages' watermark must start above it"
        ) from None


def watermark_ms(checkpoint: Path | None) -> int:
    """The time of :data:`WATERMARK_COLUMN` for a run of ``checkpoint`` (module docstring)."""
    return max(BASE_MS, checkpoint_watermark_ms(checkpoint) + 1)


def watermarked_columns(rows: DataFrame) -> list[str]:
    """The columns of ``rows`` that carry a watermark."""
    return [field.name for field in rows.schema.fields if DELAY_KEY in field.metadata]


def with_stage_watermark(rows: DataFrame, checkpoint: Path | None) -> DataFrame:
    """``rows`` with :data:`WATERMARK_COLUMN` and the stages' watermark on it.

    ``checkpoint`` is the query's checkpoint (None: a new one). Refuses rows
    that carry a watermark already: Spark would hold the stages to the lower
    of the two, and one on the events' own times drops late events.
    """
    from pyspark.sql import functions as F

    taken = watermarked_columns(rows)
    if taken:
        raise ValueError(
            f"the rows carry a watermark on {', '.join(taken)}; the stages set their own, on "
            f"{WATERMARK_COLUMN} (keyplane.spark.watermark), so that no event is dropped as late"
        )
    time = F.timestamp_millis(F.lit(watermark_ms(checkpoint)))
    return rows.withColumn(WATERMARK_COLUMN, time).withWatermark(WATERMARK_COLUMN, WATERMARK_DELAY)


def check_stage_watermark(rows: DataFrame) -> None:
    """Refuse stage input whose watermark is not :func:`with_stage_watermark`'s (one line)."""
    taken = watermarked_columns(rows)
    if taken != [WATERMARK_COLUMN]:
        found = ", ".join(taken) if taken else "no column"
        raise ValueError(
            f"the stages' input must carry its watermark on {WATERMARK_COLUMN} alone "
            f"(keyplane.spark.watermark.with_stage_watermark), found one on {found}"
        )
