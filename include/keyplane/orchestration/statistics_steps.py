"""Step 1 of the reconfiguration DAG: collect the statistics snapshot and validate it
(paper 000 §3.4).

The statistics job runs in Spark; this module only builds its arguments and
checks the snapshot it wrote against the Great Expectations suite before any
plan is made from it.
"""

from __future__ import annotations

import logging
from typing import Any

from keyplane.algorithms import statistics as stats
from keyplane.orchestration import run_records
from keyplane.orchestration.deployment import Deployment
from keyplane.orchestration.run_records import Refused

log = logging.getLogger(__name__)


def statistics_job_args(
    deployment: Deployment,
    run_id: str,
    *,
    decay: float,
    holdout_fraction: float,
) -> list[str]:
    """The arguments of ``spark_jobs/key_statistics.py`` for this run (``SparkSubmitOperator``)."""
    return [
        "--bootstrap-servers",
        deployment.bootstrap_servers,
        "--pipeline",
        deployment.pipeline,
        "--metrics-topic",
        deployment.metrics_topic,
        "--snapshots",
        str(deployment.snapshots),
        "--run-id",
        run_id,
        "--routing-store",
        str(deployment.routing_store),
        "--decay",
        str(decay),
        "--holdout-fraction",
        str(holdout_fraction),
    ]


def validate_statistics(
    deployment: Deployment, run_id: str, *, min_total_count: int = 10_000
) -> dict[str, Any]:
    """Run the ``keyplane_statistics`` suite on the run's snapshot; raise if it fails.

    Plans are only as good as their statistics (000 §3.2): too few tuples and
    per-instance loads are noise, a window that does not cover what it
    claims would plan on the wrong data.
    """
    from keyplane.orchestration.quality import QualitySettings, locked_context
    from keyplane.orchestration.quality import validate_statistics as run_suite

    snapshot = run_records.snapshot(deployment, run_id)
    widened = stats.lookback(deployment.snapshots, snapshot, min_total_count)
    if len(widened.runs) > 1:
        log.info(
            "window widened to %d runs (%d tuples): %s",
            len(widened.runs),
            widened.total,
            widened.runs,
        )
    with locked_context(deployment.gx_root) as context:
        result = run_suite(
            widened.frame,
            widened.window,
            context=context,
            settings=QualitySettings(min_total_count=min_total_count),
            run_name=f"statistics-{stats.safe_run_id(run_id)}",
            stages=deployment.operators,
        )
    log.info("statistics validation:\n%s", result.summary)
    if not result.success:
        # The run's snapshot never changes: a retry would fail the same checks.
        raise Refused(f"the statistics of run {run_id} failed validation:\n{result.summary}")
    log.info(
        "statistics of %d tuples passed validation (window %s)",
        snapshot.manifest.n_events,
        snapshot.manifest.window,
    )
    return {
        "n_events": snapshot.manifest.n_events,
        "window": list(snapshot.manifest.window),
        "summary": result.summary,
    }
