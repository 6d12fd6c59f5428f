"""The scale DAG adds an executor live, then releases it: standalone master, real job and Airflow.

A Spark standalone master and one worker, started from the stack's own
pieces (:mod:`keyplane.stack.spark`), run the routed job (4 state
partitions, stage B active on 2 of them) while events keep arriving on the
embedded broker. Each worker has room for one executor, and the job may
hold two (``spark.cores.max``). Once the job runs, the driver pins its
executor count at one, and a second worker joins: the job must not grow by
itself. Then two ``keyplane_scale`` runs (``airflow dags test``):

1. scale-out of B to 3 instances with ``executors`` on: the run asks the
   driver for one more executor, which must register on the second worker
   (the driver reports 1 → 2), then rolls B out over 3 instances live, and
   instances' tasks run on the new executor (the metrics' executors; the job
   runs with ``spark.locality.wait`` 0, which lets Spark move a state
   partition's task off the executor that loaded its store);
2. scale-in of B back to 2: the run drains B's third instance by the live
   migration, then releases the newest executor (2 → 1).

Batches keep committing throughout (the query is never restarted) and every
count is exact.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.producer import WorkloadTrickle, produce_workload
from keyplane.orchestration import dagrun, run_records, scale_steps, verification_steps
from keyplane.orchestration.deployment import Deployment
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.spark.counts_job import read_output
from keyplane.spark.executors import executor_ids
from keyplane.spark.job_checkpoint import last_commit
from keyplane.stack.config import StackConfig
from keyplane.stack.network import Network
from keyplane.stack.spark import SparkMaster, SparkWorkers, master_state
from keyplane.testing import (
    free_port,
    routed_job_settings,
    start_job_process,
    wait_while_job_runs,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

P = 4
REPO = Path(__file__).resolve().parents[2]


def _cluster(workers: int, ports: dict[str, int]) -> StackConfig:
    """Workers of 2 cores and 1 GiB: room for one executor of 1 GiB each."""
    return StackConfig(
        workers=workers,
        worker_cores=2,
        worker_memory="1g",
        job_cores=1,
        batch_cores=1,
        # This job pins at the executors it has when its first batch has run.
        job_executors_initial=None,
        shaping="off",
        **ports,
    )


def _run_scale(setup: dagrun.AirflowSetup, conf: dict[str, object], log: Path) -> None:
    with log.open("wb") as out:
        returncode = subprocess.run(
            [dagrun.airflow_command(), "dags", "test", "keyplane_scale", "-c", json.dumps(conf)],
            env=setup.environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=False,
        ).returncode
    output = log.read_text()
    assert returncode == 0, output[-6000:]
    assert "DagRun Finished" in output


def _app_executors(ui_url: str) -> int:
    """Executors the master runs for the job's application."""
    state = master_state(ui_url) or {}
    return sum(worker.get("coresused", 0) > 0 for worker in state.get("workers", []) if worker)


