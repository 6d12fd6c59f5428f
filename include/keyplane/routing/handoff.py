"""State hand-off between routed keys: what moves where when a version changes.

Paper 000 §3.4 moves the state of every key whose location changes from its
old instance to its new one. On Spark a location is a *routed key*
(:mod:`keyplane.routing.routedkeys`): the grouping value whose hash lands on the
instance, and the state store keeps one state per grouping value. So a hand-off
is a list of :class:`StateMove` — "the state of routed key ``source`` goes to
routed key ``target``" — computed here from two stored configurations.

The rule is :func:`keyplane.routing.migration.plan_migration`'s, applied to routed
keys rather than instances: a routed key that stays keeps its state; a
leaving one sends it to the new routed key on its own instance if there is
one (no network transfer), else round robin over the new routed keys. Routed
keys matter because a key can keep its instance and still change routed key:
a key that becomes hot keeps its natural instance among its d, but under a
salted routed key, so its state must move within the instance. A split
(1 → d) moves the whole state to one of the d routed keys and the others start
empty; a merge (d → 1) sends every partial to the single new routed key,
which adds them up (paper 001 §4.1.2: the partial states of a hot key
combine).

The hand-off itself runs in the job (:mod:`keyplane.spark.routed_counts`):
in the *switch* batch the old group processes its last tuples, then emits its
state and clears it; the state travels through the migration topic; in the
next batch the new group installs it before it processes any tuple. Installs
are idempotent: every move carries the plan id of its switch batch (its
``marker``), and a group that has installed a marker ignores that marker again.

Everything here is pure Python: no Spark, no Kafka.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.routedkeys import RoutedKeyTable


@dataclass(frozen=True)
class StateMove:
    """The state of ``key`` held under routed key ``source`` goes to routed key ``target``."""

    operator: str
    key: str
    source: str
    target: str


def routed_key_table(routing: OperatorRouting) -> RoutedKeyTable:
    """The salted grouping values of one operator's table and hot keys."""
    return RoutedKeyTable(
        n_instances=routing.parallelism,
        routing=routing.table,
        hot_keys={key: list(instances) for key, instances in routing.hot_keys.items()},
        active=routing.active_instances,
    )


def operator_routing(config: RoutingConfig, operator: str, parallelism: int) -> OperatorRouting:
    """``operator``'s routing in ``config``; an operator it leaves out takes the hash fallback."""
    return config.operators.get(operator, OperatorRouting(parallelism=parallelism))


class LeastLoadedRoutes:
    """Greedy-d over one reader's own counts: a hot key's tuple takes the route
    whose instance this reader has sent the fewest tuples (001 §4.1.2).

    Partial key grouping needs no global view: each source balances what it
    sends with its local estimate of the load, and the sum of balanced
    sources is balanced. Every tuple counts, a hot key's or not, so a hot
    key's tuples fill the instances its neighbours leave light: a uniform
    spread of the hot key left stage A at 1.20 max/avg, because the cold keys
    are not spread evenly, and its slowest task set the stage's duration.

    Unlike FISH's least-loaded worker, the choice depends on nothing but the
    tuples this reader has routed before, in offset order: one reader takes
    one Kafka partition's offset range of a batch, which the offset log
    fixes, so a replayed batch routes every tuple as it did the first time.
    Ties go to the earlier route. ``instances_of`` gives routes' instances;
    it is asked once per route, for many at a time where it can be. With
    ``split`` false (a version that splits no key), every key has one route
    and nothing is counted.
    """

    def __init__(
        self, instances_of: Callable[[Sequence[str]], list[int]], *, split: bool = True
    ) -> None:
        self._instances_of = instances_of
        self._split = split
        self._instances: dict[str, int] = {}
        self.load: dict[int, int] = {}

    def pick_all(self, keys: Sequence[str], routes: Mapping[str, Sequence[str]]) -> list[str]:
        """The routes of tuples with ``keys``, in order; ``routes`` holds each key's routes."""
        if not self._split:
            return [routes[key][0] for key in keys]
        self._learn(routes)
        return [self.pick(routes[key]) for key in keys]

    def pick_heaviest_first(
        self, keys: Sequence[str], routes: Mapping[str, Sequence[str]], tuples: Sequence[int]
    ) -> list[str]:
        """The routes of rows that each carry ``tuples`` tuples of a key, in order.

        For rows that combine many tuples, whose order is not the stream's:
        the rows of unsplit keys are counted first, then the split keys' rows
        take their routes heaviest first, the greedy order that balances best
        (longest processing time first).
        """
        if not self._split:
            return [routes[key][0] for key in keys]
        self._learn(routes)
        picked = [""] * len(keys)
        split = [i for i, key in enumerate(keys) if len(routes[key]) > 1]
        for i, key in enumerate(keys):
            if len(routes[key]) == 1:
                picked[i] = self.pick(routes[key], tuples[i])
        for i in sorted(split, key=lambda i: -tuples[i]):
            picked[i] = self.pick(routes[keys[i]], tuples[i])
        return picked

    def pick(self, routes: Sequence[str], tuples: int = 1) -> str:
        """The route of ``tuples`` tuples of one key among its ``routes``, counted as sent."""
        if not self._split:
            return routes[0]
        if len(routes) == 1:
            route = routes[0]
        else:
            route = min(routes, key=lambda r: self.load.get(self._instance(r), 0))
        instance = self._instance(route)
        self.load[instance] = self.load.get(instance, 0) + tuples
        return route

    def _learn(self, routes: Mapping[str, Sequence[str]]) -> None:
        """Look up the instances of routes not seen before, all in one call."""
        fresh = list({r for rs in routes.values() for r in rs if r not in self._instances})
        self._instances.update(zip(fresh, self._instances_of(fresh), strict=True))

    def _instance(self, route: str) -> int:
        instance = self._instances.get(route)
        if instance is None:
            instance = self._instances[route] = self._instances_of([route])[0]
        return instance


