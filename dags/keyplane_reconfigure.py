"""keyplane_reconfigure: re-plan the running job's routing and roll it out live.

Every ten minutes (or by hand, with Params):

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
   dry run stops here);
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

from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, Asset, Param, TaskGroup, task
from airflow.sdk.exceptions import AirflowFailException

from keyplane.operators import OPERATORS
from keyplane.orchestration import dagparts
from keyplane.orchestration.dagparts import (
    CONFIGURATION_ASSET,
    MAX_WAVES_PER_RUN,
    REPLY_TIMEOUT_MAX_S,
    ROLL_OUT_WAVES_WAITS,
    rollout_chain,
    rollout_dag_args,
)
from keyplane.orchestration.deployment import SPARK_CONN_ID, deployment
from keyplane.orchestration.triggers import AwaitRolloutOperator, RollOutWavesOperator

STATISTICS_JOB = Path(__file__).resolve().parent.parent / "spark_jobs" / "key_statistics.py"
STATISTICS_ASSET = Asset(name="keyplane_statistics_snapshot")

PARAMS = {
    "force": Param(False, type="boolean", description="Publish even when the gain is too small."),
    "dry_run": Param(False, type="boolean", description="Stop after validation and backtest."),
    "alpha": Param(
        1.03, type="number", minimum=1.0, maximum=2.0, description="Imbalance bound α (000 §3.1)."
    ),
    "window": Param(
        "decay",
        type="string",
        enum=["decay", "reset"],
        description="Statistics window: FISH-decayed history (001 §4.1.1) or this window only "
        "(000 §3.2).",
    ),
    "decay": Param(0.5, type="number", minimum=0.0, maximum=1.0, description="FISH decay."),
    "holdout_fraction": Param(
        0.2, type="number", minimum=0.0, maximum=0.9, description="Newest share kept out."
    ),
    "operators": Param(
        list(OPERATORS),
        type="array",
        items={"type": "string", "enum": list(OPERATORS)},
        minItems=1,
        uniqueItems=True,
        description="Operators to re-plan; the others keep their routing.",
    ),
    "parallelism": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        maximum=1024,
        description="Instances per operator (null: the running job's).",
    ),
    "max_table_entries": Param(None, type=["null", "integer"], minimum=0),
    "max_moves_per_wave": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        description="Roll out in waves that each move at most this many keys, to spread the "
        f"state moves over more micro-batches, at most {MAX_WAVES_PER_RUN} waves (null: one "
        "rollout).",
    ),
    "min_gain": Param(0.01, type="number", minimum=0.0, maximum=1.0),
    "migration_cost": Param(0.05, type="number", minimum=0.0, maximum=1.0),
    "min_total_count": Param(10_000, type="integer", minimum=0),
    "verify_batches": Param(5, type="integer", minimum=1, maximum=1000),
    "reply_timeout_s": Param(300, type="integer", minimum=5, maximum=REPLY_TIMEOUT_MAX_S),
}


with DAG(
    dag_id="keyplane_reconfigure",
    description="Statistics → routing plan → GX → backtest → live rollout → verify/rollback",
    tags=["keyplane", "reconfiguration", "spark"],
    params=PARAMS,
    doc_md=__doc__,
    # await_ack, await_migrated_A/B, await_new_version_batches, the rollback's three, and
    # roll_out_waves's, at most MAX_WAVES_PER_RUN waves.
    **rollout_dag_args(waits=7 + ROLL_OUT_WAVES_WAITS),
) as dag:

    @task
    def statistics_args() -> list[str]:
        from keyplane.orchestration import tasks

        params = dagparts.params()
        return tasks.statistics_job_args(
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
    def validate_statistics() -> dict[str, Any]:
        from keyplane.orchestration import tasks

        return tasks.validate_statistics(
            deployment(),
            dagparts.run_id(),
            min_total_count=int(dagparts.params()["min_total_count"]),
        )

    @task(inlets=[STATISTICS_ASSET])
    def compute_configuration() -> dict[str, Any]:
        from keyplane.orchestration import planning, tasks

        params = dagparts.params()
        plan = planning.PlanParams(
            alpha=float(params["alpha"]),
            operators=tuple(params["operators"]),
            parallelism=params["parallelism"],
            window=params["window"],
            max_table_entries=params["max_table_entries"],
            max_moves_per_wave=params["max_moves_per_wave"],
        )
        return tasks.compute_configuration(
            deployment(),
            dagparts.run_id(),
            plan,
            max_waves=MAX_WAVES_PER_RUN,
            created_by=dagparts.created_by(),
        )

    @task
    def validate_configuration() -> dict[str, Any]:
        from keyplane.orchestration import tasks

        return tasks.validate_configuration(deployment(), dagparts.run_id())

    @task
    def backtest() -> dict[str, Any]:
        from keyplane.orchestration import tasks

        return tasks.backtest(deployment(), dagparts.run_id())

    @task.short_circuit
    def decide() -> bool:
        from keyplane.orchestration import planning, tasks

        params = dagparts.params()
        rule = planning.DecisionRule(
            min_gain=float(params["min_gain"]),
            migration_cost=float(params["migration_cost"]),
            force=bool(params["force"]),
        )
        record = tasks.decide(
            deployment(), dagparts.run_id(), rule, dry_run=bool(params["dry_run"])
        )
        return bool(record["publish"])

    @task
    def publish() -> dict[str, Any]:
        from keyplane.orchestration import tasks

        return tasks.publish(deployment(), dagparts.run_id())

    @task(outlets=[CONFIGURATION_ASSET])
    def done() -> dict[str, Any]:
        from keyplane.orchestration import tasks

        return tasks.done(
            deployment(), dagparts.run_id(), version=dagparts.published_version("publish")
        )

    @task.branch
    def verify() -> str | None:
        from keyplane.orchestration import planning, tasks

        params = dagparts.params()
        record = tasks.verify(
            deployment(),
            dagparts.run_id(),
            planning.VerifyTolerances(alpha=float(params["alpha"])),
            batches=int(params["verify_batches"]),
        )
        return "rollback.prepare_rollback" if record["regressed"] else None

    published = publish()
    ack, migrated = rollout_chain("")
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
            from keyplane.orchestration import tasks

            return tasks.prepare_rollback(deployment(), dagparts.run_id())

        @task(outlets=[CONFIGURATION_ASSET])
        def rollback_done() -> dict[str, Any]:
            from keyplane.orchestration import tasks

            return tasks.done(
                deployment(),
                dagparts.run_id(),
                record_name="rollback_rollout.json",
                version=dagparts.published_version("rollback.prepare_rollback"),
            )

        @task
        def report_rollback() -> None:
            from keyplane.orchestration import tasks

            record = tasks.verify(
                deployment(), dagparts.run_id(), tasks.planning.VerifyTolerances(), batches=0
            )
            raise AirflowFailException(
                f"v{record['version']} regressed ({record['reason']}) and was rolled back"
            )

        rollback_ack, rollback_migrated = rollout_chain(
            "rollback_", published_by="rollback.prepare_rollback"
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
        >> RollOutWavesOperator(task_id="roll_out_waves", timeout_s="{{ params.reply_timeout_s }}")
        >> published
        >> ack
    )
    migrated >> finished >> await_batches >> verified >> rollback
