"""The demo's before/after measurement, its summary table and its set-up (no job).

The demo itself (broker, routed job, ``airflow dags test``) is what
``tests/dags/test_reconfigure_end_to_end.py`` runs under test; here the
figures the summary prints are checked on hand-written metrics records, and
the set-up's failures against a fake broker that only records its calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from keyplane import config as config_store
from keyplane import demo
from keyplane.batchmetrics import BatchMetrics
from keyplane.demo import DemoResult, Migration, measure_phase, run_demo, summary_lines
from keyplane.kafka.broker import BrokerState
from keyplane.orchestration.dagrun import DagRunRecord
from keyplane.settings import Settings
from keyplane.testing import free_port
from keyplane.verification import CountReport
from keyplane.workloads import PairsWorkload


def _batch(
    batch_id: int, version: int, rows: int, rows_per_s: float, a: list[int], lag: int = 0
) -> BatchMetrics:
    return BatchMetrics(
        batch_id=batch_id,
        versions={"A": version, "B": version},
        rows=rows,
        rows_per_s=rows_per_s,
        input_lag=lag,
        load={"A": dict(enumerate(a)), "B": {0: rows, 1: 0}},
        hops=rows,
        local_hops=rows // 2,
    )


RECORDS = [
    _batch(0, 1, 100, 10.0, [50, 50], lag=900),
    _batch(1, 1, 1_000, 500.0, [900, 100], lag=100),
    _batch(2, 1, 1_000, 700.0, [600, 400], lag=300),
    _batch(3, 2, 1_000, 800.0, [500, 500], lag=0),
    BatchMetrics(batch_id=4, versions={"A": 1, "B": 2}, rows=1_000, rows_per_s=1.0),
    _batch(5, 2, 0, 0.0, [0, 0]),
]


def test_measure_phase_rates_full_batches_and_sums_loads_over_the_version() -> None:
    before = measure_phase(RECORDS, 1, full_rows=1_000)
    assert before is not None
    assert (before.version, before.batches, before.rows) == (1, 3, 2_100)
    assert before.rows_per_s == pytest.approx(600.0)
    assert before.lag == pytest.approx(200.0)
    assert before.imbalance["A"] == pytest.approx(1_550 / 1_050)
    assert before.imbalance["B"] == pytest.approx(2.0)
    assert before.locality == pytest.approx(1_050 / 2_100)


def test_measure_phase_without_full_batches_rates_every_batch_and_none_without_rows() -> None:
    after = measure_phase(RECORDS, 2, full_rows=5_000)
    assert after is not None and after.batches == 1 and after.rows_per_s == 800.0
    assert measure_phase(RECORDS, 3, full_rows=1_000) is None


def test_summary_table_shows_before_after_migration_and_the_count_verdict() -> None:
    result = DemoResult(
        events=2_100,
        batches=[],
        report=CountReport(expected_events=2_100, lost=0, duplicated=3, wrong_keys=0),
        wall_s=12.0,
        dag=DagRunRecord(run_id="manual__x", state="success", returncode=0, tasks=[], output=""),
        decision="gain 0.5 repays cost 0.05",
        before=measure_phase(RECORDS, 1, full_rows=1_000),
        after=measure_phase(RECORDS, 2, full_rows=1_000),
        migration=Migration(
            version=2,
            parent=1,
            states_moved=1_234,
            batches=4,
            seconds=9.5,
            predicted_locality=(0.25, 0.9),
            moved_share=0.75,
        ),
    )
    text = "\n".join(summary_lines(result, Path("run")))
    assert "before (v1)" in text and "after (v2)" in text
    assert "0.250         0.900" in text
    assert "600           800" in text
    assert "v1 → v2: 1,234 states moved (75% of key weight), 4 batches" in text
    assert "MISMATCH" in text and "duplicated 3" in text
    assert not result.succeeded


class FakeBroker:
    """An embedded broker that records what the demo asked of it and starts nothing."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.calls: list[str] = []

    def status(self) -> None:
        return None

    def start(self) -> BrokerState:
        self.calls.append("start")
        return BrokerState(pid=4_000_000, port=self.port, storage="memory://tansu/", log="x")

    def stop(self) -> bool:
        self.calls.append("stop")
        return True


@pytest.fixture
def fake_broker(monkeypatch: pytest.MonkeyPatch) -> list[FakeBroker]:
    """The fake brokers the demo made, in order, in place of the embedded broker."""
    made: list[FakeBroker] = []

    def make(home: Path, port: int, **_: object) -> FakeBroker:
        made.append(FakeBroker(port))
        return made[-1]

    monkeypatch.setattr(demo, "EmbeddedBroker", make)
    return made


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_offsets_per_trigger": 0}, ValidationError, "max_offsets_per_trigger"),
        ({"instances": 0}, ValidationError, "parallelism"),
        ({"partitions": 0}, ValueError, "1 partition or more, not 0"),
        ({"rate": 0.0}, ValueError, "rate must be a positive, finite number"),
        ({"rate": float("nan")}, ValueError, "rate must be a positive, finite number"),
    ],
    ids=["max-offsets", "instances", "partitions", "rate-0", "rate-nan"],
)
def test_demo_with_a_bad_option_starts_no_fake_broker_and_creates_no_run_directory(
    tmp_path: Path,
    fake_broker: list[FakeBroker],
    options: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    settings = Settings(home=tmp_path, bootstrap_servers=None, broker_port=free_port())

    with pytest.raises(error, match=message):
        run_demo(PairsWorkload(n_events=10), settings, echo=lambda _: None, **options)

    assert all(broker.calls == [] for broker in fake_broker)
    assert not (tmp_path / "demo").exists()


def test_demo_stops_the_fake_broker_it_started_when_a_later_set_up_step_fails(
    tmp_path: Path, fake_broker: list[FakeBroker], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(config_store, "save", no_space)
    settings = Settings(home=tmp_path, bootstrap_servers=None, broker_port=free_port())

    with pytest.raises(OSError, match="No space left"):
        run_demo(PairsWorkload(n_events=10), settings, echo=lambda _: None)

    assert [broker.calls for broker in fake_broker] == [["start", "stop"]]