def state_moves(
    old: RoutingConfig,
    new: RoutingConfig,
    operator: str,
    parallelism: int,
    *,
    old_table: RoutedKeyTable | None = None,
    new_table: RoutedKeyTable | None = None,
) -> tuple[StateMove, ...]:
    """The routed-key hand-offs that take ``operator`` from ``old`` to ``new`` (000 §3.4).

    ``parallelism`` is the query's number of state partitions; both versions
    must route the operator over exactly that many instances, because Spark
    fixes the state partitions for the life of a checkpoint.

    Only keys one of the two versions names (table or hot keys) are
    compared: the state store cannot be listed from here. A version that
    changes the hash fallback, such as a scaled one (``active_instances``,
    003), must therefore table every key whose route the change would move;
    :func:`keyplane.algorithms.scaling.scaled_routing` does.
    """
    before = operator_routing(old, operator, parallelism)
    after = operator_routing(new, operator, parallelism)
    for version, routing in ((old.version, before), (new.version, after)):
        if routing.parallelism != parallelism:
            raise ValueError(
                f"v{version} routes {operator} over {routing.parallelism} instances, but the "
                f"query has {parallelism} state partitions"
            )
    old_table = old_table or routed_key_table(before)
    new_table = new_table or routed_key_table(after)
    keys = set(before.table) | set(before.hot_keys) | set(after.table) | set(after.hot_keys)
    changed = []
    for key in sorted(keys):
        old_routes, new_routes = old_table.route(key), new_table.route(key)
        if set(old_routes) != set(new_routes):
            changed.append((key, old_routes, new_routes))
    # A rollout can move tens of thousands of keys, most of them hashed on one
    # side: their instances are hashed in one vectorised call, not key by key.
    old_of = _instances(old_table, [r for _, routes, _ in changed for r in routes])
    new_of = _instances(new_table, [r for _, _, routes in changed for r in routes])
    moves = []
    for key, old_routes, new_routes in changed:
        on_instance = {new_of[routed]: routed for routed in new_routes}
        leaving = [routed for routed in old_routes if routed not in new_routes]
        for index, source in enumerate(leaving):
            target = on_instance.get(old_of[source], new_routes[index % len(new_routes)])
            moves.append(StateMove(operator, key, source, target))
    return tuple(moves)


def _instances(table: RoutedKeyTable, grouping_keys: list[str]) -> dict[str, int]:
    return dict(zip(grouping_keys, table.instances_of(grouping_keys), strict=True))


KEPT_VERSIONS = 4
"""Versions whose tables a process keeps: a rollout needs two, and a job that
runs for months meets a new version at every rollout."""


class VersionedTables:
    """Routed-key tables of stored versions, loaded once per process.

    The job's Python workers route tuples by the version their micro-batch
    was planned with; they read that version from the configuration store
    (verifying its checksum, :func:`keyplane.routing.config.load`) the first time
    they need it and keep the tables for the next batches. Each cache keeps
    the most recently used :data:`KEPT_VERSIONS` versions, since a table
    holds every routed key of its version; an older one is read again if a
    replayed batch asks for it.
    """

    def __init__(self, store: Path | str, parallelism: int) -> None:
        self.store = Path(store)
        self.parallelism = parallelism
        self.config = functools.lru_cache(maxsize=KEPT_VERSIONS)(self._config)
        self.table = functools.lru_cache(maxsize=2 * KEPT_VERSIONS)(self._table)
        self.moves = functools.lru_cache(maxsize=KEPT_VERSIONS)(self._moves)

    def _config(self, version: int) -> RoutingConfig:
        return config_store.load(self.store, version)

    def routing(self, version: int, operator: str) -> OperatorRouting:
        """``operator``'s routing in a stored version, checked against the query's partitions.

        Everything a table could refuse short of building it: the store's
        checksums and the configuration's own invariants (:func:`keyplane.routing.config.load`),
        and the instance count, which Spark fixes for the checkpoint's life.
        """
        routing = operator_routing(self.config(version), operator, self.parallelism)
        if routing.parallelism != self.parallelism:
            raise ValueError(
                f"v{version} routes {operator} over {routing.parallelism} instances, but "
                f"the query has {self.parallelism} state partitions"
            )
        return routing

    def _table(self, version: int, operator: str) -> RoutedKeyTable:
        return routed_key_table(self.routing(version, operator))

    def _moves(self, operator: str, from_version: int, to_version: int) -> tuple[StateMove, ...]:
        """:func:`state_moves` between two stored versions, computed once per process:
        every task of a switch batch that emits a share of them asks for all of them."""
        return state_moves(
            self.config(from_version),
            self.config(to_version),
            operator,
            self.parallelism,
            old_table=self.table(from_version, operator),
            new_table=self.table(to_version, operator),
        )
