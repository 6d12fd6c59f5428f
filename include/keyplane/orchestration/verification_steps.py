"""Step 5 of the reconfiguration DAG: verify the published version on the job's metrics,
and prepare the rollback of one that regressed (paper 000 §3.4).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.orchestration import planning, rollout_steps, run_records
from keyplane.orchestration.deployment import Deployment
from keyplane.orchestration.run_records import (
    PROPOSAL,
    ROLLBACK,
    ROLLBACK_ALLOCATION,
    ROLLOUT,
    VERIFICATION,
    StepError,
)
from keyplane.routing import config as config_store

log = logging.getLogger(__name__)


def read_metrics(
    deployment: Deployment, start: Mapping[int, int], end: Mapping[int, int] | None = None
) -> list[BatchMetrics]:
    """The metrics records in ``[start, end)`` (end: now), oldest first."""
    return [record for record, _ in read_timed_metrics(deployment, start, end)]


def read_timed_metrics(
    deployment: Deployment, start: Mapping[int, int], end: Mapping[int, int] | None = None
) -> list[tuple[BatchMetrics, float]]:
    """:func:`read_metrics` with each record's Kafka timestamp, in seconds.

    The gap between two records is the wall-clock time of the later batch
    (:class:`~keyplane.kafka.metrics_topic.PublishedMetrics`).
    """
    from keyplane.kafka.admin import high_watermarks
    from keyplane.kafka.metrics_topic import read_metrics as read_topic

    servers, topic = deployment.bootstrap_servers, deployment.metrics_topic
    stop = dict(end) if end is not None else high_watermarks(servers, topic, list(start))
    return [(r.metrics, r.published_s) for r in read_topic(servers, topic, start, stop)]


def _on_version(records: list[BatchMetrics], version: int) -> list[BatchMetrics]:
    """Batches that routed events (hops between stages) with every operator on ``version``."""
    return [
        r for r in records if r.hops > 0 and r.versions and set(r.versions.values()) == {version}
    ]


def new_version_batches(
    deployment: Deployment, dag_id: str, run_id: str, record_name: str = ROLLOUT
) -> int:
    """How many batches with rows ran on the new version since DONE.

    The version and where its batches start are read from ``record_name`` in
    ``dag_id``'s run (:func:`~keyplane.orchestration.run_records.run_folder`).
    """
    rollout = run_records.read_record(
        run_records.run_folder(deployment, dag_id, run_id) / record_name, "the rollout record"
    )
    start = {int(p): int(o) for p, o in rollout["metrics_start"].items()}
    return len(_on_version(read_metrics(deployment, start), int(rollout["version"])))


def verify(
    deployment: Deployment,
    run_id: str,
    tolerances: planning.VerifyTolerances,
    *,
    batches: int,
) -> dict[str, Any]:
    """Measured locality, imbalance and lag growth on the new version vs the window before.

    Before: the snapshot window's batches on the parent version. After: the
    first ``batches`` batches with rows on the new version since DONE.
    """
    folder = run_records.reconfigure_folder(deployment, run_id)
    existing = folder / VERIFICATION
    if existing.is_file():
        return run_records.read_record(existing, "the verification")
    rollout = run_records.read_record(folder / ROLLOUT, "the rollout record")
    proposal = run_records.read_record(folder / PROPOSAL, "the proposal")
    manifest = run_records.snapshot(deployment, run_id).manifest
    before_records = _on_version(
        read_metrics(deployment, manifest.metrics.start, manifest.metrics.end),
        int(proposal["parent_version"]),
    )
    start = {int(p): int(o) for p, o in rollout["metrics_start"].items()}
    after_records = _on_version(read_metrics(deployment, start), int(rollout["version"]))[:batches]
    if len(after_records) < batches:
        raise StepError(
            f"only {len(after_records)} of {batches} batches ran on v{rollout['version']} yet"
        )
    before = planning.measure(before_records)
    after = planning.measure(after_records)
    verdict = planning.verdict(before, after, tolerances)
    record = run_records.write_once(
        existing,
        {
            "version": int(rollout["version"]),
            "before": asdict(before),
            "after": asdict(after),
            "regressed": verdict is not None,
            "reason": verdict or "no regression",
            **promise_outcome(proposal, after),
        },
    )
    log.info(
        "verified v%d over %d batches: %s; %s",
        record["version"],
        len(after_records),
        measured_summary(before, after),
        record["reason"],
    )
    return record


def promise_outcome(proposal: Mapping[str, Any], after: planning.Measured) -> dict[str, Any]:
    """What the plan promised and how the measured imbalance compared with it.

    ``promise_ratio`` (:func:`keyplane.algorithms.plan_choice.promise_ratio`)
    is what the next runs calibrate their promise on
    (:func:`~keyplane.orchestration.run_records.promise_ratios`); None when
    the plan made no model promise or nothing was measured. A proposal of
    an older keyplane has neither field.
    """
    from keyplane.algorithms.plan_choice import promise_ratio

    promised = proposal.get("promised_imbalance")
    model = float(proposal.get("model_promise") or 0.0)
    ratio = None if after.imbalance is None else promise_ratio(after.imbalance, model)
    if ratio is not None:
        log.info(
            "measured imbalance %.3f against a promise of %s (model %.3f): ratio %.2f",
            after.imbalance,
            "none" if promised is None else f"{float(promised):.3f}",
            model,
            ratio,
        )
    return {"promised_imbalance": promised, "model_promise": model, "promise_ratio": ratio}


def measured_summary(before: planning.Measured, after: planning.Measured) -> str:
    """What verify measured, before → after, in one line."""

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    def lag(value: float | None) -> str:
        return "n/a" if value is None else f"{value:+.0f}/batch"

    return (
        f"locality {share(before.locality)} → {share(after.locality)}, imbalance "
        f"{ratio(before.imbalance)} → {ratio(after.imbalance)}, lag growth "
        f"{lag(before.lag_growth)} → {lag(after.lag_growth)}"
    )


def verification(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """The run's verification record (after :func:`verify`)."""
    return run_records.read_record(
        run_records.reconfigure_folder(deployment, run_id) / VERIFICATION, "the verification"
    )


