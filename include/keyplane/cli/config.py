"""``keyplane config show|list|diff``: the stored routing configurations, read only.

``publish`` and ``abort`` are :mod:`keyplane.cli.rollout`'s; this module dispatches to them.
"""

from __future__ import annotations

import argparse
from datetime import UTC
from pathlib import Path

from keyplane.cli.errors import CliError
from keyplane.cli.rollout import cmd_config_abort, cmd_config_publish
from keyplane.control.controller import (
    read_controller_file,
)
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.routing.config_report import render_config, render_diff
from keyplane.settings import Settings


def _config_store(settings: Settings, args: argparse.Namespace) -> tuple[Path, list[int]]:
    """The store to read and its versions, refusing an empty store up front: "no
    version 3" would send the user looking for a version when none was ever published."""
    store: Path = args.store or settings.config_store
    versions = config_store.stored_versions(store)
    if not versions:
        raise CliError(f"no configuration stored in {store}; publish one first")
    return store, versions


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    if args.action == "publish":
        return cmd_config_publish(settings, args)
    if args.action == "abort":
        return cmd_config_abort(settings, args)
    store, versions = _config_store(settings, args)
    if args.action == "list":
        return cmd_config_list(settings, store, versions, show_all=args.all)
    if args.action == "show":
        version = args.version or _active_version(settings, store, versions)
        shown = config_store.load(store, version)
        print(render_config(shown, config_store.checksum(store, version)))
        return 0
    old = config_store.load(store, args.a)
    new = config_store.load(store, args.b)
    if set(old.operators) != set(new.operators):
        raise CliError(
            f"versions {args.a} and {args.b} route different operators "
            f"({', '.join(old.operators)} vs {', '.join(new.operators)}); "
            "diff two versions of the same pipeline"
        )
    print(render_diff(old, new))
    print(_expected_gain(old, new, args.statistics or settings.home / "statistics"))
    return 0


def _active_version(settings: Settings, store: Path, versions: list[int]) -> int:
    """The version the job runs: the controller's active version once a rollout happened,
    else the newest stored version that was not marked as planned but not published."""
    saved = read_controller_file(settings.controller_state)
    if saved is not None:
        return saved.protocol.active_version
    skipped = config_store.not_published(store)
    candidates = [v for v in versions if v not in skipped]
    return candidates[-1] if candidates else versions[-1]


def cmd_config_list(settings: Settings, store: Path, versions: list[int], *, show_all: bool) -> int:
    """One line a version, newest first; versions planned but not published only with --all."""
    skipped = config_store.not_published(store)
    active = _active_version(settings, store, versions)
    hidden = 0
    for version in reversed(versions):
        if version in skipped and not show_all:
            hidden += 1
            continue
        config = config_store.load(store, version)
        parent = "-" if config.parent_version is None else f"v{config.parent_version}"
        if version == active:
            status = "active"
        elif version in skipped:
            status = f"not published: {skipped[version].get('reason', '?')}"
        else:
            status = "stored"
        print(
            f"v{version:<6} parent {parent:<7} {config.created_by:<9} "
            f"{config.created_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC  {status}"
        )
    if hidden:
        print(f"({hidden} versions planned but not published are hidden; --all lists them)")
    return 0


def _expected_gain(old: RoutingConfig, new: RoutingConfig, snapshots: Path) -> str:
    """Both versions scored on the newest statistics snapshot's hold-out, as the DAG's
    backtest scores them (paper 000 §4.3: a table is judged on the next window)."""
    from keyplane.algorithms import statistics
    from keyplane.orchestration.planning import backtest

    manifest = statistics.latest_snapshot(snapshots)
    if manifest is None:
        return f"expected gain: no statistics snapshot in {snapshots} (the DAG writes them)"
    snapshot = statistics.read_snapshot(snapshots, manifest.run_id)
    result = backtest(new, old, snapshot.pairs, snapshot.frequencies)
    return (
        f"expected on statistics {manifest.run_id} (hold-out of "
        f"{result.holdout_tuples:,.0f} tuples): locality {result.current.locality:.1%} → "
        f"{result.new.locality:.1%}, worst imbalance {result.current.worst_imbalance:.2f} → "
        f"{result.new.worst_imbalance:.2f}; the rollout moves {result.moved_share:.1%} of the state"
    )
