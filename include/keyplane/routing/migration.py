"""Migration plans: which instance sends which key's state where (paper 000 §3.4).

When a new routing configuration replaces the old one, every key whose
location changes must have its state moved before its tuples are processed
at the new location. Paper 000 §3.4 sends each instance the keys it must send
(with their recipients) and the keys it must expect, and reconfigures the
operators in DAG order, upstream first, so that an instance that has handed a
key over no longer receives tuples for it. (In a micro-batch job the batch
boundary gives that guarantee, so keyplane's operators may all switch in one
batch: :mod:`keyplane.control.job_protocol` and `keyplane.control.controller_protocol`.)

A key's *location* in one configuration is its table entry, else its hot-key
instance set (each holding a partial state, paper 001 §4.2), else the hash
fallback. Moving from location S to location D:

* an instance of S that is also in D keeps its state (or partial);
* every other instance of S sends its state to an instance of D, round robin
  over D in order, and the receiver merges it into what it holds — partials of
  a split key combine, so any receiver of D is correct;
* an instance of D that neither held the key nor receives it opens an empty
  partial (a freshly split hot key).

This covers a plain move (1 → 1), a split (1 → d), a merge (d → 1) and a
re-split (d → d'), and also scale-out and scale-in, where the hash fallback
itself changes with the parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from keyplane.routing.config import OperatorRouting, RoutingConfig, check_same_operators
from keyplane.routing.routedkeys import fold_instance

Fallback = Callable[[str, int], int]
"""``fallback(key, parallelism)``: the instance hashing gives a key (Spark's
``pmod(hash(key), P)`` at the edge), before :func:`location` folds it onto a
scaled-in operator's active instances."""

Assignment = Mapping[str, Mapping[str, frozenset[int]]]
"""Operator → key → the instances holding the key's state (or its partials)."""

MoveKind = Literal["move", "split", "merge", "resplit"]


class StalePlanError(ValueError):
    """A plan was applied to state that is not where the plan expects it."""


def location(operator: OperatorRouting, key: str, fallback: Fallback) -> tuple[int, ...]:
    """Where ``key`` lives under ``operator``'s routing: table, hot set, else hash.

    The hash instance of a scaled-in operator is folded onto its active
    instances (:func:`keyplane.routing.routedkeys.fold_instance`), as the job folds
    it: a key hashed to a released instance lives where the fold puts it, so
    a plan that stopped at the hash would list moves the job never makes.
    """
    if key in operator.table:
        return (operator.table[key],)
    if key in operator.hot_keys:
        return operator.hot_keys[key]
    instance = fallback(key, operator.parallelism)
    if not 0 <= instance < operator.parallelism:
        raise ValueError(
            f"fallback({key!r}, {operator.parallelism}) returned {instance}, "
            f"outside [0, {operator.parallelism})"
        )
    if operator.active_instances is not None:
        instance = fold_instance(instance, operator.active_instances, operator.parallelism)
    return (instance,)


@dataclass(frozen=True)
class Transfer:
    """``source`` sends the state it holds for ``key`` to ``target``."""

    key: str
    source: int
    target: int


@dataclass(frozen=True)
class KeyMove:
    """A key whose location changes from ``old`` to ``new``."""

    key: str
    old: tuple[int, ...]
    new: tuple[int, ...]

    @property
    def kind(self) -> MoveKind:
        if len(self.old) == 1:
            return "move" if len(self.new) == 1 else "split"
        return "merge" if len(self.new) == 1 else "resplit"