def prepare_rollback(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Store the parent's routing as a new version and PREPARE it.

    Versions only grow (:func:`keyplane.orchestration.planning.rollback_config`).
    The rollback configuration is the one that ran before, so it passed
    validation when it was published; it is recorded as validated with that
    reason rather than re-validated against statistics it was not planned on.

    Every call takes every step, each a no-op when done: the version is reserved first
    (:func:`~keyplane.orchestration.run_records.reserve_versions`) and stored, its validation record
    written, then ``rollback.json``. A retry after a try that died anywhere in between stores no
    second version, and a rollback is never left without the validation record its PREPARE requires:
    the job would stay on the version that regressed, every retry failing the same way.
    """
    folder = run_records.reconfigure_folder(deployment, run_id)
    verification = run_records.read_record(folder / VERIFICATION, "the verification")
    proposal = run_records.read_record(folder / PROPOSAL, "the proposal")
    path = folder / ROLLBACK
    replaces = int(verification["version"])
    restores = int(proposal["parent_version"])
    # A rollback.json without a reservation beside it is an older keyplane's: its version.
    recorded = run_records.read_record(path, "the rollback")["version"] if path.is_file() else None
    reserved = run_records.reserve_versions(
        folder / ROLLBACK_ALLOCATION,
        deployment,
        replaces,
        version=None if recorded is None else int(recorded),
    )
    version = int(reserved["version"])
    previous = config_store.load(deployment.routing_store, restores)
    active = config_store.load(deployment.routing_store, replaces)
    saved = run_records.store_version(
        deployment, planning.rollback_config(previous, active, version)
    )
    run_records.write_once(
        run_records.validation_path(deployment, version),
        {
            "version": version,
            "checksum": saved.checksum,
            "success": True,
            "summary": f"rollback to the routing of v{previous.version}",
        },
    )
    record = run_records.write_once(
        path,
        {
            "version": version,
            "restores": previous.version,
            "replaces": active.version,
            "reason": verification["reason"],
        },
    )
    rollout_steps.require_validated(deployment, version)
    with rollout_steps.controller(deployment) as control:
        control.prepare(version)
    log.info(
        "rollback: PREPARE v%d sent, restoring the routing of v%d in place of v%d",
        version,
        previous.version,
        active.version,
    )
    return record
