"""keyplane_scale: scale the running job's operators out or in (paper 003, Stela).

Every ten minutes in ``auto`` mode, or on demand with Params:

1. ``decide`` reads the newest batches of the metrics topic, measures each
   operator's input and execute rates, detects congestion (003 §4.1),
   computes ETP (003 §4.2) and chooses: scale-out of the congested operator
   with the highest projected ETP (003 §5.2), scale-in of the operator with
   the smallest ETP (003 §5.3), or nothing, which ends the run here (as does
   a dry run);
2. ``add_executor`` (scale-out, with ``executors`` on) asks the job's driver
   for one more executor and waits until it has registered
   (:mod:`keyplane.spark.executors`);
3. ``compute_scaled_configuration`` counts the keys of the pipeline's
   topics once for the run (kept in the run's ``scale_counts.json``) and
   stores the active version with that operator over its new *active*
   instances (Spark fixes the state partitions, so scaling changes which
   instances hold keys);
4. ``validate_configuration`` runs the Great Expectations configuration
   suites on it, with the run's stored counts: a failure stops the run,
   and nothing is published;
5. the rollout of paper 000 §3.4, the reconfiguration DAG's: ``publish``
   (PREPARE) → ``await_ack`` → ``propagate`` → ``await_migrated_A`` →
   ``await_migrated_B`` → ``done``, the state of every moved key handed over
   live;
6. ``verify`` checks the first batches on the new version: no tuple reached
   an inactive instance;
7. ``release_executor`` (scale-in, with ``executors`` on) then releases the
   job's newest executor.

Spark, not keyplane, places each state partition's task on an executor.

The file only wires tasks: the steps live in ``keyplane.orchestration`` and
import Kafka, Great Expectations and the algorithms when they run. See
docs/orchestration.md, "Scaling".
"""

from __future__ import annotations

from typing import Any, Literal

from airflow.sdk import DAG, Param, task

from keyplane.control.operators import stage_names
from keyplane.orchestration.dagparts import (
    CONFIGURATION_ASSET,
    fail_fast,
    params,
    published_version,
    reply_timeout_param,
    rollout_chain,
    rollout_dag_args,
    run_id,
    unclamped,
)
from keyplane.orchestration.deployment import deployment
from keyplane.orchestration.triggers import AwaitRolloutOperator

STAGES = stage_names()
"""The stages of the pipeline ``KEYPLANE_PIPELINE`` names, upstream first."""

PARAMS = {
    "action": Param(
        "auto",
        type="string",
        enum=["auto", "out", "in"],
        description="auto: scale out an operator that falls behind, or in when the job is "
        "mostly idle, judged from the newest micro-batches; out/in: add or release "
        "instances now.",
    ),
    "operator": Param(
        None,
        type=["null", "string"],
        examples=list(STAGES),
        description=f"The stage to scale, one of {', '.join(STAGES)}. Empty: the one that "
        "gains most (the busiest to scale out, the idlest to scale in). A name that is not "
        "a stage of the pipeline fails the run's first task.",
    ),
    "instances": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        maximum=1024,
        description="Active instances the operator should have after the run, at most the "
        "job's state partitions. Empty: one more (out) or one fewer (in).",
    ),
    "dry_run": Param(
        False,
        type="boolean",
        description="Decide and stop: log and record what would be scaled, send nothing.",
    ),
    "congestion_threshold": Param(
        1.2,
        type="number",
        minimum=1.0,
        maximum=10.0,
        description="An operator is congested when tuples arrive this many times faster than "
        "it processes them (1.2 = 20 % faster; 1.0 to 10.0). Paper 003 §4.1.",
    ),
    "window": Param(
        5,
        type="integer",
        minimum=1,
        maximum=100,
        description="Newest micro-batches the decision is based on (1 to 100).",
    ),
    "scale_in_utilisation": Param(
        0.5,
        type="number",
        minimum=0.0,
        maximum=0.99,
        description="auto scales in when the operators' summed busy share of the trigger "
        "interval stays below this (0.5 = busy half the time; 0.0 to 0.99).",
    ),
    "trigger_interval_s": Param(
        1.0,
        type="number",
        minimum=0.0,
        description="The job's micro-batch trigger interval, in seconds: the time a batch may "
        "take before the job falls behind.",
    ),
    "alpha": Param(
        1.2,
        type="number",
        minimum=1.0,
        maximum=4.0,
        description="Load balance the scaled routing must keep: the busiest active instance "
        "may take at most this multiple of the average active instance's tuples (1.0 to 4.0).",
    ),
    "verify_batches": Param(
        3,
        type="integer",
        minimum=1,
        maximum=1000,
        description="Micro-batches the job must run on the scaled version before verify checks "
        "that no tuple reached a released instance.",
    ),
    "executors": Param(
        False,
        type="boolean",
        description="Also change the job's executors (a cluster, not local mode): a scale-out "
        "first adds one and waits until it registers, a scale-in releases the newest once its "
        "instances are drained.",
    ),
    "reply_timeout_s": reply_timeout_param(),
}


