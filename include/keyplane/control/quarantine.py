"""Poison records: events a stage's aggregate raises on, dead-lettered instead of retried forever.

A micro-batch that fails is replayed exactly from the checkpoint (the same
offsets, routing and moves), so an event that makes a user's aggregate raise
on every try would fail every replay, and a job restarted on failure would
loop without end while everything after it stays uncounted. So:

1. A routed stage whose aggregate raises on a group's values finds the values
   to blame, each tried alone on the group's state (:func:`blame`), and fails
   its task with a :class:`PoisonRecords` error that names the stage, the key
   and those values, on one line that the driver can read back
   (:func:`poison_in`).
2. The driver (:class:`Quarantine`) starts the query again once: a failure
   may be passing. If the replay fails the same way, the events with that
   stage's key and a blamed value are quarantined: from then on each such
   event is dead-lettered, with the aggregate's error as its reason and its
   own bytes, partition and offset, instead of routed (by the reference
   pipeline's source, :mod:`keyplane.spark.routed_source`, as the
   (field-1 key, field-2 key) pairs of its two stages; by any other
   pipeline's routing step, :func:`keyplane.spark.pipeline_frames.routed_rows`),
   and the query starts again and
   goes on. Every other event counts as before; the replayed batch never
   committed, so nothing is counted twice.
3. When no single value is to blame (the aggregate raises only on some of
   them together, or the failure was passing), the job's own restarts
   (``--restarts``) start the query again; should the same batch fail the
   same way again, or the same failure come back after its pairs were
   quarantined, the job stops with an error that names the failing batch's
   partitions and offsets (:class:`PoisonUnresolved`).

The quarantine lives in the checkpoint (:data:`QUARANTINE_FILE`), so a restarted
job keeps it. Pure Python: the stages and the driver call it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from keyplane.reference.pipeline import FIRST_STAGE
from keyplane.util.processes import write_atomically
from keyplane.util.statefiles import read_model_file

QUARANTINE_FILE = "keyplane-quarantine.json"
"""The file in a checkpoint that holds its quarantined pairs."""

POISON_MARKER = "keyplane-poison "
"""Starts the line of a :class:`PoisonRecords` error, before its JSON."""

_POISON_LINE = re.compile(re.escape(POISON_MARKER) + r"(\{[^\n]*\})")

Stage = str
"""A stage's name in the pipeline (:attr:`keyplane.pipeline.Pipeline.stage_names`)."""


class Poison(BaseModel):
    """What a stage's aggregate raised on: ``values`` of ``key`` (empty: none alone)."""

    model_config = ConfigDict(frozen=True)

    stage: Stage
    key: str
    values: tuple[str, ...]
    error: str

    def pairs(self) -> list[tuple[str, str]]:
        """The (field-1 key, field-2 key) pairs of the blamed events: stage A adds the
        field-2 keys of its key's events, stage B the field-1 keys."""
        if self.stage == FIRST_STAGE:
            return [(self.key, value) for value in self.values]
        return [(value, self.key) for value in self.values]


class PoisonRecords(RuntimeError):
    """A stage's aggregate raised on a group's values (module docstring, step 1)."""

    def __init__(self, poison: Poison) -> None:
        self.poison = poison
        super().__init__(POISON_MARKER + poison.model_dump_json())


class PoisonUnresolved(RuntimeError):
    """A batch fails the same way again and no quarantine can help (one line, for a CLI)."""


def blame(
    aggregate: Any, stage: Stage, key: str, state: Any, values: Sequence[str], error: Exception
) -> PoisonRecords:
    """The error to fail a task with when ``aggregate.add(state, values)`` raised ``error``:
    each distinct value is tried alone on ``state``, and those that raise are blamed."""
    blamed = []
    for value in dict.fromkeys(values):
        try:
            aggregate.add(state, [value])
        except Exception:
            blamed.append(value)
    text = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else repr(error)
    return PoisonRecords(Poison(stage=stage, key=key, values=tuple(blamed), error=text))


def poison_in(error_text: str) -> Poison | None:
    """The :class:`Poison` a failed query's error names, or None if it names none."""
    found = _POISON_LINE.search(error_text)
    if found is None:
        return None
    try:
        return Poison.model_validate_json(found.group(1))
    except ValueError:
        return None


class QuarantinedPair(BaseModel):
    """The events of one (field-1 key, field-2 key) pair, dead-lettered with ``reason``."""

    model_config = ConfigDict(frozen=True)

    a: str
    b: str
    reason: str


class QuarantinedValue(BaseModel):
    """The events whose ``stage`` key is ``key`` and value ``value``, dead-lettered with
    ``reason``: a pipeline's quarantine, whatever its chain (the pairs are the reference
    pipeline's view of the same events)."""

    model_config = ConfigDict(frozen=True)

    stage: str
    key: str
    value: str
    reason: str


class QuarantineRecord(BaseModel):
    """:data:`QUARANTINE_FILE`: the quarantined events, and the last failure seen once."""

    model_config = ConfigDict(frozen=True)

    pairs: tuple[QuarantinedPair, ...] = ()
    values: tuple[QuarantinedValue, ...] = ()
    pending: Poison | None = None
    pending_batch: int | None = None
    """The batch whose first failure ``pending`` is: only the same batch failing the same
    way again counts as a second failure."""


