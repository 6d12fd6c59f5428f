"""The checks ``keyplane job start`` makes before it launches the routed job.

Each refuses, in one line and before Spark starts, what the detached job
would otherwise fail on only after Spark is up, in terms of Spark's plan: a
partition count other than the checkpoint's or the stored configuration's,
options other than the running job's, aggregates or a stage engine other
than the checkpoint's, and a checkpoint that has read further than its
topics now reach.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyplane.aggregates import canonical_spec
from keyplane.kafka.admin import TopicError, high_watermarks
from keyplane.kafka.offsets import CheckpointAheadError, check_not_ahead
from keyplane.routing import config as config_store
from keyplane.settings import StageEngine
from keyplane.spark.job_checkpoint import (
    checkpoint_partitions,
    events_read,
    last_commit,
    newest_offset_log_entry,
    source_offset,
)
from keyplane.spark.job_record import JobError, JobRecord, describe_aggregates
from keyplane.util.processes import write_atomically

CLI_FLAGS = {"--restart-delay-s": "--restart-delay"}
"""The job's flags that ``keyplane job start`` spells otherwise."""


@dataclass(frozen=True)
class PartitionsOnRecord:
    """A partition count the job must run with, kept with what the refusal of another
    count says: ``source`` where the count is recorded, ``fix`` how to start afresh."""

    count: int
    source: str
    fix: str


def partitions_on_record(
    checkpoint: Path, directory: Path, store: Path
) -> PartitionsOnRecord | None:
    """The checkpoint's partitions, else the newest stored configuration's; None when
    neither records a count the job must run with."""
    counted = checkpoint_partitions(checkpoint)
    if counted is not None:
        return PartitionsOnRecord(
            counted,
            source=f"the checkpoint {checkpoint} runs {counted}",
            fix=f"move {directory} aside to start afresh",
        )
    return stored_partitions(store)


def stored_partitions(store: Path) -> PartitionsOnRecord | None:
    """The instances the newest stored configuration routes over, and where that is said;
    None when the store holds no configuration, cannot be read (the job refuses it
    itself, with the store's reason) or routes its operators over different counts."""
    try:
        latest = config_store.latest_version(store)
        config = None if latest is None else config_store.load(store, latest)
    except config_store.ConfigStoreError:
        return None
    if config is None:
        return None
    counts = {routing.parallelism for routing in config.operators.values()}
    if len(counts) != 1:
        return None
    (count,) = counts
    return PartitionsOnRecord(
        count,
        source=f"v{config.version} in {store} routes over {count}",
        fix="publish a configuration for that many first",
    )


def check_same_options(running: JobRecord, given: dict[str, str]) -> None:
    """Refuse options ``given`` for a start that the running job does not run with: they
    would apply only at its next start, and "already running" would hide that."""
    defaults = {"--forward": "pairs", "--restarts": "0"}
    flags = running.flags()
    differ = [
        (flag, value, flags.get(flag, defaults.get(flag, "unset")))
        for flag, value in given.items()
        if _same_value(value) != _same_value(flags.get(flag, defaults.get(flag, "unset")))
    ]
    if differ:
        wanted = " ".join(f"{CLI_FLAGS.get(flag, flag)} {value}" for flag, value, _ in differ)
        has = ", ".join(f"{CLI_FLAGS.get(flag, flag)} {value}" for flag, _, value in differ)
        raise JobError(
            f"the job already runs (pid {running.pid}) with {has}; options apply when it "
            f"starts: stop it (`keyplane job stop`), then `keyplane job start {wanted}`"
        )