with DAG(
    dag_id="keyplane_scale",
    description="Metrics → Stela decision → scaled configuration → GX → live rollout → verify",
    tags=["keyplane", "scaling"],
    params=unclamped(PARAMS),
    doc_md=__doc__,
    # await_ack, an await_migrated per stage and await_new_version_batches, and the
    # driver's answers to add_executor and release_executor.
    **rollout_dag_args(waits=2 + len(STAGES) + 2),
) as dag:

    @task.short_circuit
    @fail_fast
    def decide() -> bool:
        from keyplane.algorithms.elasticity import CongestionSettings
        from keyplane.algorithms.scaling import ScaleRequest
        from keyplane.orchestration import scale_steps

        p = params()
        request = ScaleRequest(
            mode=p["action"],
            operator=p["operator"],
            instances=p["instances"],
            congestion=CongestionSettings(
                threshold=float(p["congestion_threshold"]), window=int(p["window"])
            ),
            scale_in_utilisation=float(p["scale_in_utilisation"]),
            trigger_interval_s=float(p["trigger_interval_s"]),
        )
        record = scale_steps.decide(deployment(), run_id(), request, dry_run=bool(p["dry_run"]))
        return bool(record["publish"])

    def change_executors(when: Literal["out", "in"]) -> dict[str, Any]:
        from keyplane.orchestration import scale_steps

        p = params()
        return scale_steps.change_executors(
            deployment(),
            run_id(),
            when=when,
            enabled=bool(p["executors"]),
            wait_s=float(p["reply_timeout_s"]),
        )

    @task
    @fail_fast
    def add_executor() -> dict[str, Any]:
        return change_executors("out")

    @task
    @fail_fast
    def release_executor() -> dict[str, Any]:
        return change_executors("in")

    @task
    @fail_fast
    def compute_scaled_configuration() -> dict[str, Any]:
        from keyplane.orchestration import scale_steps

        return scale_steps.compute_scaled_configuration(deployment(), run_id())

    @task
    @fail_fast
    def validate_configuration() -> dict[str, Any]:
        from keyplane.orchestration import scale_steps

        return scale_steps.validate_scaled_configuration(
            deployment(), run_id(), alpha=float(params()["alpha"])
        )

    @task
    @fail_fast
    def publish() -> dict[str, Any]:
        from keyplane.orchestration import scale_steps

        return scale_steps.publish(deployment(), run_id())

    @task(outlets=[CONFIGURATION_ASSET])
    @fail_fast
    def done() -> dict[str, Any]:
        from keyplane.orchestration import scale_steps

        return scale_steps.done(deployment(), run_id(), published_version("publish"))

    @task
    @fail_fast
    def verify() -> dict[str, Any]:
        from keyplane.orchestration import scale_steps

        return scale_steps.verify(deployment(), run_id(), batches=int(params()["verify_batches"]))

    ack, migrated = rollout_chain(STAGES)
    await_batches = AwaitRolloutOperator(
        task_id="await_new_version_batches",
        kind="metrics",
        batches="{{ params.verify_batches }}",
        timeout_s="{{ params.reply_timeout_s }}",
    )
    (
        decide()
        >> add_executor()
        >> compute_scaled_configuration()
        >> validate_configuration()
        >> publish()
        >> ack
    )
    migrated >> done() >> await_batches >> verify() >> release_executor()
