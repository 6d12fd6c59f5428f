"""Statistics snapshots: what the reconfiguration DAG plans from (papers 000, 001, 004).

Each run of the statistics job reads the pipeline's topics from where the
last run stopped to their current end, and the metrics topic likewise, and
writes one *snapshot* folder. The stages are the pipeline's
(:attr:`keyplane.pipeline.Pipeline.stage_names`), each event keyed by every
stage's key expression:

``frequencies.parquet``
    one row per (stage, key): the key's tuples in this window (``count``),
    and its decayed weight split into ``train`` and ``holdout`` (below).
``pairs.parquet``
    one row per (stage, a, b): ``a`` a key of ``stage`` and ``b`` a key of
    the next stage of the chain, with the same columns: the key-pair
    statistics of paper 000 §3.2 for each consecutive pair of stages, from
    which the k-partite key graph of §3.3 is built. A one-stage pipeline
    has none.
``instance_loads.parquet``
    tuples per operator instance, summed over the window's metrics records
    (the loads whose max/mean paper 000 §3.1 bounds by α).
``traffic.parquet``
    the instance traffic matrix (paper 004 §4: task-to-task traffic): the
    window's tuples per (instance of ``stage``, instance of the next stage)
    under the routing the job ran (table entry, hot-key split, else Spark's
    hash, folded onto the active instances when scaled in).
``manifest.json``
    run id, sequence number, offset ranges of the topics read, event count,
    the events that did not parse, creation time, the decay and hold-out
    settings, the job's version.

Decay across runs. Paper 000 §3.2 resets its statistics after each
reconfiguration; keyplane keeps them with FISH's inter-epoch decay instead
(paper 001 §4.1.1; one run is one epoch): a key's weight is ``decay × its
previous weight + its count in the new window``, so old windows are weighted
down, not dropped, and entries whose weight falls below ``min_weight`` are
forgotten, as FISH's bounded top-K forgets cold keys. ``decay = 0`` is the
paper-000 reset.

Hold-out. The newest ``holdout_fraction`` of each partition's window is kept
apart (``holdout``), undecayed: plans are built on ``train`` (history plus
the older part of the window) and backtested on ``holdout``, the way paper
000 §4.3 scores a table trained on one window against the next. The weight
carried to the next run is ``train + holdout`` = ``decay × previous + the
whole window``, so the split does not bias the history.

The computations are pure pandas and numpy; :func:`write_snapshot` and
:func:`read_snapshot` are the only functions touching the disk, and the Spark
job (``spark_jobs/key_statistics.py``) only reads Kafka and groups.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice, pairwise
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.costmodel import CostModel, calibrate
from keyplane.algorithms.partials import sum_by
from keyplane.routing.config import RoutingConfig
from keyplane.routing.routedkeys import routed_shares
from keyplane.util.parquet_files import read_frame

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FREQUENCIES = "frequencies.parquet"
PAIRS = "pairs.parquet"
INSTANCE_LOADS = "instance_loads.parquet"
TRAFFIC = "traffic.parquet"
SNAPSHOT_FORMAT: Literal[1] = 1

FREQUENCY_COLUMNS = (
    "stage",
    "key",
    "count",
    "train",
    "holdout",
    "epoch",
    "window_start",
    "window_end",
)
PAIR_COLUMNS = ("stage", "a", "b", "count", "train", "holdout")
LOAD_COLUMNS = ("operator", "instance", "tuples", "batches")
TRAFFIC_COLUMNS = ("stage", "a_instance", "b_instance", "tuples")
CHAIN_ROW_COLUMNS = ("stage", "a", "b", "holdout", "n")
"""What the statistics job counts per window: ``n`` events (on one side of the
hold-out line) carried key ``a`` in ``stage`` and key ``b`` in the next stage
(``b`` null in the last stage)."""
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class TopicWindow(BaseModel):
    """The offsets ``[start, end)`` of every partition of one topic read by a run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: str
    start: dict[int, int]
    end: dict[int, int]

    @property
    def records(self) -> int:
        return sum(max(0, end - self.start.get(p, 0)) for p, end in self.end.items())

    @property
    def start_total(self) -> int:
        """The window's start as one number: the sum of its partitions' start offsets."""
        return sum(self.start.get(p, 0) for p in self.end)

    @property
    def end_total(self) -> int:
        return sum(self.end.values())


