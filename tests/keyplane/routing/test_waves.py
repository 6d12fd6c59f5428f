"""Tests of rollouts in waves: one large reconfiguration as a chain of smaller ones."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.migration import apply, assignment, plan_migration
from keyplane.routing.waves import split_into_waves, wave_count

CREATED = datetime(2026, 11, 27, tzinfo=UTC)
P = 4


def crc_fallback(key: str, parallelism: int) -> int:
    return zlib.crc32(key.encode()) % parallelism


def config(
    version: int, parent: int | None, operators: dict[str, OperatorRouting]
) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_at=CREATED,
        created_by="initial" if parent is None else "schedule",
        operators=operators,
    )


def moved(keys: list[str], shift: int = 1) -> dict[str, int]:
    return {key: (crc_fallback(key, P) + shift) % P for key in keys}


OLD = config(
    1,
    None,
    {
        "A": OperatorRouting(
            parallelism=P, table=moved(["kept", "back"]), hot_keys={"unsplit": (0, 1)}
        ),
        "B": OperatorRouting(parallelism=P),
    },
)
NEW = config(
    2,
    1,
    {
        "A": OperatorRouting(
            parallelism=P,
            table={"kept": OLD.operators["A"].table["kept"], **moved([f"a{i}" for i in range(9)])},
            hot_keys={"hot": (1, 2, 3)},
        ),
        "B": OperatorRouting(parallelism=P, table=moved([f"b{i}" for i in range(3)], shift=2)),
    },
)
"""From OLD: 9 plain moves, a split ("hot"), a merge ("unsplit"), a key back to its hash
instance ("back") in A; 3 moves in B; "kept" stays. 15 moved keys in all."""


def test_wave_count_is_the_fewest_waves_under_the_limit_pure() -> None:
    assert wave_count(15, 4) == 4
    assert wave_count(15, 5) == 3
    assert wave_count(15, 15) == 1
    assert wave_count(0, 5) == 1


def test_wave_count_rejects_a_limit_below_one_pure() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        wave_count(3, 0)


def test_more_waves_than_allowed_is_refused_with_the_smallest_limit_that_fits_pure() -> None:
    with pytest.raises(ValueError, match=r"15 moved keys .* 8 waves, more than the 4 allowed") as e:
        split_into_waves(OLD, NEW, crc_fallback, 2, max_waves=4)
    assert str(e.value).endswith("at least 4")
    assert len(split_into_waves(OLD, NEW, crc_fallback, 4, max_waves=4)) == 4


def test_one_wave_when_the_moves_fit_returns_the_target_itself_pure() -> None:
    assert split_into_waves(OLD, NEW, crc_fallback, 15) == (NEW,)


def test_waves_planned_from_a_later_version_start_there_and_carry_only_what_is_left_pure() -> None:
    """The job runs the first of four waves (an abort stopped the second, say): the same
    target, re-published as v9, is planned from that wave, not from NEW's parent."""
    first = split_into_waves(OLD, NEW, crc_fallback, 4)[0]
    again = NEW.model_copy(update={"version": 9})

    waves = split_into_waves(first, again, crc_fallback, 4)

    assert [w.version for w in waves] == [9, 10, 11]
    assert [w.parent_version for w in waves] == [2, 9, 10]
    assert plan_migration(first, again, crc_fallback).cost.keys == 15 - 4
    assert waves[-1].operators == NEW.operators

    single = split_into_waves(first, again, crc_fallback, 15)
    assert single == (again.model_copy(update={"parent_version": 2}),)


def test_waves_chain_versions_and_end_on_the_targets_routing_pure() -> None:
    waves = split_into_waves(OLD, NEW, crc_fallback, 4)
    assert [w.version for w in waves] == list(range(2, 2 + len(waves)))
    assert [w.parent_version for w in waves] == [1, *range(2, 1 + len(waves))]
    assert waves[-1].operators == NEW.operators
    assert len(waves) > 1


@pytest.mark.parametrize(("limit", "waves"), [(1, 15), (4, 4), (7, 3), (14, 2)])
def test_each_wave_moves_at_most_the_limit_and_every_key_moves_once_pure(
    limit: int, waves: int
) -> None:
    chain = split_into_waves(OLD, NEW, crc_fallback, limit)
    assert len(chain) == waves
    before = OLD
    moved_keys: list[tuple[str, str]] = []
    for wave in chain:
        plan = plan_migration(before, wave, crc_fallback)
        assert 0 < plan.cost.keys <= limit
        moved_keys += [(m.operator, key) for m in plan.operators for key in m.moved_keys]
        before = wave
    whole = plan_migration(OLD, NEW, crc_fallback)
    assert sorted(moved_keys) == sorted(
        (m.operator, key) for m in whole.operators for key in m.moved_keys
    )


def test_every_operators_moves_are_dealt_evenly_over_the_waves_pure() -> None:
    """Each wave carries a share of every stage's work, not stage A first and B last."""
    waves = split_into_waves(OLD, NEW, crc_fallback, 4)
    before = OLD
    per_wave: dict[str, list[int]] = {"A": [], "B": []}
    for wave in waves:
        for migration in plan_migration(before, wave, crc_fallback).operators:
            per_wave[migration.operator].append(len(migration.moves))
        before = wave
    # 15 moves in waves of 4, 4, 4 and 3; B's three spread over the waves, not all last.
    assert per_wave == {"A": [3, 3, 4, 2], "B": [1, 1, 0, 1]}


def test_a_rescale_is_not_split_pure() -> None:
    bigger = NEW.model_copy(
        update={
            "operators": {**NEW.operators, "B": OperatorRouting(parallelism=P + 1)},
        }
    )
    with pytest.raises(ValueError, match=r"\['B'\] change their instances"):
        split_into_waves(OLD, bigger, crc_fallback, 2)


def test_a_target_not_newer_than_the_old_version_is_rejected_pure() -> None:
    with pytest.raises(ValueError, match="must be newer"):
        split_into_waves(NEW, OLD, crc_fallback, 2)


@settings(max_examples=50, deadline=None)
@given(
    moves=st.dictionaries(st.sampled_from([f"k{i}" for i in range(40)]), st.integers(1, P - 1)),
    hot=st.dictionaries(
        st.sampled_from([f"h{i}" for i in range(10)]),
        st.sets(st.integers(0, P - 1), min_size=2).map(lambda s: tuple(sorted(s))),
    ),
    limit=st.integers(1, 12),
)
def test_states_end_where_the_target_routes_them_through_any_waves_pure(
    moves: dict[str, int], hot: dict[str, tuple[int, ...]], limit: int
) -> None:
    """Replaying each wave's plan on where the state lives lands every key where NEW routes
    it: the waves lose nothing and move nothing twice to the wrong place."""
    target = config(
        5,
        1,
        {
            "A": OperatorRouting(
                parallelism=P,
                table={key: (crc_fallback(key, P) + shift) % P for key, shift in moves.items()},
                hot_keys=hot,
            )
        },
    )
    start = config(1, None, {"A": OperatorRouting(parallelism=P)})
    keys = {"A": [*moves, *hot, "untouched"]}
    held = assignment(start, keys, crc_fallback)
    before = start
    for wave in split_into_waves(start, target, crc_fallback, limit):
        held = apply(plan_migration(before, wave, crc_fallback), held)
        before = wave
    assert held == assignment(target, keys, crc_fallback)
