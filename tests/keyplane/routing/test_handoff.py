"""State hand-offs between routed keys (paper 000 §3.4 on Spark's keyed state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.handoff import (
    KEPT_VERSIONS,
    LeastLoadedRoutes,
    VersionedTables,
    routed_key_table,
    state_moves,
)
from keyplane.routing.routedkeys import spark_partition

P = 4


def _config(version: int, **operators: OperatorRouting) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=None if version == 1 else version - 1,
        created_by="initial" if version == 1 else "manual",
        operators=dict(operators),
    )


def _table(moves, before: OperatorRouting, after: OperatorRouting) -> dict[str, list[tuple]]:
    old, new = routed_key_table(before), routed_key_table(after)
    out: dict[str, list[tuple]] = {}
    for move in moves:
        out.setdefault(move.key, []).append(
            (move.source, old.instance_of(move.source), move.target, new.instance_of(move.target))
        )
    return out


def test_a_new_hot_key_moves_its_state_even_where_it_keeps_its_instance() -> None:
    key = "hot"
    natural = spark_partition(key, P)
    instances = (natural, (natural + 1) % P, (natural + 2) % P)
    before = OperatorRouting(parallelism=P)
    after = OperatorRouting(parallelism=P, hot_keys={key: instances})
    moves = state_moves(_config(1, A=before), _config(2, A=after), "A", P)
    # The whole count leaves the plain routed key for the salted one on the same instance.
    assert _table(moves, before, after) == {
        key: [(key, natural, routed_key_table(after).route(key)[0], natural)]
    }


def test_undoing_a_split_sends_every_partial_to_the_single_new_routed_key() -> None:
    before = OperatorRouting(parallelism=P, hot_keys={"h": (0, 1, 3)})
    after = OperatorRouting(parallelism=P, table={"h": 1})
    moves = state_moves(_config(1, A=before), _config(2, A=after), "A", P)
    target = routed_key_table(after).route("h")[0]
    sources = routed_key_table(before).route("h")
    assert sorted(m.source for m in moves) == sorted(r for r in sources if r != target)
    assert {m.target for m in moves} == {target}


def test_a_tabled_key_moves_and_untouched_keys_stay() -> None:
    key = "k"
    elsewhere = (spark_partition(key, P) + 1) % P
    before = OperatorRouting(parallelism=P, table={"same": 2})
    after = OperatorRouting(parallelism=P, table={"same": 2, key: elsewhere})
    moves = state_moves(_config(1, A=before), _config(2, A=after), "A", P)
    assert [(m.key, m.source) for m in moves] == [(key, key)]
    assert routed_key_table(after).instance_of(moves[0].target) == elsewhere


def test_a_version_of_another_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="3 instances, but the query has 4"):
        state_moves(
            _config(1, A=OperatorRouting(parallelism=P)),
            _config(2, A=OperatorRouting(parallelism=3)),
            "A",
            P,
        )


def _instances_of_last_digit(routes: Sequence[str]) -> list[int]:
    return [int(route[-1]) for route in routes]


def test_least_loaded_routes_fill_the_instances_cold_keys_leave_light_pure() -> None:
    balancer = LeastLoadedRoutes(_instances_of_last_digit)
    routes = {"cold": ["cold#0"], "warm": ["warm#1"], "hot": ["hot#0", "hot#1", "hot#2", "hot#3"]}
    keys = ["cold"] * 300 + ["warm"] * 100 + ["hot"] * 800
    picks = balancer.pick_all(keys, routes)
    assert balancer.load == {0: 300, 1: 300, 2: 300, 3: 300}
    assert picks[400:].count("hot#0") == 0
    assert picks[400:].count("hot#1") == 200
    assert picks[400:].count("hot#2") == picks[400:].count("hot#3") == 300


def test_least_loaded_routes_repeat_their_picks_for_the_same_tuples_pure() -> None:
    routes = {"a": ["a#0"], "h": ["h#1", "h#2", "h#0"], "b": ["b#2"]}
    keys = [("a", "h", "h", "b", "h")[(i * 7) % 5] for i in range(1_000)]
    first = LeastLoadedRoutes(_instances_of_last_digit).pick_all(keys, routes)
    again = LeastLoadedRoutes(_instances_of_last_digit)
    assert first == [again.pick(routes[key]) for key in keys]
    assert max(again.load.values()) - min(again.load.values()) <= 1
    assert first[:4] == ["a#0", "h#1", "h#2", "h#1"]


def test_least_loaded_routes_of_a_version_without_splits_count_nothing_pure() -> None:
    asked: list[Sequence[str]] = []

    def instances_of(routes: Sequence[str]) -> list[int]:
        asked.append(routes)
        return _instances_of_last_digit(routes)

    balancer = LeastLoadedRoutes(instances_of, split=False)
    routes = {"a": ["a#0"], "b": ["b#3"]}
    assert balancer.pick_all(["a", "b", "a"], routes) == ["a#0", "b#3", "a#0"]
    assert balancer.pick_heaviest_first(["b", "a"], routes, [5, 2]) == ["b#3", "a#0"]
    assert balancer.pick(["b#3"]) == "b#3"
    assert balancer.load == {} and asked == []


def test_rows_of_many_tuples_place_the_unsplit_first_then_the_heaviest_split_pure() -> None:
    balancer = LeastLoadedRoutes(_instances_of_last_digit)
    routes = {"cold": ["cold#0"], "warm": ["warm#1"], "hot": ["hot#0", "hot#1", "hot#2", "hot#3"]}
    keys = ["hot", "hot", "cold", "hot", "warm", "hot"]
    tuples = [10, 40, 50, 30, 20, 20]
    picks = balancer.pick_heaviest_first(keys, routes, tuples)
    assert picks[2] == "cold#0" and picks[4] == "warm#1"
    assert picks[1] == "hot#2" and picks[3] == "hot#3"
    assert balancer.load == {0: 50, 1: 40, 2: 40, 3: 40}
    assert picks == LeastLoadedRoutes(_instances_of_last_digit).pick_heaviest_first(
        keys, routes, tuples
    )


def test_versioned_tables_keep_a_bounded_number_of_versions(tmp_path: Path) -> None:
    """A long-running job meets a new version at every rollout: old tables are let go,
    and read again (the same routes) if a replayed batch asks for one."""
    versions = range(1, 2 * KEPT_VERSIONS + 2)
    for version in versions:
        save(_config(version, A=OperatorRouting(parallelism=P, table={"k": version % P})), tmp_path)
    tables = VersionedTables(tmp_path, P)
    first = tables.table(1, "A")
    for version in versions:
        table = tables.table(version, "A")
        assert table.instance_of(table.route("k")[0]) == version % P
        if version > 1:
            assert len(tables.moves("A", version - 1, version)) == 1
    assert tables.config.cache_info().currsize == KEPT_VERSIONS
    assert tables.moves.cache_info().currsize == KEPT_VERSIONS
    assert tables.table.cache_info().currsize == 2 * KEPT_VERSIONS
    again = tables.table(1, "A")
    assert again is not first
    assert again.route("k") == first.route("k")


def test_versioned_tables_load_verified_versions_once(tmp_path: Path) -> None:
    save(_config(1, A=OperatorRouting(parallelism=P, table={"k": 3})), tmp_path)
    tables = VersionedTables(tmp_path, P)
    table = tables.table(1, "A")
    assert table.instance_of(table.route("k")[0]) == 3
    assert tables.table(1, "A") is table
    # An operator the version leaves out takes the hash fallback.
    assert tables.table(1, "B").route("k") == ["k"]
    with pytest.raises(LookupError):
        tables.table(9, "A")
