"""Rollouts in waves: one large reconfiguration as a chain of smaller ones.

A rollout's moved states cost the stateful stages work in the two batches
that switch and install them: each moved state is read, evicted, shipped and
installed through Spark's keyed state store, one key at a time (paper 000
§3.4). That work does not shrink (each wave even adds a little of its own),
but it can be spread: the same moves in several waves slow each wave's two
batches less, over more batches in all (docs/benchmarks.md gives the
measured dips).

A wave is an ordinary configuration: the old one with a share of the moves
applied. Each wave is stored (checksummed) and rolled out like any other
version (PREPARE → ACK → PROPAGATE → MIGRATED → DONE), so waves need nothing
new in the job or the protocol, and a job killed between waves runs a valid
configuration. The last wave routes exactly as the target.

Every operator's moves are dealt over the waves in proportion, so each
wave carries a share of every stage's work. A rescale cannot be split:
it changes the hash fallback of every key at once.
"""

from __future__ import annotations

import math

from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.migration import Fallback, KeyMove, MigrationPlan, plan_migration


def wave_count(moves: int, max_moves_per_wave: int) -> int:
    """How many waves carry ``moves`` moved keys, at most ``max_moves_per_wave`` each."""
    if max_moves_per_wave < 1:
        raise ValueError(f"max_moves_per_wave must be at least 1, not {max_moves_per_wave}")
    return max(1, math.ceil(moves / max_moves_per_wave))


def _interleaved(plan: MigrationPlan) -> list[tuple[str, KeyMove]]:
    """Every operator's moves in one sequence, each operator's spread evenly along it.

    The i-th of an operator's n moves sits at (i + ½)/n, so any stretch of
    the sequence holds every operator's moves in proportion: a wave cut from
    it carries a share of every stage's work, not stage A's first and B's last.
    """
    placed = [
        ((index + 0.5) / len(migration.moves), order, migration.operator, move)
        for order, migration in enumerate(plan.operators)
        for index, move in enumerate(migration.moves)
    ]
    placed.sort(key=lambda item: (item[0], item[1]))
    return [(operator, move) for _, _, operator, move in placed]


def _with_moves(
    old: OperatorRouting, new: OperatorRouting, moves: list[KeyMove]
) -> OperatorRouting:
    """``old`` with each of ``moves`` routed as ``new`` routes it."""
    table = dict(old.table)
    hot_keys = dict(old.hot_keys)
    for move in moves:
        table.pop(move.key, None)
        hot_keys.pop(move.key, None)
        if move.key in new.table:
            table[move.key] = new.table[move.key]
        elif move.key in new.hot_keys:
            hot_keys[move.key] = new.hot_keys[move.key]
    return OperatorRouting.model_validate(
        {**old.model_dump(), "table": table, "hot_keys": hot_keys}
    )


def split_into_waves(
    old: RoutingConfig,
    new: RoutingConfig,
    fallback: Fallback,
    max_moves_per_wave: int,
    *,
    max_waves: int | None = None,
) -> tuple[RoutingConfig, ...]:
    """The configurations that take a job from ``old`` to ``new`` in waves.

    Each wave moves at most ``max_moves_per_wave`` keys (a hot key split or
    merged counts as one). The waves are numbered from ``new.version`` on,
    each the parent of the next, the first a child of ``old``; the last
    routes every key as ``new`` does. With no more
    moves than one wave holds, the result is ``new`` alone, as a child of
    ``old``.

    ``old`` is best the version the job runs, which need not be ``new``'s
    parent: after an aborted wave, say, the job runs the last wave it
    finished, and waves planned from there carry only the moves still to do.

    Raises ``ValueError`` when an operator's parallelism or active instances
    differ between ``old`` and ``new`` (a rescale moves in one wave: publish
    it without waves), when ``new.version`` is not newer than
    ``old.version``, or when the moves need more than ``max_waves`` waves
    (None: no limit), naming the smallest ``max_moves_per_wave`` that fits.
    """
    if new.version <= old.version:
        raise ValueError(f"version {new.version} must be newer than {old.version}")
    plan = plan_migration(old, new, fallback)
    rescaled = [
        name
        for name in plan.operator_order
        if old.operators[name].active != new.operators[name].active
        or old.operators[name].parallelism != new.operators[name].parallelism
    ]
    if rescaled:
        raise ValueError(
            f"operators {rescaled} change their instances: a rescale moves every key's "
            "hash instance at once, so it rolls out in one wave"
        )
    waves = wave_count(plan.cost.keys, max_moves_per_wave)
    if max_waves is not None and waves > max_waves:
        raise ValueError(
            f"{plan.cost.keys:,} moved keys at most {max_moves_per_wave:,} a wave make "
            f"{waves:,} waves, more than the {max_waves:,} allowed: raise max_moves_per_wave "
            f"to at least {math.ceil(plan.cost.keys / max_waves):,}"
        )
    if waves == 1:
        return (_wave(new, 1, old.version, new.operators),)
    sequence = _interleaved(plan)
    configs = []
    for wave in range(1, waves):
        # Waves of ⌈n/waves⌉ or one fewer moves; each wave applies all moves before its end.
        done = sequence[: math.ceil(wave * len(sequence) / waves)]
        operators = {
            name: _with_moves(
                old.operators[name],
                new.operators[name],
                [move for operator, move in done if operator == name],
            )
            for name in new.operators
        }
        configs.append(_wave(new, wave, old.version, operators))
    return (*configs, _wave(new, waves, old.version, new.operators))


def _wave(
    new: RoutingConfig, wave: int, old_version: int, operators: dict[str, OperatorRouting]
) -> RoutingConfig:
    """Wave ``wave`` (from 1) of the rollout to ``new``: numbered from ``new.version``."""
    version = new.version + wave - 1
    return RoutingConfig(
        version=version,
        parent_version=old_version if wave == 1 else version - 1,
        created_at=new.created_at,
        created_by=new.created_by,
        operators=operators,
    )
