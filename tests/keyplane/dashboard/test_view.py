"""The dashboard's JSON document (keyplane.dashboard.view) and its offline assets.

Pure tests: hand-made records and configurations, no broker, no Airflow.
The stages are named as a user would name them (``parse``, ``enrich``,
``count``), so nothing here passes on the reference job's literal "A"/"B".
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from control_records import T0, control_message
from great_expectations.render import view as gx_view

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.controller_protocol import ControllerState, Reconfiguration
from keyplane.dashboard import assets, view
from keyplane.dashboard.metrics import MetricsRead
from keyplane.routing.config import OperatorRouting, RoutingConfig

STAGES = ("parse", "enrich", "count")


def _batch(batch_id: int, version: int | dict[str, int], **extra: object) -> BatchMetrics:
    versions = version if isinstance(version, dict) else dict.fromkeys(STAGES, version)
    return BatchMetrics.model_validate(
        {
            "batch_id": batch_id,
            "started_at": T0 + timedelta(seconds=5 * batch_id),
            "versions": versions,
            "rows": 300,
            "rows_per_s": 600.0,
            "duration_ms": 500,
            "input_lag": 7,
            "load": {
                "parse": {0: 100, 1: 50 + batch_id},
                "enrich": {0: 30, 1: 30, 2: 40},
                "count": {0: 10},
            },
            "hops": 200,
            "local_hops": 150,
            **extra,
        }
    )


def test_pure_heatmaps_have_one_entry_per_stage_named_by_the_records() -> None:
    records = [_batch(i, 1) for i in range(3)]
    heatmaps = view.load_heatmaps(records)
    assert [h["stage"] for h in heatmaps] == list(STAGES)
    parse = heatmaps[0]
    assert parse["instances"] == [0, 1]
    assert [b["t"] for b in parse["batches"]] == [
        int((T0 + timedelta(seconds=5 * i)).timestamp() * 1000) for i in range(3)
    ]
    assert parse["cells"] == [
        [0, 0, 100],
        [0, 1, 50],
        [1, 0, 100],
        [1, 1, 51],
        [2, 0, 100],
        [2, 1, 52],
    ]
    assert parse["max"] == 100
    assert heatmaps[1]["instances"] == [0, 1, 2]


def test_pure_batch_series_is_on_wall_clock_time_without_idle_batches() -> None:
    idle = _batch(3, 1).model_copy(update={"rows": 0, "hops": 0})
    series = view.batch_series(
        [_batch(1, 1), idle, _batch(0, {"parse": 2, "enrich": 1, "count": 1})]
    )
    assert [(b["batch"], b["version"]) for b in series] == [(0, None), (1, 1)]
    assert series[1]["t"] == int((T0 + timedelta(seconds=5)).timestamp() * 1000)
    assert series[1]["locality"] == pytest.approx(0.75)
    assert series[1]["imbalance"] == pytest.approx(100 / 75.5)  # parse, the worst stage


def _config(version: int, parent: int | None, **stages: OperatorRouting) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_at=T0,
        created_by="initial" if parent is None else "manual",
        operators=stages,
    )


def test_pure_routing_table_counts_keys_per_instance_and_the_hash_share() -> None:
    config = _config(
        2,
        1,
        parse=OperatorRouting(
            parallelism=4, table={"a": 0, "b": 0, "c": 2}, hot_keys={"h": (1, 2)}
        ),
        count=OperatorRouting(parallelism=4, active_instances=(0, 1)),
    )
    weights = {"parse": {"a": 10.0, "b": 10.0, "h": 60.0, "z": 20.0}}
    parse, count = view.routing_table(config, weights)
    assert parse["stage"] == "parse" and parse["active"] == [0, 1, 2, 3]
    assert [(i["instance"], i["pinned"], i["hot"]) for i in parse["instances"]] == [
        (0, 2, 0),
        (1, 0, 1),
        (2, 1, 1),
        (3, 0, 0),
    ]
    assert parse["hash_share"] == pytest.approx(0.2)
    assert count["active"] == [0, 1] and count["hash_share"] is None


def test_pure_version_diff_names_what_changed_per_stage() -> None:
    old = _config(
        1,
        None,
        parse=OperatorRouting(parallelism=4, table={"a": 0, "b": 1}, hot_keys={"h": (0, 1)}),
        count=OperatorRouting(parallelism=4),
    )
    new = _config(
        2,
        1,
        parse=OperatorRouting(parallelism=4, table={"a": 3, "c": 1}, hot_keys={"g": (2, 3)}),
        count=OperatorRouting(parallelism=4, active_instances=(0, 1)),
    )
    diff = view.version_diff(old, new)
    assert (diff["from"], diff["to"]) == (1, 2)
    parse, count = diff["stages"]
    assert (parse["pinned_added"], parse["pinned_removed"], parse["pinned_moved"]) == (1, 1, 1)
    assert (parse["hot_added"], parse["hot_removed"]) == (["g"], ["h"])
    assert count["active"] == [[0, 1, 2, 3], [0, 1]]


def test_pure_rollout_progress_lists_every_step_per_stage_and_the_states_moved() -> None:
    in_flight = Reconfiguration(
        version=2,
        checksum="c",
        base=1,
        prepare=control_message("PREPARE", 2, 0, previous_version=1),
        ack=control_message("ACK", 2, 1),
        propagated={"parse": control_message("PROPAGATE", 2, 2, operator="parse")},
        migrated={"parse": control_message("MIGRATED", 2, 3, operator="parse")},
    )
    state = ControllerState(
        operators=STAGES, active_version=1, active_checksum="c", current=in_flight
    )
    records = [
        _batch(0, 1),
        _batch(1, {"parse": 2, "enrich": 1, "count": 1}, moved_states=40),
        _batch(2, {"parse": 2, "enrich": 2, "count": 1}, moved_states=2),
        _batch(3, 2, moved_states=0),
    ]
    progress = view.rollout_progress(state, records)
    assert progress is not None
    assert progress["state"] == "in flight" and progress["seconds"] is None
    steps = [(s["step"], s["stage"], s["done"]) for s in progress["steps"]]
    assert steps == [
        ("PREPARE", None, True),
        ("ACK", None, True),
        ("PROPAGATE", "parse", True),
        ("MIGRATED", "parse", True),
        ("PROPAGATE", "enrich", False),
        ("MIGRATED", "enrich", False),
        ("PROPAGATE", "count", False),
        ("MIGRATED", "count", False),
        ("DONE", None, False),
    ]
    assert progress["states_moved"] == 42


def test_pure_a_stopped_job_is_not_live_and_its_version_only_last_known() -> None:
    """With the job and the broker stopped, the page must not present a version as running."""
    stopped = view.JobFacts(
        process_running=False, end_offsets=None, committed_offsets=None, dead_letters=None
    )
    health = view.job_health(stopped, MetricsRead((), "Kafka at x did not answer"), T0)
    assert health["state"] == "down" and health["lag"] == []
    assert health["reasons"] == [
        "no job process runs in this home",
        "metrics unavailable: Kafka at x did not answer",
    ]
    # Metrics of a job that stopped ten minutes ago: down, however fresh they once were.
    old = MetricsRead((_batch(0, 1),))
    health = view.job_health(view.JobFacts(None, None, None, None), old, T0 + timedelta(minutes=10))
    assert health["state"] == "down" and health["last_batch_age_s"] == pytest.approx(600)


def test_pure_a_running_job_is_up_with_its_lag_per_partition() -> None:
    facts = view.JobFacts(True, {0: 120, 1: 80}, {0: 100, 1: 80}, 3)
    read = MetricsRead((_batch(0, 1), _batch(1, 1, invalid_events=2)))
    health = view.job_health(facts, read, T0 + timedelta(seconds=20))
    assert health["state"] == "up" and health["reasons"] == []
    assert health["last_batch"] == 1 and health["last_batch_age_s"] == pytest.approx(15)
    assert [(p["partition"], p["lag"]) for p in health["lag"]] == [(0, 20), (1, 0)]
    assert (health["dead_letters"], health["invalid_events"]) == (3, 2)


def test_pure_failed_runs_are_newest_first_with_links_to_the_run_and_each_task_log() -> None:
    runs = [
        view.FailedRun("keyplane_scale", "manual__1", T0, T0 + timedelta(minutes=1)),
        view.FailedRun(
            "keyplane_reconfigure",
            "scheduled__2026-11-03T12:10:00+00:00",
            T0,
            T0 + timedelta(minutes=12),
            (("decide", -1), ("wait", 2)),
        ),
    ]
    newest, older = view.failed_runs(runs)
    assert newest["url"] == (
        "/dags/keyplane_reconfigure/runs/scheduled__2026-11-03T12%3A10%3A00%2B00%3A00"
    )
    assert [t["url"] for t in newest["tasks"]] == [
        newest["url"] + "/tasks/decide",
        newest["url"] + "/tasks/wait/mapped/2",
    ]
    assert older["run_id"] == "manual__1" and older["tasks"] == []


GX_TEMPLATES = Path(gx_view.__file__).parent / "templates"


def test_pure_every_asset_gx_data_docs_load_from_a_cdn_is_served_locally() -> None:
    """Each GX template's CDN tags become local URLs; a GX upgrade adding one fails here."""
    for template in sorted(GX_TEMPLATES.glob("*.j2")):
        offline = assets.offline_data_doc(template.read_text(), 2, "../../../static/vendor/")
        assert assets.remote_assets(offline) == [], template.name
    for served in assets.CDN.values():
        assert served in assets.FILES, served