@pytest.mark.timeout(2400)
def test_scale_out_adds_an_executor_live_and_scale_in_releases_it_with_counts_exact(
    broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = {
        "spark_master_port": free_port(),
        "spark_ui_port": free_port(),
        "spark_worker_ui_port": free_port(),
    }
    home = tmp_path / "stack"
    unshaped = Network(shaped=False, reason="a test on loopback")
    master = SparkMaster(home, _cluster(1, ports), unshaped)
    conf_dir = tmp_path / "job-conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        "spark.cores.max 2\nspark.executor.cores 1\nspark.executor.memory 1g\n"
        # Spark schedules a state partition's task where its store was loaded last, for
        # as long as spark.locality.wait; these batches' tasks are shorter than the
        # default 3 s, so without this every one of them would stay on the first executor.
        "spark.locality.wait 0\n"
    )
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))

    before = PairsWorkload(n_keys=48, locality=0.9, n_events=2_000, seed=11)
    assert produce_workload(before, broker, topic_name, partitions=2) == before.n_events
    store = tmp_path / "routing"
    hashed = RoutingConfig.all_hash(P, OPERATORS)
    b = OperatorRouting.model_validate(
        {**hashed.operators["B"].model_dump(mode="json"), "active_instances": [0, 1]}
    )
    config_store.save(hashed.model_copy(update={"operators": {**hashed.operators, "B": b}}), store)
    settings = routed_job_settings(
        broker,
        topic_name,
        tmp_path,
        parallelism=P,
        batch=1_000,
        trigger="1 second",
        version=1,
        master=master.url,
    )
    setup = dagrun.AirflowSetup.for_job(
        settings,
        airflow_home=tmp_path / "airflow",
        keyplane_home=tmp_path / "keyplane-home",
        dags_folder=REPO / "dags",
    )
    producer = WorkloadTrickle(
        lambda i: PairsWorkload(n_keys=48, locality=0.9, n_events=150, seed=300 + i),
        broker,
        topic_name,
    )
    job_log = tmp_path / "job.log"
    job: subprocess.Popen[bytes] | None = None
    workers = SparkWorkers(home, _cluster(1, ports), unshaped, master)
    try:
        master.up()
        workers.up()
        job = start_job_process(settings, job_log)
        dagrun.migrate_database(setup)

        def counted(n: int) -> bool:
            frame = read_output(settings.output)
            return int(frame.loc[frame["stage"] == "A", "count"].sum()) >= n

        wait_while_job_runs(
            lambda: counted(before.n_events), "the first events", job, job_log, timeout_s=600
        )
        wait_while_job_runs(
            lambda: "executors pinned at 1" in job_log.read_text(),
            "the executor count pinned",
            job,
            job_log,
            timeout_s=120,
        )
        # A second worker joins; the pinned job must not take it by itself.
        workers = SparkWorkers(home, _cluster(2, ports), unshaped, master)
        workers.up()
        time.sleep(10)
        assert _app_executors(master.ui_url) == 1
        producer.start()

        common = {"operator": "B", "executors": True, "alpha": 3.0, "reply_timeout_s": 180}
        out_log = tmp_path / "airflow-out.log"
        committed_before_out = last_commit(settings.checkpoint)
        _run_scale(setup, {**common, "action": "out", "instances": 3}, out_log)
        (out_folder,) = (setup.keyplane_home / "scale").iterdir()
        added = json.loads((out_folder / scale_steps.EXECUTORS).read_text())
        assert added["action"] == "add"
        assert len(added["executors_after"]) == len(added["executors_before"]) + 1 == 2
        assert added["executor"] in added["executors_after"]
        assert added["executor"] not in added["executors_before"]
        assert 0 < added["seconds_from_decision"] < 300
        assert _app_executors(master.ui_url) == 2
        proposal = json.loads((out_folder / scale_steps.PROPOSAL).read_text())
        assert len(proposal["active_after"]) == 3
        verification = json.loads((out_folder / "verification.json").read_text())
        assert verification["ok"]
        # Where Spark ran the instances' tasks since the rollout began: the metrics'
        # "host:executor" labels (keyplane.spark.routed_counts.executor_id).
        deployment = Deployment.under(
            setup.keyplane_home,
            bootstrap_servers=broker,
            events_topic=topic_name,
            metrics_topic=settings.metrics_topic,
            control_topic=settings.control_topic,
            routing_store=store,
        )
        rollout = json.loads((out_folder / run_records.ROLLOUT).read_text())
        start = {int(p): int(o) for p, o in rollout["metrics_start"].items()}
        ran_on = {
            label
            for record in verification_steps.read_metrics(deployment, start)
            for instances in record.executors.values()
            for label in instances.values()
        }
        assert added["executor"] in executor_ids(ran_on), ran_on
        committed_after_out = last_commit(settings.checkpoint)
        assert committed_before_out is not None and committed_after_out is not None
        assert committed_after_out > committed_before_out

        in_log = tmp_path / "airflow-in.log"
        _run_scale(setup, {**common, "action": "in", "instances": 2}, in_log)
        (in_folder,) = set((setup.keyplane_home / "scale").iterdir()) - {out_folder}
        released = json.loads((in_folder / scale_steps.EXECUTORS).read_text())
        assert released["action"] == "release"
        assert released["executor"] == added["executor"]
        assert released["executors_after"] == added["executors_before"]
        assert _app_executors(master.ui_url) == 1
        committed_after_in = last_commit(settings.checkpoint)
        assert committed_after_in is not None and committed_after_in > committed_after_out

        producer.finish()
        total = sum(high_watermarks(broker, topic_name).values())
        assert total == before.n_events + sum(spec.n_events for spec in producer.specs)
        wait_while_job_runs(lambda: counted(total), "every event", job, job_log, timeout_s=600)
    finally:
        producer.stop.set()
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=120)
        workers.down()
        master.down()
    assert "starting it again from its checkpoint" not in job_log.read_text()
    truth = expected_counts_of((before, *producer.specs))
    report = compare_counts(truth, read_output(settings.output))
    assert report.expected_events == total
    assert report.exact, report
