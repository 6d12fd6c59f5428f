"""The stages' time mode, and the watermark of the checkpoints that have one.

Spark fixes a ``transformWithState`` operator's time mode for the life of its
checkpoint: a restart that changes it fails with
``STATE_STORE_INVALID_CONFIG_AFTER_RESTART`` (checked on PySpark 4.3). Neither
stage of the counting jobs (:mod:`keyplane.spark.routed_counts`,
:mod:`keyplane.spark.running_counts`, :mod:`keyplane.spark.jvm`) sets a timer or
keeps state by time, so a new checkpoint's stages run without one
(:data:`NEW_CHECKPOINT_TIME_MODE`).

Why not event time. Checkpoints written by earlier versions of keyplane ran stage A in
event-time mode, once thought needed for a second stateful operator to follow
the first (PySpark 4.3 chains two ``transformWithState`` stages without it). In
that mode Spark scans the stage's timers after every task's rows although none
is ever set, keeps timer column families in every state partition, and needs a
watermark, which could drop rows (below) and makes batches without input. Such
a checkpoint keeps event time, read from Spark's operator metadata
(:func:`checkpoint_time_mode`), and the job carries on with it.

What an event-time checkpoint's watermark must not do is drop rows. Spark drops
each input row of an event-time ``transformWithState`` whose event time is at or
below the previous batch's watermark. On the events' own times (``ts``), that
dropped every event more than the delay behind the newest one of an earlier
batch (a producer whose clock is behind, partitions read out of step, a
backfill), while the batch's metrics counted it as read. The application counts
every tuple (paper 000 §4.1), so counts must stay exact whatever the events'
times.

So the watermark follows :data:`WATERMARK_COLUMN`, which holds one time on every
row (:func:`watermark_ms`). Spark's watermark is the newest time seen minus
:data:`WATERMARK_DELAY`, so it stays below that time and no row is ever at or
below it. The events keep their own ``ts`` as data. Every checkpoint's rows
carry the column, so that both modes have one schema; only an event-time
checkpoint puts a watermark on it.

The time is the same in every batch and every run of a checkpoint,
:data:`BASE_MS`, so a batch replayed after a crash gets the value it first had.
Only a checkpoint written while the watermark followed the events' times can
hold a watermark above it (a future-dated event puts it anywhere up to the year
9999): such a checkpoint takes the time just above its watermark, and keeps it,
since its watermark then stays where it was. Its watermark is read from Spark's
offset log (:func:`checkpoint_watermark_ms`).

A side effect: the watermark moves once in an event-time checkpoint's life, so
Spark would run its batch without input for an advanced watermark once, not
after every batch (:func:`keyplane.spark.counts_job._no_batches_without_data`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

StageTimeMode = Literal["None", "EventTime"]
"""A stage's ``transformWithState`` time mode, as PySpark names it (no processing time:
the stages have no timers)."""
NEW_CHECKPOINT_TIME_MODE: StageTimeMode = "None"
"""The time mode stage A starts a new checkpoint in (module docstring)."""
SPARK_TIME_MODES: dict[str, StageTimeMode] = {"NoTime": "None", "EventTime": "EventTime"}
"""Spark's names in its operator metadata (``operatorPropertiesJson.timeMode``) → ours."""
WATERMARK_COLUMN = "watermark_ts"
"""The column an event-time stage A's watermark follows; stage A passes it on as its
output's event time."""
WATERMARK_DELAY = "1 minute"
"""Any positive delay would do: the watermark must stay strictly below the column's time."""
BASE_MS = 946_684_800_000
"""2000-01-01T00:00:00Z in epoch milliseconds: the column's time for a checkpoint whose
watermark is below it. Any time would do; a round one reads as what it is in Spark's
progress reports."""
DELAY_KEY = "spark.watermarkDelayMs"
"""The column metadata by which Spark marks a watermark's column."""


class CheckpointRecordError(ValueError):
    """A record Spark keeps in a checkpoint that cannot be read as Spark writes it (one line,
    naming the file, for a CLI)."""


def checkpoint_time_mode(checkpoint: Path | None) -> StageTimeMode | None:
    """The time mode ``checkpoint``'s stages were started in; None when Spark recorded none.

    Spark writes each stateful operator's properties, its time mode among them,
    under ``state/<operator>/_metadata/v2/<batch>`` when it plans the
    checkpoint's first batch (and again when they change), before the batch
    runs; that record is what a restart is checked against. A checkpoint is
    in event time if any operator's newest record says so (only stage A ever
    ran in it). No record (a new checkpoint, or one whose first batch was never
    planned) leaves the mode free.
    """
    state = None if checkpoint is None else checkpoint / "state"
    if state is None or not state.is_dir():
        return None
    modes = set()
    for records in sorted(state.glob("*/_metadata/v2")):
        batches = [int(entry.name) for entry in records.iterdir() if entry.name.isdigit()]
        if batches:
            modes.add(_recorded_time_mode(records / str(max(batches))))
    if not modes:
        return None
    return "EventTime" if "EventTime" in modes else "None"


