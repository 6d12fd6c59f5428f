"""The dashboard's data loading and rendering on hand-made records (pure: no Airflow, no Kafka).

One test reads a stopped broker: it checks that the page degrades instead of
hanging, against a real closed port.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from control_records import T0, control_message

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.controller_protocol import ControllerState, Reconfiguration
from keyplane.dashboard import metrics as dm
from keyplane.dashboard import view
from keyplane.dashboard.records import (
    DecisionRecord,
    ProposalRecord,
    RollbackRecord,
    ValidationRecord,
)
from keyplane.dashboard.service import DashboardService
from keyplane.dashboard.timeline import (
    Dashboard,
    DashboardPaths,
    RunRecords,
    backtest_gain,
    build_rows,
    hot_key_rows,
    load_dashboard,
    moved_key_rows,
)
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.handoff import state_moves
from keyplane.routing.routedkeys import spark_partition
from keyplane.testing import free_port


def _config(version: int, parent: int | None, by: str, hot: bool = False) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_at=T0 + timedelta(minutes=version),
        created_by=by,
        operators={
            "A": OperatorRouting(
                parallelism=3,
                table={"eu": version % 3, "us": (version + 1) % 3},
                hot_keys={"<hot>": (0, 1, 2)} if hot else {},
            ),
            "B": OperatorRouting(parallelism=3, table={"#spark": version % 3}),
        },
    )


def _controller(version: int, base: int) -> ControllerState:
    rollout = Reconfiguration(
        version=version,
        checksum="c",
        base=base,
        prepare=control_message("PREPARE", version, 0, previous_version=base),
        ack=control_message("ACK", version, 1),
        propagated={"A": control_message("PROPAGATE", version, 1.5, operator="A")},
        migrated={"A": control_message("MIGRATED", version, 3.5, operator="A")},
        finish=control_message("DONE", version, 4.25),
    )
    return ControllerState(
        operators=("A", "B"), active_version=version, active_checksum="c", last=rollout
    )


def _batch(batch_id: int, versions: dict[str, int], local: int = 50) -> BatchMetrics:
    return BatchMetrics(
        batch_id=batch_id,
        versions=versions,
        rows=100,
        rows_per_s=1000.0,
        duration_ms=500,
        input_lag=10 * batch_id,
        load={"A": {0: 60, 1: 40}, "B": {0: 50, 1: 50}},
        hops=100,
        local_hops=local,
    )


RUNS = [
    RunRecords(
        run_id="run-1",
        proposal=ProposalRecord(version=2),
        backtest={
            "version": 2,
            "new": {"locality": 0.8, "imbalance": {"A": 1.1}},
            "current": {"locality": 0.5, "imbalance": {"A": 1.4}},
        },
        decision=DecisionRecord(publish=True, gain=0.6, cost=0.03, reason="ok"),
        rollout={"version": 2},
        verification={"version": 2, "regressed": True, "reason": "lag regressed"},
        rollback=RollbackRecord(version=3, restores=1, replaces=2, reason="lag regressed"),
    ),
    RunRecords("run-2", ProposalRecord(version=4), None, None, None, None, None),
]


def test_pure_timeline_rows_from_hand_made_records() -> None:
    configs: dict[int, RoutingConfig | str] = {
        1: _config(1, None, "initial"),
        2: _config(2, 1, "schedule"),
        3: _config(3, 2, "rollback"),
        4: _config(4, 3, "manual"),
        5: "unreadable: checksum mismatch",
    }
    validations = {
        2: ValidationRecord(success=True, summary="all passed"),
        3: ValidationRecord(success=True, summary="rollback to the routing of v1"),
        4: ValidationRecord(success=False, summary="max/mean within α failed"),
    }
    rows = build_rows(configs, validations, RUNS, _controller(3, 2), [])
    by = {r.version: r for r in rows}
    assert [r.version for r in rows] == [5, 4, 3, 2, 1]
    assert by[3].status == "active" and by[3].created_by == "rollback"
    assert by[3].rollback == "restores v1: lag regressed"
    assert by[3].migration is not None and by[3].migration.seconds == pytest.approx(4.25)
    assert by[3].migration.detail == "4.2 s (A 2.0 s)"
    assert by[2].status == "rolled back" and by[2].rollback == "rolled back by v3: lag regressed"
    assert by[2].gain == pytest.approx(0.6) and by[2].cost == pytest.approx(0.03)
    assert by[2].validation == "passed" and by[2].run_id == "run-1"
    assert by[4].status == "refused" and by[4].validation == "failed"
    assert by[1].status == "superseded" and by[1].validation == "not validated"
    assert by[5].problem == "unreadable: checksum mismatch" and by[5].created_at is None


def test_pure_waves_rows_name_their_run_and_leave_the_decision_to_the_last() -> None:
    configs: dict[int, RoutingConfig | str] = {
        1: _config(1, None, "initial"),
        2: _config(2, 1, "schedule"),
        3: _config(3, 2, "schedule"),
        4: _config(4, 3, "schedule"),
    }
    validations = {
        2: ValidationRecord(success=True, summary="wave 1 of 3 towards v4, which passed"),
        3: ValidationRecord(success=True, summary="wave 2 of 3 towards v4, which passed"),
        4: ValidationRecord(success=True, summary="all passed"),
    }
    run = RunRecords(
        run_id="run-w",
        proposal=ProposalRecord(version=4, waves=(2, 3)),
        backtest=None,
        decision=DecisionRecord(publish=True, gain=0.4, cost=0.05, reason="ok"),
        rollout={"version": 4},
        verification=None,
        rollback=None,
    )
    rows = build_rows(configs, validations, [run], _controller(4, 3), [])
    by = {r.version: r for r in rows}
    assert [by[v].run_id for v in (1, 2, 3, 4)] == [None, "run-w", "run-w", "run-w"]
    assert [by[v].status for v in (2, 3, 4)] == ["superseded", "superseded", "active"]
    assert by[2].gain is None and by[2].decision is None and by[2].validation == "passed"
    assert by[4].gain == pytest.approx(0.4) and by[4].decision == "ok"


def test_pure_backtest_gain_follows_the_decision_rule() -> None:
    record = RUNS[0].backtest
    assert record is not None
    assert backtest_gain(record) == pytest.approx((0.8 - 0.5) + (1.4 - 1.1))
    assert backtest_gain({"new": {}}) is None


def test_pure_migration_from_metrics_when_the_controller_has_no_record() -> None:
    configs: dict[int, RoutingConfig | str] = {
        1: _config(1, None, "initial"),
        2: _config(2, 1, "schedule"),
    }
    records = [
        _batch(0, {"A": 1, "B": 1}),
        _batch(1, {"A": 2, "B": 1}),
        _batch(2, {"A": 2, "B": 1}),
        _batch(3, {"A": 2, "B": 2}),
    ]
    rows = build_rows(configs, {}, [], None, records)
    newest = rows[0]
    assert newest.status == "active"
    assert newest.migration is not None and newest.migration.source == "metrics"
    assert newest.migration.seconds == pytest.approx(1.5)
    assert newest.migration.detail == "≈1.5 s over 3 batches (1–3)"


def test_pure_switch_windows_and_summaries() -> None:
    records = [
        _batch(0, {"A": 1, "B": 1}, 20),
        _batch(1, {"A": 2, "B": 1}),
        _batch(2, {"A": 2, "B": 2}, 90),
    ]
    window = dm.switch_windows(records)[2]
    assert (window.first_batch, window.last_batch, window.batches) == (1, 2, 2)
    summaries = {s.version: s for s in dm.summaries(records)}
    assert summaries[1].locality == pytest.approx(0.2)
    assert summaries[2].locality == pytest.approx(0.9)
    assert summaries[2].imbalance == pytest.approx(1.2)
    points = dm.points(records)
    assert [p.version for p in points] == [1, None, 2]


def test_pure_hot_and_moved_keys_are_ranked_by_weight() -> None:
    old, new = _config(1, None, "initial"), _config(2, 1, "schedule", hot=True)
    weights = {"A": {"eu": 10.0, "us": 500.0, "<hot>": 900.0}}
    hot = hot_key_rows(new, weights)
    assert [(h.key, h.split, h.weight) for h in hot] == [("<hot>", 3, 900.0)]
    moved = moved_key_rows(old, new, weights)
    assert [m.key for m in moved if m.operator == "A"][:2] == ["<hot>", "us"]
    assert {m.kind for m in moved if m.key == "<hot>"} == {"split"}


def test_pure_document_says_when_metrics_are_unavailable_and_keeps_keys_as_data(
    tmp_path: Path,
) -> None:
    store = tmp_path / "configs"
    config_store.save(_config(1, None, "initial"), store)
    config_store.save(_config(2, 1, "schedule", hot=True), store)
    paths = DashboardPaths(store, tmp_path / "statistics", tmp_path / "controller.json", tmp_path)
    down = dm.MetricsRead((), "Kafka at 127.0.0.1:1 did not answer")
    doc = _document(load_dashboard(paths, []), down)
    assert [v["version"] for v in doc["versions"]] == [2, 1]
    assert doc["metrics"] == {
        "available": False,
        "problem": "Kafka at 127.0.0.1:1 did not answer",
        "records": 0,
    }
    # Keys stay raw data: the page inserts them as text, never as HTML.
    assert [h["key"] for h in doc["hot_keys"]] == ["<hot>"]
    assert doc["batches"] == [] and doc["heatmaps"] == []
    json.dumps(doc)  # the route returns it as JSON


def test_pure_load_dashboard_reads_the_files_the_dag_writes(tmp_path: Path) -> None:
    store = tmp_path / "configs"
    config_store.save(_config(1, None, "initial"), store)
    config_store.save(_config(2, 1, "schedule", hot=True), store)
    (store / "validation-v000002.json").write_text(json.dumps({"version": 2, "success": True}))
    run = tmp_path / "statistics" / "run-1"
    run.mkdir(parents=True)
    (run / "proposal.json").write_text(json.dumps({"version": 2, "parent_version": 1}))
    (run / "decision.json").write_text(json.dumps({"version": 2, "publish": True, "gain": 0.1}))
    (run / "backtest.json").write_text("{not json")
    site = tmp_path / "gx" / "gx" / "uncommitted" / "data_docs" / "local_site"
    page = (
        site / "validations" / "keyplane_configuration_keys" / "configuration-v2" / "t" / "b.html"
    )
    page.parent.mkdir(parents=True)
    page.write_text("<html></html>")
    paths = DashboardPaths(
        store, tmp_path / "statistics", tmp_path / "controller.json", tmp_path / "gx"
    )
    dashboard = load_dashboard(paths, [_batch(0, {"A": 2, "B": 2})])
    newest = dashboard.rows[0]
    assert dashboard.active_version == 2 and newest.status == "active"
    assert newest.gain == pytest.approx(0.1) and newest.validation == "passed"
    assert [d.label for d in newest.data_docs] == ["keyplane_configuration_keys"]
    assert [h.key for h in dashboard.hot_keys] == ["<hot>"]
    assert (dashboard.moved_from, dashboard.moved_to) == (1, 2)
    service = DashboardService(paths, dm.CachedMetrics("127.0.0.1:1", "m"))
    assert service.data_doc(newest.data_docs[0].path) == page.resolve()
    assert service.data_doc("../../../../configs/validation-v000002.json") is None


def test_reading_metrics_from_a_stopped_broker_degrades_quickly() -> None:
    started = time.monotonic()
    read = dm.read_metrics(f"127.0.0.1:{free_port()}", "keyplane.metrics", timeout_s=2.0)
    assert not read.available and read.records == ()
    assert "did not answer" in (read.problem or "")
    assert time.monotonic() - started < 5


def _home(tmp_path: Path) -> DashboardPaths:
    """A store with v1 → v2 → v3 (a rollback of v2) and the records of the run that made them."""
    store = tmp_path / "configs"
    config_store.save(_config(1, None, "initial"), store)
    config_store.save(_config(2, 1, "schedule", hot=True), store)
    config_store.save(_config(3, 2, "rollback"), store)
    records = {
        "configs/validation-v000001.json": {"version": 1, "success": False, "summary": "no"},
        "configs/validation-v000002.json": {"version": 2, "success": True, "summary": "ok"},
        "statistics/run-1/proposal.json": {"version": 2, "parent_version": 1, "waves": []},
        "statistics/run-1/decision.json": {
            "version": 2,
            "publish": True,
            "gain": 0.25,
            "cost": 0.02,
            "reason": "publish",
        },
        "statistics/run-1/rollback.json": {
            "version": 3,
            "restores": 1,
            "replaces": 2,
            "reason": "lag regressed",
        },
    }
    for name, record in records.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(record))
    return DashboardPaths(store, tmp_path / "statistics", tmp_path / "controller.json", tmp_path)


def _set_field(path: Path, field: str, value: object) -> None:
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, field: value}))


def _document(dashboard: Dashboard, read: dm.MetricsRead | None = None) -> dict[str, Any]:
    """The page's JSON document of ``dashboard`` and ``read`` (none: metrics not read)."""
    read = read or dm.MetricsRead((), "not read")
    health = view.job_health(view.JobFacts(None, None, None, None), read, T0)
    return view.document(
        dashboard,
        read,
        dm.summaries(read.records),
        active=None,
        controller=dashboard.controller,
        configs=dashboard.configs,
        weights=dashboard.weights,
        validations=dashboard.validations,
        health=health,
        failed=None,
        generated_at=T0,
        metrics_topic="m",
        has_data_docs=False,
    )