class SnapshotManifest(BaseModel):
    """What a snapshot describes; written last, so a snapshot with a manifest is complete."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = SNAPSHOT_FORMAT
    run_id: str = Field(min_length=1)
    sequence: int = Field(ge=0, description="Runs before this one: the FISH epoch number.")
    previous_run_id: str | None = None
    created_at: AwareDatetime
    events: tuple[TopicWindow, ...] = Field(min_length=1)
    metrics: TopicWindow
    n_events: int = Field(ge=0)
    unparsed_events: int = Field(
        default=0,
        ge=0,
        description="Events of the window that did not parse against the pipeline's schema, "
        "were too large, or had a null key: not counted.",
    )
    n_metrics_records: int = Field(ge=0)
    decay: float = Field(ge=0.0, le=1.0)
    holdout_fraction: float = Field(ge=0.0, lt=1.0)
    job_version: int | None = Field(
        default=None, description="Routing version of the window's newest metrics record."
    )
    cost_weights: tuple[float, ...] | None = Field(
        default=None,
        description="The cost model's service weight per stage (upstream first), then its "
        "remote weight, fitted to the window's metrics records, or None when they were too "
        "few (keyplane.algorithms.costmodel.calibrate).",
    )

    @field_validator("events", mode="before")
    @classmethod
    def _one_topic_is_a_tuple(cls, value: object) -> object:
        return (value,) if isinstance(value, TopicWindow | dict) else value

    @property
    def cost_model(self) -> CostModel:
        """The planner's cost model: calibrated from the job's metrics when they sufficed."""
        if self.cost_weights is None or len(self.cost_weights) < 2:
            return CostModel()
        *service, remote = self.cost_weights
        return CostModel(tuple(service), remote, source="calibrated")

    @property
    def window(self) -> tuple[int, int]:
        """The events window as ``(start, end)`` totals over the topics read: what the
        statistics suite checks."""
        return (
            sum(w.start_total for w in self.events),
            sum(w.end_total for w in self.events),
        )


@dataclass(frozen=True)
class Snapshot:
    """A snapshot loaded back from its folder."""

    path: Path
    manifest: SnapshotManifest
    frequencies: pd.DataFrame
    pairs: pd.DataFrame
    instance_loads: pd.DataFrame
    traffic: pd.DataFrame

    def quality_frame(self) -> pd.DataFrame:
        """The frame :func:`keyplane.orchestration.quality.validate_statistics` checks."""
        return self.frequencies[
            ["stage", "key", "count", "epoch", "window_start", "window_end"]
        ].copy()


@dataclass(frozen=True)
class StatisticsSettings:
    """How a run folds its window into the statistics.

    ``decay`` is FISH's inter-epoch factor (001 §4.1.1; default 0.5 as in
    :class:`keyplane.algorithms.hotkeys.FishSettings` and
    :class:`keyplane.algorithms.pair_history.HistoryPolicy`);
    ``min_weight`` forgets entries that decayed below it (default 0.05: with
    decay 0.5 a key seen once is kept four more windows, so the long tail a
    plan routes by its table is not forgotten two windows after it was
    seen); ``max_entries`` bounds the pairs and each stage's
    keys kept, heaviest first, as a SpaceSaving summary would (000 §3.2);
    ``holdout_fraction`` is the newest share of each partition's window kept
    for the backtest (default 0.2).
    """

    decay: float = 0.5
    min_weight: float = 0.05
    max_entries: int | None = 200_000
    holdout_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must lie in [0, 1], got {self.decay}")
        if self.min_weight < 0:
            raise ValueError(f"min_weight must be ≥ 0, got {self.min_weight}")
        if self.max_entries is not None and self.max_entries < 1:
            raise ValueError(f"max_entries must be ≥ 1 or None, got {self.max_entries}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must lie in [0, 1), got {self.holdout_fraction}")


def safe_run_id(run_id: str) -> str:
    """A folder name for an Airflow run id (``scheduled__2026-11-03T12:00:00+00:00``)."""
    cleaned = _RUN_ID_UNSAFE.sub("_", run_id).strip("._")
    if not cleaned:
        raise ValueError(f"run id {run_id!r} has no usable characters")
    return cleaned


def next_window(
    topic: str,
    previous: TopicWindow | None,
    earliest: Mapping[int, int],
    latest: Mapping[int, int],
) -> TopicWindow:
    """The window a run reads: from the previous run's end (else earliest) to ``latest``.

    A partition the previous run did not know starts at its earliest offset;
    an end that retention moved past starts at the earliest still kept. A
    partition whose latest offset is below the previous end was recreated or
    reset (offsets never go back otherwise): its records are new ones, so it
    starts at its earliest offset too, with a warning, rather than skipping
    them until the offsets pass the old end.
    """
    start: dict[int, int] = {}
    for partition in latest:
        known = None if previous is None else previous.end.get(partition)
        first = int(earliest.get(partition, 0))
        if known is not None and int(latest[partition]) < int(known):
            log.warning(
                "topic %s, partition %d: latest offset %d is below the last run's end %d; "
                "the topic was recreated or reset, so it is read from its earliest offset %d",
                topic,
                partition,
                int(latest[partition]),
                int(known),
                first,
            )
            known = None
        start[partition] = first if known is None else max(int(known), first)
    end = {p: max(int(off), start[p]) for p, off in latest.items()}
    return TopicWindow(topic=topic, start=start, end=end)


def holdout_starts(window: TopicWindow, fraction: float) -> dict[int, int]:
    """Per partition, the first offset of the hold-out (the newest ``fraction``)."""
    starts = {}
    for partition, end in window.end.items():
        begin = window.start.get(partition, 0)
        starts[partition] = end - math.floor((end - begin) * fraction)
    return starts


def is_holdout(
    partitions: Sequence[int] | np.ndarray,
    offsets: Sequence[int] | np.ndarray,
    starts: Mapping[int, int],
) -> np.ndarray:
    """Whether each record (partition, offset) lies in the hold-out."""
    part = np.asarray(partitions, dtype=np.int64)
    threshold = np.array([starts.get(int(p), np.iinfo(np.int64).max) for p in part], np.int64)
    return np.asarray(offsets, dtype=np.int64) >= threshold


def chain_rows(events: pd.DataFrame, stages: Sequence[str]) -> pd.DataFrame:
    """:data:`CHAIN_ROW_COLUMNS` rows from rows of every stage's key, ``holdout`` and ``n``.

    ``events``' first ``len(stages)`` columns are the stages' keys in chain
    order (their names do not matter, so that no stage name can collide with
    ``holdout`` or ``n``), then ``holdout`` and ``n``.
    """
    keys = events.iloc[:, : len(stages)]
    frames = []
    for index, stage in enumerate(stages):
        following = keys.iloc[:, index + 1] if index + 1 < len(stages) else None
        frames.append(
            pd.DataFrame(
                {
                    "stage": stage,
                    "a": keys.iloc[:, index].to_numpy(object),
                    "b": None if following is None else following.to_numpy(object),
                    "holdout": events["holdout"].to_numpy(bool),
                    "n": events["n"].to_numpy(np.int64),
                }
            )
        )
    if not frames or events.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in CHAIN_ROW_COLUMNS}).astype(
            {"holdout": bool, "n": np.int64}
        )
    return pd.concat(frames, ignore_index=True).astype({"stage": object, "a": object, "b": object})


def window_pairs(grouped: pd.DataFrame) -> pd.DataFrame:
    """``stage, a, b, train, holdout`` raw counts from :data:`CHAIN_ROW_COLUMNS` rows.

    ``grouped`` is what the Spark job computes (one row per stage, key, next
    stage's key and side of the hold-out line), or :func:`chain_rows` of any
    list of events with ``n = 1``. ``b`` is null in the last stage.
    """
    if grouped.empty:
        return pd.DataFrame({"stage": [], "a": [], "b": [], "train": [], "holdout": []}).astype(
            {"stage": object, "a": object, "b": object, "train": np.float64, "holdout": np.float64}
        )
    n = grouped["n"].astype(np.float64).to_numpy()
    held = grouped["holdout"].astype(bool).to_numpy()
    frame = grouped[["stage", "a", "b"]].assign(
        train=np.where(held, 0.0, n), holdout=np.where(held, n, 0.0)
    )
    linked = frame["b"].notna().to_numpy()
    pairs = sum_by(frame[linked], ["stage", "a", "b"], ["train", "holdout"])
    last = sum_by(frame[~linked].drop(columns="b"), ["stage", "a"], ["train", "holdout"])
    last.insert(2, "b", None)
    together = pd.concat([pairs, last.astype({"b": object})], ignore_index=True)
    return together[["stage", "a", "b", "train", "holdout"]]


def _fold(
    previous: pd.DataFrame | None,
    window: pd.DataFrame,
    keys: list[str],
    settings: StatisticsSettings,
) -> pd.DataFrame:
    """``decay × (previous train + holdout) + window train`` per key, keeping both parts.

    Returns ``keys…, count, train, holdout``: ``count`` is the raw window
    count, ``train`` the decayed history plus the window's older part.
    """
    current = sum_by(window, keys, ["train", "holdout"])
    current["count"] = current["train"] + current["holdout"]
    if previous is not None and not previous.empty and settings.decay > 0:
        history = previous[[*keys, "train", "holdout"]].copy()
        history["history"] = settings.decay * (history["train"] + history["holdout"])
        merged = current.merge(history[[*keys, "history"]], on=keys, how="outer")
    else:
        merged = current.assign(history=0.0)
    merged = merged.fillna({"count": 0.0, "train": 0.0, "holdout": 0.0, "history": 0.0})
    merged["train"] = merged["train"] + merged["history"]
    weight = merged["train"] + merged["holdout"]
    merged = merged[(weight >= settings.min_weight) | (merged["count"] > 0)]
    if settings.max_entries is not None and len(merged) > settings.max_entries:
        order = (merged["train"] + merged["holdout"]).to_numpy()
        keep = np.argsort(-order, kind="stable")[: settings.max_entries]
        merged = merged.iloc[np.sort(keep)]
    merged = merged.sort_values(keys, kind="stable").reset_index(drop=True)
    return merged[[*keys, "count", "train", "holdout"]]


def fold_pairs(
    previous: pd.DataFrame | None, window: pd.DataFrame, settings: StatisticsSettings
) -> pd.DataFrame:
    """The key-pair statistics of each consecutive pair of stages (000 §3.2) after this
    window, decayed (001 §4.1.1). ``max_entries`` bounds the pairs of all links together."""
    linked = window[window["b"].notna()] if "b" in window else window
    folded = _fold(previous, linked, ["stage", "a", "b"], settings)
    folded["count"] = folded["count"].round().astype(np.int64)
    return folded


def fold_frequencies(
    previous: pd.DataFrame | None,
    window: pd.DataFrame,
    settings: StatisticsSettings,
    *,
    epoch: int,
    window_bounds: tuple[int, int],
) -> pd.DataFrame:
    """Per-stage key frequencies after this window, decayed like the pairs.

    Every event counts once for its key in each stage, so the frequencies
    come from the window's rows, not from the (bounded) pair statistics. A
    stage of the previous frequencies that saw no event in this window keeps
    its history, decayed.
    """
    stages = list(dict.fromkeys(window["stage"].tolist()))
    if previous is not None:
        stages += [s for s in dict.fromkeys(previous["stage"].tolist()) if s not in stages]
    frames = []
    for stage in stages:
        rows = window[window["stage"] == stage]
        per_key = sum_by(rows[["a", "train", "holdout"]], ["a"], ["train", "holdout"])
        per_key = per_key.rename(columns={"a": "key"})
        before = None if previous is None else previous[previous["stage"] == stage]
        folded = _fold(before, per_key, ["key"], settings)
        folded.insert(0, "stage", stage)
        frames.append(folded)
    if not frames:
        frames.append(
            pd.DataFrame(
                {c: pd.Series(dtype=np.float64) for c in ("count", "train", "holdout")}
            ).assign(stage=pd.Series(dtype=object), key=pd.Series(dtype=object))
        )
    frequencies = pd.concat(frames, ignore_index=True)
    frequencies["count"] = frequencies["count"].round().astype(np.int64)
    frequencies["epoch"] = np.int64(epoch)
    frequencies["window_start"] = np.int64(window_bounds[0])
    frequencies["window_end"] = np.int64(window_bounds[1])
    return frequencies[list(FREQUENCY_COLUMNS)].astype({"key": object, "stage": object})


def instance_loads(records: Iterable[BatchMetrics]) -> pd.DataFrame:
    """Tuples per operator instance over the window's batches (000 §3.1's loads).

    Measured, not predicted: the tuples each instance reported it took.
    :func:`keyplane.routing.routedkeys.predicted_instance_loads` predicts such loads
    from a configuration and per-key weights; a measurement is what a
    prediction is checked against, so the two stay apart.
    """
    totals: dict[tuple[str, int], int] = {}
    batches: dict[tuple[str, int], int] = {}
    for record in records:
        for operator, loads in record.load.items():
            for instance, tuples in loads.items():
                key = (operator, int(instance))
                totals[key] = totals.get(key, 0) + int(tuples)
                batches[key] = batches.get(key, 0) + 1
    rows = [(op, inst, totals[(op, inst)], batches[(op, inst)]) for op, inst in sorted(totals)]
    return pd.DataFrame(rows, columns=list(LOAD_COLUMNS)).astype(
        {"operator": object, "instance": np.int64, "tuples": np.int64, "batches": np.int64}
    )


def traffic_matrix(
    pairs: pd.DataFrame, config: RoutingConfig, stages: Sequence[str], column: str = "count"
) -> pd.DataFrame:
    """Tuples per (instance of ``stage``, instance of the next stage) of ``pairs`` under
    ``config``, for each consecutive pair of ``stages`` (upstream first).

    The task-to-task traffic matrix of paper 004 §4 (TurboStream consolidates
    and bisects instances by it). Each side routes its keys as the job does
    (:func:`keyplane.routing.routedkeys.routed_shares`: table entry, hot-key split,
    else the hash fallback, folded when scaled in); a hot key's tuples spread
    evenly over its instances, independently on both sides.
    """
    frames = []
    for upstream, downstream in pairwise(stages):
        rows = pairs[pairs["stage"] == upstream]
        if rows.empty or upstream not in config.operators or downstream not in config.operators:
            continue
        weights = rows[column].to_numpy(np.float64)
        share_a = routed_shares(config.operators[upstream], rows["a"].astype(str).tolist())
        share_b = routed_shares(config.operators[downstream], rows["b"].astype(str).tolist())
        matrix = (share_a * weights[:, None]).T @ share_b
        a_index, b_index = np.nonzero(matrix > 0)
        frames.append(
            pd.DataFrame(
                {
                    "stage": upstream,
                    "a_instance": a_index.astype(np.int64),
                    "b_instance": b_index.astype(np.int64),
                    "tuples": matrix[a_index, b_index],
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else _empty_traffic()


def _empty_traffic() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "stage": pd.Series(dtype=object),
            "a_instance": pd.Series(dtype=np.int64),
            "b_instance": pd.Series(dtype=np.int64),
            "tuples": pd.Series(dtype=np.float64),
        }
    )


def snapshot_folder(root: Path | str, run_id: str) -> Path:
    return Path(root) / safe_run_id(run_id)


def list_snapshots(root: Path | str) -> list[SnapshotManifest]:
    """Every complete snapshot under ``root``, oldest first (by sequence, then time)."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    manifests = []
    for entry in folder.iterdir():
        manifest = entry / MANIFEST_NAME
        if entry.is_dir() and not entry.name.startswith(".") and manifest.is_file():
            manifests.append(SnapshotManifest.model_validate_json(manifest.read_text()))
    return sorted(manifests, key=lambda m: (m.sequence, m.created_at))


