"""Pure offset arithmetic of the Kafka source (no broker)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyplane.kafka.offsets import (
    CheckpointAheadError,
    OffsetSpecError,
    cap_offsets,
    check_not_ahead,
    parse_starting_offsets,
    total_rows,
)


def test_parse_starting_offsets() -> None:
    assert parse_starting_offsets("earliest") == "earliest"
    assert parse_starting_offsets("latest") == "latest"
    assert parse_starting_offsets('{"t": {"0": 5, "1": 0}}') == {"t": {"0": 5, "1": 0}}
    with pytest.raises(OffsetSpecError, match="earliest"):
        parse_starting_offsets("first")
    with pytest.raises(OffsetSpecError, match="topic -> partition -> offset"):
        parse_starting_offsets('{"t": {"0": -1}}')


def test_cap_shares_budget_in_proportion_to_backlog() -> None:
    start = {"t": {"0": 0, "1": 100}}
    latest = {"t": {"0": 300, "1": 200}}
    assert cap_offsets(start, latest, 200) == {"t": {"0": 150, "1": 150}}
    assert cap_offsets(start, latest, 10_000) == latest


@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), min_size=1, max_size=12),
    st.integers(1, 50_000),
)
def test_cap_never_exceeds_budget_or_latest_and_always_progresses(
    ranges: list[tuple[int, int]], budget: int
) -> None:
    start = {"t": {str(i): s for i, (s, _) in enumerate(ranges)}}
    latest = {"t": {str(i): s + n for i, (s, n) in enumerate(ranges)}}
    end = cap_offsets(start, latest, budget)
    available = total_rows(start, latest)
    taken = total_rows(start, end)
    assert taken == min(budget, available)
    for p, off in end["t"].items():
        assert start["t"][p] <= off <= latest["t"][p]


def test_a_checkpoint_ahead_of_its_topic_is_named_with_both_offsets() -> None:
    check_not_ahead("events", {"0": 5, "1": 7}, {0: 5, 1: 9})
    check_not_ahead("events", {}, {})
    with pytest.raises(CheckpointAheadError) as ahead:
        check_not_ahead("events", {"0": 5, "1": 72}, {0: 5, 1: 0})
    assert str(ahead.value).startswith(
        "the checkpoint has read topic 'events' partition 1 up to offset 72, but the topic "
        "ends at offset 0: the broker lost records it had acknowledged"
    )
    with pytest.raises(CheckpointAheadError, match="partition 0 up to offset 3, but the topic "):
        check_not_ahead("gone", {"0": 3}, {})