@dataclass(frozen=True)
class OperatorMigration:
    """The reconfiguration message of 000 §3.4 for every instance of one operator.

    ``send[i]`` lists what instance i sends (``reconfiguration_send``),
    ``receive[i]`` what it must expect (``reconfiguration_receive``);
    ``opened`` lists (key, instance) pairs that start an empty partial.
    ``examined_keys`` are all the keys whose locations were compared.
    ``rehashed``: the hash fallback changed (the parallelism or the active
    instances), so a key outside both tables may have moved too.
    """

    operator: str
    old_parallelism: int
    new_parallelism: int
    moves: tuple[KeyMove, ...]
    send: Mapping[int, tuple[Transfer, ...]]
    receive: Mapping[int, tuple[Transfer, ...]]
    opened: tuple[tuple[str, int], ...]
    examined_keys: frozenset[str]
    rehashed: bool = False

    @property
    def moved_keys(self) -> tuple[str, ...]:
        return tuple(move.key for move in self.moves)

    @property
    def splits(self) -> tuple[KeyMove, ...]:
        """Keys that become hot or change their hot instance set."""
        return tuple(move for move in self.moves if move.kind in ("split", "resplit"))

    @property
    def merges(self) -> tuple[KeyMove, ...]:
        """Hot keys that go back to a single instance."""
        return tuple(move for move in self.moves if move.kind == "merge")

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(transfer for source in sorted(self.send) for transfer in self.send[source])


@dataclass(frozen=True)
class MigrationCost:
    """How much a migration moves.

    ``state_bytes`` is ``None`` when no state sizes were given; a transfer of a
    key held by k instances counts 1/k of the key's size (partials assumed even).
    """

    keys: int
    transfers: int
    state_bytes: int | None


@dataclass(frozen=True)
class MigrationPlan:
    """Per-operator migrations in the order to run them (upstream first)."""

    old_version: int
    new_version: int
    operators: tuple[OperatorMigration, ...]
    cost: MigrationCost

    @property
    def operator_order(self) -> tuple[str, ...]:
        return tuple(migration.operator for migration in self.operators)

    def operator(self, name: str) -> OperatorMigration:
        for migration in self.operators:
            if migration.operator == name:
                return migration
        raise KeyError(f"the plan has no operator {name!r}; it has {list(self.operator_order)}")


def _migrate_operator(
    name: str,
    old: OperatorRouting,
    new: OperatorRouting,
    keys: set[str],
    fallback: Fallback,
) -> OperatorMigration:
    moves: list[KeyMove] = []
    send: dict[int, list[Transfer]] = {}
    receive: dict[int, list[Transfer]] = {}
    opened: list[tuple[str, int]] = []
    for key in sorted(keys):
        before = location(old, key, fallback)
        after = location(new, key, fallback)
        if set(before) == set(after):
            continue
        moves.append(KeyMove(key, before, after))
        leaving = [instance for instance in before if instance not in after]
        targets = set()
        for index, source in enumerate(leaving):
            target = after[index % len(after)]
            transfer = Transfer(key, source, target)
            send.setdefault(source, []).append(transfer)
            receive.setdefault(target, []).append(transfer)
            targets.add(target)
        opened.extend(
            (key, instance)
            for instance in after
            if instance not in before and instance not in targets
        )
    return OperatorMigration(
        operator=name,
        old_parallelism=old.parallelism,
        new_parallelism=new.parallelism,
        moves=tuple(moves),
        send={instance: tuple(items) for instance, items in sorted(send.items())},
        receive={instance: tuple(items) for instance, items in sorted(receive.items())},
        opened=tuple(opened),
        examined_keys=frozenset(keys),
        rehashed=(old.parallelism, old.active) != (new.parallelism, new.active),
    )


def _resolve_order(
    old: RoutingConfig, new: RoutingConfig, operator_order: Sequence[str] | None
) -> list[str]:
    check_same_operators(old, new)
    order = list(new.operators) if operator_order is None else list(operator_order)
    if sorted(order) != sorted(new.operators):
        raise ValueError(
            f"operator_order {order} must list each operator {sorted(new.operators)} exactly once"
        )
    return order


