"""``bench/stack_locality.py``: its verdicts, probes, workloads and streams (pure)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest


@pytest.fixture
def stack_bench(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("stack_locality")


def test_verdict_holds_a_ratio_to_its_goal_in_its_direction_pure(stack_bench: ModuleType) -> None:
    assert stack_bench.verdict(0.25, 0.3, "at most") == "MET"
    assert stack_bench.verdict(0.31, 0.3, "at most") == "NOT MET"
    assert stack_bench.verdict(1.3, 1.3, "at least") == "MET"
    assert stack_bench.verdict(1.29, 1.3, "at least") == "NOT MET"
    with pytest.raises(ValueError, match="direction"):
        stack_bench.verdict(1.0, 1.0, "about")


def test_every_goal_of_the_issue_has_a_direction_pure(stack_bench: ModuleType) -> None:
    assert stack_bench.GOALS == {
        "remote bytes, locality / hash": (0.3, "at most"),
        "throughput, locality / hash": (1.3, "at least"),
        "hot-correlated, keyplane / plain Spark": (1.5, "at least"),
        "uniform, keyplane / plain Spark": (0.9, "at least"),
    }


def test_connect_probe_output_is_read_or_refused_pure(stack_bench: ModuleType) -> None:
    assert stack_bench.connect_rtt_ms("0.853\n") == pytest.approx(0.853)
    assert stack_bench.connect_rtt_ms("") is None
    assert stack_bench.connect_rtt_ms("Traceback ...\nConnectionRefusedError") is None


def test_ratio_cell_is_the_median_of_per_round_ratios_pure(stack_bench: ModuleType) -> None:
    mid, cell = stack_bench.ratio_cell([2.0, 3.0, 1.0], [1.0, 2.0, 1.0])
    assert mid == pytest.approx(1.5)
    assert cell == "**1.50×** (1.00–2.00)"


def test_hot_correlated_workload_is_skewed_and_its_stage_b_key_follows_a_pure(
    stack_bench: ModuleType,
) -> None:
    batch = stack_bench.user_workload("hot-correlated", 20_000, 4_000).events(0, 20_000)
    assert np.array_equal(batch.b, batch.a % 40)
    _, counts = np.unique(batch.a, return_counts=True)
    assert counts.max() > 50 * counts.mean()


def test_uniform_workload_has_no_correlation_to_exploit_pure(stack_bench: ModuleType) -> None:
    batch = stack_bench.user_workload("uniform", 20_000, 4_000).events(0, 20_000)
    pairs = {(int(a), int(b)) for a, b in zip(batch.a, batch.b, strict=True)}
    assert len(pairs) > 19_000
    _, counts = np.unique(batch.a, return_counts=True)
    assert counts.max() < 5 * counts.mean()


def test_locality_streams_split_warm_up_and_measured_events_pure(
    bench_module: Callable[[str], ModuleType],
) -> None:
    locality = bench_module("locality_shuffle")
    warm, measured = locality.streams(12_000, 300, 8_000, "random", "distinct")
    assert (warm.n_events, measured.n_events) == (3_000, 9_000)
    assert warm.seed != measured.seed
    assert (measured.locality, measured.pad_min, measured.pad_max) == (0.8, 8_000, 8_000)
    assert measured.relabel_b
    assert not locality.streams(12_000, 300, 8_000, "random", "shared")[1].relabel_b


def test_exact_cell_names_each_round_and_what_an_inexact_one_got_wrong_pure(
    stack_bench: ModuleType,
) -> None:
    rounds = [
        {"exact": False, "lost": 1_200, "duplicated": 3},
        {"exact": True, "lost": 0, "duplicated": 0},
    ]
    assert stack_bench.exact_cell(rounds) == "1,200 lost, 3 duplicated; exact"