@pytest.mark.parametrize(
    ("file", "field", "value", "version", "attribute", "shown"),
    [
        ("statistics/run-1/decision.json", "gain", "abc", 2, "gain", None),
        ("statistics/run-1/decision.json", "gain", [1], 2, "gain", None),
        ("statistics/run-1/decision.json", "gain", float("nan"), 2, "gain", None),
        ("statistics/run-1/decision.json", "cost", "0.1", 2, "cost", None),
        ("statistics/run-1/decision.json", "reason", 5, 2, "decision", None),
        ("statistics/run-1/decision.json", "publish", "false", 2, "gain", 0.25),
        ("configs/validation-v000002.json", "summary", {"a": 1}, 2, "validation_summary", None),
        ("configs/validation-v000002.json", "summary", [1], 2, "validation_summary", None),
        ("configs/validation-v000002.json", "summary", 3, 2, "validation_summary", None),
        ("configs/validation-v000002.json", "success", "false", 2, "validation", None),
        ("configs/validation-v000002.json", "success", float("nan"), 2, "validation", None),
        ("configs/validation-v000001.json", "version", True, 1, "validation", "not validated"),
        ("statistics/run-1/proposal.json", "version", None, 2, "run_id", None),
        ("statistics/run-1/proposal.json", "version", "v2", 2, "run_id", None),
        ("statistics/run-1/proposal.json", "waves", None, 2, "run_id", "run-1"),
        ("statistics/run-1/proposal.json", "waves", 3, 2, "run_id", "run-1"),
        ("statistics/run-1/rollback.json", "replaces", None, 2, "rollback", None),
        (
            "statistics/run-1/rollback.json",
            "restores",
            "v1",
            3,
            "rollback",
            "restores —: lag regressed",
        ),
    ],
)
def test_pure_a_field_of_the_wrong_type_shows_a_dash_and_a_problem_line(
    tmp_path: Path,
    file: str,
    field: str,
    value: object,
    version: int,
    attribute: str,
    shown: object,
) -> None:
    paths = _home(tmp_path)
    _set_field(tmp_path / file, field, value)
    dashboard = load_dashboard(paths, [])
    row = next(r for r in dashboard.rows if r.version == version)
    assert getattr(row, attribute) == shown
    [problem] = dashboard.problems
    assert f"{file}: field '{field}' is unreadable" in problem
    assert problem in _document(dashboard)["problems"]


