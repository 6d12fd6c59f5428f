"""Text reports of stored routing configurations, for ``keyplane config show|diff``.

An operator deciding whether to publish or roll back a configuration needs to
see what it routes and what switching to it would move, without reading
Parquet files. The diff is computed with the same planner the control plane
runs (:func:`keyplane.routing.migration.plan_migration`) and the same hash fallback as
Spark (:func:`keyplane.routing.routedkeys.spark_partition`), so the keys it reports are
the keys a reconfiguration would really migrate.

This module only builds text; the command line reads the store and prints.
"""

from __future__ import annotations

from collections.abc import Sequence

from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.migration import Fallback, OperatorMigration, plan_migration
from keyplane.routing.routedkeys import spark_partition

TOP = 10
"""How many hot keys or moved keys a report lists per operator: enough to
recognise a change, few enough to read in a terminal."""


def _key(key: str) -> str:
    """The key as typed, unless printing it raw would break a report line."""
    return key if key.isprintable() and key.strip() == key and key else repr(key)


def _where(instances: Sequence[int]) -> str:
    """One instance as a number, a split key's instances as a list."""
    return str(instances[0]) if len(instances) == 1 else str(list(instances))


def _more(total: int, shown: int) -> list[str]:
    return [f"    ... and {total - shown} more"] if total > shown else []


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _operator_lines(name: str, operator: OperatorRouting, top: int) -> list[str]:
    lines = [
        f"operator {name}: parallelism {operator.parallelism}, "
        f"{_plural(len(operator.table), 'tabled key')}, "
        f"{_plural(len(operator.hot_keys), 'hot key')}"
    ]
    if operator.hot_keys:
        # No frequencies are stored, so the keys split widest come first.
        ranked = sorted(operator.hot_keys.items(), key=lambda item: (-len(item[1]), item[0]))
        lines.append(f"  hot keys (widest {min(top, len(ranked))}):")
        lines.extend(
            f"    {_key(key)}: d={len(instances)} {list(instances)}"
            for key, instances in ranked[:top]
        )
        lines.extend(_more(len(ranked), top))
    per_instance = [0] * operator.parallelism
    for instance in operator.table.values():
        per_instance[instance] += 1
    lines.append("  tabled keys per instance:")
    lines.extend(f"    {i}: {count}" for i, count in enumerate(per_instance))
    return lines


def render_config(config: RoutingConfig, checksum: str, top: int = TOP) -> str:
    """Describe one stored version: lineage, checksum and every operator's routing."""
    parent = "none (initial)" if config.parent_version is None else str(config.parent_version)
    lines = [
        f"version {config.version}",
        f"parent: {parent}",
        f"created by {config.created_by} at {config.created_at.isoformat()}",
        f"checksum: {checksum}",
    ]
    for name, operator in config.operators.items():
        lines.extend(_operator_lines(name, operator, top))
    return "\n".join(lines)


def _hot_key_lines(old: OperatorRouting, new: OperatorRouting) -> list[str]:
    added = sorted(set(new.hot_keys) - set(old.hot_keys))
    removed = sorted(set(old.hot_keys) - set(new.hot_keys))
    resized = sorted(
        key
        for key in set(old.hot_keys) & set(new.hot_keys)
        if len(old.hot_keys[key]) != len(new.hot_keys[key])
    )
    lines = []
    if added:
        lines.append(f"  hot keys added: {len(added)}")
        lines.extend(f"    {_key(k)}: d 1 → {len(new.hot_keys[k])}" for k in added)
    if removed:
        lines.append(f"  hot keys removed: {len(removed)}")
        lines.extend(f"    {_key(k)}: d {len(old.hot_keys[k])} → 1" for k in removed)
    if resized:
        lines.append(f"  hot keys resized: {len(resized)}")
        lines.extend(
            f"    {_key(k)}: d {len(old.hot_keys[k])} → {len(new.hot_keys[k])}" for k in resized
        )
    return lines


def _migration_lines(
    migration: OperatorMigration, old: OperatorRouting, new: OperatorRouting, top: int
) -> list[str]:
    p_old, p_new = migration.old_parallelism, migration.new_parallelism
    header = f"operator {migration.operator}: parallelism {p_old}"
    lines = [header if p_old == p_new else f"{header} → {p_new}"]
    if p_old != p_new:
        # The plan only knows the keys either configuration names; rehashed
        # keys that hold state elsewhere are invisible to a config-only diff.
        lines.append("  note: hash-routed keys outside both configurations also move; not counted")
    lines.append(f"  moved keys: {len(migration.moves)}")
    lines.extend(
        f"    {_key(move.key)}: {_where(move.old)} → {_where(move.new)}"
        for move in migration.moves[:top]
    )
    lines.extend(_more(len(migration.moves), top))
    lines.extend(_hot_key_lines(old, new))
    instances = sorted(set(migration.send) | set(migration.receive))
    if instances:
        lines.append("  transfers per instance:")
        lines.extend(
            f"    {i}: sends {len(migration.send.get(i, ()))}, "
            f"receives {len(migration.receive.get(i, ()))}"
            for i in instances
        )
    lines.append(
        f"  estimated cost: {_plural(len(migration.moves), 'key')}, "
        f"{_plural(len(migration.transfers), 'transfer')}"
    )
    return lines


def render_diff(
    old: RoutingConfig,
    new: RoutingConfig,
    fallback: Fallback = spark_partition,
    top: int = TOP,
) -> str:
    """What replacing ``old`` by ``new`` changes and moves, operator by operator.

    Operators come in ``new``'s order (upstream first), the order a
    reconfiguration runs them in. Both versions must route the same operators,
    as the planner requires; otherwise :class:`ValueError` says which differ.
    """
    plan = plan_migration(old, new, fallback)
    lines = [f"diff version {old.version} → {new.version}"]
    for migration in plan.operators:
        name = migration.operator
        lines.extend(_migration_lines(migration, old.operators[name], new.operators[name], top))
    lines.append(
        f"estimated migration cost: {_plural(plan.cost.keys, 'key')}, "
        f"{_plural(plan.cost.transfers, 'transfer')}"
    )
    return "\n".join(lines)