def latest_snapshot(root: Path | str, *, before: str | None = None) -> SnapshotManifest | None:
    """The newest complete snapshot, skipping ``before`` (the run being computed)."""
    manifests = [m for m in list_snapshots(root) if before is None or m.run_id != before]
    return manifests[-1] if manifests else None


def write_snapshot(
    root: Path | str,
    manifest: SnapshotManifest,
    *,
    frequencies: pd.DataFrame,
    pairs: pd.DataFrame,
    loads: pd.DataFrame,
    traffic: pd.DataFrame,
) -> Path:
    """Write a snapshot folder atomically (temporary folder renamed into place).

    Writing a run that already has a snapshot changes nothing: a retried or
    repeated run keeps the snapshot of its first success, so the window it
    read is not read a second time.
    """
    final = snapshot_folder(root, manifest.run_id)
    if (final / MANIFEST_NAME).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        frequencies.to_parquet(staging / FREQUENCIES, index=False)
        pairs.to_parquet(staging / PAIRS, index=False)
        loads.to_parquet(staging / INSTANCE_LOADS, index=False)
        traffic.to_parquet(staging / TRAFFIC, index=False)
        (staging / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final


def read_snapshot(root: Path | str, run_id: str) -> Snapshot:
    """Load a snapshot; ``FileNotFoundError`` when the run has none (yet)."""
    folder = snapshot_folder(root, run_id)
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no statistics snapshot for run {run_id!r} in {folder}")
    return Snapshot(
        path=folder,
        manifest=SnapshotManifest.model_validate_json(manifest_path.read_text()),
        frequencies=read_frame(folder / FREQUENCIES),
        pairs=read_frame(folder / PAIRS),
        instance_loads=read_frame(folder / INSTANCE_LOADS),
        traffic=read_frame(folder / TRAFFIC),
    )


def _fitted_weights(
    metrics: Sequence[BatchMetrics], stages: Sequence[str]
) -> tuple[float, ...] | None:
    fitted = calibrate(metrics, stages)
    if fitted.source != "calibrated":
        return None
    return (*fitted.service, fitted.remote)


@dataclass(frozen=True)
class Lookback:
    """A snapshot's counts widened over the windows before it (:func:`lookback`).

    ``frame`` is shaped as :meth:`Snapshot.quality_frame` with ``count``
    summed over ``runs`` (newest first) and ``window`` the widened events
    window, from the oldest run's start to the newest's end.
    """

    frame: pd.DataFrame
    window: tuple[int, int]
    runs: tuple[str, ...]

    @property
    def total(self) -> int:
        return int(self.frame["count"].sum())


def _earlier(root: Path | str, snapshot: Snapshot) -> Iterator[Snapshot]:
    """The snapshots of the windows before ``snapshot``, newest first, as long as each
    window joins the next one exactly (each run started where the previous ended):
    the walk stops at a gap or at a missing snapshot."""
    manifest = snapshot.manifest
    while manifest.previous_run_id is not None:
        try:
            earlier = read_snapshot(root, manifest.previous_run_id)
        except FileNotFoundError:
            return
        if [w.end for w in earlier.manifest.events] != [w.start for w in manifest.events]:
            return
        yield earlier
        manifest = earlier.manifest


def lookback(root: Path | str, snapshot: Snapshot, min_total_count: int) -> Lookback:
    """The snapshot's counts, widened over earlier runs' windows until they reach
    ``min_total_count``.

    A small window (a quiet topic, a short schedule) does not count enough
    tuples for per-instance loads to be more than noise; the planner's
    statistics already carry the decayed history of earlier windows, so the
    check of "enough data" looks back over them too. Only windows that join
    the next one exactly are added (:func:`_earlier`), so the widened window is
    one contiguous offset range; the walk stops once the total is reached.
    """
    if min_total_count < 0:
        raise ValueError(f"min_total_count must be ≥ 0, got {min_total_count}")
    frames = [snapshot.quality_frame()]
    runs = [snapshot.manifest.run_id]
    manifest = snapshot.manifest
    total = int(frames[0]["count"].sum())
    for earlier in _earlier(root, snapshot):
        if total >= min_total_count:
            break
        frames.append(earlier.quality_frame())
        runs.append(earlier.manifest.run_id)
        manifest = earlier.manifest
        total += int(frames[-1]["count"].sum())
    window = (manifest.window[0], snapshot.manifest.window[1])
    if len(frames) == 1:
        return Lookback(frames[0], snapshot.manifest.window, tuple(runs))
    counts = sum_by(pd.concat(frames, ignore_index=True), ["stage", "key"], ["count"])
    epoch = int(snapshot.manifest.sequence)
    frame = counts.assign(
        epoch=np.int64(epoch), window_start=np.int64(window[0]), window_end=np.int64(window[1])
    )
    frame["count"] = frame["count"].astype(np.int64)
    return Lookback(frame, window, tuple(runs))


def recent_windows(root: Path | str, snapshot: Snapshot, count: int) -> list[pd.DataFrame]:
    """Each of the last ``count`` consecutive windows' own counts (``stage``, ``key``,
    ``count``), oldest first, ending with ``snapshot``'s: the series a forecast of
    the next window is fitted and backtested on
    (:func:`keyplane.orchestration.planning.forecast_loads`)."""
    if count < 1:
        raise ValueError(f"count must be ≥ 1, got {count}")
    frames = [snapshot.quality_frame()]
    for earlier in islice(_earlier(root, snapshot), count - 1):
        frames.append(earlier.quality_frame())
    return [frame[["stage", "key", "count"]] for frame in reversed(frames)]


def job_version(records: Sequence[BatchMetrics]) -> int | None:
    """The routing version of the newest record whose operators all ran one version."""
    for record in reversed(records):
        versions = set(record.versions.values())
        if len(versions) == 1:
            return versions.pop()
    return None


def build_snapshot(
    *,
    run_id: str,
    grouped: pd.DataFrame,
    stages: Sequence[str],
    metrics: Sequence[BatchMetrics],
    events: TopicWindow | Sequence[TopicWindow],
    metrics_window: TopicWindow,
    previous: Snapshot | None,
    config: RoutingConfig | None,
    settings: StatisticsSettings,
    unparsed_events: int = 0,
    created_at: datetime | None = None,
) -> tuple[SnapshotManifest, dict[str, pd.DataFrame]]:
    """Everything a snapshot holds, from the Spark job's grouped window (pure).

    ``grouped`` has :data:`CHAIN_ROW_COLUMNS` (see :func:`window_pairs`) for
    the chain ``stages``, upstream first; ``events`` the windows of the topics
    read; ``config`` is the routing the job ran in the window, for the
    traffic matrix (none: an empty matrix).
    """
    windows = (events,) if isinstance(events, TopicWindow) else tuple(events)
    window = window_pairs(grouped)
    sequence = 0 if previous is None else previous.manifest.sequence + 1
    pairs = fold_pairs(None if previous is None else previous.pairs, window, settings)
    frequencies = fold_frequencies(
        None if previous is None else previous.frequencies,
        window,
        settings,
        epoch=sequence,
        window_bounds=(
            sum(w.start_total for w in windows),
            sum(w.end_total for w in windows),
        ),
    )
    raw = window.assign(count=window["train"] + window["holdout"])
    linked = raw[raw["b"].notna()]
    traffic = traffic_matrix(linked, config, stages) if config is not None else _empty_traffic()
    first = raw[raw["stage"] == stages[0]] if stages else raw.iloc[:0]
    manifest = SnapshotManifest(
        run_id=run_id,
        sequence=sequence,
        previous_run_id=None if previous is None else previous.manifest.run_id,
        created_at=created_at or datetime.now(UTC),
        events=windows,
        metrics=metrics_window,
        n_events=round(float(first["count"].sum())),
        unparsed_events=unparsed_events,
        n_metrics_records=len(metrics),
        decay=settings.decay,
        holdout_fraction=settings.holdout_fraction,
        job_version=job_version(metrics),
        cost_weights=_fitted_weights(metrics, stages),
    )
    return manifest, {
        "frequencies": frequencies,
        "pairs": pairs,
        "loads": instance_loads(metrics),
        "traffic": traffic,
    }