def _frequencies(path: Path, **columns: list[object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(columns).to_parquet(path, index=False)


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        ({"stage": ["A"], "key": ["<hot>"]}, "no column count"),
        ({"stage": ["A"], "key": ["<hot>"], "count": ["many"]}, "column count is not numeric"),
    ],
)
def test_pure_a_broken_newer_snapshot_leaves_key_weights_to_an_older_one(
    tmp_path: Path, broken: dict[str, list[object]], reason: str
) -> None:
    paths = _home(tmp_path)
    older = paths.snapshots / "run-1" / "frequencies.parquet"
    _frequencies(older, stage=["A", "A"], key=["<hot>", "eu"], count=[900, 10])
    newer = paths.snapshots / "run-2" / "frequencies.parquet"
    _frequencies(newer, **broken)
    dashboard = load_dashboard(paths, [_batch(0, {"A": 2, "B": 2})])
    assert [(h.key, h.weight) for h in dashboard.hot_keys] == [("<hot>", 900.0)]
    assert f"{newer}: {reason}, key weights from an older snapshot" in dashboard.problems


@pytest.mark.parametrize("relative", ["a\x00b", "x" * 300, "x" * 300 + "/index.html"])
def test_pure_data_docs_path_the_os_cannot_take_is_not_found(tmp_path: Path, relative: str) -> None:
    paths = _home(tmp_path)
    paths.data_docs.mkdir(parents=True)
    (paths.data_docs / "index.html").write_text("<html></html>")
    service = DashboardService(paths, dm.CachedMetrics("127.0.0.1:1", "m"))
    assert service.data_doc("index.html") == (paths.data_docs / "index.html").resolve()
    assert service.data_doc(relative) is None