class Quarantine:
    """The driver's side (module docstring, steps 2 and 3), over a checkpoint's record."""

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.path = checkpoint / QUARANTINE_FILE

    def record(self) -> QuarantineRecord:
        found = read_model_file(
            self.path,
            QuarantineRecord,
            what="a checkpoint's quarantine record",
            fix="move it aside to start with no quarantined events",
            error=PoisonUnresolved,
        )
        return found or QuarantineRecord()

    def pairs(self) -> tuple[tuple[str, str, str], ...]:
        """The quarantined (field-1 key, field-2 key, reason)s, whose events are dead-lettered."""
        return tuple((p.a, p.b, p.reason) for p in self.record().pairs)

    def option(self) -> str:
        """The quarantined pairs as the routed source's ``quarantine`` option (JSON)."""
        return json.dumps([list(pair) for pair in self.pairs()])

    def quarantined_values(self) -> tuple[tuple[str, str, str, str], ...]:
        """The quarantined (stage, key, value, reason)s, which a pipeline's rows dead-letter
        (:func:`keyplane.spark.pipeline_frames.routed_rows`)."""
        return tuple((v.stage, v.key, v.value, v.reason) for v in self.record().values)

    def after_failure(self, error_text: str) -> bool:
        """Whether the query should start again at once, quarantine done, because of a
        poison record; False when the error names none, or none to blame yet, so that the
        job's own restarts decide. Raises :class:`PoisonUnresolved` when starting again
        cannot help."""
        poison = poison_in(error_text)
        if poison is None:
            return False
        record = self.record()
        held = {(v.stage, v.key, v.value) for v in record.values}
        blamed = [(poison.stage, poison.key, value) for value in poison.values]
        batch = failing_batch_id(self.checkpoint)
        again = record.pending == poison and record.pending_batch == batch
        where = failing_batch(self.checkpoint)
        if not poison.values:
            if again:
                raise PoisonUnresolved(
                    f"stage {poison.stage}'s aggregate raises ({poison.error}) on key "
                    f"{poison.key!r}, and on none of its values alone, in {where}, twice; the "
                    "job stops rather than replay that batch forever: fix the aggregate, or "
                    "move those events aside"
                )
            # Perhaps passing (a timeout inside the aggregate): the job's restarts decide.
            self._write(record.model_copy(update={"pending": poison, "pending_batch": batch}))
            return False
        if all(event in held for event in blamed):
            raise PoisonUnresolved(
                f"stage {poison.stage}'s aggregate still raises ({poison.error}) on key "
                f"{poison.key!r} in {where}, although its events are quarantined; the job stops"
            )
        if not again:
            self._write(record.model_copy(update={"pending": poison, "pending_batch": batch}))
            return True
        reason = (
            f"poison: stage {poison.stage}'s aggregate raised {poison.error} on this event "
            "in two tries of its batch"
        )
        known = {(p.a, p.b) for p in record.pairs}
        pairs = tuple(
            QuarantinedPair(a=a, b=b, reason=reason)
            for a, b in poison.pairs()
            if (a, b) not in known
        )
        values = tuple(
            QuarantinedValue(stage=stage, key=key, value=value, reason=reason)
            for stage, key, value in blamed
            if (stage, key, value) not in held
        )
        self._write(QuarantineRecord(pairs=record.pairs + pairs, values=record.values + values))
        return True

    def _write(self, record: QuarantineRecord) -> None:
        self.checkpoint.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, record.model_dump_json(indent=2) + "\n")


def failing_batch_id(checkpoint: Path) -> int | None:
    """The batch the checkpoint has planned and not committed; None if there is none."""
    try:
        planned = _ids(checkpoint / "offsets")
        committed = set(_ids(checkpoint / "commits"))
    except OSError:
        return None
    batch = max(planned, default=None)
    return None if batch is None or batch in committed else batch


def failing_batch(checkpoint: Path) -> str:
    """The batch the checkpoint has planned and not committed, with its events' partitions
    and offsets, in words; what can be told of it when the logs do not say."""
    try:
        planned = _ids(checkpoint / "offsets")
        committed = set(_ids(checkpoint / "commits"))
        batch = max(planned)
        if batch in committed:
            return f"the batch after {batch}"
        end = _events(checkpoint / "offsets" / str(batch))
        start = _events(checkpoint / "offsets" / str(batch - 1)) if batch - 1 in planned else {}
    except (OSError, ValueError, KeyError, TypeError):
        return "the batch it was running (its offsets cannot be read)"
    ranges = ", ".join(
        f"partition {p} offsets {start.get(p, 0)}-{end[p]}"
        for p in sorted(end, key=int)
        if end[p] > start.get(p, 0)
    )
    return f"batch {batch} (events {ranges or 'none'})"


def _ids(directory: Path) -> list[int]:
    return [int(p.name) for p in directory.iterdir() if p.name.isdigit()]


def _events(entry: Path) -> dict[str, int]:
    """The events' end offsets in an offset log entry of the routed source."""
    for line in entry.read_text(encoding="utf-8").splitlines()[2:]:
        offset = json.loads(line)
        if isinstance(offset, dict) and isinstance(offset.get("events"), dict):
            return {str(p): int(o) for p, o in offset["events"].items()}
    raise KeyError("events")
