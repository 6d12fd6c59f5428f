"""Keyed aggregates: the contract a routed stage relies on, checked as properties.

The shipped aggregates must pass :func:`keyplane.testing.check_aggregate_laws`
on any batches, and the checker must reject aggregates that break each law
(otherwise it could not fail). ``load_aggregate`` is the boundary: every bad
``module:attr`` gives one line that says what is wrong.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.aggregates import (
    AggregateSpecError,
    DistinctCount,
    RunningCount,
    Sum,
    TopK,
    ValueCounts,
    load_aggregate,
    merge_encoded,
)
from keyplane.testing import check_aggregate_laws

values = st.text(alphabet="abcdé#\x00,:\"'{", max_size=4)
batches = st.lists(st.lists(values, max_size=8), max_size=5)


@settings(deadline=None)
@given(batches)
def test_running_count_satisfies_the_laws(batches_: list[list[str]]) -> None:
    check_aggregate_laws(RunningCount(), batches_)


@settings(deadline=None)
@given(batches)
def test_value_counts_satisfies_the_laws(batches_: list[list[str]]) -> None:
    check_aggregate_laws(ValueCounts(), batches_)


@settings(deadline=None)
@given(st.lists(batches.filter(lambda b: len(b) >= 1), min_size=1, max_size=4))
def test_a_split_keys_partials_merge_to_the_unsplit_answer(
    splits: list[list[list[str]]],
) -> None:
    """Each routed key of a hot key adds its share; the encoded partials merge exactly."""
    for agg in (RunningCount(), ValueCounts()):
        encoded = []
        for routed_key_batches in splits:
            state = agg.zero()
            for batch in routed_key_batches:
                state = agg.add(state, batch)
            encoded.append(agg.encode(state))
        everything = [v for part in splits for batch in part for v in batch]
        whole = agg.result(agg.add(agg.zero(), everything))
        assert merge_encoded(agg, [*encoded, agg.encode(agg.zero())]) == whole


numbers = st.one_of(
    st.integers(-(10**12), 10**12).map(str),
    st.decimals(
        allow_nan=False, allow_infinity=False, places=3, max_value=10**9, min_value=-(10**9)
    ).map(str),
)


@settings(deadline=None)
@given(st.lists(st.lists(numbers, max_size=8), max_size=5))
def test_sum_satisfies_the_laws(batches_: list[list[str]]) -> None:
    check_aggregate_laws(Sum(), batches_)


@settings(deadline=None)
@given(batches)
def test_distinct_count_and_top_k_satisfy_the_laws(batches_: list[list[str]]) -> None:
    check_aggregate_laws(DistinctCount(), batches_)
    check_aggregate_laws(TopK(2), batches_)


def test_sum_distinct_count_and_top_k_answer_what_they_say() -> None:
    """Sums are exact decimals (0.1 + 0.2 is 0.3); a whole sum is an int; distinct values
    count once; the top k are the heaviest, ties by value, and k bounds them."""
    assert Sum().result(Sum().add(Sum().zero(), ["0.1", "0.2"])) == 0.3
    assert Sum().result(Sum().add(Sum().zero(), ["2", "-5", "1.5", "1.5"])) == 0
    assert isinstance(Sum().result(Sum().add(Sum().zero(), ["2", "3"])), int)
    with pytest.raises(ValueError, match="Sum: 'x' is not a number"):
        Sum().add(Sum().zero(), ["1", "x"])
    distinct = DistinctCount()
    assert (
        distinct.result(
            distinct.merge(
                distinct.add(distinct.zero(), ["a", "b", "a"]),
                distinct.add(distinct.zero(), ["b", "c"]),
            )
        )
        == 3
    )
    top = TopK(2)
    state = top.merge(top.add(top.zero(), ["x", "y", "y"]), top.add(top.zero(), ["z", "x", "z"]))
    assert top.result(state) == [["x", 2], ["y", 2]]
    with pytest.raises(ValueError, match="k must be 1 or more"):
        TopK(0)


def test_value_counts_answers_how_often_each_value_came() -> None:
    agg = ValueCounts()
    state = agg.add(agg.add(agg.zero(), ["x", "y", "x"]), ["y", "z"])
    assert agg.result(state) == {"x": 2, "y": 2, "z": 1}
    assert agg.result(agg.merge(state, state)) == {"x": 4, "y": 4, "z": 2}


class _Broken:
    """A running count with one law broken, picked by ``law``."""

    def __init__(self, law: str) -> None:
        self.law = law

    def zero(self) -> Any:
        return 1 if self.law == "identity" else 0

    def add(self, state: Any, values: Sequence[str]) -> Any:
        if self.law == "distributes":
            return state + min(len(values), 2)
        return state + len(values)

    def merge(self, a: Any, b: Any) -> Any:
        if self.law == "commutes" and a and b:
            return a + 2 * b
        if self.law == "associates":
            return abs(a - b)
        return a + b

    def result(self, state: Any) -> Any:
        return {1, state} if self.law == "json" else state

    def encode(self, state: Any) -> Any:
        if self.law == "text":
            return state
        return str(state + 1 if self.law == "roundtrip" else state)

    def decode(self, text: str) -> Any:
        return int(text)


@pytest.mark.parametrize(
    ("law", "message"),
    [
        ("identity", "merge(zero, s) == s"),
        ("commutes", "merge(a, b) == merge(b, a)"),
        ("associates", "merge(merge(a, b), c)"),
        ("distributes", "merging the partials == adding every value to zero"),
        ("roundtrip", "decode(encode(s)) == s"),
        ("text", "not str"),
        ("json", "not JSON serializable"),
    ],
)
def test_check_aggregate_laws_rejects_each_broken_law_with_fake_aggregates(
    law: str, message: str
) -> None:
    with pytest.raises((AssertionError, TypeError), match=re.escape(message)):
        check_aggregate_laws(_Broken(law), [["a", "b", "c"], ["d"], ["e", "f"]])


def test_check_aggregate_laws_catches_a_mutating_merge_with_a_fake_aggregate() -> None:
    class MutatingValueCounts(ValueCounts):
        def merge(self, a: Any, b: Any) -> Any:
            a.update(b)
            return a

    with pytest.raises(AssertionError, match="mutate"):
        check_aggregate_laws(MutatingValueCounts(), [["a"], ["b"], ["c"]])


def test_load_aggregate_takes_a_class_or_an_instance() -> None:
    assert isinstance(load_aggregate("keyplane.aggregates:RunningCount"), RunningCount)
    assert isinstance(load_aggregate("keyplane.aggregates:ValueCounts"), ValueCounts)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("keyplane.aggregates", "expected 'module:attr'"),
        ("keyplane.no_such_module:Count", "cannot import 'keyplane.no_such_module'"),
        ("keyplane.aggregates:NoSuch", "has no 'NoSuch'"),
        ("keyplane.aggregates:load_aggregate", "missing zero, add, merge, result, encode"),
        ("keyplane.aggregates:AggregateSpecError", "is not a KeyedAggregate"),
        ("collections:Counter", "missing zero, add, merge, result, encode, decode"),
    ],
)
def test_load_aggregate_refuses_a_bad_spec_in_one_line(spec: str, message: str) -> None:
    with pytest.raises(AggregateSpecError, match=re.escape(message)) as raised:
        load_aggregate(spec)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("module", "source", "message"),
    [
        (
            "fake_aggregates_raising",
            'raise RuntimeError("no database\\nsecond line")\n',
            "cannot import 'fake_aggregates_raising': RuntimeError: no database",
        ),
        (
            "fake_aggregates_bad_syntax",
            "def broken(:\n",
            "cannot import 'fake_aggregates_bad_syntax': SyntaxError: ",
        ),
        (
            "fake_aggregates_silent",
            'raise ValueError("")\n',
            "cannot import 'fake_aggregates_silent': ValueError",
        ),
        (
            "fake_aggregates_failing_class",
            "class Agg:\n    def __init__(self):\n        raise KeyError('region')\n",
            "Agg() failed (the class must build with no arguments): KeyError: 'region'",
        ),
    ],
)
def test_load_aggregate_refuses_a_fake_module_that_fails_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str, message: str
) -> None:
    """The user's module runs at the boundary: whatever it raises is told in one line."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(AggregateSpecError) as raised:
            load_aggregate(f"{module}:Agg")
    finally:
        sys.modules.pop(module, None)
    assert str(raised.value).startswith(f"aggregate '{module}:Agg': {message}")
    assert "\n" not in str(raised.value)


def test_load_aggregate_refuses_a_relative_module_name_in_one_line() -> None:
    with pytest.raises(AggregateSpecError) as raised:
        load_aggregate(".aggregates:RunningCount")
    assert str(raised.value) == (
        "aggregate '.aggregates:RunningCount': '.aggregates' is a relative module name; "
        "name it in full"
    )
