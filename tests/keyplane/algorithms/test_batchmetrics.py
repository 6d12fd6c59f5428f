"""Per-batch metrics from the routed job's traffic rows (pure pandas)."""

from __future__ import annotations

import pandas as pd

from keyplane.algorithms.batchmetrics import (
    BatchMetrics,
    combined_metrics,
    traffic_metrics,
)


def _hop(upstream: int, up_ex: str, instance: int, ex: str, n: int) -> dict:
    return {
        "kind": "hop",
        "upstream": upstream,
        "upstream_executor": up_ex,
        "instance": instance,
        "executor": ex,
        "n": n,
    }


def test_loads_locality_and_top_pairs_from_hand_made_rows_pure() -> None:
    rows = pd.DataFrame(
        [
            _hop(0, "e1", 0, "e1", 30),  # local
            _hop(1, "e2", 0, "e1", 10),  # crosses executors
            _hop(1, "e2", 2, "e2", 20),  # local
            {"kind": "pair", "key": "b1", "detail": "a1", "instance": 0, "n": 25},
            {"kind": "pair", "key": "b2", "detail": "a9", "instance": 0, "n": 40},
            {"kind": "moved"},
            {"kind": "moves", "count": 250},  # a packed migration record of the JVM stages
            {"kind": "invalid"},
            {"kind": "invalid"},
        ]
    )
    metrics = traffic_metrics(7, rows, {"A": 3, "B": 3})
    assert metrics.load == {"A": {0: 30, 1: 30, 2: 0}, "B": {0: 40, 1: 0, 2: 20}}
    assert metrics.executors == {"A": {0: "e1", 1: "e2"}, "B": {0: "e1", 2: "e2"}}
    assert (metrics.hops, metrics.local_hops) == (60, 50)
    assert metrics.locality == 50 / 60
    # Idle instances count in the mean, as in paper 000's imbalance.
    assert metrics.imbalance("B") == 40 / 20
    assert [(p.a, p.b, p.n) for p in metrics.top_pairs[0]] == [("a9", "b2", 40), ("a1", "b1", 25)]
    assert (metrics.moved_states, metrics.invalid_events) == (251, 2)


def test_an_empty_batch_has_no_locality_and_no_imbalance_pure() -> None:
    columns = ["kind", "key", "instance", "upstream", "executor", "upstream_executor", "n"]
    metrics = traffic_metrics(0, pd.DataFrame(columns=[*columns, "detail"]), {"A": 2, "B": 2})
    assert metrics.locality is None
    assert metrics.imbalance("A") is None


def test_hops_of_a_three_stage_chain_load_the_stage_pair_they_name_pure() -> None:
    """A hop names its downstream stage; its upstream is the stage before in the chain. A
    middle stage's load is what reaches it, not also what leaves it."""
    rows = pd.DataFrame(
        [
            {**_hop(0, "e1", 1, "e2", 5), "stage": "users"},
            {**_hop(1, "e2", 0, "e1", 7), "stage": "pages"},
        ]
    )
    metrics = traffic_metrics(3, rows, {"sessions": 2, "users": 2, "pages": 2})
    assert metrics.load == {
        "sessions": {0: 5, 1: 0},
        "users": {0: 0, 1: 5},
        "pages": {0: 7, 1: 0},
    }
    assert metrics.executors == {"sessions": {0: "e1"}, "users": {1: "e2"}, "pages": {0: "e1"}}
    assert metrics.imbalance("users") == 2.0
    assert (metrics.hops, metrics.local_hops) == (12, 0)


def test_busy_time_sums_each_stages_count_rows_per_instance_pure() -> None:
    """``busy_ns`` on ``count`` rows adds up per stage and instance, every instance of a
    timed stage listed (0 when idle); a stage whose rows carry no time (the JVM stages) and
    tombstones (no instance) are left out."""
    rows = pd.DataFrame(
        [
            _hop(0, "e1", 1, "e1", 4),
            {"kind": "count", "stage": "A", "instance": 0, "busy_ns": 2_000_000},
            {"kind": "count", "stage": "A", "instance": 0, "busy_ns": 500_000},
            {"kind": "count", "stage": "B", "instance": 1, "busy_ns": 9_000_000},
            {"kind": "count", "stage": "B", "instance": None, "busy_ns": None},  # a tombstone
            {"kind": "count", "stage": "C", "instance": 0, "busy_ns": None},  # untimed
            {"kind": "pair", "key": "b1", "detail": "a1", "instance": 1, "n": 4},
        ]
    )
    metrics = traffic_metrics(1, rows, {"A": 2, "B": 2, "C": 2})
    assert metrics.busy_ms == {"A": {0: 2.5, 1: 0.0}, "B": {0: 0.0, 1: 9.0}}
    # Rows without the column (older stages' output) measure no time.
    assert traffic_metrics(1, rows.drop(columns="busy_ns"), {"A": 2, "B": 2}).busy_ms == {}


def test_the_parts_of_a_batch_combine_to_the_metrics_of_the_whole_batch_pure() -> None:
    """The sink's tasks each measure their rows; adding the parts up on the driver gives what
    the whole output gives: loads, executors, busy times, hops, moves, dead letters, and each
    instance's heaviest pairs across parts."""
    rows = pd.DataFrame(
        [
            _hop(0, "e1", 0, "e1", 30),
            _hop(1, "e2", 0, "e1", 10),
            _hop(1, "e2", 2, "e2", 20),
            {"kind": "pair", "key": "b1", "detail": "a1", "instance": 0, "n": 25},
            {"kind": "pair", "key": "b2", "detail": "a9", "instance": 0, "n": 40},
            *(
                {"kind": "pair", "key": f"c{i}", "detail": "a2", "instance": 0, "n": i}
                for i in range(6)
            ),
            {"kind": "pair", "key": "b3", "detail": "a3", "instance": 2, "n": 7},
            {"kind": "count", "stage": "A", "instance": 0, "busy_ns": 2_000_000},
            {"kind": "count", "stage": "A", "instance": 1, "busy_ns": 1_000_000},
            {"kind": "moved"},
            {"kind": "moves", "count": 250},
            {"kind": "invalid"},
        ]
    )
    parallelism = {"A": 3, "B": 3}
    whole = traffic_metrics(4, rows, parallelism)
    # Any split of the rows: here the odd and the even rows, and a third part left empty.
    parts = [
        traffic_metrics(4, part.reset_index(drop=True), parallelism)
        for part in (rows.iloc[0::2], rows.iloc[1::2], rows.iloc[0:0])
    ]
    combined = combined_metrics(4, parts, parallelism)
    assert combined.model_dump(exclude={"top_pairs"}) == whole.model_dump(exclude={"top_pairs"})

    def pairs(metrics: BatchMetrics) -> dict[int, list[tuple[str, str, int]]]:
        return {i: sorted((p.a, p.b, p.n) for p in top) for i, top in metrics.top_pairs.items()}

    assert pairs(combined) == pairs(whole)
    assert [p.n for p in combined.top_pairs[0]] == [40, 25, 5, 4, 3]
    # A batch of no parts (no rows at all) is an empty batch with every instance idle.
    empty = combined_metrics(5, [], parallelism)
    assert empty.load == {"A": {0: 0, 1: 0, 2: 0}, "B": {0: 0, 1: 0, 2: 0}}
    assert (empty.hops, empty.moved_states, empty.busy_ms) == (0, 0, {})
