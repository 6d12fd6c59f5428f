"""The DAG folder parses cleanly, cheaply, and the reconfiguration DAG is set up as intended.

Parsing happens in a subprocess with a throwaway ``AIRFLOW_HOME``: Airflow
parses DAG files under a timeout and over and over, so the file must import
no Spark, Great Expectations or METIS and do no work at parse time.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"
HEAVY = ("pyspark", "great_expectations", "pymetis", "pandas", "pyarrow", "kafka")

_PROBE = """
import json, sys, time
started = time.monotonic()
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
print(json.dumps({
    "errors": {str(k): str(v) for k, v in bag.import_errors.items()},
    "dags": sorted(bag.dags),
    "heavy": [m for m in sys.argv[2].split(",") if m in sys.modules],
    "seconds": time.monotonic() - started,
}))
"""


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow")
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }


@pytest.fixture(scope="module")
def parsed(airflow_env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(DAGS), ",".join(HEAVY)],
        env=airflow_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def dag(airflow_env: dict[str, str]) -> Iterator[Any]:
    previous = dict(os.environ)
    os.environ.update(airflow_env)
    try:
        from airflow.dag_processing.dagbag import DagBag

        yield DagBag(dag_folder=str(DAGS)).dags["keyplane_reconfigure"]
    finally:
        os.environ.clear()
        os.environ.update(previous)


@pytest.fixture(scope="module")
def scale_dag(airflow_env: dict[str, str]) -> Iterator[Any]:
    previous = dict(os.environ)
    os.environ.update(airflow_env)
    try:
        from airflow.dag_processing.dagbag import DagBag

        yield DagBag(dag_folder=str(DAGS)).dags["keyplane_scale"]
    finally:
        os.environ.clear()
        os.environ.update(previous)


def test_dag_folder_imports_without_errors(parsed: dict[str, Any]) -> None:
    assert parsed["errors"] == {}
    assert "keyplane_reconfigure" in parsed["dags"]
    assert "keyplane_scale" in parsed["dags"]


def test_parsing_imports_nothing_heavy(parsed: dict[str, Any]) -> None:
    assert parsed["heavy"] == []


def test_schedule_runs_and_retries(dag: Any) -> None:
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert {"keyplane", "reconfiguration"} <= set(dag.tags)
    assert dag.timetable.timetable.delta == timedelta(minutes=10)
    # ...and whenever the job's metrics call for a re-plan (an asset watcher).
    from keyplane.orchestration.triggers import MetricsSignalTrigger

    (signal,) = dag.timetable.asset_condition.objects
    assert signal.name == "keyplane_metrics_signal"
    (watcher,) = signal.watchers
    assert isinstance(watcher.trigger, MetricsSignalTrigger)
    assert watcher.trigger.thresholds["imbalance_above"] == 1.5
    for task in dag.tasks:
        assert task.retries >= 1, task.task_id


def test_rollout_propagates_upstream_first_then_waits_deferrably(dag: Any) -> None:
    from keyplane.orchestration.triggers import AwaitRolloutOperator, RollOutWavesOperator

    order = [
        "validate_configuration",
        "backtest",
        "decide",
        "approve_rollout",
        "roll_out_waves",
        "publish",
        "await_ack",
        "propagate",
        "await_migrated_A",
        "await_migrated_B",
        "done",
        "await_new_version_batches",
        "verify",
    ]
    for upstream, downstream in itertools.pairwise(order):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    waits = [
        t for t in dag.tasks if t.task_id.split(".")[-1].startswith(("await", "rollback_await"))
    ]
    assert len(waits) == 7
    assert all(isinstance(t, AwaitRolloutOperator) for t in waits)
    assert isinstance(dag.get_task("roll_out_waves"), RollOutWavesOperator)
    assert dag.get_task("collect_statistics").task_type == "SparkSubmitOperator"
    outlets = {a.name for t in dag.tasks for a in t.outlets}
    assert outlets == {"keyplane_statistics_snapshot", "keyplane_routing_configuration"}


def _waits(dag: Any) -> list[Any]:
    from keyplane.orchestration.triggers import AwaitRolloutOperator

    return [t for t in dag.tasks if isinstance(t, AwaitRolloutOperator)]


def test_every_wait_and_propagate_acts_on_the_version_its_own_chain_published(
    dag: Any, scale_dag: Any
) -> None:
    """The waits and PROPAGATEs read their version from the XCom of the task that
    PREPAREd it: the rollback's from ``prepare_rollback``, not from ``publish`` (also
    upstream). One task PROPAGATEs every operator, upstream first, so that the job
    reads them at one batch boundary and switches both stages in the same batch."""
    chain = ["await_ack", "await_migrated_A", "await_migrated_B"]
    for defined, publishers in (
        (dag, {"": "publish", "rollback.rollback_": "rollback.prepare_rollback"}),
        (scale_dag, {"": "publish"}),
    ):
        published = {w.task_id: w.published_by for w in _waits(defined) if w.kind != "metrics"}
        assert published == {
            prefix + wait: publisher for prefix, publisher in publishers.items() for wait in chain
        }
        steps = {
            t.task_id: tuple(t.op_args)
            for t in defined.tasks
            if t.task_id.rsplit(".", 1)[-1].removeprefix("rollback_").startswith("propagate")
        }
        assert steps == {f"{prefix}propagate": (["A", "B"], p) for prefix, p in publishers.items()}
        for task_id, publisher in {**published, **{t: p for t, (_, p) in steps.items()}}.items():
            upstream = defined.get_task(task_id).get_flat_relative_ids(upstream=True)
            assert publisher in upstream, task_id


@pytest.mark.parametrize("fixture", ["dag", "scale_dag"])
def test_a_run_within_its_params_never_reaches_the_run_timeout(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """At ``dagrun_timeout`` the scheduler skips a deferred wait without its abort, so
    the timeout leaves every wait the longest ``reply_timeout_s`` and the other steps time,
    ``roll_out_waves``'s included: an ACK and each operator's MIGRATED for every wave
    but the last, of as many waves as a run may plan."""
    from keyplane.control.operators import OPERATORS
    from keyplane.orchestration.dagparts import MAX_WAVES_PER_RUN
    from keyplane.orchestration.triggers import RollOutWavesOperator

    defined = request.getfixturevalue(fixture)
    from keyplane.orchestration import dagparts

    longest = timedelta(
        seconds=dagparts.bound(defined.params.get_param("reply_timeout_s"), "maximum")
    )
    wave_tasks = [t for t in defined.tasks if isinstance(t, RollOutWavesOperator)]
    assert len(wave_tasks) == (1 if fixture == "dag" else 0)
    waits = len(_waits(defined)) + len(wave_tasks) * (MAX_WAVES_PER_RUN - 1) * (1 + len(OPERATORS))
    assert defined.dagrun_timeout > waits * longest


@pytest.mark.parametrize("fixture", ["dag", "scale_dag"])
def test_a_failed_run_aborts_its_version_in_flight(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    from keyplane.orchestration.dagparts import abort_run_in_flight

    assert request.getfixturevalue(fixture).on_failure_callback is abort_run_in_flight


@pytest.mark.parametrize("fixture", ["dag", "scale_dag"])
def test_a_runs_records_are_found_by_its_dags_id(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The failure callback, a failed wave and a metrics wait find a run's records by
    its DAG's id (both DAGs can have a run of the same id): the ids must be the DAGs'."""
    from keyplane.algorithms import statistics as stats
    from keyplane.orchestration import run_records
    from keyplane.testing import deployment_under

    target = deployment_under(tmp_path)
    written_by = {
        "dag": stats.snapshot_folder(target.snapshots, "run"),
        "scale_dag": run_records.scale_folder(target, "run"),
    }

    dag_id = request.getfixturevalue(fixture).dag_id
    assert run_records.run_folder(target, dag_id, "run") == written_by[fixture]


