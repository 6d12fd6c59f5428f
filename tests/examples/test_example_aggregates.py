"""The examples' own aggregates obey the laws that make splitting and moving a key exact."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.clickstream.aggregates import DistinctCount, Sum, TopK
from examples.hot_merchant.pipeline import CentsTotal
from keyplane.testing import check_aggregate_laws

DIGITS = st.lists(st.lists(st.integers(0, 10**6).map(str), max_size=6), min_size=1, max_size=4)
WORDS = st.lists(st.lists(st.sampled_from("abcdef"), max_size=6), min_size=1, max_size=4)


@pytest.mark.parametrize("aggregate", [Sum(), CentsTotal()])
@settings(max_examples=50, deadline=None)
@given(batches=DIGITS)
def test_numeric_aggregates_obey_the_laws(aggregate: Any, batches: list[list[str]]) -> None:
    check_aggregate_laws(aggregate, batches)


@pytest.mark.parametrize("aggregate", [DistinctCount(), TopK(2)])
@settings(max_examples=50, deadline=None)
@given(batches=WORDS)
def test_set_aggregates_obey_the_laws(aggregate: Any, batches: list[list[str]]) -> None:
    check_aggregate_laws(aggregate, batches)


def test_top_k_of_merged_partials_is_the_top_k_of_the_whole() -> None:
    top = TopK(2)
    left = top.add(top.zero(), ["a", "a", "b"])
    right = top.add(top.zero(), ["c", "c", "c", "b", "b"])
    assert top.result(top.merge(left, right)) == [["b", 3], ["c", 3]]