@pytest.mark.parametrize("broken", [1, 2])
def test_pure_moved_keys_are_unknown_when_a_side_cannot_be_read(
    tmp_path: Path, broken: int
) -> None:
    store = tmp_path / "configs"
    config_store.save(_config(1, None, "initial"), store)
    config_store.save(_config(2, 1, "schedule", hot=True), store)
    (store / f"v{broken:06d}" / "manifest.json").write_text("{not json")
    state = tmp_path / "controller.json"
    state.write_text(json.dumps({"protocol": _controller(2, 1).model_dump(mode="json")}))
    paths = DashboardPaths(store, tmp_path / "statistics", state, tmp_path)
    dashboard = load_dashboard(paths, [])
    assert (dashboard.moved_from, dashboard.moved_to, dashboard.moved_keys) == (1, 2, None)
    expected = f"moved keys of v1 → v2 unknown: v{broken} could not be read"
    assert expected in dashboard.problems
    doc = _document(dashboard)
    assert doc["moved_keys"] is None and doc["diff"] is None


def test_pure_moved_keys_of_a_scale_in_are_the_moves_the_job_makes() -> None:
    keys = [f"k{i}" for i in range(100)]
    folded_in_place = next(k for k in keys if spark_partition(k, 4) == 2)
    folded_away = next(k for k in keys if spark_partition(k, 4) == 3)
    table = {folded_in_place: 0, folded_away: 0}
    old = _scaled(1, OperatorRouting(parallelism=4, table=table))
    new = _scaled(2, OperatorRouting(parallelism=4, active_instances=(0, 1)))
    rows = moved_key_rows(old, new, {})
    assert [(r.key, r.old, r.new) for r in rows] == [(folded_away, (0,), (1,))]
    assert {move.key for move in state_moves(old, new, "A", 4)} == {folded_away}


