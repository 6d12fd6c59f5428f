"""Tests of migration plans between routing configurations (paper 000 §3.4)."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.migration import (
    StalePlanError,
    Transfer,
    apply,
    assignment,
    location,
    plan_migration,
)
from keyplane.routing.routedkeys import fallback_instances, spark_partition

CREATED = datetime(2026, 11, 3, tzinfo=UTC)


def crc_fallback(key: str, parallelism: int) -> int:
    return zlib.crc32(key.encode()) % parallelism


def config(version: int, operators: dict[str, OperatorRouting]) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=None if version == 1 else version - 1,
        created_at=CREATED,
        created_by="initial" if version == 1 else "schedule",
        operators=operators,
    )


def test_location_is_table_then_hot_set_then_hash() -> None:
    operator = OperatorRouting(parallelism=4, table={"t": 3}, hot_keys={"h": (0, 2)})
    assert location(operator, "t", crc_fallback) == (3,)
    assert location(operator, "h", crc_fallback) == (0, 2)
    assert location(operator, "other", crc_fallback) == (crc_fallback("other", 4),)
    with pytest.raises(ValueError, match=r"returned 4, outside \[0, 4\)"):
        location(operator, "other", lambda key, p: p)


def test_location_folds_the_hash_of_a_scaled_in_operator_as_the_job_does() -> None:
    keys = [f"k{i}" for i in range(40)]
    operator = OperatorRouting(parallelism=4, active_instances=(0, 2))
    job = fallback_instances(keys, 4, operator.active_instances)
    assert any(spark_partition(key, 4) in (1, 3) for key in keys)
    assert [location(operator, key, spark_partition) for key in keys] == [(int(i),) for i in job]


def test_scale_in_plans_no_move_for_a_key_the_fold_leaves_in_place() -> None:
    key = next(f"k{i}" for i in range(100) if spark_partition(f"k{i}", 4) == 2)
    old = config(1, {"A": OperatorRouting(parallelism=4, table={key: 0})})
    new = config(2, {"A": OperatorRouting(parallelism=4, active_instances=(0, 1))})

    assert plan_migration(old, new, spark_partition).cost.keys == 0


def test_plan_lists_sends_receives_splits_and_merges() -> None:
    old = config(
        1,
        {
            "A": OperatorRouting(
                parallelism=3, table={"moved": 0, "split": 1}, hot_keys={"merged": (0, 2)}
            )
        },
    )
    new = config(
        2,
        {
            "A": OperatorRouting(
                parallelism=3, table={"moved": 2, "merged": 0}, hot_keys={"split": (1, 0, 2)}
            )
        },
    )

    migration = plan_migration(old, new, crc_fallback).operator("A")

    assert {m.key: m.kind for m in migration.moves} == {
        "moved": "move",
        "split": "split",
        "merged": "merge",
    }
    assert migration.send == {
        0: (Transfer("moved", 0, 2),),
        2: (Transfer("merged", 2, 0),),
    }
    assert migration.receive == {
        0: (Transfer("merged", 2, 0),),
        2: (Transfer("moved", 0, 2),),
    }
    assert sorted(migration.opened) == [("split", 0), ("split", 2)]
    assert [m.key for m in migration.splits] == ["split"]
    assert [m.key for m in migration.merges] == ["merged"]


def test_operators_are_ordered_upstream_first_as_given() -> None:
    operators = {
        "B": OperatorRouting(parallelism=2, table={"x": 0}),
        "A": OperatorRouting(parallelism=2, table={"y": 1}),
    }
    old, new = config(1, operators), config(2, operators)

    assert plan_migration(old, new, crc_fallback).operator_order == ("B", "A")
    assert plan_migration(old, new, crc_fallback, operator_order=["A", "B"]).operator_order == (
        "A",
        "B",
    )
    with pytest.raises(ValueError, match="exactly once"):
        plan_migration(old, new, crc_fallback, operator_order=["A"])


def test_cost_counts_keys_transfers_and_state_bytes() -> None:
    old = config(1, {"A": OperatorRouting(parallelism=4, table={"a": 0}, hot_keys={"h": (1, 2)})})
    new = config(2, {"A": OperatorRouting(parallelism=4, table={"a": 3, "h": 3})})

    plan = plan_migration(old, new, crc_fallback, state_bytes={"A": {"a": 100, "h": 60}})

    # "a": one transfer of 100 bytes; "h": two partials of 30 bytes each move to 3.
    assert plan.cost.keys == 2
    assert plan.cost.transfers == 3
    assert plan.cost.state_bytes == 160
    assert plan_migration(old, new, crc_fallback).cost.state_bytes is None


def test_scale_out_moves_hashed_keys_that_were_passed_in() -> None:
    keys = [f"k{i}" for i in range(50)]
    old = config(1, {"A": OperatorRouting(parallelism=2)})
    new = config(2, {"A": OperatorRouting(parallelism=5)})

    plan = plan_migration(old, new, crc_fallback, keys={"A": keys})

    expected_moves = {k for k in keys if crc_fallback(k, 2) != crc_fallback(k, 5)}
    assert set(plan.operator("A").moved_keys) == expected_moves
    before = assignment(old, {"A": keys}, crc_fallback)
    assert apply(plan, before) == assignment(new, {"A": keys}, crc_fallback)


def test_apply_rejects_state_the_plan_does_not_expect() -> None:
    old = config(1, {"A": OperatorRouting(parallelism=3, table={"k": 0})})
    new = config(2, {"A": OperatorRouting(parallelism=3, table={"k": 1})})
    plan = plan_migration(old, new, crc_fallback)

    with pytest.raises(StalePlanError, match=r"'k' is held by \[2\]"):
        apply(plan, {"A": {"k": frozenset({2})}})


def test_apply_rejects_unexamined_keys_when_parallelism_changes() -> None:
    old = config(1, {"A": OperatorRouting(parallelism=2)})
    new = config(2, {"A": OperatorRouting(parallelism=3)})
    plan = plan_migration(old, new, crc_fallback)

    with pytest.raises(StalePlanError, match="pass every stateful key"):
        apply(plan, assignment(old, {"A": ["lost"]}, crc_fallback))


def test_apply_rejects_unexamined_keys_when_the_active_instances_change() -> None:
    old = config(1, {"A": OperatorRouting(parallelism=4)})
    new = config(2, {"A": OperatorRouting(parallelism=4, active_instances=(0, 1))})
    plan = plan_migration(old, new, spark_partition)

    with pytest.raises(StalePlanError, match="the hash fallback changes"):
        apply(plan, assignment(old, {"A": ["lost"]}, spark_partition))


def test_apply_skips_keys_without_state() -> None:
    old = config(1, {"A": OperatorRouting(parallelism=3, table={"k": 0, "j": 1})})
    new = config(2, {"A": OperatorRouting(parallelism=3, table={"k": 1, "j": 2})})
    plan = plan_migration(old, new, crc_fallback)

    assert apply(plan, {"A": {"k": frozenset({0})}}) == {"A": {"k": frozenset({1})}}


KEYS = [f"key{i}" for i in range(12)]


@st.composite
def operator_routing(draw: st.DrawFn) -> OperatorRouting:
    parallelism = draw(st.integers(1, 5))
    table: dict[str, int] = {}
    hot: dict[str, tuple[int, ...]] = {}
    for key in draw(st.lists(st.sampled_from(KEYS), unique=True)):
        if parallelism >= 2 and draw(st.booleans()):
            order = draw(st.permutations(range(parallelism)))
            hot[key] = tuple(order[: draw(st.integers(2, parallelism))])
        else:
            table[key] = draw(st.integers(0, parallelism - 1))
    return OperatorRouting(parallelism=parallelism, table=table, hot_keys=hot)


@st.composite
def config_pairs(draw: st.DrawFn) -> tuple[RoutingConfig, RoutingConfig]:
    names = draw(st.lists(st.sampled_from(["A", "B", "C"]), min_size=1, unique=True))
    old = config(1, {name: draw(operator_routing()) for name in names})
    new = config(2, {name: draw(operator_routing()) for name in draw(st.permutations(names))})
    return old, new


@settings(max_examples=150, deadline=None)
@given(config_pairs())
def test_property_applying_the_plan_to_old_assignment_gives_new_assignment(
    configs: tuple[RoutingConfig, RoutingConfig],
) -> None:
    old, new = configs
    keys = {name: KEYS for name in old.operators}
    plan = plan_migration(old, new, crc_fallback, keys=keys)

    assert apply(plan, assignment(old, keys, crc_fallback)) == assignment(new, keys, crc_fallback)
    for migration in plan.operators:
        sent = sorted(
            (t.key, t.source, t.target) for items in migration.send.values() for t in items
        )
        received = sorted(
            (t.key, t.source, t.target) for items in migration.receive.values() for t in items
        )
        assert sent == received
        assert all(i == t.source for i, items in migration.send.items() for t in items)
        assert all(i == t.target for i, items in migration.receive.items() for t in items)
        for move in migration.moves:
            assert set(move.old) != set(move.new)
        for transfer in migration.transfers:
            move = next(m for m in migration.moves if m.key == transfer.key)
            assert transfer.source in move.old and transfer.source not in move.new
            assert transfer.target in move.new
