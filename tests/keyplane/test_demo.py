"""The demo: ``make demo``'s code path end to end, and its pure parts on their own.

The end-to-end test runs :func:`run_demo` as ``make demo`` does, smaller: the
real embedded broker, the routed job on two executors, a real ``airflow dags
test`` run. It then reads the job's metrics topic itself and checks that every
number of the summary's before/after table comes from those records, over
the same number of events on both versions, and that every count is exact.
The unit tests check the phase selection and the table on hand-written
records, and the set-up's failures against a fake broker that only records
its calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from keyplane import demo
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.demo import (
    DemoResult,
    Migration,
    compare_phases,
    gain_line,
    measure_phase,
    phase_candidates,
    run_demo,
    summary_lines,
)
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.broker import BrokerState
from keyplane.kafka.metrics_topic import read_metrics
from keyplane.orchestration.dagrun import DagRunRecord
from keyplane.reference.verification import CountReport
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing import config as config_store
from keyplane.settings import Settings
from keyplane.testing import free_port


def _batch(
    batch_id: int, version: int, rows: int, duration_ms: int, a: list[int], lag: int = 0
) -> BatchMetrics:
    return BatchMetrics(
        batch_id=batch_id,
        versions={"A": version, "B": version},
        rows=rows,
        rows_per_s=rows / duration_ms * 1000 if duration_ms else 0.0,
        duration_ms=duration_ms,
        input_lag=lag,
        load={"A": dict(enumerate(a)), "B": {0: rows, 1: 0}},
        hops=rows,
        local_hops=rows // 2,
    )


RECORDS = [
    _batch(0, 1, 1_000, 4_000, [500, 500], lag=900),
    _batch(1, 1, 1_000, 2_000, [900, 100], lag=100),
    _batch(2, 1, 1_000, 1_000, [600, 400], lag=300),
    _batch(3, 1, 100, 1_000, [50, 50]),
    BatchMetrics(batch_id=4, versions={"A": 1, "B": 2}, rows=1_000, duration_ms=1_000),
    _batch(5, 2, 0, 0, [0, 0]),
    _batch(6, 2, 1_000, 500, [500, 500], lag=0),
    _batch(7, 2, 1_000, 500, [500, 500], lag=0),
    _batch(8, 2, 1_000, 400, [500, 500], lag=0),
]


def test_unit_phase_candidates_are_full_batches_of_one_version_after_the_warm_up() -> None:
    before = phase_candidates(RECORDS, 1, full_rows=1_000, batch_ids=range(1, 6))
    after = phase_candidates(RECORDS, 2, full_rows=1_000, batch_ids=range(6, 100))
    assert [r.batch_id for r in before] == [1, 2]
    assert [r.batch_id for r in after] == [6, 7, 8]


def test_unit_compare_phases_measures_both_versions_over_the_same_number_of_batches() -> None:
    before, after = compare_phases(
        phase_candidates(RECORDS, 1, 1_000, range(1, 6)),
        phase_candidates(RECORDS, 2, 1_000, range(6, 100)),
        (1, 2),
    )
    assert before is not None and after is not None
    assert (before.batch_ids, after.batch_ids) == ((1, 2), (6, 7))
    assert after.locality == pytest.approx(0.5)
    assert before.rows == after.rows == 2_000
    assert before.rows_per_s == pytest.approx(2_000 / 3.0)
    assert after.rows_per_s == pytest.approx(2_000 / 1.0)
    assert before.imbalance["A"] == pytest.approx(1_500 / 1_000)
    assert before.imbalance["B"] == pytest.approx(2.0)
    assert before.locality == pytest.approx(0.5)
    assert gain_line(before, after).startswith(
        "none from routing: 3.00× the rows/s of v1, but executor locality 0.500 → 0.500 "
        "did not rise"
    )


def test_unit_gain_line_gives_the_gain_only_with_a_locality_that_rose_and_else_says_none() -> None:
    slow = measure_phase(1, [RECORDS[2]])
    same = measure_phase(2, [_batch(9, 2, 1_000, 1_020, [500, 500])])
    local = _batch(10, 2, 1_000, 500, [500, 500]).model_copy(update={"local_hops": 900})
    assert gain_line(slow, same).startswith("none: 0.98× the rows/s of v1")
    assert gain_line(slow, measure_phase(2, [local])) == (
        "2.00× the rows/s of v1, executor locality 0.500 → 0.900"
    )
    assert gain_line(slow, None).startswith("not measured")
    assert compare_phases(RECORDS[:2], [], (1, 2)) == (None, None)


def test_unit_summary_table_shows_both_phases_the_migration_and_the_count_verdict() -> None:
    before, after = compare_phases(
        phase_candidates(RECORDS, 1, 1_000, range(1, 6)),
        phase_candidates(RECORDS, 2, 1_000, range(6, 100)),
        (1, 2),
    )
    result = DemoResult(
        events=2_100,
        batches=[],
        report=CountReport(expected_events=2_100, lost=0, duplicated=3, wrong_keys=0),
        wall_s=12.0,
        dag=DagRunRecord(run_id="manual__x", state="success", returncode=0, tasks=[], output=""),
        decision="gain 0.5 repays cost 0.05",
        before=before,
        after=after,
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
    assert "1-2           6-7" in text
    assert "667         2,000" in text
    assert "gain                  none from routing: 3.00× the rows/s of v1" in text
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
        ({"warmup_batches": 1}, ValueError, "larger than the warm-up"),
    ],
    ids=["max-offsets", "instances", "partitions", "rate-0", "rate-nan", "warm-up"],
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
        run_demo(
            PairsWorkload(n_events=10),
            settings,
            echo=lambda _: None,
            **{"warmup_batches": 0, **options},
        )

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
        run_demo(PairsWorkload(n_events=10), settings, warmup_batches=0, echo=lambda _: None)

    assert [broker.calls for broker in fake_broker] == [["start", "stop"]]


def _table(lines: list[str]) -> dict[str, tuple[str, str]]:
    """The summary's before/after rows: label → (before, after), as printed."""
    rows: dict[str, tuple[str, str]] = {}
    for line in lines:
        parts = line.strip().rsplit(maxsplit=2)
        if line.startswith("  ") and len(parts) == 3 and "  " in line.strip():
            rows[parts[0].strip()] = (parts[1], parts[2])
    return rows


