"""The dashboard's data as one JSON document, built from what the other modules read.

The page (``static/dashboard.js``) draws everything in the browser with
ECharts; this module decides *what* it draws, so every figure is computed,
and tested, in Python: the per-batch series on a wall-clock axis, each
stage's load per instance over time (a heatmap per stage, stages named by
the records), the routing table and the difference between two versions,
the rollout's protocol steps (000 §3.4: PREPARE → ACK → PROPAGATE →
MIGRATED per stage → DONE), the job's health, the data-quality history,
failed DAG runs with links into the Airflow UI, and the locality each
version was predicted to reach against the one measured.

Times are epoch milliseconds (what ECharts' time axis takes), numbers are
left unformatted (the page formats them one way everywhere), and every list
has a fixed order so that a refresh never reshuffles a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal
from urllib.parse import quote

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.protocol import ControllerState, Reconfiguration
from keyplane.dashboard.metrics import (
    ActiveInstances,
    MetricsRead,
    VersionSummary,
    batch_version,
    on_active_instances,
    switch_windows,
    worst_imbalance,
)
from keyplane.dashboard.records import ValidationRecord
from keyplane.dashboard.timeline import Dashboard, VersionRow
from keyplane.routing.config import RoutingConfig

STALE_AFTER_S = 120.0
"""A job whose newest batch started longer ago than this is not called up: the
routed job runs a micro-batch every few seconds, and even an idle one commits
empty batches."""

Health = Literal["up", "down", "unknown"]


def epoch_ms(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


def stages_of(records: Sequence[BatchMetrics]) -> list[str]:
    """The stages the records report, in the order the job first reported them."""
    seen: dict[str, None] = {}
    for record in sorted(records, key=lambda r: r.batch_id):
        for stage in record.load:
            seen.setdefault(stage, None)
    return list(seen)


def batch_series(
    records: Sequence[BatchMetrics], active: ActiveInstances | None = None
) -> list[dict[str, Any]]:
    """One entry per batch that routed events, in batch order, with its start time.

    Idle batches are left out: their locality and imbalance are undefined.
    """
    busy = sorted((r for r in records if r.rows > 0 or r.hops > 0), key=lambda r: r.batch_id)
    return [
        {
            "batch": r.batch_id,
            "t": epoch_ms(r.started_at),
            "version": batch_version(r),
            "locality": r.locality,
            "imbalance": worst_imbalance(on_active_instances(r, active)),
            "rows_per_s": r.rows_per_s,
            "lag": r.input_lag,
            "duration_ms": r.duration_ms,
            "moved_states": r.moved_states,
            "invalid_events": r.invalid_events,
        }
        for r in busy
    ]


def load_heatmaps(records: Sequence[BatchMetrics]) -> list[dict[str, Any]]:
    """Each stage's tuples per instance per batch: ``cells`` are ``[batch, instance, tuples]``.

    The batch is an index into ``batches`` (its id and start time), so the
    page can label the axis with wall-clock times. Instances are every one
    any batch reported for the stage, ascending.
    """
    ordered = sorted(records, key=lambda r: r.batch_id)
    result = []
    for stage in stages_of(ordered):
        with_stage = [r for r in ordered if r.load.get(stage)]
        instances = sorted({int(i) for r in with_stage for i in r.load[stage]})
        cells = [
            [index, instance, tuples]
            for index, record in enumerate(with_stage)
            for instance, tuples in sorted(record.load[stage].items())
        ]
        result.append(
            {
                "stage": stage,
                "instances": instances,
                "batches": [
                    {
                        "batch": r.batch_id,
                        "t": epoch_ms(r.started_at),
                        "version": r.versions.get(stage),
                    }
                    for r in with_stage
                ],
                "cells": cells,
                "max": max((c[2] for c in cells), default=0),
            }
        )
    return result


def routing_table(
    config: RoutingConfig, weights: Mapping[str, Mapping[str, float]]
) -> list[dict[str, Any]]:
    """Per stage of ``config``: each active instance's pinned and hot keys, and the hash share.

    ``hash_share`` is the share of the snapshot's weight carried by keys in
    neither the table nor the hot keys, which the hash fallback routes (None
    without a snapshot). A hot key counts on every instance it is split over.
    """
    stages = []
    for stage, routing in config.operators.items():
        pinned = dict.fromkeys(routing.active, 0)
        hot = dict.fromkeys(routing.active, 0)
        for instance in routing.table.values():
            pinned[instance] = pinned.get(instance, 0) + 1
        for instances in routing.hot_keys.values():
            for instance in instances:
                hot[instance] = hot.get(instance, 0) + 1
        known = weights.get(stage, {})
        total = sum(known.values())
        routed = sum(w for k, w in known.items() if k in routing.table or k in routing.hot_keys)
        stages.append(
            {
                "stage": stage,
                "parallelism": routing.parallelism,
                "active": list(routing.active),
                "instances": [
                    {"instance": i, "pinned": pinned[i], "hot": hot[i]} for i in sorted(pinned)
                ],
                "table_keys": len(routing.table),
                "hot_keys": len(routing.hot_keys),
                "hash_share": None if total <= 0 else (total - routed) / total,
            }
        )
    return stages


def version_diff(old: RoutingConfig, new: RoutingConfig) -> dict[str, Any]:
    """What changed from ``old`` to ``new``, per stage (stages of either, in ``new``'s order)."""
    names = list(new.operators) + [s for s in old.operators if s not in new.operators]
    stages = []
    for stage in names:
        before, after = old.operators.get(stage), new.operators.get(stage)
        table_before = before.table if before is not None else {}
        table_after = after.table if after is not None else {}
        hot_before = before.hot_keys if before is not None else {}
        hot_after = after.hot_keys if after is not None else {}
        stages.append(
            {
                "stage": stage,
                "active": [
                    None if before is None else list(before.active),
                    None if after is None else list(after.active),
                ],
                "pinned_added": len(table_after.keys() - table_before.keys()),
                "pinned_removed": len(table_before.keys() - table_after.keys()),
                "pinned_moved": sum(
                    1
                    for k in table_after.keys() & table_before.keys()
                    if table_after[k] != table_before[k]
                ),
                "hot_added": sorted(hot_after.keys() - hot_before.keys()),
                "hot_removed": sorted(hot_before.keys() - hot_after.keys()),
            }
        )
    return {"from": old.version, "to": new.version, "stages": stages}


def _step(name: str, stage: str | None, at: datetime | None) -> dict[str, Any]:
    return {"step": name, "stage": stage, "at": epoch_ms(at), "done": at is not None}


def rollout_progress(
    controller: ControllerState | None, records: Sequence[BatchMetrics]
) -> dict[str, Any] | None:
    """The rollout in flight, else the last one: each protocol step and when it happened.

    ``states_moved`` sums the job's ``moved_states`` over the batches of the
    version's switch window (the first batch some stage ran it to the first
    all did), the state the migration actually carried.
    """
    if controller is None:
        return None
    rollout: Reconfiguration | None = controller.current or controller.last
    if rollout is None:
        return None
    stages = list(controller.operators)
    steps = [
        _step("PREPARE", None, rollout.prepare.sent_at),
        _step("ACK", None, None if rollout.ack is None else rollout.ack.sent_at),
    ]
    for stage in stages:
        sent = rollout.propagated.get(stage)
        migrated = rollout.migrated.get(stage)
        steps.append(_step("PROPAGATE", stage, None if sent is None else sent.sent_at))
        steps.append(_step("MIGRATED", stage, None if migrated is None else migrated.sent_at))
    finish = rollout.finish
    steps.append(
        _step(
            "DONE" if finish is None else finish.type,
            None,
            None if finish is None else finish.sent_at,
        )
    )
    if rollout.refused is not None:
        state = "refused"
    elif finish is None:
        state = "in flight"
    else:
        state = "done" if finish.type == "DONE" else "aborted"
    window = switch_windows(records).get(rollout.version)
    moved = None
    if window is not None:
        moved = sum(
            r.moved_states for r in records if window.first_batch <= r.batch_id <= window.last_batch
        )
    return {
        "version": rollout.version,
        "base": rollout.base,
        "state": state,
        "refused": None if rollout.refused is None else rollout.refused.reason,
        "steps": steps,
        "states_moved": moved,
        "seconds": None
        if finish is None
        else (finish.sent_at - rollout.prepare.sent_at).total_seconds(),
    }


@dataclass(frozen=True)
class JobFacts:
    """What the server found out about the job, each None when it could not be asked."""

    process_running: bool | None
    """Whether a job process runs in this home (None: this server cannot see it)."""
    end_offsets: Mapping[int, int] | None
    """The events topic's end offset per partition."""
    committed_offsets: Mapping[int, int] | None
    """The offsets the checkpoint's last committed batch read through, per partition."""
    dead_letters: int | None
    """Records retained on the dead-letter topic."""


def job_health(
    facts: JobFacts, metrics: MetricsRead, now: datetime, stale_after_s: float = STALE_AFTER_S
) -> dict[str, Any]:
    """Up, down or unknown, with why, the newest batch's age and the lag per partition.

    Up needs evidence that the job runs now: a batch younger than
    ``stale_after_s`` (and no sign its process has gone). A job whose
    process is gone, or whose metrics are silent or unreadable, is not up,
    and the page then shows the active version as the last known one.
    """
    newest = max(metrics.records, key=lambda r: r.batch_id, default=None)
    started = None if newest is None else newest.started_at
    age = None if started is None else (now - started).total_seconds()
    reasons = []
    if facts.process_running is False:
        reasons.append("no job process runs in this home")
    if not metrics.available:
        reasons.append(f"metrics unavailable: {metrics.problem}")
    elif newest is None:
        reasons.append("no batch on the metrics topic yet")
    elif age is None:
        reasons.append("the newest batch carries no start time")
    elif age > stale_after_s:
        reasons.append(f"no batch for {age:,.0f} s")
    state: Health
    if not reasons:
        state = "up"
    elif facts.process_running is False or (age is not None and age > stale_after_s):
        state = "down"
    elif not metrics.available and facts.process_running is None:
        state = "unknown"
    else:
        state = "down"
    lag: list[dict[str, int]] = []
    if facts.end_offsets is not None and facts.committed_offsets is not None:
        lag = [
            {
                "partition": p,
                "end": end,
                "committed": facts.committed_offsets.get(p, 0),
                "lag": max(0, end - facts.committed_offsets.get(p, 0)),
            }
            for p, end in sorted(facts.end_offsets.items())
        ]
    return {
        "state": state,
        "reasons": reasons,
        "last_batch": None if newest is None else newest.batch_id,
        "last_batch_at": epoch_ms(started),
        "last_batch_age_s": age,
        "dead_letters": facts.dead_letters,
        "invalid_events": sum(r.invalid_events for r in metrics.records),
        "lag": lag,
    }


@dataclass(frozen=True)
class FailedRun:
    """A failed DAG run as the Airflow database records it, and its failed tasks."""

    dag_id: str
    run_id: str
    started_at: datetime | None
    ended_at: datetime | None
    failed_tasks: tuple[tuple[str, int], ...] = ()
    """(task id, map index) of each failed task instance; -1: not mapped."""


def run_url(dag_id: str, run_id: str) -> str:
    """The run's page in the Airflow 3 UI (a path from the server's root)."""
    return f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def task_url(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The task instance's page in the Airflow 3 UI, which opens on its log."""
    url = f"{run_url(dag_id, run_id)}/tasks/{quote(task_id, safe='')}"
    return url if map_index < 0 else f"{url}/mapped/{map_index}"


def failed_runs(runs: Sequence[FailedRun]) -> list[dict[str, Any]]:
    """Newest first, each with its run link and a log link per failed task."""
    ordered = sorted(
        runs, key=lambda r: (epoch_ms(r.ended_at or r.started_at) or 0, r.run_id), reverse=True
    )
    return [
        {
            "dag_id": r.dag_id,
            "run_id": r.run_id,
            "started_at": epoch_ms(r.started_at),
            "ended_at": epoch_ms(r.ended_at),
            "url": run_url(r.dag_id, r.run_id),
            "tasks": [
                {
                    "task_id": task,
                    "map_index": index,
                    "url": task_url(r.dag_id, r.run_id, task, index),
                }
                for task, index in r.failed_tasks
            ],
        }
        for r in ordered
    ]


def quality_history(
    validations: Mapping[int, ValidationRecord], rows: Sequence[VersionRow]
) -> list[dict[str, Any]]:
    """Every version's configuration validation, newest version first, with its Data Docs."""
    by_version = {row.version: row for row in rows}
    history = []
    for version in sorted(validations, reverse=True):
        record = validations[version]
        row = by_version.get(version)
        history.append(
            {
                "version": version,
                "at": None if row is None else epoch_ms(row.created_at),
                "success": record.success,
                "summary": record.summary,
                "data_docs": []
                if row is None
                else [{"label": d.label, "path": d.path} for d in row.data_docs],
            }
        )
    return history


def _row(row: VersionRow) -> dict[str, Any]:
    migration = row.migration
    return {
        "version": row.version,
        "parent": row.parent_version,
        "created_at": epoch_ms(row.created_at),
        "created_by": row.created_by,
        "status": row.status,
        "validation": row.validation,
        "validation_summary": row.validation_summary,
        "gain": row.gain,
        "cost": row.cost,
        "decision": row.decision,
        "migration_s": None if migration is None else migration.seconds,
        "migration": None if migration is None else migration.detail,
        "migration_source": None if migration is None else migration.source,
        "rollback": row.rollback,
        "run_id": row.run_id,
        "run_url": None
        if row.run_id is None or row.dag_id is None
        else run_url(row.dag_id, row.run_id),
        "data_docs": [{"label": d.label, "path": d.path} for d in row.data_docs],
        "problem": row.problem,
        "predicted_locality": row.predicted_locality,
    }


def locality_comparison(
    rows: Sequence[VersionRow], summaries: Sequence[VersionSummary]
) -> list[dict[str, Any]]:
    """Predicted (backtest or scale plan) against measured locality, per version, oldest first."""
    measured = {s.version: s for s in summaries}
    versions = sorted({r.version for r in rows if r.predicted_locality is not None} | set(measured))
    predicted = {r.version: r.predicted_locality for r in rows}
    return [
        {
            "version": v,
            "predicted": predicted.get(v),
            "measured": measured[v].locality if v in measured else None,
            "batches": measured[v].batches if v in measured else 0,
        }
        for v in versions
    ]


def document(
    dashboard: Dashboard,
    metrics: MetricsRead,
    summaries: Sequence[VersionSummary],
    *,
    active: ActiveInstances | None,
    controller: ControllerState | None,
    configs: Mapping[int, RoutingConfig | str],
    weights: Mapping[str, Mapping[str, float]],
    validations: Mapping[int, ValidationRecord],
    health: dict[str, Any],
    failed: Sequence[FailedRun] | None,
    generated_at: datetime,
    metrics_topic: str,
    has_data_docs: bool,
) -> dict[str, Any]:
    """The whole JSON document of ``/keyplane/api/state``."""
    current = configs.get(dashboard.active_version) if dashboard.active_version else None
    diff = None
    if dashboard.moved_from is not None and dashboard.moved_to is not None:
        old, new = configs.get(dashboard.moved_from), configs.get(dashboard.moved_to)
        if isinstance(old, RoutingConfig) and isinstance(new, RoutingConfig):
            diff = version_diff(old, new)
    return {
        "generated_at": epoch_ms(generated_at),
        "metrics_topic": metrics_topic,
        "metrics": {
            "available": metrics.available,
            "problem": metrics.problem,
            "records": len(metrics.records),
        },
        "active_version": dashboard.active_version,
        "live": health["state"] == "up",
        "health": health,
        "problems": list(dashboard.problems),
        "versions": [_row(r) for r in dashboard.rows],
        "hidden_versions": dashboard.hidden,
        "summaries": [
            {
                "version": s.version,
                "batches": s.batches,
                "rows": s.rows,
                "locality": s.locality,
                "imbalance": s.imbalance,
                "rows_per_s": s.rows_per_s,
                "lag": s.lag,
            }
            for s in summaries
        ],
        "batches": batch_series(metrics.records, active),
        "heatmaps": load_heatmaps(metrics.records),
        "routing": None
        if not isinstance(current, RoutingConfig)
        else {"version": current.version, "stages": routing_table(current, weights)},
        "diff": diff,
        "moved_keys": None
        if dashboard.moved_keys is None
        else [
            {
                "stage": m.operator,
                "key": m.key,
                "old": list(m.old),
                "new": list(m.new),
                "kind": m.kind,
                "weight": m.weight,
            }
            for m in dashboard.moved_keys
        ],
        "hot_keys": [
            {
                "stage": h.operator,
                "key": h.key,
                "split": h.split,
                "instances": list(h.instances),
                "weight": h.weight,
            }
            for h in dashboard.hot_keys
        ],
        "rollout": rollout_progress(controller, metrics.records),
        "quality": quality_history(validations, dashboard.rows),
        "failed_runs": None if failed is None else failed_runs(failed),
        "locality": locality_comparison(dashboard.rows, summaries),
        "has_data_docs": has_data_docs,
    }
