"""The hot-key benchmark's ``CostlyCount`` (``bench/_costly_aggregate.py``): pure, no Spark.

The benchmark's p99 figures rest on it counting exactly like the reference
count and obeying the laws a routed stage relies on (it is split and merged
like any user aggregate), while spending the configured work per tuple.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from types import ModuleType

import pytest

from keyplane.aggregates import RunningCount, load_aggregate
from keyplane.testing import check_aggregate_laws


@pytest.fixture
def costly(
    monkeypatch: pytest.MonkeyPatch, bench_module: Callable[[str], ModuleType]
) -> ModuleType:
    """The module, imported from ``bench/`` as the job imports it (by its spec's name)."""
    monkeypatch.setenv("KEYPLANE_BENCH_TUPLE_WORK", "3")
    return bench_module("_costly_aggregate")


def test_costly_count_loads_by_its_spec_and_counts_like_the_running_count_pure(
    costly: ModuleType,
) -> None:
    aggregate = load_aggregate(costly.SPEC)
    assert isinstance(aggregate, costly.CostlyCount)
    assert aggregate.rounds == 3
    reference = RunningCount()
    batches = [["a", "b"], [], ["c"] * 5]
    state, expected = aggregate.zero(), reference.zero()
    for values in batches:
        state, expected = aggregate.add(state, values), reference.add(expected, values)
    assert aggregate.result(state) == reference.result(expected) == 7


def test_costly_count_obeys_the_aggregate_laws_pure(costly: ModuleType) -> None:
    check_aggregate_laws(costly.CostlyCount(), [["x", "y"], ["z"], [], ["x"] * 4])


def test_each_tuple_does_the_configured_pbkdf2_work_pure(
    costly: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int]] = []
    real = costly.work

    def counted(value: str, rounds: int) -> bytes:
        calls.append((value, rounds))
        return real(value, rounds)

    monkeypatch.setattr(costly, "work", counted)
    costly.CostlyCount().add(0, ["p", "q", "p"])
    assert calls == [("p", 3), ("q", 3), ("p", 3)]
    assert real("p", 3) == hashlib.pbkdf2_hmac("sha256", b"p", b"keyplane", 3)
    assert real("p", 3) != real("p", 4)
