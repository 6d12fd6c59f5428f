"""Unit tests of the pure statistics of a snapshot (papers 000 §3.2, 001 §4.1.1, 004 §4)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from keyplane.algorithms import statistics as stats
from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.costmodel import CostModel
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.routedkeys import fold_instance, spark_partition

SETTINGS = stats.StatisticsSettings(decay=0.5, min_weight=0.5, holdout_fraction=0.2)


def _events(pairs: list[tuple[str, str, bool, int]]) -> pd.DataFrame:
    """The Spark job's rows for events of a two-stage chain A → B keyed (a, b)."""
    return stats.chain_rows(pd.DataFrame(pairs, columns=["a", "b", "holdout", "n"]), ("A", "B"))


def _links(window: pd.DataFrame) -> pd.DataFrame:
    return window[window["stage"] == "A"]


def test_next_window_starts_where_the_previous_ended_and_new_partitions_at_earliest() -> None:
    first = stats.next_window("t", None, {0: 0, 1: 5}, {0: 10, 1: 20})
    assert (first.start, first.end, first.records) == ({0: 0, 1: 5}, {0: 10, 1: 20}, 25)
    second = stats.next_window("t", first, {0: 0, 1: 5, 2: 0}, {0: 12, 1: 20, 2: 3})
    assert second.start == {0: 10, 1: 20, 2: 0}
    assert second.records == 5


def test_a_recreated_topic_is_read_from_its_earliest_offset_not_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = stats.next_window("t", None, {0: 0, 1: 0}, {0: 1000, 1: 40})
    # Partition 0 was recreated: its offsets restart below the last run's end.
    second = stats.next_window("t", first, {0: 0, 1: 0}, {0: 500, 1: 60})
    assert (second.start, second.end, second.records) == ({0: 0, 1: 40}, {0: 500, 1: 60}, 520)
    assert "partition 0: latest offset 500 is below the last run's end 1000" in caplog.text


def test_holdout_is_the_newest_fraction_of_each_partition() -> None:
    window = stats.TopicWindow(topic="t", start={0: 0, 1: 100}, end={0: 10, 1: 150})
    starts = stats.holdout_starts(window, 0.2)
    assert starts == {0: 8, 1: 140}
    flags = stats.is_holdout([0, 0, 1, 1], [7, 8, 139, 149], starts)
    assert flags.tolist() == [False, True, False, True]


def test_window_pairs_splits_train_and_holdout() -> None:
    frame = stats.window_pairs(
        _events([("1", "x", False, 3), ("1", "x", True, 1), ("2", "y", True, 2)])
    )
    rows = {(r.a, r.b): (r.train, r.holdout) for r in _links(frame).itertuples()}
    assert rows == {("1", "x"): (3.0, 1.0), ("2", "y"): (0.0, 2.0)}
    last = {r.a: (r.train, r.holdout) for r in frame[frame["stage"] == "B"].itertuples()}
    assert last == {"x": (3.0, 1.0), "y": (0.0, 2.0)}
    assert frame.loc[frame["stage"] == "B", "b"].isna().all()


def test_keys_that_differ_only_after_a_nul_keep_their_own_pairs_and_frequencies() -> None:
    """pandas groups an object column's strings as C strings, up to their first NUL; the
    job counts ``"\x00a"`` and ``"\x00b"`` apart, so the statistics must too."""
    window = stats.window_pairs(
        _events([("\x00a", "x", False, 3), ("\x00b", "x", True, 2), ("1", "\x00y", False, 1)])
    )
    rows = {(r.a, r.b): (r.train, r.holdout) for r in _links(window).itertuples()}
    assert rows == {
        ("\x00a", "x"): (3.0, 0.0),
        ("\x00b", "x"): (0.0, 2.0),
        ("1", "\x00y"): (1.0, 0.0),
    }
    assert window["a"].dtype == object
    pairs = stats.fold_pairs(None, window, SETTINGS)
    assert {(r.a, r.b): r.count for r in pairs.itertuples()} == {
        ("\x00a", "x"): 3,
        ("\x00b", "x"): 2,
        ("1", "\x00y"): 1,
    }
    freq = stats.fold_frequencies(None, window, SETTINGS, epoch=1, window_bounds=(0, 6))
    counts = {(r.stage, r.key): r.count for r in freq.itertuples()}
    assert counts == {
        ("A", "\x00a"): 3,
        ("A", "\x00b"): 2,
        ("A", "1"): 1,
        ("B", "x"): 5,
        ("B", "\x00y"): 1,
    }