@pytest.mark.parametrize(
    "override",
    [
        {"alpha": 0.9},
        {"alpha": "high"},
        {"window": "forever"},
        {"operators": []},
        {"operators": ["A", "A"]},
        {"parallelism": 0},
        {"dry_run": "yes"},
        {"verify_batches": 0},
        {"max_moves_per_wave": 0},
        {"max_moves_per_wave": 2.5},
    ],
)
def test_params_schema_rejects_bad_values(dag: Any, override: dict[str, Any]) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    ((name, value),) = override.items()
    with pytest.raises(ParamValidationError):
        copy.deepcopy(dag.params.get_param(name)).resolve(value)


def test_params_defaults_validate(dag: Any) -> None:
    resolved = dag.params.validate()
    assert resolved["alpha"] == 1.03 and resolved["dry_run"] is False
    assert copy.deepcopy(dag.params.get_param("parallelism")).resolve(4) == 4
    assert copy.deepcopy(dag.params.get_param("operators")).resolve(["B"]) == ["B"]


def test_params_defaults_are_the_librarys_defaults(dag: Any) -> None:
    """The DAG file may not import the library's pandas-backed modules to read their
    defaults (parsing stays light), so it repeats them; this keeps the copies equal."""
    from keyplane.algorithms.statistics import StatisticsSettings
    from keyplane.control.operators import stage_names
    from keyplane.orchestration.planning import DecisionRule, PlanParams

    resolved = dag.params.validate()
    plan, rule, statistics = PlanParams(), DecisionRule(), StatisticsSettings()
    assert resolved["alpha"] == plan.alpha and resolved["window"] == plan.window
    assert plan.operators is None  # every stage: the Param's default lists them all
    assert resolved["operators"] == list(stage_names())
    assert resolved["parallelism"] == plan.parallelism
    assert resolved["max_table_entries"] == plan.max_table_entries
    assert resolved["max_moves_per_wave"] == plan.max_moves_per_wave
    assert resolved["decay"] == statistics.decay
    assert resolved["holdout_fraction"] == statistics.holdout_fraction
    assert resolved["min_gain"] == rule.min_gain
    assert resolved["migration_cost"] == rule.migration_cost
    assert resolved["force"] == rule.force


