"""Tests for keyplane.routing.routedkeys: Spark's hash, routed keys, salt search, the table.

The pure tests pin the hash to values Spark 4.3.0 returned. The integration
tests compare against a real local SparkSession: ``F.hash`` itself, hash
repartitioning, and a streaming ``applyInPandasWithState`` operator.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

from keyplane.algorithms import statistics as stats
from keyplane.orchestration import planning, quality
from keyplane.routing import routedkeys
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.routedkeys import (
    CONTROL_STARTS,
    ESCAPE,
    SEPARATOR,
    RoutedKeyTable,
    SaltNotFoundError,
    escaped,
    find_salt,
    find_salts,
    fold_instance,
    original_key,
    predicted_instance_loads,
    routed_key,
    routed_shares,
    salt_prefix,
    spark_hash_long,
    spark_hash_string,
    spark_hash_strings,
    spark_partition,
    spark_partitions,
    split_routed_key,
    stands_alone,
)

SPARK_4_3_STRING_HASHES = {
    "": 142593372,
    "a": 1485273170,
    "abcd": -396302900,
    "abcde": 814637928,
    "é": 2119106806,
    "中文": -1261019299,
    "😀": 1877935379,
    "user42#17": -68127719,
}
"""``F.hash(F.lit(s))`` on pyspark 4.3.0: every tail length 0-3, 2-, 3- and 4-byte UTF-8."""

SPARK_4_3_LONG_HASHES = {
    0: -1670924195,
    -1: -939490007,
    2**63 - 1: -1604625029,
    -(2**63): -853646085,
}
"""``F.hash(F.lit(v).cast("long"))`` on pyspark 4.3.0."""

ALPHABET = "abcXYZ019 #_-\x00\x7fé\u00ffΩж中文😀🚀\u0301"
"""ASCII (including the separator and NUL), 2-, 3- and 4-byte UTF-8, a combining mark."""

keys_strategy = st.text(max_size=30)


def random_strings(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [""] + [
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(count - 1)
    ]


# Spark's hash.


@pytest.mark.parametrize(("text", "expected"), SPARK_4_3_STRING_HASHES.items())
def test_string_hash_matches_recorded_spark_values(text: str, expected: int) -> None:
    assert spark_hash_string(text) == expected


@pytest.mark.parametrize(("value", "expected"), SPARK_4_3_LONG_HASHES.items())
def test_long_hash_matches_recorded_spark_values(value: int, expected: int) -> None:
    assert spark_hash_long(value) == expected


def test_long_hash_rejects_values_outside_64_bits() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        spark_hash_long(2**63)


@given(st.lists(st.text(max_size=40), max_size=40))
def test_vectorised_hash_equals_scalar_hash(strings: list[str]) -> None:
    vectorised = spark_hash_strings(strings)
    assert vectorised.dtype == np.int32
    assert vectorised.tolist() == [spark_hash_string(s) for s in strings]


@given(keys_strategy, st.integers(min_value=1, max_value=1000))
def test_partition_is_pmod_of_hash(text: str, n: int) -> None:
    partition = spark_partition(text, n)
    assert 0 <= partition < n
    assert (partition - spark_hash_string(text)) % n == 0
    assert spark_partitions([text], n).tolist() == [partition]


def test_partition_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        spark_partition("a", 0)


# Routed-key format.


@given(keys_strategy, st.integers(min_value=0, max_value=10**12))
def test_routed_key_round_trips(key: str, salt: int) -> None:
    routed = routed_key(key, salt)
    assert split_routed_key(routed) == (key, salt)
    assert original_key(routed) == key or key.startswith(ESCAPE)


CONTROL_LIKE_KEYS = [
    "",
    "\x00",
    "\x00A",
    "\x00install-B#3",
    "\U0010ffff",
    "\U0010ffffevict-A#0",
    ESCAPE,
    ESCAPE + "#2",
    "#",
    "#0",
    " ",
    "\t\n",
]
"""Keys that a plain grouping value would put among or before the control groups."""


@given(
    st.one_of(st.sampled_from(CONTROL_LIKE_KEYS), keys_strategy),
    st.integers(min_value=1, max_value=16),
    st.sampled_from([None, (0,), (1, 2)]),
)
def test_every_key_routes_between_the_control_groups_and_back(
    key: str, n: int, active: tuple[int, ...] | None
) -> None:
    """Whatever a key holds, its grouping value sorts after every NUL-started control group
    and before every U+10FFFF-started one (the JVM stages' order), lands on the key's own
    (folded) partition, and gives the key back."""
    active = None if active is None or max(active) >= n else active
    table = RoutedKeyTable(n_instances=n, routing={}, active=active)
    for values in (table.route(key), table.route_all([key])[key]):
        (value,) = values
        assert value and not value.startswith(CONTROL_STARTS)
        assert value.startswith(ESCAPE) == escaped(key)
        assert b"\x00" < value.encode() < "\U0010ffff".encode()
        assert original_key(value) == key
        assert spark_partition(value, n) == table.fallback_instance(key)


@pytest.mark.parametrize("key", CONTROL_LIKE_KEYS)
def test_control_like_keys_route_as_tabled_and_hot_keys_pure(key: str) -> None:
    table = RoutedKeyTable(n_instances=4, routing={key: 2}, hot_keys={key + "h": (0, 3)})
    (tabled,) = table.route(key)
    assert original_key(tabled) == key and table.instance_of(tabled) == 2
    assert not tabled.startswith(CONTROL_STARTS)
    hot = table.route(key + "h")
    assert [original_key(v) for v in hot] == [key + "h"] * 2
    assert [spark_partition(v, 4) for v in hot] == [0, 3]


@given(st.lists(st.sampled_from(["a", SEPARATOR, "1", "0", "é"]), max_size=8).map("".join))
def test_keys_made_of_separators_and_digits_round_trip(key: str) -> None:
    assert split_routed_key(routed_key(key, 7)) == (key, 7)


@given(keys_strategy.filter(lambda key: SEPARATOR not in key))
def test_plain_key_is_its_own_original_key(key: str) -> None:
    assert original_key(key) == key


@pytest.mark.parametrize("text", ["abc", "abc#", "a#-1", "a#+1", "a#01", "a# 1", "a#1.0", "a#١"])
def test_split_rejects_non_canonical_salts(text: str) -> None:
    with pytest.raises(ValueError, match="not a routed key"):
        split_routed_key(text)


def test_routed_key_rejects_negative_salt() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        routed_key("a", -1)


# Salt search.


@given(keys_strategy, st.integers(min_value=1, max_value=40), st.data())
def test_find_salt_returns_the_smallest_hitting_salt(key: str, n: int, data: st.DataObject) -> None:
    target = data.draw(st.integers(min_value=0, max_value=n - 1))
    start = data.draw(st.integers(min_value=0, max_value=200))
    salt = find_salt(key, target, n, start=start)
    assert salt >= start
    assert spark_partition(routed_key(key, salt), n) == target
    assert all(spark_partition(routed_key(key, s), n) != target for s in range(start, salt))


def test_find_salt_raises_past_its_bound() -> None:
    n = 1000
    miss = (spark_partition(routed_key("k", 0), n) + 1) % n
    with pytest.raises(SaltNotFoundError, match=r"no salt in \[0, 1\) sends 'k' to partition"):
        find_salt("k", miss, n, max_tries=1)


def test_find_salt_default_bound_is_tries_per_partition_times_n(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 1000
    monkeypatch.setattr(routedkeys, "TRIES_PER_PARTITION", 1)
    reached = set(spark_partitions([routed_key("k", s) for s in range(n)], n).tolist())
    missed = min(set(range(n)) - reached)
    with pytest.raises(SaltNotFoundError, match=r"no salt in \[0, 1000\)"):
        find_salt("k", missed, n)
    with pytest.raises(SaltNotFoundError, match=r"no salt in \[0, 1000\)"):
        find_salts(["k"], [missed], n)


@pytest.mark.parametrize(
    ("start", "max_tries", "message"), [(-1, None, "start"), (0, 0, "max_tries")]
)
def test_search_rejects_bad_bounds(start: int, max_tries: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_salt("k", 0, 4, start=start, max_tries=max_tries)
    with pytest.raises(ValueError, match=message):
        find_salts(["k"], [0], 4, start=start, max_tries=max_tries)


def test_find_salt_rejects_a_target_outside_the_partitions() -> None:
    with pytest.raises(ValueError, match="not in"):
        find_salt("k", 8, 8)


def test_bulk_search_equals_scalar_search() -> None:
    rng = random.Random(7)
    keys = [*random_strings(300, seed=11), "a#3", "#", SEPARATOR * 5]
    for n in (1, 3, 16, 101):
        targets = [rng.randrange(n) for _ in keys]
        start = rng.choice([0, 95, 9990])
        bulk = find_salts(keys, targets, n, start=start)
        scalar = [find_salt(k, t, n, start=start) for k, t in zip(keys, targets, strict=True)]
        assert bulk.tolist() == scalar


def test_bulk_search_routes_20k_keys_to_their_targets() -> None:
    rng = random.Random(5)
    keys = [f"user{rng.getrandbits(48)}" for _ in range(20_000)]
    targets = np.array([rng.randrange(64) for _ in keys])
    salts = find_salts(keys, targets, 64)
    routed = [routed_key(k, int(s)) for k, s in zip(keys, salts, strict=True)]
    assert np.array_equal(spark_partitions(routed, 64), targets)


def test_bulk_search_raises_past_its_bound() -> None:
    n = 1000
    misses = [(spark_partition(routed_key(k, 0), n) + 1) % n for k in ("x", "y")]
    with pytest.raises(SaltNotFoundError, match=r"2 key\(s\) with n=1000"):
        find_salts(["x", "y"], misses, n, max_tries=1)


def test_bulk_search_of_no_keys_is_empty() -> None:
    assert find_salts([], [], 4).tolist() == []


def test_bulk_search_needs_one_target_per_key() -> None:
    with pytest.raises(ValueError, match="one target per key"):
        find_salts(["a", "b"], [0], 4)


# The routed-key table.


def test_table_routes_tabled_keys_to_their_instance() -> None:
    routing = {f"key{i}": i % 8 for i in range(100)}
    table = RoutedKeyTable(n_instances=8, routing=routing)
    for key, instance in routing.items():
        (routed,) = table.route(key)
        assert original_key(routed) == key
        assert table.instance_of(routed) == instance
        assert spark_partition(routed, 8) == instance


def test_table_splits_hot_keys_over_their_instances_in_order() -> None:
    table = RoutedKeyTable(n_instances=8, routing={"cold": 1}, hot_keys={"hot": [5, 0, 3]})
    routed = table.route("hot")
    assert len(set(routed)) == 3
    assert [original_key(r) for r in routed] == ["hot"] * 3
    assert [spark_partition(r, 8) for r in routed] == [5, 0, 3]
    assert [table.instance_of(r) for r in routed] == [5, 0, 3]


def test_instances_of_many_keys_agree_with_one_at_a_time() -> None:
    table = RoutedKeyTable(n_instances=8, routing={"cold": 1}, hot_keys={"hot": [5, 0, 3]})
    keys = [*table.route("hot"), *table.route("cold"), "stranger", "x#3", "", "ключ"]
    assert table.instances_of(keys) == [table.instance_of(k) for k in keys]
    assert table.instances_of(keys)[:4] == [5, 0, 3, 1]
    assert table.instances_of([]) == []


def test_unrouted_key_keeps_its_natural_partition() -> None:
    table = RoutedKeyTable(n_instances=8, routing={"a": 2})
    assert table.route("stranger") == ["stranger"]
    assert table.instance_of("stranger") == spark_partition("stranger", 8)


def test_unrouted_key_with_separator_is_salted_to_its_natural_partition() -> None:
    table = RoutedKeyTable(n_instances=8, routing={"a": 2})
    (tabled,) = table.route("a")
    (fallback,) = table.route(tabled)
    assert fallback != tabled
    assert original_key(fallback) == tabled
    assert spark_partition(fallback, 8) == spark_partition(tabled, 8)


def unbounded_fallback(key: str, n: int, active: tuple[int, ...]) -> str:
    """The scaled-in hash fallback of ``key`` worked out from scratch, nothing kept."""
    natural = spark_partition(key, n)
    target = fold_instance(natural, active, n)
    if target == natural and stands_alone(key):
        return key
    prefix = salt_prefix(key)
    return routed_key(prefix, find_salt(prefix, target, n))


def test_a_scaled_in_table_keeps_only_the_most_recent_fallback_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table lives as long as its Python worker: what it keeps of a stream's ever new
    keys must stay bounded, and a key it dropped routes as it did."""
    monkeypatch.setattr(routedkeys, "FOLDS_KEPT", 50)
    n, active = 6, (1, 4)
    table = RoutedKeyTable(n_instances=n, routing={}, active=active)
    keys = [f"user{i}" for i in range(400)] + ["a#1", "#"]
    expected = [[unbounded_fallback(key, n, active)] for key in keys]

    first = [table.route(key) for key in keys]
    kept_after_first = list(table._folded)
    again = [table.route(key) for key in keys]
    table.route(keys[-50])
    table.route("newcomer")

    assert first == again == expected
    assert kept_after_first == keys[-50:]
    assert len(table._folded) == 50
    assert keys[-50] in table._folded
    assert keys[-49] not in table._folded


@pytest.mark.parametrize("active", [None, (0, 2, 5)])
def test_route_all_equals_route_one_key_at_a_time(
    monkeypatch: pytest.MonkeyPatch, active: tuple[int, ...] | None
) -> None:
    monkeypatch.setattr(routedkeys, "FOLDS_KEPT", 100)
    tabled = {"t": 2}
    hot = {"h": [0, 5]}
    one_at_a_time = RoutedKeyTable(n_instances=6, routing=tabled, hot_keys=hot, active=active)
    at_once = RoutedKeyTable(n_instances=6, routing=tabled, hot_keys=hot, active=active)
    keys = [*random_strings(300, seed=7), "t", "h", "t#0", "x#3", "user1", "user1"]

    first = at_once.route_all(keys[:150])
    routes = at_once.route_all(keys)

    assert routes == {key: one_at_a_time.route(key) for key in keys}
    assert first == {key: routes[key] for key in keys[:150]}
    assert at_once.route_all([]) == {}
    assert len(at_once._folded) == (0 if active is None else 100)


@st.composite
def tables_and_keys(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    """A table's arguments, scaled in or not, and keys to route: tabled, hot, routed values
    of those (which the table does not name) and strangers, with and without separators."""
    n = draw(st.integers(min_value=1, max_value=12))
    partitions = st.integers(min_value=0, max_value=n - 1)
    active = draw(st.none() | st.sets(partitions, min_size=1).map(sorted).map(tuple))
    key_text = keys_strategy | st.text(ALPHABET, max_size=8)
    routing = draw(st.dictionaries(key_text, partitions, max_size=4))
    hot: dict[str, list[int]] = {}
    if n >= 2:
        spreads = st.lists(partitions, min_size=2, max_size=n, unique=True)
        hot = draw(
            st.dictionaries(key_text.filter(lambda k: k not in routing), spreads, max_size=3)
        )
    named = [*routing, *hot]
    salted = [routed_key(key, salt) for key in named for salt in range(3)]
    pool = st.sampled_from(named + salted) | key_text if named else key_text
    keys = draw(st.lists(pool, max_size=30))
    return {"n_instances": n, "routing": routing, "hot_keys": hot, "active": active}, keys


@settings(max_examples=150, deadline=None)
@given(tables_and_keys())
def test_route_and_route_all_agree_on_any_keys(case: tuple[dict[str, Any], list[str]]) -> None:
    """The single-key and batch paths apply one hash-fallback rule: same grouping values,
    each on the instance the fallback names, whether searched, kept or not kept at all."""
    arguments, keys = case
    n, active = arguments["n_instances"], arguments["active"]
    one_at_a_time = RoutedKeyTable(**arguments)
    at_once = RoutedKeyTable(**arguments)

    single = {key: one_at_a_time.route(key) for key in keys}
    single_again = {key: one_at_a_time.route(key) for key in keys}
    batch = at_once.route_all(keys)

    assert single == single_again == batch == at_once.route_all(reversed(keys))
    for key in set(keys) - set(arguments["routing"]) - set(arguments["hot_keys"]):
        (value,) = single[key]
        natural = spark_partition(key, n)
        expected = natural if active is None else fold_instance(natural, active, n)
        assert one_at_a_time.fallback_instance(key) == expected
        assert spark_partition(value, n) == expected
        assert original_key(value) == key
        assert (value == key) == (expected == natural and stands_alone(key))


@pytest.mark.parametrize(
    ("routing", "hot_keys", "message"),
    [
        ({"a": 1}, {"a": [1, 2]}, "both tabled and hot"),
        ({}, {"h": [1]}, "≥ 2 distinct"),
        ({}, {"h": [1, 1]}, "≥ 2 distinct"),
        ({"a": 4}, {}, r"instance 4 is not in \[0, 4\)"),
        ({}, {"h": [0, -1]}, r"instance -1 is not in"),
    ],
)
def test_table_rejects_inconsistent_input(
    routing: dict[str, int], hot_keys: dict[str, list[int]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RoutedKeyTable(n_instances=4, routing=routing, hot_keys=hot_keys)


def scaled_routing_and_loads() -> tuple[OperatorRouting, dict[str, float], np.ndarray]:
    """A scaled-in routing with a table key, a hot key and folded fallback keys.

    Returns the routing, per-key loads and each instance's expected load,
    worked out key by key from the routing rules (000 §3.3, 001 §4.1.2, 003 §5.3).
    """
    p, active = 6, (0, 2, 3, 5)
    routing = OperatorRouting(
        parallelism=p, table={"t": 2}, hot_keys={"h": (0, 3, 5)}, active_instances=active
    )
    loads = {"t": 7.0, "h": 9.0, **{f"k{i}": 1.0 + i % 5 for i in range(60)}}
    expected = np.zeros(p)
    expected[2] += 7.0
    expected[[0, 3, 5]] += 3.0
    for i in range(60):
        expected[fold_instance(spark_partition(f"k{i}", p), active, p)] += 1.0 + i % 5
    assert any(spark_partition(f"k{i}", p) not in active for i in range(60))
    return routing, loads, expected


def test_routed_shares_route_table_hot_and_folded_fallback_keys() -> None:
    routing, loads, expected = scaled_routing_and_loads()
    keys = list(loads)

    shares = routed_shares(routing, keys)

    assert shares.shape == (len(keys), 6)
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    np.testing.assert_allclose(shares[:, [1, 4]], 0.0)
    assert shares[0].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(shares[1], [1 / 3, 0, 0, 1 / 3, 0, 1 / 3])
    np.testing.assert_allclose(np.fromiter(loads.values(), float) @ shares, expected)


def test_every_caller_predicts_the_same_instance_loads() -> None:
    """The planner, its locality and backtest, the traffic matrix and the gate share one ruler."""
    routing, loads, expected = scaled_routing_and_loads()
    active = list(routing.active)
    keys = list(loads)
    weights = np.fromiter(loads.values(), dtype=np.float64)
    config = RoutingConfig(
        version=1,
        created_by="initial",
        operators={"A": routing, "B": OperatorRouting(parallelism=6, table={"x": 1})},
    )
    pairs = pd.DataFrame({"stage": "A", "a": keys, "b": "x", "count": weights})
    traffic = stats.traffic_matrix(pairs, config, ("A", "B")).groupby("a_instance")["tuples"].sum()
    prediction = quality.OperatorPrediction(1.0, 0.5, 0.5, key_loads=loads)
    _, summary = quality.config_frames(
        RoutingConfig(version=1, created_by="initial", operators={"A": routing}),
        {"A": prediction},
    )

    np.testing.assert_allclose(predicted_instance_loads(routing, loads), expected[active])
    np.testing.assert_allclose(quality.predicted_instance_loads(routing, loads), expected[active])
    np.testing.assert_allclose(planning.instance_loads(routing, loads), expected[active])
    np.testing.assert_allclose((weights @ routed_shares(routing, keys))[active], expected[active])
    np.testing.assert_allclose(traffic.reindex(range(6), fill_value=0.0), expected)
    assert summary.iloc[0]["load_max_over_mean"] == pytest.approx(
        planning.imbalance(expected[active])
    )


def test_a_route_outside_the_instances_carries_no_load() -> None:
    """A routing built without validation reaches the gate; it must be judged, not crash."""
    routing = OperatorRouting.model_construct(
        parallelism=4,
        table={"in": 1, "above": 4, "below": -1},
        hot_keys={"h": (0, 9), "empty": ()},
        active_instances=None,
    )
    loads = {"in": 1.0, "above": 2.0, "below": 4.0, "h": 8.0, "empty": 16.0}

    shares = routed_shares(routing, list(loads))

    assert predicted_instance_loads(routing, loads).tolist() == [4.0, 1.0, 0.0, 0.0]
    assert shares.sum(axis=1).tolist() == [1.0, 0.0, 0.0, 0.5, 0.0]
    assert predicted_instance_loads(routing, {}).tolist() == [0.0] * 4


# Against a real SparkSession.


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[1]")
        .appName("test_routedkeys")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.fixture(scope="module")
def routed_200() -> tuple[RoutedKeyTable, list[str]]:
    """200 routed keys over 4 instances: 180 tabled keys and 5 hot keys split 4 ways."""
    rng = random.Random(3)
    tabled = list(dict.fromkeys(random_strings(400, seed=13)))[:180]
    routing = {key: rng.randrange(4) for key in tabled}
    hot_keys = {f"hot{i}{SEPARATOR}é": [0, 1, 2, 3] for i in range(5)}
    table = RoutedKeyTable(n_instances=4, routing=routing, hot_keys=hot_keys)
    routed = [r for key in [*routing, *hot_keys] for r in table.route(key)]
    assert len(set(routed)) == 200
    return table, routed


@pytest.mark.integration
def test_string_hash_equals_spark_hash(spark: SparkSession) -> None:
    strings = random_strings(3000, seed=17)
    frame = spark.createDataFrame(list(enumerate(strings)), "i long, s string")
    rows = frame.select("i", F.hash("s").alias("h")).collect()
    spark_hashes = [row.h for row in sorted(rows, key=lambda row: row.i)]
    assert spark_hashes == [spark_hash_string(s) for s in strings]
    assert spark_hashes == spark_hash_strings(strings).tolist()


@pytest.mark.integration
def test_long_hash_equals_spark_hash(spark: SparkSession) -> None:
    rng = random.Random(19)
    extremes = [0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]
    values = extremes + [rng.randint(-(2**63), 2**63 - 1) for _ in range(500)]
    frame = spark.createDataFrame(list(enumerate(values)), "i long, v long")
    rows = frame.select("i", F.hash("v").alias("h")).collect()
    spark_hashes = [row.h for row in sorted(rows, key=lambda row: row.i)]
    assert spark_hashes == [spark_hash_long(v) for v in values]


@pytest.mark.integration
def test_routed_keys_land_on_their_partition_when_repartitioned(
    spark: SparkSession, routed_200: tuple[RoutedKeyTable, list[str]]
) -> None:
    """``repartition(n, col)`` is ``HashPartitioning``, the stateful operators' partitioning."""
    table, routed = routed_200
    frame = spark.createDataFrame([(r,) for r in routed], "rk string")
    rows = frame.repartition(4, "rk").select("rk", F.spark_partition_id().alias("p")).collect()
    assert sorted((row.rk, row.p) for row in rows) == sorted(
        (r, table.instance_of(r)) for r in routed
    )


@pytest.mark.integration
def test_routed_keys_land_on_their_partition_in_a_stateful_operator(
    spark: SparkSession, routed_200: tuple[RoutedKeyTable, list[str]], tmp_path: Path
) -> None:
    """A streaming ``applyInPandasWithState`` runs each routed key's group on its instance.

    Two micro-batches: the 50 keys seen again in the second find their state
    from the first, on the same instance.
    """
    table, routed = routed_200
    (tmp_path / "in").mkdir()
    pd.DataFrame({"rk": routed}).to_parquet(tmp_path / "in" / "0.parquet")
    pd.DataFrame({"rk": routed[:50]}).to_parquet(tmp_path / "in" / "1.parquet")
    collected: list[tuple[str, int, int]] = []

    def partition_of_each_group(
        key: tuple[str], frames: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        """Count the group's rows in its state; emit the task (state partition) that ran it.

        Defined here so that cloudpickle ships it by value to Spark's Python worker.
        """
        context = TaskContext.get()
        assert context is not None
        seen = (state.get[0] if state.exists else 0) + sum(len(frame) for frame in frames)
        state.update((seen,))
        yield pd.DataFrame({"rk": [key[0]], "p": [context.partitionId()], "seen": [seen]})

    def collect(batch: DataFrame, batch_id: int) -> None:
        collected.extend((row.rk, row.p, row.seen) for row in batch.collect())

    query = (
        spark.readStream.schema("rk string")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(tmp_path / "in"))
        .groupBy("rk")
        .applyInPandasWithState(
            partition_of_each_group,
            "rk string, p int, seen long",
            "seen long",
            "update",
            GroupStateTimeout.NoTimeout,
        )
        .writeStream.outputMode("update")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .foreachBatch(collect)
        .start()
    )
    query.awaitTermination()
    first = [(r, table.instance_of(r), 1) for r in routed]
    second = [(r, table.instance_of(r), 2) for r in routed[:50]]
    assert sorted(collected) == sorted(first + second)