def _scaled(version: int, routing: OperatorRouting) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=None if version == 1 else version - 1,
        created_at=T0,
        created_by="initial" if version == 1 else "scale",
        operators={"A": routing},
    )


def test_imbalance_after_a_scale_in_counts_the_active_instances_only(tmp_path: Path) -> None:
    """After a scale-in to 2 of 4 instances the two released instances hold no keys:
    an even load over the two active ones is balanced, not 2.0."""
    store = tmp_path / "configs"
    config_store.save(RoutingConfig.all_hash(4, ["A", "B"]), store)
    scaled = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="scale",
        operators={
            "A": OperatorRouting(parallelism=4, active_instances=(0, 2)),
            "B": OperatorRouting(parallelism=4),
        },
    )
    config_store.save(scaled, store)
    batch = BatchMetrics(
        batch_id=0,
        versions={"A": 2, "B": 2},
        rows=100,
        hops=100,
        local_hops=90,
        load={"A": {0: 50, 1: 0, 2: 51, 3: 0}, "B": {0: 25, 1: 25, 2: 25, 3: 25}},
    )
    active = dm.active_instances(store, [2])
    assert active == {2: {"A": (0, 2), "B": (0, 1, 2, 3)}}
    (summary,) = dm.summaries([batch], active)
    assert summary.imbalance == pytest.approx(51 / 50.5)
    (point,) = dm.points([batch], active)
    assert point.imbalance == pytest.approx(51 / 50.5)
    # Without the store's word on active instances, the zeros count (and read 2.02).
    assert dm.summaries([batch])[0].imbalance == pytest.approx(51 / 25.25)


