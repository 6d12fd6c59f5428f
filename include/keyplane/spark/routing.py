"""Routed stages: group each stateful stage by a routed key from a routing config.

A :class:`~keyplane.config.RoutingConfig` says, per stateful operator, which
keys a routing table pins to an instance (paper 000 §3.3) and which hot keys
are split over several instances (paper 001 §4.1.2). :mod:`keyplane.routedkeys`
turns that into grouping values: a routed key ``key#salt`` whose Spark hash
lands on the wanted partition. This module puts those values on the data path.

Why a broadcast join. The table is computed once, on the driver, into a small
mapping DataFrame ``key → routes`` (the key's routed keys). Each micro-batch
joins its rows to it with a broadcast left join, so every executor gets the
table once per batch and routes its rows with native Spark expressions: no
Python UDF on the data path, so no row leaves the JVM before the stateful
operator that needs it, and keys outside the table cost one hash lookup.
Keys absent from the table (the left join's nulls) take the hash fallback of
paper 000 §3.3: the key itself, unless it contains the separator, in which
case it is salted to its own natural partition exactly as
:meth:`RoutedKeyTable.route <keyplane.routedkeys.RoutedKeyTable.route>` does
(the same smallest-salt search, written as a Spark higher-order function).

Hot keys. A key with d routed keys sends each row to
``routes[pmod(hash(spread columns), d)]``. FISH (001 §4.2) picks the worker
with the shortest estimated waiting time; that choice depends on timing, so
a replayed micro-batch could route a tuple elsewhere and break exactly-once.
A hash of the row's own fields is deterministic, so a replay routes every
row exactly as before, and it still spreads a hot key's rows evenly.

Towards live reconfiguration. The stateful functions never see the
configuration: they recover the original key from whatever routed key they
are given (:func:`keyplane.routedkeys.original_key`). So the configuration
only enters through :class:`RouteMapping`, a value built from one config
version; choosing a different mapping per batch (000 §3.4) changes nothing
downstream of :func:`with_routed_key`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from keyplane.config import OperatorRouting, RoutingConfig
from keyplane.routedkeys import SEPARATOR, TRIES_PER_PARTITION, RoutedKeyTable

STAGE_A = "A"
STAGE_B = "B"
MAPPING_SCHEMA = "key STRING, routes ARRAY<STRING>"

_KEY = "__keyplane_mapping_key"
_ROUTES = "__keyplane_mapping_routes"


@dataclass(frozen=True)
class RouteMapping:
    """One operator's routing under one config version, ready to join.

    ``frame`` has one row per tabled or hot key (:data:`MAPPING_SCHEMA`); the
    routed keys of a hot key are listed in the order of its instances.
    ``n_instances`` is the operator's parallelism, which must equal the
    query's number of state partitions.
    """

    version: int
    n_instances: int
    frame: DataFrame


@dataclass(frozen=True)
class RoutedStages:
    """The mappings of the reference job's two stateful stages, A then B."""

    version: int
    a: RouteMapping
    b: RouteMapping


def routed_key_table(routing: OperatorRouting) -> RoutedKeyTable:
    """The salted grouping values of one operator's table and hot keys (pure)."""
    return RoutedKeyTable(
        n_instances=routing.parallelism,
        routing=routing.table,
        hot_keys={key: list(instances) for key, instances in routing.hot_keys.items()},
    )


def mapping_rows(routing: OperatorRouting) -> pd.DataFrame:
    """``key, routes`` for every tabled and hot key of one operator (pure)."""
    table = routed_key_table(routing)
    keys = [*routing.table, *routing.hot_keys]
    return pd.DataFrame({"key": keys, "routes": [table.route(key) for key in keys]})


def route_mapping(spark: SparkSession, routing: OperatorRouting, version: int) -> RouteMapping:
    """Build one operator's mapping DataFrame on the driver."""
    rows = mapping_rows(routing)
    frame = spark.createDataFrame(rows, MAPPING_SCHEMA) if len(rows) else _empty(spark)
    return RouteMapping(version=version, n_instances=routing.parallelism, frame=frame)