def test_scale_dag_is_scheduled_once_at_a_time_and_propagates_upstream_first(
    scale_dag: Any,
) -> None:
    from keyplane.orchestration.triggers import AwaitRolloutOperator

    assert scale_dag.max_active_runs == 1 and scale_dag.catchup is False
    assert scale_dag.timetable.delta == timedelta(minutes=10)
    assert {"keyplane", "scaling"} <= set(scale_dag.tags)
    order = [
        "decide",
        "add_executor",
        "compute_scaled_configuration",
        "validate_configuration",
        "publish",
        "await_ack",
        "propagate",
        "await_migrated_A",
        "await_migrated_B",
        "done",
        "await_new_version_batches",
        "verify",
        "release_executor",
    ]
    assert sorted(scale_dag.task_ids) == sorted(order)
    for upstream, downstream in itertools.pairwise(order):
        assert scale_dag.get_task(upstream).downstream_task_ids == {downstream}, upstream
    assert scale_dag.get_task("decide").task_type == "_ShortCircuitDecoratedOperator"
    waits = [t for t in scale_dag.tasks if t.task_id.startswith("await")]
    assert len(waits) == 4 and all(isinstance(t, AwaitRolloutOperator) for t in waits)
    assert all(task.retries >= 1 for task in scale_dag.tasks)
    outlets = {a.name for t in scale_dag.tasks for a in t.outlets}
    assert outlets == {"keyplane_routing_configuration"}


@pytest.mark.parametrize(
    "override",
    [
        {"action": "sideways"},
        {"instances": 0},
        {"dry_run": "yes"},
        {"congestion_threshold": 0.5},
        {"window": 0},
        {"scale_in_utilisation": 1.0},
        {"trigger_interval_s": -1},
    ],
)
def test_scale_params_schema_rejects_bad_values(scale_dag: Any, override: dict[str, Any]) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    ((name, value),) = override.items()
    with pytest.raises(ParamValidationError):
        copy.deepcopy(scale_dag.params.get_param(name)).resolve(value)


def test_scale_params_defaults_are_the_librarys_defaults(scale_dag: Any) -> None:
    from keyplane.algorithms.elasticity import CongestionSettings
    from keyplane.algorithms.scaling import ScaleRequest

    resolved = scale_dag.params.validate()
    request, congestion = ScaleRequest(), CongestionSettings()
    assert resolved["action"] == request.mode and resolved["operator"] == request.operator
    assert resolved["instances"] == request.instances
    assert resolved["scale_in_utilisation"] == request.scale_in_utilisation
    assert resolved["congestion_threshold"] == congestion.threshold
    assert resolved["window"] == congestion.window


def test_scale_params_defaults_validate(scale_dag: Any) -> None:
    resolved = scale_dag.params.validate()
    assert resolved["action"] == "auto" and resolved["operator"] is None
    assert resolved["instances"] is None and resolved["dry_run"] is False
    assert resolved["executors"] is False
    assert copy.deepcopy(scale_dag.params.get_param("operator")).resolve("B") == "B"
    assert copy.deepcopy(scale_dag.params.get_param("instances")).resolve(2) == 2