def test_fold_decays_history_fish_style_and_forgets_light_entries() -> None:
    first = stats.fold_pairs(
        None, stats.window_pairs(_events([("1", "x", False, 8), ("2", "y", False, 1)])), SETTINGS
    )
    second = stats.fold_pairs(
        first, stats.window_pairs(_events([("1", "x", False, 2), ("3", "z", True, 4)])), SETTINGS
    )
    rows = {(r.a, r.b): (r.count, r.train, r.holdout) for r in second.itertuples()}
    # 0.5 × 8 + 2 for the old pair; (2, y) decays to 0.5 and is kept (≥ min_weight);
    assert rows[("1", "x")] == (2, 6.0, 0.0)
    assert rows[("2", "y")] == (0, 0.5, 0.0)
    assert rows[("3", "z")] == (4, 0.0, 4.0)
    third = stats.fold_pairs(second, stats.window_pairs(_events([])), SETTINGS)
    assert ("2", "y") not in {(r.a, r.b) for r in third.itertuples()}


def test_decay_zero_is_paper_000_reset() -> None:
    reset = stats.StatisticsSettings(decay=0.0)
    first = stats.fold_pairs(None, stats.window_pairs(_events([("1", "x", False, 8)])), reset)
    second = stats.fold_pairs(first, stats.window_pairs(_events([("2", "y", False, 1)])), reset)
    assert list(zip(second["a"], second["b"], strict=True)) == [("2", "y")]


def test_frequencies_count_every_event_once_per_stage() -> None:
    window = stats.window_pairs(
        _events([("1", "x", False, 3), ("1", "y", True, 1), ("2", "y", False, 2)])
    )
    freq = stats.fold_frequencies(None, window, SETTINGS, epoch=4, window_bounds=(10, 16))
    assert list(freq.columns) == list(stats.FREQUENCY_COLUMNS)
    counts = {(r.stage, r.key): r.count for r in freq.itertuples()}
    assert counts == {("A", "1"): 4, ("A", "2"): 2, ("B", "x"): 3, ("B", "y"): 3}
    assert set(freq["epoch"]) == {4} and set(freq["window_end"]) == {16}


def test_max_entries_keeps_the_heaviest() -> None:
    bounded = stats.StatisticsSettings(max_entries=2)
    window = stats.window_pairs(
        _events([("1", "x", False, 5), ("2", "x", False, 1), ("3", "x", False, 3)])
    )
    folded = stats.fold_pairs(None, window, bounded)
    assert sorted(folded["a"]) == ["1", "3"]


def test_instance_loads_sum_over_batches() -> None:
    records = [
        BatchMetrics(batch_id=1, load={"A": {0: 3, 1: 1}, "B": {0: 4}}),
        BatchMetrics(batch_id=2, load={"A": {0: 2, 1: 0}}),
    ]
    loads = stats.instance_loads(records)
    rows = {(r.operator, r.instance): (r.tuples, r.batches) for r in loads.itertuples()}
    assert rows == {("A", 0): (5, 2), ("A", 1): (1, 2), ("B", 0): (4, 1)}


def test_job_version_is_the_newest_uniform_record() -> None:
    records = [
        BatchMetrics(batch_id=1, versions={"A": 1, "B": 1}),
        BatchMetrics(batch_id=2, versions={"A": 2, "B": 1}),
    ]
    assert stats.job_version(records) == 1
    assert stats.job_version([]) is None


def test_traffic_matrix_routes_table_hot_and_hash_fallback() -> None:
    p = 4
    config = RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            "A": OperatorRouting(parallelism=p, table={"1": 2}, hot_keys={"2": (0, 1)}),
            "B": OperatorRouting(parallelism=p, table={"x": 3}),
        },
    )
    pairs = pd.DataFrame(
        {"stage": "A", "a": ["1", "2", "9"], "b": ["x", "x", "x"], "count": [4.0, 2.0, 1.0]}
    )
    traffic = stats.traffic_matrix(pairs, config, ("A", "B"))
    cells = {(r.a_instance, r.b_instance): r.tuples for r in traffic.itertuples()}
    hashed = spark_partition("9", p)
    expected = {(2, 3): 4.0, (0, 3): 1.0, (1, 3): 1.0}
    expected[(hashed, 3)] = expected.get((hashed, 3), 0.0) + 1.0
    assert cells == pytest.approx(expected)
    assert traffic["tuples"].sum() == pytest.approx(7.0)


