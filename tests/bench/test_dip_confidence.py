"""``bench/dip_confidence.py``: the per-run dips it reads and the bound it decides by (pure)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

PLAIN = "throughput dip, switch and install batches, vs the same batches without a rollout"
OWN_PACE = (
    "throughput dip, switch and install batches, each job at its own pace outside the rollout"
)
RESULT = f"""events: ... 3 run(s) of the 2 jobs

| measure | together |
|---|---:|
| {PLAIN} | **11%** (-11%, 20%, 24%) |
| {OWN_PACE} | **7%** (−1%, 14%, 9%) |
| counts exact | True / True / True |
"""


@pytest.fixture
def dips(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("dip_confidence")


def test_each_runs_value_is_read_not_the_pooled_one_pure(dips: ModuleType) -> None:
    assert dips.run_values(RESULT, dips.OWN_PACE) == [-1.0, 14.0, 9.0]
    assert dips.OWN_PACE == OWN_PACE
    assert dips.run_values(RESULT, PLAIN) == [-11.0, 20.0, 24.0]


def test_a_single_runs_file_gives_its_one_value_pure(dips: ModuleType) -> None:
    single = f"| {dips.OWN_PACE} | **12%** |\n"
    assert dips.run_values(single, dips.OWN_PACE) == [12.0]


def test_a_missing_measure_is_a_clear_error_pure(dips: ModuleType) -> None:
    with pytest.raises(ValueError, match="no row 'rows per second'"):
        dips.run_values(RESULT, "rows per second")


def test_the_upper_bound_is_the_mean_plus_t_standard_errors_pure(dips: ModuleType) -> None:
    # Two runs, 0 and 10: mean 5, sd 7.071, t(0.95, 1 df) = 6.3138.
    assert dips.upper_bound([0.0, 10.0], 0.95) == pytest.approx(5 + 6.3138 * 5.0, abs=1e-3)
    with pytest.raises(ValueError, match="needs at least two runs"):
        dips.upper_bound([3.0], 0.95)


def test_the_verdict_follows_the_bound_not_the_mean_pure(dips: ModuleType, tmp_path: Path) -> None:
    tight = tmp_path / "tight.md"
    tight.write_text(f"| {dips.OWN_PACE} | **8%** (7%, 8%, 9%, 8%) |\n")
    wide = tmp_path / "wide.md"
    wide.write_text(f"| {dips.OWN_PACE} | **8%** (-10%, 26%, 0%, 16%) |\n")
    assert dips.report([tight], dips.OWN_PACE, 0.95, 10.0).rstrip().endswith("| met |")
    assert dips.report([wide], dips.OWN_PACE, 0.95, 10.0).rstrip().endswith("| not shown |")
    # Runs from several files pool.
    assert "| 8 |" in dips.report([tight, wide], dips.OWN_PACE, 0.95, 10.0)
