"""A version's routed-key tables as the JVM router reads them (pure logic)."""

from __future__ import annotations

import json
from pathlib import Path

from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.exported_tables import export_tables, tables_document, tables_file
from keyplane.routing.handoff import VersionedTables, routed_key_table
from keyplane.routing.routedkeys import spark_partition


def test_the_document_holds_each_entry_with_its_instance_the_split_and_the_fold() -> None:
    hot = routed_key_table(OperatorRouting(parallelism=4, table={"k": 2}, hot_keys={"h": (0, 3)}))
    scaled = routed_key_table(OperatorRouting(parallelism=4, active_instances=(1, 2)))
    document = tables_document({"A": hot, "B": scaled})["operators"]

    assert set(document["A"]["routes"]) == {"k", "h"}
    for key, routes in document["A"]["routes"].items():
        assert [route for route, _ in routes] == hot.route(key)
        assert all(spark_partition(route, 4) == instance for route, instance in routes)
    assert [instance for _, instance in document["A"]["routes"]["h"]] == [0, 3]
    assert (document["A"]["split"], document["A"]["fold"]) == (True, None)
    assert document["B"] == {"routes": {}, "split": False, "fold": [1, 1, 2, 2]}


def test_a_version_is_written_once_and_left_alone(tmp_path: Path) -> None:
    a = OperatorRouting(parallelism=4, table={"k": 1})
    save(RoutingConfig(version=3, created_by="initial", operators={"A": a}), tmp_path)
    tables = VersionedTables(tmp_path, 4)

    path = export_tables(tables, 3, ("A", "B"))
    assert path == tables_file(tmp_path, 3, 4)
    written = json.loads(path.read_text())["operators"]
    assert written["A"]["routes"]["k"][0][1] == 1
    assert written["B"] == {"routes": {}, "split": False, "fold": None}, "B takes the hash"

    path.write_text("{}")
    assert export_tables(tables, 3, ("A", "B")).read_text() == "{}"
