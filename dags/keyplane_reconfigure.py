"""keyplane_reconfigure: re-plan the running job's routing and roll it out live.

Every ten minutes, whenever the job's metrics call for it (the asset
``keyplane_metrics_signal``: imbalance, locality or lag growth past the
``KEYPLANE_RECONFIGURE_*`` thresholds), or by hand, with Params:

1. ``collect_statistics`` (Spark) reads the events and metrics topics since
   the last run and writes a statistics snapshot (asset
   ``keyplane_statistics_snapshot``);
2. ``validate_statistics`` (Great Expectations) checks it;
3. ``compute_configuration`` plans METIS routing tables and FISH hot keys
   (papers 000 §3.3, 001 §4) and stores them as a new version;
4. ``validate_configuration`` (Great Expectations) checks it: a failure stops
   the run with a readable summary, and nothing is published;
5. ``backtest`` scores it against the current version on the snapshot's
   hold-out, ``decide`` publishes only when the gain repays the migration (a
   dry run stops here); with ``require_approval``, ``approve_rollout`` waits
   for a person to approve in the UI's Required actions, showing the
   backtest (a rejection skips the rollout and publishes nothing);
   with ``max_moves_per_wave``, ``compute_configuration`` stores the change
   as waves and ``roll_out_waves`` rolls out all but the last, one after the
   other with deferred waits, so each wave's micro-batches carry a share of
   the moved state;
6. the rollout of paper 000 §3.4: ``publish`` (PREPARE) → ``await_ack`` →
   ``propagate`` → ``await_migrated_A`` → ``await_migrated_B`` → ``done``
   (asset ``keyplane_routing_configuration``), every wait deferred to the
   triggerer: ``propagate`` sends both PROPAGATEs in one publish, so both
   stages switch in one micro-batch and install in the next;
7. ``verify`` compares the new version's first batches with the window
   before, and ``rollback`` republishes the previous routing as a new version
   when they regressed.

The file only wires tasks: the steps live in ``keyplane.orchestration`` and
import Spark, Great Expectations and METIS when they run, not when this file
is parsed. See docs/orchestration.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import (
    DAG,
    Asset,
    AssetOrTimeSchedule,
    DeltaTriggerTimetable,
    Param,
    TaskGroup,
    task,
)
from airflow.sdk.exceptions import AirflowFailException

from keyplane.control.operators import stage_names
from keyplane.orchestration import dagparts
from keyplane.orchestration.approval import RolloutApprovalOperator
from keyplane.orchestration.dagparts import (
    CONFIGURATION_ASSET,
    MAX_WAVES_PER_RUN,
    reply_timeout_param,
    roll_out_waves_waits,
    rollout_chain,
    rollout_dag_args,
)
from keyplane.orchestration.deployment import SPARK_CONN_ID, deployment
from keyplane.orchestration.triggers import AwaitRolloutOperator, RollOutWavesOperator

log = logging.getLogger(__name__)

STATISTICS_JOB = Path(__file__).resolve().parent.parent / "spark_jobs" / "key_statistics.py"
STATISTICS_ASSET = Asset(name="keyplane_statistics_snapshot")
METRICS_SIGNAL = dagparts.metrics_signal_asset()
STAGES = stage_names()
"""The stages of the pipeline ``KEYPLANE_PIPELINE`` names, upstream first: the operators a
run re-plans and rolls out, one MIGRATED wait each."""

PARAMS = {
    "force": Param(
        False,
        type="boolean",
        description="Roll the new routing out even when the backtest says its gain does not "
        "repay the cost of moving state.",
    ),
    "dry_run": Param(
        False,
        type="boolean",
        description="Plan, validate and backtest, then stop: nothing is sent to the job. The "
        "planned version is kept as 'not published'.",
    ),
    "require_approval": Param(
        False,
        type="boolean",
        description="Wait for a person to approve the rollout in the Airflow UI (Required "
        "actions), after the backtest and before anything is sent to the job. Rejecting "
        "ends the run with nothing published.",
    ),
    "alpha": Param(
        1.03,
        type="number",
        minimum=1.0,
        maximum=2.0,
        description="Load balance the plan must keep: the busiest instance of an operator may "
        "take at most this multiple of the average instance's tuples (1.03 = 3 % above the "
        "average; 1.0 to 2.0). Paper 000 §3.1's α.",
    ),
    "window": Param(
        "decay",
        type="string",
        enum=["decay", "reset"],
        description="Which traffic the plan learns from: 'decay' weighs all past runs' "
        "statistics, older ones less (halved each run with decay 0.5); 'reset' uses only "
        "the traffic since the last run.",
    ),
    "decay": Param(
        0.5,
        type="number",
        minimum=0.0,
        maximum=1.0,
        description="With window 'decay': the weight each run keeps of the traffic before it "
        "(0: forget it, 1: never forget; 0.0 to 1.0).",
    ),
    "holdout_fraction": Param(
        0.2,
        type="number",
        minimum=0.0,
        maximum=0.9,
        description="Share of the newest traffic kept out of planning to backtest the plan on "
        "(0.2 = the newest 20 %; 0.0 to 0.9).",
    ),
    "operators": Param(
        list(STAGES),
        type="array",
        items={"type": "string"},
        examples=list(STAGES),
        minItems=1,
        uniqueItems=True,
        description="The pipeline's stages to re-plan, of "
        f"{', '.join(STAGES)}; the others keep the routing they run. A name that is not a "
        "stage of the pipeline fails the run's first task.",
    ),
    "parallelism": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        maximum=1024,
        description="Instances each re-planned operator spreads its keys over, at most the "
        "job's state partitions (fixed when the job started); empty: the instances it uses "
        "now.",
    ),
    "max_table_entries": Param(
        None,
        type=["null", "integer"],
        minimum=0,
        description="Most keys per operator pinned in the routing table (the rest follow the "
        "hash); keeps the table the job loads small. Empty: every key seen.",
    ),
    "max_moves_per_wave": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        description="Roll out in waves that each move the state of at most this many keys, "
        "so each micro-batch carries a smaller share of the moved state (at most "
        f"{MAX_WAVES_PER_RUN} waves). Empty: one rollout.",
    ),
    "min_gain": Param(
        0.01,
        type="number",
        minimum=0.0,
        maximum=1.0,
        description="Smallest backtested improvement worth a rollout: locality gained (0.01 "
        "= one percentage point of tuples kept on one executor) plus the drop of the worst "
        "imbalance, after the migration cost.",
    ),
    "migration_cost": Param(
        0.05,
        type="number",
        minimum=0.0,
        maximum=1.0,
        description="What moving all of the job's state costs, in the same units as "
        "min_gain; a rollout that moves 40 % of the state is charged 0.4 × this.",
    ),
    "min_total_count": Param(
        10_000,
        type="integer",
        minimum=0,
        description="Fewest tuples the statistics must hold to plan on (below, the run fails "
        "in validate_statistics: too little traffic to trust per-instance loads).",
    ),
    "verify_batches": Param(
        5,
        type="integer",
        minimum=1,
        maximum=1000,
        description="Micro-batches the job must run on the new version before verify compares "
        "their locality, balance and lag with the batches before (a regression rolls back).",
    ),
    "verify_locality_tolerance": Param(
        0.05,
        type="number",
        minimum=0,
        maximum=1,
        description="Points of executor locality the new version may lose in verify before it "
        "counts as a regression (1 ignores locality: where Spark places tasks is not pinned).",
    ),
    "reply_timeout_s": reply_timeout_param(),
}


with DAG(
    dag_id="keyplane_reconfigure",
    description="Statistics → routing plan → GX → backtest → live rollout → verify/rollback",
    tags=["keyplane", "reconfiguration", "spark"],
    params=dagparts.unclamped(PARAMS),
    doc_md=__doc__,
    # await_ack, an await_migrated per stage, await_new_version_batches, the rollback's
    # the same, and roll_out_waves's, at most MAX_WAVES_PER_RUN waves.
    **rollout_dag_args(
        waits=3 + 2 * len(STAGES) + roll_out_waves_waits(len(STAGES)),
        # Every ten minutes, and whenever the job's metrics call for a re-plan.
        schedule=AssetOrTimeSchedule(
            timetable=DeltaTriggerTimetable(dagparts.SCHEDULE), assets=[METRICS_SIGNAL]
        ),
    ),
) as dag:

    @task
    @dagparts.fail_fast
    def statistics_args() -> list[str]:
        """The first task: refuses Params the job cannot take before any Spark work."""
        from keyplane.orchestration import configuration_steps, statistics_steps

        params = dagparts.params()
        checked = configuration_steps.check_plan_params(
            deployment(), params["operators"], params["parallelism"]
        )
        log.info(
            "Params fit the job on v%d; collecting statistics for %s",
            checked["active_version"],
            ", ".join(checked["operators"]),
        )
        return statistics_steps.statistics_job_args(
            deployment(),
            dagparts.run_id(),
            decay=float(params["decay"]),
            holdout_fraction=float(params["holdout_fraction"]),
        )

    collect_statistics = SparkSubmitOperator(
        task_id="collect_statistics",
        application=str(STATISTICS_JOB),
        conn_id=SPARK_CONN_ID,
        name="keyplane-statistics",
        # Airflow resolves an XComArg in a templated field before the task runs;
        # the operator's annotation does not say so.
        application_args=statistics_args(),  # type: ignore[arg-type]
        outlets=[STATISTICS_ASSET],
    )

    @task
    @dagparts.fail_fast
    def validate_statistics() -> dict[str, Any]:
        from keyplane.orchestration import statistics_steps

        return statistics_steps.validate_statistics(
            deployment(),
            dagparts.run_id(),
            min_total_count=int(dagparts.params()["min_total_count"]),
        )

    @task(inlets=[STATISTICS_ASSET])
    @dagparts.fail_fast
    def compute_configuration() -> dict[str, Any]:
        from keyplane.orchestration import configuration_steps, planning

        params = dagparts.params()
        plan = planning.PlanParams(
            alpha=float(params["alpha"]),
            operators=tuple(params["operators"]),
            parallelism=params["parallelism"],
            window=params["window"],
            max_table_entries=params["max_table_entries"],
            max_moves_per_wave=params["max_moves_per_wave"],
        )
        return configuration_steps.compute_configuration(
            deployment(),
            dagparts.run_id(),
            plan,
            max_waves=MAX_WAVES_PER_RUN,
            created_by=dagparts.created_by(),
        )

    @task
    @dagparts.fail_fast
    def validate_configuration() -> dict[str, Any]:
        from keyplane.orchestration import configuration_steps

        return configuration_steps.validate_configuration(deployment(), dagparts.run_id())

    @task
    @dagparts.fail_fast
    def backtest() -> dict[str, Any]:
        from keyplane.orchestration import decision_steps

        return decision_steps.backtest(deployment(), dagparts.run_id())

    @task.short_circuit
    @dagparts.fail_fast
    def decide() -> bool:
        from keyplane.orchestration import decision_steps, planning

        params = dagparts.params()
        rule = planning.DecisionRule(
            min_gain=float(params["min_gain"]),
            migration_cost=float(params["migration_cost"]),
            force=bool(params["force"]),
        )
        record = decision_steps.decide(
            deployment(), dagparts.run_id(), rule, dry_run=bool(params["dry_run"])
        )
        return bool(record["publish"])

    @task
    @dagparts.fail_fast
    def publish() -> dict[str, Any]:
        from keyplane.orchestration import rollout_steps

        return rollout_steps.publish(deployment(), dagparts.run_id())

    @task(outlets=[CONFIGURATION_ASSET])
    @dagparts.fail_fast
    def done() -> dict[str, Any]:
        from keyplane.orchestration import rollout_steps

        return rollout_steps.done(
            deployment(), dagparts.run_id(), version=dagparts.published_version("publish")
        )

    @task.branch
    @dagparts.fail_fast
    def verify() -> str | None:
        from keyplane.orchestration import planning, verification_steps

        params = dagparts.params()
        record = verification_steps.verify(
            deployment(),
            dagparts.run_id(),
            planning.VerifyTolerances(
                alpha=float(params["alpha"]),
                locality=float(params["verify_locality_tolerance"]),
            ),
            batches=int(params["verify_batches"]),
        )
        return "rollback.prepare_rollback" if record["regressed"] else None

    published = publish()
    ack, migrated = rollout_chain(STAGES)
    finished = done()
    await_batches = AwaitRolloutOperator(
        task_id="await_new_version_batches",
        kind="metrics",
        batches="{{ params.verify_batches }}",
        timeout_s="{{ params.reply_timeout_s }}",
    )
    verified = verify()

    with TaskGroup("rollback") as rollback:

        @task
        def prepare_rollback() -> dict[str, Any]:
            from keyplane.orchestration import verification_steps

            return verification_steps.prepare_rollback(deployment(), dagparts.run_id())

        @task(outlets=[CONFIGURATION_ASSET])
        def rollback_done() -> dict[str, Any]:
            from keyplane.orchestration import rollout_steps

            return rollout_steps.done(
                deployment(),
                dagparts.run_id(),
                record_name="rollback_rollout.json",
                version=dagparts.published_version("rollback.prepare_rollback"),
            )

        @task
        def report_rollback() -> None:
            from keyplane.orchestration import planning, verification_steps

            record = verification_steps.verify(
                deployment(), dagparts.run_id(), planning.VerifyTolerances(), batches=0
            )
            raise AirflowFailException(
                f"v{record['version']} regressed ({record['reason']}) and was rolled back"
            )

        rollback_ack, rollback_migrated = rollout_chain(
            STAGES, "rollback_", published_by="rollback.prepare_rollback"
        )
        prepare_rollback() >> rollback_ack
        rollback_migrated >> rollback_done() >> report_rollback()

    (
        collect_statistics
        >> validate_statistics()
        >> compute_configuration()
        >> validate_configuration()
        >> backtest()
        >> decide()
        >> RolloutApprovalOperator(task_id="approve_rollout")
        >> RollOutWavesOperator(task_id="roll_out_waves", timeout_s="{{ params.reply_timeout_s }}")
        >> published
        >> ack
    )
    migrated >> finished >> await_batches >> verified >> rollback