def check_checkpoint_aggregates(
    checkpoint: Path, directory: Path, aggregates_file: Path, aggregates: dict[str, str | None]
) -> None:
    """Refuse aggregates other than those whose states the checkpoint holds.

    The aggregates are fixed for the life of a checkpoint: its state store
    keeps each routed key's state as their ``encode`` wrote it, and another
    aggregate's ``decode`` would misread it inside a Spark task, after the
    job is up. So the first start of a checkpoint records them next to it
    (in ``aggregates_file``), and a restart must name the same ones.
    """
    if last_commit(checkpoint) is None:
        write_atomically(aggregates_file, json.dumps(aggregates) + "\n")
        return
    try:
        recorded = json.loads(aggregates_file.read_text(encoding="utf-8"))
        stored = {stage: canonical_spec(spec) for stage, spec in recorded.items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise JobError(
            f"cannot read {aggregates_file} ({exc}); it names the aggregates "
            f"whose states {checkpoint} holds"
        ) from None
    if stored != aggregates:
        raise JobError(
            f"the checkpoint {checkpoint} holds the states of "
            f"{describe_aggregates(stored)}, not {describe_aggregates(aggregates)}; "
            f"start with the same aggregates, or move {directory} aside to start afresh"
        )


def check_checkpoint_engine(checkpoint: Path, directory: Path, stage_engine: StageEngine) -> None:
    """Refuse a stage engine other than the one the checkpoint's stages ran on.

    Spark refuses a checkpoint whose stateful operators changed only at its
    first batch, in a detached process; the job's own check
    (:func:`~keyplane.spark.routed_counts.resolve_engine`) runs after Spark
    has started. So it is made here too, in one line.
    """
    if stage_engine == "auto":
        return
    from keyplane.spark.routed_counts import recorded_engine

    recorded = recorded_engine(checkpoint)
    if recorded is not None and recorded != stage_engine:
        raise JobError(
            f"stage engine {stage_engine!r}: the checkpoint {checkpoint} was "
            f"written by the {recorded!r} stages, and a checkpoint keeps its engine for life; "
            f"start with --stage-engine {recorded}, or move {directory} aside to start "
            "afresh"
        )


def check_checkpoint_not_ahead(
    checkpoint: Path, bootstrap: str, events_topic: str, control_topic: str, migration_topic: str
) -> None:
    """Refuse to start a checkpoint that has read further than its topics now reach.

    A broker that lost its records (memory storage, restarted) leaves the
    checkpoint ahead of every topic it reads; the job would fail on it
    only after Spark is up, in terms of Spark's plan. So the offsets of the
    checkpoint's newest batch, which a restart replays, are compared with
    the topics' ends first, and the first partition ahead is named.
    """
    lines = newest_offset_log_entry(checkpoint)
    if lines is None:
        return
    try:
        offsets = source_offset(lines)
    except ValueError:
        return
    if offsets is None:
        return
    try:
        events = events_read(lines, events_topic)
    except ValueError:
        events = None
    reads = checkpoint_reads(offsets, events, events_topic, control_topic, migration_topic)
    for topic, through in reads:
        if not any(int(offset) > 0 for offset in through.values()):
            continue
        try:
            ends: dict[int, int] = high_watermarks(bootstrap, topic)
        except TopicError:
            ends = {}
        try:
            check_not_ahead(topic, through, ends)
        except CheckpointAheadError as error:
            raise JobError(
                f"{error}".replace("the checkpoint has", f"the checkpoint {checkpoint} has")
            ) from None


def checkpoint_reads(
    offsets: dict[str, Any],
    events: dict[str, int] | None,
    events_topic: str,
    control_topic: str,
    migration_topic: str,
) -> list[tuple[str, dict[str, int]]]:
    """(topic, end offset per partition) of each topic a batch read: ``offsets`` is the
    routed source's, ``events`` what the batch read of ``events_topic`` by either source
    (:func:`~keyplane.spark.job_checkpoint.events_read`: Spark's connector keeps its own
    offsets when it reads the events)."""
    read: list[tuple[str, dict[str, int]]] = [
        (topic, dict(parts)) for topic, parts in offsets.get("events", {}).items()
    ]
    if events and events_topic not in offsets.get("events", {}):
        read.append((events_topic, dict(events)))
    if "control" in offsets:
        read.append((control_topic, {"0": int(offsets["control"])}))
    if isinstance(offsets.get("migration"), dict):
        read.append((migration_topic, dict(offsets["migration"])))
    return read


def _same_value(text: str) -> str:
    """A flag's value compared as a number when it is one: ``10`` and ``10.0`` s agree."""
    try:
        return repr(float(text))
    except ValueError:
        return text