def test_pure_the_gx_logo_comes_from_the_site_and_integrity_attributes_go() -> None:
    page = (
        '<img src="https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/logo-long.png'
        '?d=123" alt="x"><script src="https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/'
        'bootstrap.min.js" integrity="sha384-x" crossorigin="anonymous"></script>'
    )
    offline = assets.offline_data_doc(page, 4, "V/")
    assert offline == (
        '<img src="../../../../static/images/logo-long.png" alt="x">'
        '<script src="V/bootstrap/bootstrap.min.js"></script>'
    )


def test_pure_install_copies_the_libraries_once(tmp_path: Path) -> None:
    node_modules = tmp_path / "node_modules"
    for source in (*assets.FILES.values(), *(f"{d}/font.woff2" for d in assets.FOLDERS.values())):
        (node_modules / source).parent.mkdir(parents=True, exist_ok=True)
        (node_modules / source).write_text(source)
    vendor = tmp_path / "vendor"
    assert assets.install(node_modules, vendor) == len(assets.FILES) + len(assets.FOLDERS)
    assert (vendor / "echarts" / "echarts.min.js").read_text() == "echarts/dist/echarts.min.js"
    assert assets.install(node_modules, vendor) == 0
    (node_modules / "jquery/dist/jquery.min.js").unlink()
    with pytest.raises(assets.AssetsMissing, match=r"jquery/dist/jquery\.min\.js"):
        assets.install(node_modules, vendor)


def test_the_bootstrapped_static_folder_holds_every_library_the_page_loads() -> None:
    """``make bootstrap`` ran npm ci and copied the libraries: the page's script tags resolve."""
    page = (assets.STATIC / "index.html").read_text()
    assert assets.remote_assets(page) == []
    for dest in assets.FILES:
        assert (assets.VENDOR / dest).is_file(), f"{dest}: run make bootstrap"
    assert 'src="static/vendor/echarts/echarts.min.js"' in page
    assert assets.static_file("../assets.py") is None