def _empty(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([], MAPPING_SCHEMA)


def routed_stages(
    spark: SparkSession, config: RoutingConfig, state_partitions: int | None = None
) -> RoutedStages:
    """The mappings of operators ``"A"`` and ``"B"`` of ``config``.

    Both operators must have ``parallelism == state_partitions`` (default: the
    session's ``spark.sql.shuffle.partitions``), since a routed key is salted
    for exactly that many partitions. An operator missing from ``config``
    takes the hash fallback for every key.

    The routed keys are the grouping keys of the checkpointed state, so a
    checkpoint keeps the grouping it was started with: turning routing on or
    off needs a fresh checkpoint, and a new version that changes a key's
    routed key needs the state migration of 000 §3.4 (not done here).
    """
    partitions = state_partitions
    if partitions is None:
        partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or 0)
    unknown = sorted(set(config.operators) - {STAGE_A, STAGE_B})
    if unknown:
        raise ValueError(f"the two-stage job has operators A and B, not {unknown}")
    mappings = []
    for name in (STAGE_A, STAGE_B):
        routing = config.operators.get(name, OperatorRouting(parallelism=partitions))
        if routing.parallelism != partitions:
            raise ValueError(
                f"operator {name} has parallelism {routing.parallelism}, but the query has "
                f"{partitions} state partitions; a routed key only reaches its instance when "
                "they are equal"
            )
        mappings.append(route_mapping(spark, routing, config.version))
    return RoutedStages(version=config.version, a=mappings[0], b=mappings[1])


def fallback_routed_key(key: Column, n_instances: int) -> Column:
    """The hash-fallback grouping value of ``key``, as a native Spark expression.

    Mirrors :meth:`RoutedKeyTable.route` for keys without a table entry: the
    key itself, or, when it contains the separator, ``key#salt`` with the
    smallest salt that keeps the key on its natural partition. Only such keys
    evaluate the salt search (``TRIES_PER_PARTITION * n`` hashes).
    """
    n = F.lit(n_instances)
    natural = F.pmod(F.hash(key), n)
    salts = F.sequence(F.lit(0), F.lit(TRIES_PER_PARTITION * n_instances - 1))
    hits = F.filter(
        salts,
        lambda salt: (
            F.pmod(F.hash(F.concat(key, F.lit(SEPARATOR), salt.cast("string"))), n) == natural
        ),
    )
    salt = F.coalesce(
        F.get(hits, 0),
        F.raise_error(F.concat(F.lit("no salt keeps key on its natural partition: "), key)),
    )
    salted = F.concat(key, F.lit(SEPARATOR), salt.cast("string"))
    return F.when(key.contains(SEPARATOR), salted).otherwise(key)


def with_routed_key(
    rows: DataFrame,
    key_col: str,
    mapping: RouteMapping,
    out_col: str,
    *,
    spread_by: Sequence[str] = ("seq",),
) -> DataFrame:
    """``rows`` plus ``out_col``: the routed key that groups each row's ``key_col``.

    A tabled key gets its one routed key, a hot key one of its d routed keys
    chosen by ``pmod(hash(*spread_by), d)``, any other key its hash fallback.
    ``spread_by`` must be columns that are fixed for a row across replays
    (``seq`` for events).
    """
    table = mapping.frame.select(F.col("key").alias(_KEY), F.col("routes").alias(_ROUTES))
    routes = F.col(_ROUTES)
    spread = F.pmod(F.hash(*[F.col(name) for name in spread_by]), F.size(routes))
    chosen = F.when(routes.isNotNull(), F.element_at(routes, spread + 1))
    joined = rows.join(F.broadcast(table), rows[key_col] == F.col(_KEY), "left")
    routed = F.coalesce(chosen, fallback_routed_key(F.col(key_col), mapping.n_instances))
    return joined.withColumn(out_col, routed).drop(_KEY, _ROUTES)
