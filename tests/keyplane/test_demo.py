"""The demo's before/after measurement and its summary table (pure logic, no job).

The demo itself (broker, routed job, ``airflow dags test``) is what
``tests/dags/test_reconfigure_end_to_end.py`` runs under test; here the
figures the summary prints are checked on hand-written metrics records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.batchmetrics import BatchMetrics
from keyplane.demo import DemoResult, Migration, measure_phase, summary_lines
from keyplane.orchestration.dagrun import DagRunRecord
from keyplane.verification import CountReport


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
