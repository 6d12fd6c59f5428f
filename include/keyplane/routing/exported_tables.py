"""A version's routed-key tables as a file, for the router in the JVM.

When Spark's own Kafka connector reads the routed job's events, its tasks
route them in the JVM (``RoutedEvents.java`` in :mod:`keyplane.spark.jvm`),
which cannot build a :class:`~keyplane.routing.routedkeys.RoutedKeyTable`: the
salt search and the configuration store's checks are Python's. So the driver
writes each version's tables once, the first time it plans a batch on that
version (:mod:`keyplane.spark.routed_source`), beside the version in the
store: every key with a table entry or a hot-key split and its routes, each
with its instance, and the fold of a scaled-in stage (003 §5.3). A key without
an entry takes the hash fallback (000 §3.3), which the JVM computes as
:meth:`~keyplane.routing.routedkeys.RoutedKeyTable.route` does.

A stored version never changes (:mod:`keyplane.routing.config`), so neither
does its file: it is written under its version and partition count, once,
atomically, and read by every executor that routes a batch on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from keyplane.routing.handoff import VersionedTables
from keyplane.routing.routedkeys import RoutedKeyTable
from keyplane.util.processes import write_atomically

TABLES_DIRECTORY = "jvm-tables"
"""Where in the store the files are, one per version and partition count."""


def tables_file(store: Path | str, version: int, parallelism: int) -> Path:
    """The file of ``version``'s tables over ``parallelism`` instances."""
    return Path(store) / TABLES_DIRECTORY / f"v{version}-p{parallelism}.json"


def tables_document(tables: Mapping[str, RoutedKeyTable]) -> dict[str, Any]:
    """What the file holds: per operator, its routes (``key → [[route, instance], …]``),
    whether it splits any key, and its fold (``null`` when every instance is active)."""
    return {
        "operators": {
            operator: {
                "routes": {key: [list(r) for r in routes] for key, routes in t.entries().items()},
                "split": bool(t.hot_keys),
                "fold": None if t.fold_of is None else list(t.fold_of),
            }
            for operator, t in tables.items()
        }
    }


def export_tables(tables: VersionedTables, version: int, operators: Sequence[str]) -> Path:
    """Write ``version``'s tables of ``operators`` unless they are written already."""
    path = tables_file(tables.store, version, tables.parallelism)
    if not path.is_file():
        document = tables_document({op: tables.table(version, op) for op in operators})
        write_atomically(path, json.dumps(document, separators=(",", ":")))
    return path
