"""``bench/overhead_confidence.py``: the per-run ratios it reads, the rule it decides by (pure)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

RESULT = """events: 1,000,000 geo-tags (2,000 tags), 50,000 per micro-batch, local[2], 3 run(s)

| pipeline | batches per run | median batch s | steady rows/s | vs plain Spark (runs) |
|---|---:|---:|---:|---:|
| native-counts | 20 | 1.4 | 33,979 | **1.00** (1.00, 1.00, 1.00) |
| routed | 20 | 1.5 | 32,731 | **0.96** (1.01, 0.89, 1.01) |
| routed-checkout | 20 | 1.5 | 31,002 | **0.91** (0.93, 0.84, 0.96) |

routed / plain Spark: **0.96**
"""


@pytest.fixture
def overhead(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("overhead_confidence")


def test_each_runs_ratio_is_read_not_the_pooled_one_pure(overhead: ModuleType) -> None:
    assert overhead.run_ratios(RESULT, "routed") == [1.01, 0.89, 1.01]
    assert overhead.run_ratios(RESULT, "routed-checkout") == [0.93, 0.84, 0.96]
    assert overhead.run_ratios("| routed | 20 | 1.1 | 43,240 | **0.98** |\n", "routed") == [0.98]


def test_a_missing_variant_is_a_clear_error_pure(overhead: ModuleType) -> None:
    with pytest.raises(ValueError, match="no row 'routed-python'"):
        overhead.run_ratios(RESULT, "routed-python")


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ("0.97, 0.96, 0.98, 0.97", "met"),  # the bound clears the goal
        ("1.20, 0.70, 1.10, 0.72", "at its edge"),  # the mean does, the bound does not
        ("0.89, 0.88, 0.90, 0.89", "not met"),
    ],
)
def test_the_verdict_follows_the_bound_then_the_mean_pure(
    overhead: ModuleType, tmp_path: Path, runs: str, expected: str
) -> None:
    result = tmp_path / "result.md"
    result.write_text(f"| routed | 20 | 1.1 | 43,240 | **0.9** ({runs}) |\n")
    assert overhead.report([result], "routed", 0.95, 0.9).rstrip().endswith(f"| {expected} |")


def test_runs_from_several_files_pool_and_the_bound_is_t_standard_errors_pure(
    overhead: ModuleType, tmp_path: Path
) -> None:
    first, second = tmp_path / "1.md", tmp_path / "2.md"
    first.write_text("| routed | 20 | 1.1 | 1 | **0.9** (0.80) |\n")
    second.write_text("| routed | 20 | 1.1 | 1 | **1.0** (1.00) |\n")
    # Two runs, 0.8 and 1.0: mean 0.9, sd 0.1414, t(0.95, 1 df) = 6.3138, se 0.1.
    line = overhead.report([first, second], "routed", 0.95, 0.9).splitlines()[-1]
    assert line.startswith("| 2 | 0.80, 1.00 | 0.900 | 0.141 | ")
    assert float(line.split("|")[5]) == pytest.approx(0.9 - 0.63138, abs=1e-3)