def test_traffic_matrix_folds_the_hash_fallback_of_a_scaled_in_operator() -> None:
    p, active = 4, (0, 1)
    config = RoutingConfig(
        version=1,
        created_by="initial",
        operators={
            "A": OperatorRouting(parallelism=p, active_instances=active),
            "B": OperatorRouting(parallelism=p, table={"x": 3}),
        },
    )
    keys = [str(i) for i in range(20)]
    pairs = pd.DataFrame({"stage": "A", "a": keys, "b": "x", "count": 1.0})
    traffic = stats.traffic_matrix(pairs, config, ("A", "B"))
    cells = {(r.a_instance, r.b_instance): r.tuples for r in traffic.itertuples()}
    expected: dict[tuple[int, int], float] = {}
    for key in keys:
        cell = (fold_instance(spark_partition(key, p), active, p), 3)
        expected[cell] = expected.get(cell, 0.0) + 1.0
    assert any(spark_partition(key, p) not in active for key in keys)
    assert cells == pytest.approx(expected)


def test_snapshot_round_trip_is_write_once(tmp_path: Path) -> None:
    events = stats.TopicWindow(topic="e", start={0: 0}, end={0: 6})
    metrics = stats.TopicWindow(topic="m", start={0: 0}, end={0: 1})
    grouped = _events([("1", "x", False, 5), ("1", "x", True, 1)])
    manifest, frames = stats.build_snapshot(
        run_id="manual__2026-11-03T12:00:00+00:00",
        grouped=grouped,
        stages=("A", "B"),
        metrics=[BatchMetrics(batch_id=0, versions={"A": 1, "B": 1}, load={"A": {0: 6}})],
        events=events,
        metrics_window=metrics,
        previous=None,
        config=None,
        settings=SETTINGS,
        created_at=datetime(2026, 11, 3, tzinfo=UTC),
    )
    assert manifest.n_events == 6 and manifest.job_version == 1 and manifest.window == (0, 6)
    folder = stats.write_snapshot(tmp_path, manifest, **frames)
    assert folder.name == "manual__2026-11-03T12_00_00_00_00"
    loaded = stats.read_snapshot(tmp_path, manifest.run_id)
    assert loaded.manifest == manifest
    assert int(loaded.quality_frame()["count"].sum()) == 12
    other = manifest.model_copy(update={"n_events": 99})
    stats.write_snapshot(tmp_path, other, **frames)
    assert stats.read_snapshot(tmp_path, manifest.run_id).manifest.n_events == 6
    assert stats.latest_snapshot(tmp_path) == manifest
    assert stats.latest_snapshot(tmp_path, before=manifest.run_id) is None
    assert np.isclose(loaded.pairs["train"].sum(), 5.0)


def test_the_default_min_weight_keeps_a_key_seen_once_for_four_more_windows() -> None:
    settings = stats.StatisticsSettings()
    folded = stats.fold_pairs(None, stats.window_pairs(_events([("1", "x", False, 1)])), settings)
    for _ in range(4):
        folded = stats.fold_pairs(folded, stats.window_pairs(_events([])), settings)
    assert ("1", "x") in {(r.a, r.b) for r in folded.itertuples()}
    folded = stats.fold_pairs(folded, stats.window_pairs(_events([])), settings)
    assert ("1", "x") not in {(r.a, r.b) for r in folded.itertuples()}


