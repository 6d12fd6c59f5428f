"""The hot merchant example's own aggregate obeys the laws that make splitting a key exact."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.hot_merchant.pipeline import CentsTotal
from keyplane.testing import check_aggregate_laws

DIGITS = st.lists(st.lists(st.integers(0, 10**6).map(str), max_size=6), min_size=1, max_size=4)


@pytest.mark.parametrize("aggregate", [CentsTotal()])
@settings(max_examples=50, deadline=None)
@given(batches=DIGITS)
def test_numeric_aggregates_obey_the_laws(aggregate: Any, batches: list[list[str]]) -> None:
    check_aggregate_laws(aggregate, batches)