def plan_migration(
    old: RoutingConfig,
    new: RoutingConfig,
    fallback: Fallback,
    *,
    operator_order: Sequence[str] | None = None,
    keys: Mapping[str, Iterable[str]] | None = None,
    state_bytes: Mapping[str, Mapping[str, int]] | None = None,
) -> MigrationPlan:
    """Plan the state moves that take every operator from ``old`` to ``new`` (000 §3.4).

    The plan covers every key in either configuration's table or hot keys,
    plus the keys in ``keys`` and ``state_bytes`` per operator. Keys outside
    both configurations only move when the hash fallback changes (the
    parallelism, or the active instances a scaled-in operator folds onto):
    then pass every key holding state, or they are not planned.
    ``operator_order`` is upstream first; by default it is ``new``'s operator
    order.
    """
    order = _resolve_order(old, new, operator_order)
    migrations = []
    n_transfers = 0
    total_bytes = 0.0
    for name in order:
        before, after = old.operators[name], new.operators[name]
        universe = set(before.table) | set(before.hot_keys) | set(after.table)
        universe |= set(after.hot_keys)
        if keys is not None:
            universe.update(keys.get(name, ()))
        sizes = state_bytes.get(name, {}) if state_bytes is not None else {}
        universe.update(sizes)
        migration = _migrate_operator(name, before, after, universe, fallback)
        migrations.append(migration)
        holders = {move.key: len(move.old) for move in migration.moves}
        for transfer in migration.transfers:
            n_transfers += 1
            total_bytes += sizes.get(transfer.key, 0) / holders[transfer.key]
    cost = MigrationCost(
        keys=sum(len(migration.moves) for migration in migrations),
        transfers=n_transfers,
        state_bytes=None if state_bytes is None else round(total_bytes),
    )
    return MigrationPlan(old.version, new.version, tuple(migrations), cost)


def assignment(
    config: RoutingConfig, keys: Mapping[str, Iterable[str]], fallback: Fallback
) -> dict[str, dict[str, frozenset[int]]]:
    """Where each of ``keys`` lives under ``config``, per operator."""
    return {
        name: {
            key: frozenset(location(config.operators[name], key, fallback)) for key in operator_keys
        }
        for name, operator_keys in keys.items()
    }


def apply(plan: MigrationPlan, old_assignment: Assignment) -> dict[str, dict[str, frozenset[int]]]:
    """Carry out the plan's transfers on an assignment of state to instances.

    This replays exactly what the instances are told: each ``send`` removes
    the key from its source and adds it to its target, and each opened partial
    adds an instance. A key absent from ``old_assignment`` has no state and is
    skipped. A key held elsewhere than the plan expects raises
    :class:`StalePlanError`, as does a key the plan never examined in an
    operator whose hash fallback changes (its hash location may have moved).
    """
    result = {name: dict(holders) for name, holders in old_assignment.items()}
    for migration in plan.operators:
        holders = result.get(migration.operator)
        if holders is None:
            continue
        planned = {move.key: move for move in migration.moves}
        for key, instances in holders.items():
            move = planned.get(key)
            if move is not None and set(move.old) != instances:
                raise StalePlanError(
                    f"{migration.operator}: key {key!r} is held by {sorted(instances)}, "
                    f"but the plan moves it from {sorted(move.old)}"
                )
        if migration.rehashed:
            unplanned = [key for key in holders if key not in migration.examined_keys]
            _check_unplanned_on_rescale(migration, unplanned)
        working = {key: set(holders[key]) for key in planned if key in holders}
        for transfer in migration.transfers:
            if transfer.key in working:
                working[transfer.key].discard(transfer.source)
                working[transfer.key].add(transfer.target)
        for key, instance in migration.opened:
            if key in working:
                working[key].add(instance)
        holders.update({key: frozenset(instances) for key, instances in working.items()})
    return result


def _check_unplanned_on_rescale(migration: OperatorMigration, unplanned: list[str]) -> None:
    if unplanned:
        shown = ", ".join(repr(key) for key in unplanned[:5])
        raise StalePlanError(
            f"{migration.operator}: the hash fallback changes (parallelism "
            f"{migration.old_parallelism} → {migration.new_parallelism}, or the active "
            f"instances), but keys {shown} hold state and are not in the plan; pass every "
            "stateful key to plan_migration(keys=...)"
        )