def _chain(tmp_path: Path, sizes: list[int], gap_before: int | None = None) -> stats.Snapshot:
    """Snapshots of consecutive windows of ``sizes`` events each, written and read back.

    Each window starts where the previous ended, except ``gap_before``'s,
    which starts 100 offsets later (retention removed them).
    """
    previous: stats.Snapshot | None = None
    start = 0
    for index, size in enumerate(sizes):
        if index == gap_before:
            start += 100
        events = stats.TopicWindow(topic="e", start={0: start}, end={0: start + size})
        metrics = stats.TopicWindow(topic="m", start={0: 0}, end={0: 0})
        grouped = _events([(str(k), f"b{k}", False, size // 4) for k in range(4)])
        manifest, frames = stats.build_snapshot(
            run_id=f"run{index}",
            grouped=grouped,
            stages=("A", "B"),
            metrics=[],
            events=events,
            metrics_window=metrics,
            previous=previous,
            config=None,
            settings=SETTINGS,
            created_at=datetime(2026, 11, 3, index, tzinfo=UTC),
        )
        stats.write_snapshot(tmp_path, manifest, **frames)
        previous = stats.read_snapshot(tmp_path, manifest.run_id)
        start += size
    assert previous is not None
    return previous


def test_lookback_widens_a_small_window_over_the_previous_ones_until_enough(
    tmp_path: Path,
) -> None:
    newest = _chain(tmp_path, [400, 400, 400, 400])
    # Each window counts 400 events twice (once per stage): 800 a window.
    widened = stats.lookback(tmp_path, newest, 2_000)
    assert widened.runs == ("run3", "run2", "run1")
    assert widened.total == 2_400
    assert widened.window == (400, 1_600)
    assert set(widened.frame["window_start"]) == {400}
    assert set(widened.frame["window_end"]) == {1_600}
    assert stats.lookback(tmp_path, newest, 100).runs == ("run3",)
    everything = stats.lookback(tmp_path, newest, 10**9)
    assert everything.runs == ("run3", "run2", "run1", "run0") and everything.total == 3_200


def test_lookback_stops_at_a_gap_between_windows(tmp_path: Path) -> None:
    newest = _chain(tmp_path, [400, 400, 400], gap_before=2)
    assert stats.lookback(tmp_path, newest, 10**9).runs == ("run2",)


def test_the_snapshot_carries_a_cost_model_fitted_to_enough_metrics_records() -> None:
    rng = np.random.default_rng(1)
    records = []
    for batch in range(12):
        loads_a = {i: int(v) for i, v in enumerate(rng.integers(500, 3_000, 4))}
        loads_b = {i: int(v) for i, v in enumerate(rng.integers(500, 3_000, 4))}
        hops = sum(loads_a.values())
        local = int(rng.integers(0, hops))
        duration = 30 + 0.01 * max(loads_a.values()) + 0.02 * max(loads_b.values())
        duration += 0.04 * (hops - local) / 4
        records.append(
            BatchMetrics(
                batch_id=batch,
                duration_ms=round(duration),
                load={"A": loads_a, "B": loads_b},
                hops=hops,
                local_hops=local,
            )
        )
    events = stats.TopicWindow(topic="e", start={0: 0}, end={0: 6})
    metrics = stats.TopicWindow(topic="m", start={0: 0}, end={0: 12})

    def manifest(metrics_records: list[BatchMetrics]) -> stats.SnapshotManifest:
        return stats.build_snapshot(
            run_id="r",
            grouped=_events([("1", "x", False, 6)]),
            stages=("A", "B"),
            metrics=metrics_records,
            events=events,
            metrics_window=metrics,
            previous=None,
            config=None,
            settings=SETTINGS,
        )[0]

    fitted = manifest(records)
    assert fitted.cost_weights is not None
    assert fitted.cost_model.source == "calibrated"
    assert fitted.cost_model.remote == pytest.approx(0.04, rel=0.2)
    assert manifest(records[:3]).cost_weights is None
    assert manifest(records[:3]).cost_model == CostModel()


def test_recent_windows_are_each_runs_own_counts_oldest_first_up_to_a_gap(
    tmp_path: Path,
) -> None:
    newest = _chain(tmp_path, [400, 800, 1_200, 1_600], gap_before=1)
    windows = stats.recent_windows(tmp_path, newest, 5)
    # run0 is behind the gap: the series starts at run1
    assert [int(w["count"].sum()) for w in windows] == [1_600, 2_400, 3_200]
    assert list(windows[0].columns) == ["stage", "key", "count"]
    assert [int(w["count"].sum()) for w in stats.recent_windows(tmp_path, newest, 2)] == [
        2_400,
        3_200,
    ]
    with pytest.raises(ValueError, match="count must be"):
        stats.recent_windows(tmp_path, newest, 0)
