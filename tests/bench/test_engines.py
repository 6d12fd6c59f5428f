"""``bench/engines.py``: how its runs are summarised and compared (pure)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def engines(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("engines")


def test_spread_is_median_min_and_max_pure(engines: ModuleType) -> None:
    assert engines.spread([3.0, 1.0, 10.0, 2.0, 4.0]) == (3.0, 1.0, 10.0)
    assert engines.spread([2.0, 4.0]) == (3.0, 2.0, 4.0)


def test_spread_of_nothing_is_a_clear_error_pure(engines: ModuleType) -> None:
    with pytest.raises(ValueError, match="no values"):
        engines.spread([])


def test_spread_cell_formats_median_then_range_pure(engines: ModuleType) -> None:
    assert engines.spread_cell([12_000.4, 9_000.0, 15_500.0], ",.0f") == "12,000 (9,000–15,500)"


def test_ratios_pair_each_run_with_the_run_it_took_turns_with_pure(engines: ModuleType) -> None:
    assert engines.ratios([8.0, 9.0, 6.0], [10.0, 9.0, 12.0]) == [0.8, 1.0, 0.5]
    with pytest.raises(ValueError):
        engines.ratios([1.0, 2.0], [1.0])


def test_runs_line_lists_every_run_of_every_variant_in_order_pure(engines: ModuleType) -> None:
    line = engines.runs_line({"plain-spark": [9_071.2, 11_512.0], "routed-v1": [6_134.0]})
    assert line == "runs (rows/s): plain-spark 9,071, 11,512; routed-v1 6,134"
