"""A KEYPLANE_HOME filled by the real components, cheaply, for the dashboard's tests.

No Spark job runs: the orchestration end-to-end test covers that. Instead the
records the dashboard reads are produced by the code that produces them in
production:

* a statistics snapshot built by :func:`keyplane.algorithms.statistics.build_snapshot`
  from a small skewed window (one stage-A key carries about 40 % of the tuples,
  more than α × an instance's share, so the plan splits it);
* the DAG's own steps (the ``keyplane.orchestration`` step modules): validate the
  statistics and the configuration with Great Expectations (real Data Docs),
  plan v2 from v1 with METIS and FISH (stored by ``keyplane.routing.config.save``),
  backtest and decide;
* a real rollout of v2 by :class:`keyplane.control.controller.Controller` over the
  embedded broker's control topic, answered by
  :class:`keyplane.testing.ProtocolOnlyJob` (the job's real protocol without
  Spark), which leaves the controller's state file with its timings;
* BatchMetrics records on the metrics topic, written with keyplane's
  producer: batches on v1, two mid-migration batches, batches on v2.

:class:`MeteredProtocolJob` then stands in for the running job while a DAG
run rolls a version out.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from keyplane.algorithms.batchmetrics import BatchMetrics, PairCount
from keyplane.control.operators import OPERATORS
from keyplane.orchestration import configuration_steps, decision_steps, planning, statistics_steps
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig

P = 4
RUN = "scheduled__2026-11-03T12:00:00+00:00"
CONTROL_KEY = "dashboard-tests-key-0123456789abcdef"
HOT_KEY = "7"


@dataclass(frozen=True)
class PreparedHome:
    """The filled home and what a test needs to point the dashboard at it."""

    deployment: Deployment
    metrics_topic: str
    bootstrap_servers: str
    batches: int

    def environment(self) -> dict[str, str]:
        """The ``KEYPLANE_*`` variables under which the dashboard reads this home."""
        return {
            "KEYPLANE_HOME": str(self.deployment.home),
            "KEYPLANE_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "KEYPLANE_METRICS_TOPIC": self.metrics_topic,
            "KEYPLANE_CONTROL_TOPIC": self.deployment.control_topic,
            "KEYPLANE_CONTROL_KEY": CONTROL_KEY,
        }


def _batch(batch_id: int, versions: dict[str, int], locality: float, skew: float) -> BatchMetrics:
    """One batch of 4 000 A→B tuples; ``skew`` is the share instance 0 carries on top of even."""
    base = 1000
    load = {op: {i: base for i in range(P)} for op in OPERATORS}
    load["A"][0] = int(base * (1 + skew))
    hops = sum(load["A"].values())
    return BatchMetrics(
        batch_id=batch_id,
        # The last 20 batches, 5 s apart, ending now: inside the page's default time range.
        started_at=datetime.now(UTC) - timedelta(seconds=5 * (20 - batch_id)),
        versions=versions,
        rows=hops,
        rows_per_s=hops / 0.8 * (1 + 0.1 * (batch_id % 3)),
        duration_ms=800,
        input_lag=max(0, 3000 - 150 * batch_id),
        load=load,
        executors={op: {i: f"exec-{i % 2}" for i in range(P)} for op in OPERATORS},
        hops=hops,
        local_hops=int(hops * locality),
        top_pairs={0: [PairCount(a=HOT_KEY, b="1007", n=400)]},
    )


def metrics_records() -> list[BatchMetrics]:
    """Batches 0–7 on v1, 8–9 mid-migration (A on v2, B on v1), 10–19 on v2."""
    records = [_batch(i, {"A": 1, "B": 1}, 0.3 + 0.01 * i, 0.9) for i in range(8)]
    records += [_batch(i, {"A": 2, "B": 1}, 0.4, 0.6) for i in (8, 9)]
    records += [_batch(i, {"A": 2, "B": 2}, 0.75 + 0.005 * i, 0.05) for i in range(10, 20)]
    return records


def prepare_home(home: Path, bootstrap_servers: str) -> PreparedHome:
    from keyplane.control.controller import Controller
    from keyplane.kafka.admin import ensure_topic
    from keyplane.kafka.control import ControlChannel
    from keyplane.kafka.producer import make_producer
    from keyplane.testing import (
        ProtocolOnlyJob,
        deployment_under,
        paired_tuple_counts,
        write_statistics_snapshot,
    )

    suffix = home.name.replace("_", "-")
    deployment = deployment_under(home, bootstrap_servers, f"dash-{suffix}.")
    config_store.save(
        RoutingConfig.all_hash(P, OPERATORS),
        deployment.routing_store,
    )
    write_statistics_snapshot(deployment.snapshots, RUN, paired_tuple_counts(48, 5, {HOT_KEY: 30}))
    statistics_steps.validate_statistics(deployment, RUN, min_total_count=1_000)
    proposal = configuration_steps.compute_configuration(
        deployment, RUN, planning.PlanParams(alpha=1.1)
    )
    assert proposal["version"] == 2, proposal
    assert configuration_steps.validate_configuration(deployment, RUN)["success"]
    decision_steps.backtest(deployment, RUN)
    decision = decision_steps.decide(
        deployment, RUN, planning.DecisionRule(force=True), dry_run=False
    )
    assert decision["publish"], decision

    previous_key = os.environ.get("KEYPLANE_CONTROL_KEY")
    os.environ["KEYPLANE_CONTROL_KEY"] = CONTROL_KEY
    try:
        job_channel = ControlChannel(bootstrap_servers, deployment.control_topic, key=CONTROL_KEY)
        job_channel.ensure()
        with (
            ProtocolOnlyJob(job_channel, deployment.routing_store, OPERATORS, 1),
            ControlChannel(bootstrap_servers, deployment.control_topic, key=CONTROL_KEY) as ours,
        ):
            Controller(ours, deployment.controller_state, deployment.routing_store).rollout(
                2, timeout_s=30
            )
        job_channel.close()
    finally:
        if previous_key is None:
            os.environ.pop("KEYPLANE_CONTROL_KEY", None)
        else:
            os.environ["KEYPLANE_CONTROL_KEY"] = previous_key

    records = metrics_records()
    ensure_topic(bootstrap_servers, deployment.metrics_topic, 1)
    producer = make_producer(bootstrap_servers)
    try:
        for record in records:
            producer.send(deployment.metrics_topic, value=record.model_dump_json().encode())
        producer.flush(timeout=30)
    finally:
        producer.close()
    return PreparedHome(deployment, deployment.metrics_topic, bootstrap_servers, len(records))


class MeteredProtocolJob:
    """The job's protocol and metrics, without Spark: what a DAG run needs from a job.

    :class:`keyplane.testing.ProtocolOnlyJob` answers the rollout (ACK, and
    MIGRATED for each stage) over the real control topic; a second thread
    writes one :class:`BatchMetrics` record a second to the metrics topic,
    each stage on the version the protocol routes it with, so that the run's
    ``await_new_version_batches`` and ``verify`` read real records of the
    new version. Even loads, a fixed locality: the figures are not under test.
    """

    def __init__(self, prepared: PreparedHome, active_version: int) -> None:
        self.prepared = prepared
        self.active_version = active_version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, name="metrics-writer", daemon=True)
        self._job: Any = None
        self._error: BaseException | None = None

    def __enter__(self) -> MeteredProtocolJob:
        from keyplane.kafka.control import ControlChannel
        from keyplane.testing import ProtocolOnlyJob

        deployment = self.prepared.deployment
        channel = ControlChannel(
            self.prepared.bootstrap_servers, deployment.control_topic, key=CONTROL_KEY
        )
        channel.ensure()
        self._job = ProtocolOnlyJob(
            channel, deployment.routing_store, OPERATORS, self.active_version, batch_interval_s=0.5
        ).__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._job.__exit__(None, None, None)
        if self._error is not None:
            raise AssertionError("the metrics writer failed") from self._error

    def _write(self) -> None:
        from keyplane.kafka.producer import make_producer

        producer = make_producer(self.prepared.bootstrap_servers)
        batch = 1000
        try:
            while not self._stop.is_set():
                state = self._job.state
                versions = {
                    op: state.routes[op][-1][1] if state.routes.get(op) else state.active_version
                    for op in OPERATORS
                }
                load = {op: dict.fromkeys(range(P), 1000) for op in OPERATORS}
                record = BatchMetrics(
                    batch_id=batch,
                    started_at=datetime.now(UTC),
                    versions=versions,
                    rows=4000,
                    rows_per_s=5000.0,
                    duration_ms=800,
                    input_lag=100,
                    load=load,
                    hops=4000,
                    local_hops=3200,
                )
                producer.send(self.prepared.metrics_topic, value=record.model_dump_json().encode())
                producer.flush(timeout=10)
                batch += 1
                self._stop.wait(1.0)
        except BaseException as error:
            self._error = error
        finally:
            producer.close()
