"""The plan of the micro-batch a task runs in, read back from Spark's offset log.

Why. When Spark's own Kafka connector reads the routed job's events
(:mod:`keyplane.spark.connector_events`), the tasks that route them do not
read keyplane's source, whose offset carries the batch's routing versions
(:mod:`keyplane.spark.routed_source`). They find that offset where Spark keeps
it: the offset log, the checkpoint's ``offsets/<batch id>`` file, which Spark
writes before it runs the batch and reads back when it replays it. So a
replayed batch routes on the versions it first routed on (000 §3.4) with no
record of keyplane's own. A task knows its batch by the local property Spark
sets while it runs one (:data:`BATCH_ID_PROPERTY`).

The log's format, a version line, the batch's metadata and then one line per
source, is Spark's own (``OffsetSeqLog``); :func:`planned_offset` finds
keyplane's line by its content, not by its position among the sources.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BATCH_ID_PROPERTY = "streaming.sql.batchId"
"""The local property Spark sets on the tasks of a streaming query's micro-batch."""


class BatchPlanUnavailable(RuntimeError):
    """A task cannot find the plan of its micro-batch; the message says why."""


def running_batch_id() -> int:
    """The id of the micro-batch the calling task runs in."""
    from pyspark import TaskContext

    context = TaskContext.get()
    value = context.getLocalProperty(BATCH_ID_PROPERTY) if context is not None else None
    if value is None:
        raise BatchPlanUnavailable(
            "not in a task of a streaming query's micro-batch: Spark sets no "
            f"{BATCH_ID_PROPERTY!r} here"
        )
    return int(value)


def offset_log_file(checkpoint: str, batch_id: int) -> Path:
    """Where Spark's offset log keeps ``batch_id`` of the query checkpointed at ``checkpoint``.

    The tasks read it as a file, so the checkpoint must be on a file system
    every executor mounts, as keyplane's routing store is.
    """
    location = checkpoint.removeprefix("file://").removeprefix("file:")
    if "://" in location:
        raise BatchPlanUnavailable(
            f"checkpoint {checkpoint!r}: the tasks that route the connector's events read the "
            "batch's plan from the checkpoint as a file; put the checkpoint on a file system "
            "every executor mounts, or read the events through keyplane's source"
        )
    return Path(location) / "offsets" / str(batch_id)


def planned_offset(checkpoint: str, batch_id: int) -> dict[str, Any]:
    """The offset keyplane's source planned ``batch_id`` with: its ``routing`` and more."""
    path = offset_log_file(checkpoint, batch_id)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise BatchPlanUnavailable(
            f"batch {batch_id}: Spark's offset log {path} cannot be read ({error}); the "
            "executors must see the query's checkpoint"
        ) from error
    for line in lines[2:]:
        if not line.startswith("{"):
            continue
        offset = json.loads(line)
        if "routing" in offset and "protocol" in offset:
            return dict(offset)
    raise BatchPlanUnavailable(
        f"batch {batch_id}: {path} holds no offset of keyplane's routed source; is the query "
        "reading one?"
    )
