"""``bench/scale_out.py``: the round-robin choice, the phase rates, the first batch on the new
executor and the starting configuration (pure, no Spark, no cluster)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.spark.counts_job import BatchProgress


@pytest.fixture
def scale_bench(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("scale_out")


def test_round_robin_grows_stages_in_chain_order_from_the_first_pure(
    scale_bench: ModuleType,
) -> None:
    chosen = [scale_bench.round_robin_stage(("A", "B", "C"), grown) for grown in range(7)]
    assert chosen == ["A", "B", "C", "A", "B", "C", "A"]
    assert scale_bench.round_robin_stage(("A", "B"), 0) == "A"
    with pytest.raises(ValueError, match="at least one stage"):
        scale_bench.round_robin_stage((), 0)
    with pytest.raises(ValueError, match="at least 0"):
        scale_bench.round_robin_stage(("A",), -1)


def _batch(batch_id: int, rows: int, duration_ms: int) -> BatchProgress:
    return BatchProgress(
        batch_id=batch_id, rows=rows, rows_per_s=0.0, duration_ms=duration_ms, lag=0, committed=0
    )


def test_phase_rate_is_rows_over_summed_durations_not_a_mean_of_rates_pure(
    scale_bench: ModuleType,
) -> None:
    batches = [_batch(1, 1000, 1000), _batch(2, 1000, 3000)]
    assert scale_bench.phase_rate(batches) == pytest.approx(500.0)
    with pytest.raises(ValueError, match="no timed batches"):
        scale_bench.phase_rate([])
    with pytest.raises(ValueError, match="no timed batches"):
        scale_bench.phase_rate([_batch(1, 10, 0)])


def _metrics(batch_id: int, labels: dict[str, dict[int, str]]) -> BatchMetrics:
    return BatchMetrics(batch_id=batch_id, executors=labels)


def test_first_batch_on_the_new_executor_counts_from_the_decision_pure(
    scale_bench: ModuleType,
) -> None:
    timed = [
        (_metrics(9, {"A": {0: "10.55.0.4:2"}}), 90.0),  # before the decision: ignored
        (_metrics(12, {"A": {0: "10.55.0.2:0"}, "B": {1: "10.55.0.3:1"}}), 112.0),
        (_metrics(14, {"B": {2: "10.55.0.4:2"}}), 130.5),
        (_metrics(13, {"A": {1: "10.55.0.4:2"}}), 121.0),
    ]
    assert scale_bench.first_batch_on(timed, "2", 100.0) == pytest.approx(21.0)
    assert scale_bench.first_batch_on(timed, "7", 100.0) is None
    # An executor id is matched whole, not as the tail of another one's.
    assert scale_bench.first_batch_on([(_metrics(1, {"A": {0: "h:12"}}), 5.0)], "2", 0.0) is None


def test_both_stages_start_hashed_over_the_same_two_of_four_instances_pure(
    scale_bench: ModuleType,
) -> None:
    config = scale_bench.starting_config()
    assert config.version == 1
    assert {name: list(r.active) for name, r in config.operators.items()} == {
        "A": [0, 1],
        "B": [0, 1],
    }
    assert {r.parallelism for r in config.operators.values()} == {4}