def test_a_scale_version_row_links_its_run_and_gives_its_reason(tmp_path: Path) -> None:
    store = tmp_path / "configs"
    config_store.save(RoutingConfig.all_hash(4, ["A", "B"]), store)
    config_store.save(
        RoutingConfig(
            version=2,
            parent_version=1,
            created_by="scale",
            operators={
                "A": OperatorRouting(parallelism=4),
                "B": OperatorRouting(parallelism=4, active_instances=(0, 1)),
            },
        ),
        store,
    )
    run = "manual__2026-11-03T12:00:00+00:00"
    folder = tmp_path / "scale" / "manual__2026-11-03T12_00_00_00_00"
    folder.mkdir(parents=True)
    (folder / "scale_decision.json").write_text(
        json.dumps({"publish": True, "reason": "B under-utilised: scale in to 2"})
    )
    (folder / "scale_proposal.json").write_text(
        json.dumps({"version": 2, "run_id": run, "locality_before": 0.925, "locality_after": 0.473})
    )
    paths = DashboardPaths(
        store, tmp_path / "statistics", tmp_path / "controller.json", tmp_path, tmp_path / "scale"
    )

    dashboard = load_dashboard(paths, [])

    row = next(r for r in dashboard.rows if r.version == 2)
    assert row.run_id == run and row.dag_id == "keyplane_scale"
    assert row.decision == "B under-utilised: scale in to 2; predicted locality 92.5% → 47.3%"
    assert row.predicted_locality == pytest.approx(0.473)
    (shown,) = [v for v in _document(dashboard)["versions"] if v["version"] == 2]
    assert shown["run_url"] == "/dags/keyplane_scale/runs/manual__2026-11-03T12%3A00%3A00%2B00%3A00"


def test_versions_planned_but_not_published_are_not_listed(tmp_path: Path) -> None:
    store = tmp_path / "configs"
    config_store.save(_config(1, None, "initial"), store)
    config_store.save(_config(2, 1, "schedule", hot=True), store)
    config_store.save(_config(3, 1, "schedule"), store)
    config_store.mark_not_published(store, 2, "gain too small", "scheduled__1")
    config_store.mark_not_published(store, 3, "dry run", "scheduled__2")
    paths = DashboardPaths(store, tmp_path / "statistics", tmp_path / "controller.json", tmp_path)

    dashboard = load_dashboard(paths, [_batch(0, {"A": 1, "B": 1})])

    assert [r.version for r in dashboard.rows] == [1]
    assert dashboard.hidden == 2
    assert _document(dashboard)["hidden_versions"] == 2


def test_moved_keys_keep_their_order_when_a_newer_snapshot_arrives(tmp_path: Path) -> None:
    """The moved keys of v1 → v2 are ranked by the snapshot v2 was planned from, so a
    refresh after the next run's snapshot does not re-rank the table."""
    store = tmp_path / "configs"
    config_store.save(_config(1, None, "initial"), store)
    config_store.save(_config(2, 1, "schedule"), store)
    snapshots = tmp_path / "statistics"
    (snapshots / "run-1").mkdir(parents=True)
    (snapshots / "run-1" / "proposal.json").write_text(json.dumps({"version": 2}))
    _frequencies(
        snapshots / "run-1" / "frequencies.parquet",
        stage=["A", "A"],
        key=["us", "eu"],
        count=[500, 10],
    )
    paths = DashboardPaths(store, snapshots, tmp_path / "controller.json", tmp_path)
    before = [m.key for m in load_dashboard(paths, []).moved_keys or () if m.operator == "A"]
    assert before == ["us", "eu"]

    _frequencies(
        snapshots / "run-2" / "frequencies.parquet",
        stage=["A", "A"],
        key=["us", "eu"],
        count=[1, 900],
    )
    dashboard = load_dashboard(paths, [])
    assert [m.key for m in dashboard.moved_keys or () if m.operator == "A"] == before
    # The hot-key weights still come from the newest snapshot.
    assert dashboard.weights["A"]["eu"] == 900.0
