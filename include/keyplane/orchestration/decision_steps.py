"""Step 3 of the reconfiguration DAG: backtest the proposed configuration, decide whether
to publish it, and record an operator's approval where one is required (paper 000 §3.4).

The decision and the approval are records of the run, written once, which the
publish gate reads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from keyplane.orchestration import planning, run_records
from keyplane.orchestration.deployment import Deployment
from keyplane.orchestration.run_records import (
    APPROVAL,
    BACKTEST,
    DECISION,
    PROPOSAL,
    Proposal,
    Refused,
)
from keyplane.routing import config as config_store

log = logging.getLogger(__name__)


def backtest(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Score the proposal and the active version on the snapshot's hold-out."""
    folder = run_records.reconfigure_folder(deployment, run_id)
    proposal, config = run_records.read_proposal(deployment, run_id)
    current = config_store.load(deployment.routing_store, proposal.parent_version)
    snapshot = run_records.snapshot(deployment, run_id)
    result = planning.backtest(
        config, current, snapshot.pairs, snapshot.frequencies, deployment.operators
    )
    record = run_records.write_once(
        folder / BACKTEST, {"version": proposal.version, **asdict(result)}
    )
    log.info("backtest of v%d on the hold-out: %s", proposal.version, backtest_summary(record))
    return record


def backtest_summary(record: Mapping[str, Any]) -> str:
    """One line of a backtest record: locality, worst imbalance and state moved."""
    result = _backtest_of(record)
    return (
        f"locality {result.current.locality:.1%} → {result.new.locality:.1%}, worst imbalance "
        f"{result.current.worst_imbalance:.3f} → {result.new.worst_imbalance:.3f}, "
        f"{result.moved_share:.1%} of the state moves"
    )


def _backtest_of(record: Mapping[str, Any]) -> planning.Backtest:
    return planning.Backtest(
        new=planning.Forecast(**record["new"]),
        current=planning.Forecast(**record["current"]),
        moved_share=float(record["moved_share"]),
        holdout_tuples=float(record["holdout_tuples"]),
    )


def decide(
    deployment: Deployment, run_id: str, rule: planning.DecisionRule, *, dry_run: bool
) -> dict[str, Any]:
    """Whether to publish the proposal (:class:`~keyplane.orchestration.planning.DecisionRule`).

    A dry run never publishes. The first decision of a run stands.
    """
    folder = run_records.reconfigure_folder(deployment, run_id)
    result = _backtest_of(run_records.read_record(folder / BACKTEST, "the backtest"))
    decision = planning.decide(result, rule)
    publish_it = decision.publish and not dry_run
    reason = f"dry run: {decision.reason}" if dry_run else decision.reason
    record = run_records.write_once(
        folder / DECISION,
        {
            "version": run_records.read_record(folder / PROPOSAL, "the proposal")["version"],
            "publish": publish_it,
            "gain": decision.gain,
            "cost": decision.cost,
            "reason": reason,
        },
    )
    log.info("decision: %s", record["reason"])
    if not record["publish"]:
        proposal = Proposal.model_validate(
            run_records.read_record(folder / PROPOSAL, "the proposal")
        )
        not_published(
            deployment, [*proposal.waves, proposal.version], str(record["reason"]), run_id
        )
    return record


def not_published(
    deployment: Deployment, versions: Sequence[int], reason: str, run_id: str
) -> None:
    """Mark the run's ``versions`` as planned but not published, then prune the oldest such
    (:func:`keyplane.routing.config.prune_not_published`), never the job's active version or one
    in flight."""
    for version in versions:
        config_store.mark_not_published(deployment.routing_store, version, reason, run_id)
    protected: list[int] = []
    if deployment.controller_state.is_file():
        from keyplane.control.controller import ControllerFile

        saved = ControllerFile.model_validate_json(deployment.controller_state.read_text())
        state = saved.protocol
        protected = [state.active_version] + [
            r.version for r in (state.current, state.last) if r is not None
        ]
    pruned = config_store.prune_not_published(
        deployment.routing_store, deployment.unpublished_versions_kept, protected
    )
    if pruned:
        log.info(
            "pruned %d versions that were never published (v%s)",
            len(pruned),
            ", v".join(map(str, pruned)),
        )


def approval_summary(deployment: Deployment, run_id: str) -> dict[str, str]:
    """What the person asked to approve the rollout sees: the version, the backtest's
    predicted gain, the keys and state it moves, and the migration cost."""
    from keyplane.routing.migration import plan_migration
    from keyplane.routing.routedkeys import spark_partition

    folder = run_records.reconfigure_folder(deployment, run_id)
    proposal, config = run_records.read_proposal(deployment, run_id)
    decision = run_records.read_record(folder / DECISION, "the decision")
    result = _backtest_of(run_records.read_record(folder / BACKTEST, "the backtest"))
    parent = config_store.load(deployment.routing_store, proposal.parent_version)
    moved = sum(len(m.moves) for m in plan_migration(parent, config, spark_partition).operators)
    waves = f" in {len(proposal.waves) + 1} waves" if proposal.waves else ""
    body = "\n".join(
        [
            f"**v{proposal.version}** replaces the active **v{proposal.parent_version}**{waves}.",
            "",
            "Backtest on the newest traffic, held out of planning:",
            "",
            f"- locality: {result.current.locality:.1%} → {result.new.locality:.1%}",
            f"- worst imbalance: {result.current.worst_imbalance:.3f} → "
            f"{result.new.worst_imbalance:.3f}",
            f"- keys moved: {moved}, {result.moved_share:.1%} of the state",
            f"- predicted gain {decision['gain']:+.4f}, migration cost {decision['cost']:.4f}",
            "",
            f"Decision: {decision['reason']}",
        ]
    )
    return {
        "subject": f"Roll out v{proposal.version}? (gain {decision['gain']:+.4f}, "
        f"{moved} keys move)",
        "body": body,
    }


def record_approval(deployment: Deployment, run_id: str, approved: bool, by: str) -> dict[str, Any]:
    """Record the answer to the approval request, once; a rejected version is marked not
    published and :func:`~keyplane.orchestration.rollout_steps.publish` refuses it."""
    folder = run_records.reconfigure_folder(deployment, run_id)
    proposal = Proposal.model_validate(run_records.read_record(folder / PROPOSAL, "the proposal"))
    record = run_records.write_once(
        folder / APPROVAL, {"version": proposal.version, "approved": approved, "by": by}
    )
    if not record["approved"]:
        not_published(
            deployment, [*proposal.waves, proposal.version], f"rejected by {record['by']}", run_id
        )
    return record


def require_approved(folder: Path) -> None:
    """Refuse a version whose approval request was answered with a rejection."""
    path = folder / APPROVAL
    if path.is_file():
        record = run_records.read_record(path, "the approval")
        if not record.get("approved"):
            raise Refused(f"v{record['version']} was rejected by {record.get('by')}")