@pytest.mark.parametrize("dag_id", ["keyplane_reconfigure", "keyplane_scale"])
def test_every_param_has_an_operator_description(dag: Any, scale_dag: Any, dag_id: str) -> None:
    """Each Param says what it does in the operator's terms: a sentence of its own, not a
    paper section (a citation may follow the explanation, never replace it)."""
    import re

    chosen = dag if dag_id == "keyplane_reconfigure" else scale_dag
    for name in chosen.params:
        description = chosen.params.get_param(name).description
        assert description, f"{dag_id} Param {name!r} has no description"
        assert len(description) >= 40, (name, description)
        words_before_citation = re.split(r"\(?\b\d{3} §", description)[0]
        assert len(words_before_citation.split()) >= 6, (name, description)


@pytest.mark.parametrize("dag_id", ["keyplane_reconfigure", "keyplane_scale"])
def test_no_param_is_clamped_by_the_trigger_form_yet_each_bound_refuses(
    dag: Any, scale_dag: Any, dag_id: str
) -> None:
    """Airflow's form clamps a number field to a top-level minimum/maximum without a word
    (α 7 became 2); the bounds live under allOf, and a value past one is refused, naming it."""
    from airflow.sdk.definitions.param import ParamValidationError

    from keyplane.orchestration.dagparts import BOUNDS, bound

    chosen = dag if dag_id == "keyplane_reconfigure" else scale_dag
    checked = 0
    for name in chosen.params:
        param = chosen.params.get_param(name)
        assert not set(BOUNDS) & set(param.schema), (name, param.schema)
        highest = bound(param, "maximum")
        if highest is None:
            continue
        with pytest.raises(ParamValidationError, match=f"greater than the maximum of {highest}"):
            copy.deepcopy(param).resolve(highest * 3 + 1)
        checked += 1
    assert checked >= 3


def test_the_first_tasks_refuse_for_good_and_the_steps_that_refuse_fail_fast() -> None:
    """A refused step fails its task with AirflowFailException, which Airflow never
    retries; any other error (Kafka down, a reply not in) is left to the retries."""
    from airflow.sdk.exceptions import AirflowFailException

    from keyplane.orchestration.dagparts import fail_fast
    from keyplane.orchestration.run_records import Refused, StepError

    def refused() -> None:
        raise Refused("parallelism 8 is more than the job's 4 state partitions")

    def transient() -> None:
        raise StepError("only 1 of 3 batches ran on v2 yet")

    with pytest.raises(AirflowFailException, match="4 state partitions"):
        fail_fast(refused)()
    with pytest.raises(StepError):
        fail_fast(transient)()
    assert fail_fast(refused).__name__ == "refused"


_CHAIN_PROBE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
out = {"errors": {str(k): str(v) for k, v in bag.import_errors.items()}}
for dag_id in ("keyplane_reconfigure", "keyplane_scale"):
    dag = bag.dags[dag_id]
    out[dag_id] = {
        "tasks": sorted(dag.task_ids),
        "downstream": {t: sorted(dag.get_task(t).downstream_task_ids) for t in dag.task_ids},
        "defaults": dag.params.validate(),
    }
print(json.dumps(out, default=str))
"""


def test_the_dags_follow_a_three_stage_pipeline_named_by_one_setting(
    airflow_env: dict[str, str],
) -> None:
    """With ``KEYPLANE_PIPELINE`` naming the three-stage clickstream example, both DAGs
    wait for each of its stages' MIGRATED, upstream first, and re-plan all three."""
    root = DAGS.parent
    env = {
        **airflow_env,
        "KEYPLANE_PIPELINE": "examples.clickstream.pipeline:clicks",
        "PYTHONPATH": os.pathsep.join([str(root), airflow_env.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHAIN_PROBE, str(DAGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed["errors"] == {}
    stages = ["sessions", "users", "categories"]
    reconfigure, scale = parsed["keyplane_reconfigure"], parsed["keyplane_scale"]
    assert reconfigure["defaults"]["operators"] == stages
    for dag in (reconfigure, scale):
        chain = ["propagate", *(f"await_migrated_{stage}" for stage in stages), "done"]
        for upstream, downstream in itertools.pairwise(chain):
            assert downstream in dag["downstream"][upstream], (upstream, downstream)
        assert not any(t.endswith(("_A", "_B")) for t in dag["tasks"])
    rollback = [f"rollback.rollback_await_migrated_{stage}" for stage in stages]
    assert set(rollback) <= set(reconfigure["tasks"])