@pytest.mark.integration
def test_make_demo_path_end_to_end_summary_numbers_come_from_the_runs_metrics(
    tmp_path: Path, broker: str
) -> None:
    """``make demo``'s code path, smaller: every figure of the table is recomputed here from
    the metrics topic, and the counts are exact."""
    lines: list[str] = []
    settings = Settings(home=tmp_path, bootstrap_servers=broker)
    max_offsets = 2_000
    result = run_demo(
        PairsWorkload(n_events=30_000, n_keys=200, locality=0.9, relabel_b=True, seed=7),
        settings,
        rate=None,
        max_offsets_per_trigger=max_offsets,
        warmup_batches=2,
        echo=lines.append,
    )

    assert result.dag.state == "success", result.dag.output[-3_000:]
    assert result.report.exact
    assert (result.report.lost, result.report.duplicated, result.report.wrong_keys) == (0, 0, 0)
    (run_dir,) = (tmp_path / "demo").iterdir()
    topic = f"{settings.events_topic}.demo-{run_dir.name}"
    events = sum(high_watermarks(broker, topic).values())
    assert result.events == events >= 30_000
    assert result.batches[-1].committed == events

    metrics_topic = f"{topic}.metrics"
    end = high_watermarks(broker, metrics_topic)
    records = {
        r.metrics.batch_id: r.metrics
        for r in read_metrics(broker, metrics_topic, dict.fromkeys(end, 0), end)
    }
    before, after = result.before, result.after
    assert before is not None and after is not None and result.migration is not None
    assert (before.version, after.version) == (1, result.migration.version)
    assert before.batches == after.batches >= 1
    assert max(before.batch_ids) < min(after.batch_ids)
    # Not the warm-up's batches: they committed the first 2 × max_offsets offsets.
    warm = [p.batch_id for p in result.batches if p.committed <= 2 * max_offsets]
    assert min(before.batch_ids) > max(warm)

    table = _table(summary_lines(result, run_dir))
    assert table == _table(lines[-len(summary_lines(result, run_dir)) :])
    for column, phase in enumerate((before, after)):
        batches = [records[i] for i in phase.batch_ids]
        assert all(set(r.versions.values()) == {phase.version} for r in batches)
        assert all(r.rows >= max_offsets for r in batches)
        rows = sum(r.rows for r in batches)
        seconds = sum(r.duration_ms for r in batches) / 1000
        hops = sum(r.hops for r in batches)
        local = sum(r.local_hops for r in batches)
        ids = f"{phase.batch_ids[0]}-{phase.batch_ids[-1]}"
        assert table["batches measured (ids)"][column] == ids
        assert table["rows measured"][column] == f"{rows:,}"
        assert table["seconds (sum of batch durations)"][column] == f"{seconds:,.1f}"
        assert table["rows/s"][column] == f"{rows / seconds:,.0f}"
        assert table["locality, executors (measured)"][column] == f"{local / hops:.3f}"
    # Same number of events on both sides: full batches hold max_offsets offsets each.
    assert table["rows measured"][0] == table["rows measured"][1]
    # Two executors: the run saw both, so locality is measured, not 1.000 by construction.
    seen = {e for r in records.values() for per in r.executors.values() for e in per.values()}
    assert len(seen) == 2, seen
    gain = next(line for line in lines if line.startswith("  gain "))
    assert after.rows_per_s is not None and before.rows_per_s is not None
    assert after.locality is not None and before.locality is not None
    ratio = after.rows_per_s / before.rows_per_s
    assert f"{ratio:.2f}× the rows/s of v1" in gain
    rose = after.locality - before.locality >= demo.LOCALITY_THRESHOLD
    faster = ratio > 1 + demo.GAIN_THRESHOLD
    assert gain.startswith("  gain                  none") == (not (rose and faster))
    assert "EXACT" in next(line for line in lines if "counts vs truth" in line)
