"""A failed micro-batch is replayed by a restart of the query; counts stay exact.

The routed job runs as its own process on the real broker with
``restarts=2``. Stage A's aggregate is
:class:`keyplane.testing.FailsOnceWhenArmed`: after the first batch the test
arms it and rolls a new configuration out, and the next batch fails inside a
Spark task, as a batch fails when the broker never acknowledges its records.
The job starts the query again from its checkpoint in the same session, the
rollout completes and every count equals the generator's ground truth.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from keyplane.control.controller import Controller
from keyplane.control.operators import OPERATORS
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, UnknownVersionError, save
from keyplane.spark.counts_job import (
    QueryRestarts,
    RestartStopped,
    read_output,
)
from keyplane.spark.job_status import read_metrics_topic
from keyplane.testing import (
    FAIL_ONCE_DIR_ENV,
    moved_off_hash_config,
    routed_job_settings,
    start_job_process,
    wait_while_job_runs,
)

P = 4


class _FakeQuery:
    """Stands in for a started query in the pure tests of the restart policy."""


def test_restarts_are_bounded_and_the_last_error_is_raised_with_a_fake_query_pure() -> None:
    restarts = QueryRestarts(restarts=2, delay_s=0)
    started: list[Any] = []

    def start() -> Any:
        started.append(_FakeQuery())
        return started[-1]

    assert restarts.start(start) is started[0]
    assert restarts.after_failure("task failed: one", start) is started[1]
    assert restarts.after_failure("task failed: two", start) is started[2]
    with pytest.raises(RuntimeError, match="streaming query failed: task failed: three"):
        restarts.after_failure("task failed: three", start)
    assert restarts.errors == ["task failed: one", "task failed: two"]
    assert len(started) == 3


def test_a_start_that_fails_uses_a_restart_and_without_one_raises_as_is_pure() -> None:
    attempts: list[int] = []

    def broker_down_once() -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("broker down")
        return _FakeQuery()

    assert isinstance(QueryRestarts(1, 0).start(broker_down_once), _FakeQuery)
    assert len(attempts) == 2
    attempts.clear()
    with pytest.raises(ConnectionError, match="broker down"):
        QueryRestarts(0, 0).start(broker_down_once)


def test_a_start_error_no_wait_can_heal_is_raised_at_once_and_keeps_the_restarts_pure() -> None:
    attempts: list[int] = []

    def unknown_version() -> Any:
        attempts.append(1)
        raise UnknownVersionError("routing version 9 is not in the store")

    restarts = QueryRestarts(3, delay_s=60)
    with pytest.raises(UnknownVersionError, match="version 9"):
        restarts.start(unknown_version)
    assert attempts == [1]
    assert (restarts.left, restarts.errors) == (3, [])


def test_a_stop_while_waiting_to_restart_ends_the_wait_pure() -> None:
    restarts = QueryRestarts(1, delay_s=60, should_stop=lambda: True)
    with pytest.raises(RestartStopped, match="stopped while waiting to restart"):
        restarts.after_failure("task failed", _FakeQuery)


@pytest.mark.integration
def test_a_batch_that_fails_mid_rollout_is_replayed_and_counts_stay_exact(
    broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = "query-restarts"
    spec = ZipfEvolvingWorkload(n_keys=300, exponent=1.2, n_categories=12, n_events=8_000, seed=5)
    assert produce_workload(spec, broker, topic, partitions=2) == spec.n_events
    truth = expected_counts(spec)
    a_keys = truth.loc[truth["stage"] == "A"].nlargest(8, "count")["key"].tolist()
    store = tmp_path / "routing"
    save(RoutingConfig.all_hash(P, OPERATORS), store)
    save(moved_off_hash_config(2, {"A": a_keys, "B": []}, P), store)
    settings = routed_job_settings(
        broker,
        topic,
        tmp_path,
        parallelism=P,
        batch=1_000,
        trigger="1 second",
        version=1,
        stage_a_aggregate="keyplane.testing:FailsOnceWhenArmed",
        restarts=2,
        restart_delay_s=1,
    )
    failure = tmp_path / "failure"
    failure.mkdir()
    monkeypatch.setenv(FAIL_ONCE_DIR_ENV, str(failure))
    log = tmp_path / "job.log"
    job = start_job_process(settings, log)
    try:
        wait_while_job_runs(
            lambda: any(settings.output.glob("batch-*.parquet")), "a first batch", job, log,
            timeout_s=300,
        )  # fmt: skip
        (failure / "armed").touch()
        with ControlChannel(broker, settings.control_topic) as channel:
            controller = Controller(channel, tmp_path / "controller.json", store)
            assert controller.rollout(2, timeout_s=300).version == 2

        def all_counted() -> bool:
            frame = read_output(settings.output)
            return int(frame.loc[frame["stage"] == "A", "count"].sum()) == spec.n_events

        wait_while_job_runs(all_counted, "every event", job, log, timeout_s=300)
        metrics = read_metrics_topic(broker, settings.metrics_topic)
        assert metrics is not None and metrics.latest.versions == {"A": 2, "B": 2}
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert (failure / "fired").exists(), "the injected failure never fired"
    text = log.read_text()
    assert "injected failure of one micro-batch" in text
    assert "starting it again from its checkpoint" in text
    report = compare_counts(truth, read_output(settings.output))
    assert report.exact, report