def _recorded_time_mode(record: Path) -> StageTimeMode:
    """The time mode in one of Spark's operator metadata files (v2: a version line, JSON)."""
    lines = record.read_text(encoding="utf-8").splitlines()
    try:
        properties = json.loads(json.loads(lines[1])["operatorPropertiesJson"])
        return SPARK_TIME_MODES[properties["timeMode"]]
    except (IndexError, KeyError, TypeError, ValueError) as error:
        raise CheckpointRecordError(
            f"{record}: no time mode Spark's operator metadata can have ({error!r}); "
            "the stages must start in the mode the checkpoint was written in"
        ) from None


def stage_time_mode(
    checkpoint: Path | None, new: StageTimeMode = NEW_CHECKPOINT_TIME_MODE
) -> StageTimeMode:
    """The time mode the stages run in for a run of ``checkpoint``: the recorded one, else ``new``.

    ``new`` is what a new checkpoint starts in; ``"EventTime"`` writes one as
    earlier versions of keyplane did (to compare the two modes, or test a restart of such a
    checkpoint).
    """
    return checkpoint_time_mode(checkpoint) or new


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
        raise CheckpointRecordError(
            f"{entry}: no batchWatermarkMs in Spark's offset log entry ({error!r}); "
            "the stages' watermark must start above it"
        ) from None


def watermark_ms(checkpoint: Path | None) -> int:
    """The time of :data:`WATERMARK_COLUMN` for a run of ``checkpoint`` (module docstring)."""
    return max(BASE_MS, checkpoint_watermark_ms(checkpoint) + 1)


def watermarked_columns(rows: DataFrame) -> list[str]:
    """The columns of ``rows`` that carry a watermark."""
    return [field.name for field in rows.schema.fields if DELAY_KEY in field.metadata]


def with_stage_watermark(
    rows: DataFrame, checkpoint: Path | None, time_mode: StageTimeMode | None = None
) -> DataFrame:
    """``rows`` with :data:`WATERMARK_COLUMN`, and the stages' watermark on it if they run in
    event time for a run of ``checkpoint`` (None: a new one).

    ``time_mode`` is the stages' mode for this run, as a caller that has read
    it already passes it (:func:`stage_time_mode`); None reads it here. The
    stages read it back from the rows (:func:`input_time_mode`). Refuses
    rows that carry a watermark already: Spark would hold an event-time stage to
    the lower of the two, and one on the events' own times drops late events.
    """
    from pyspark.sql import functions as F

    taken = watermarked_columns(rows)
    if taken:
        raise ValueError(
            f"the rows carry a watermark on {', '.join(taken)}; the stages set their own, on "
            f"{WATERMARK_COLUMN} (keyplane.spark.watermark), so that no event is dropped as late"
        )
    if (time_mode or stage_time_mode(checkpoint)) == "None":
        return rows.withColumn(WATERMARK_COLUMN, F.timestamp_millis(F.lit(BASE_MS)))
    time = F.timestamp_millis(F.lit(watermark_ms(checkpoint)))
    return rows.withColumn(WATERMARK_COLUMN, time).withWatermark(WATERMARK_COLUMN, WATERMARK_DELAY)


def input_time_mode(rows: DataFrame) -> StageTimeMode:
    """The time mode of stage input made by :func:`with_stage_watermark`: event time when it
    carries the watermark; refuses input that is not such (one line)."""
    taken = watermarked_columns(rows)
    if WATERMARK_COLUMN not in rows.columns or taken not in ([], [WATERMARK_COLUMN]):
        found = ", ".join(taken) if taken else "no column"
        raise ValueError(
            f"the stages' input must carry {WATERMARK_COLUMN}, with a watermark on it alone or "
            f"none (keyplane.spark.watermark.with_stage_watermark); its watermark is on {found}"
        )
    return "EventTime" if taken else "None"


def event_time_column(mode: StageTimeMode) -> str:
    """Stage A's ``eventTimeColumnName`` in ``mode``: its output's event time, "" for none
    (PySpark's default)."""
    return WATERMARK_COLUMN if mode == "EventTime" else ""
