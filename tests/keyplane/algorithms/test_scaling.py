"""Scaling decisions (paper 003) and scaled routing configurations.

The metrics windows are built by hand (``BatchMetrics`` records as the routed
job writes them), which the test names say; the routing and the hand-off are
the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.elasticity import CongestionSettings
from keyplane.algorithms.scaling import (
    ScaleRequest,
    choose_active,
    decide_scaling,
    is_saturated,
    measure_window,
    scaled_routing,
    stage_shares,
)
from keyplane.routing import config as config_store
from keyplane.routing.config import OperatorRouting, RoutingConfig
from keyplane.routing.handoff import routed_key_table, state_moves
from keyplane.routing.routedkeys import fold_instance, spark_partition

P = 4
ALL = {"A": (0, 1, 2, 3), "B": (0, 1, 2, 3)}


def _batch(
    batch_id: int,
    *,
    rows: int = 1_000,
    lag: int = 0,
    duration_ms: int = 1_000,
    load_a: dict[int, int] | None = None,
    load_b: dict[int, int] | None = None,
    busy_ms: dict[str, dict[int, float]] | None = None,
) -> BatchMetrics:
    even = {i: rows // P for i in range(P)}
    return BatchMetrics(
        batch_id=batch_id,
        rows=rows,
        duration_ms=duration_ms,
        input_lag=lag,
        load={"A": load_a or even, "B": load_b or even},
        busy_ms=busy_ms or {},
        hops=rows,
    )


def _window(n: int = 6, **kwargs: object) -> list[BatchMetrics]:
    lag_step = int(kwargs.pop("lag_step", 0))  # type: ignore[call-overload]
    return [_batch(i, lag=i * lag_step, **kwargs) for i in range(n)]  # type: ignore[arg-type]


# --- the hash fallback over active instances ----------------------------------------------


def test_fold_instance_deals_inactive_partitions_round_robin() -> None:
    assert [fold_instance(i, (0, 2), 4) for i in range(4)] == [0, 0, 2, 2]
    assert [fold_instance(i, (1, 2, 3), 4) for i in range(4)] == [1, 1, 2, 3]
    assert [fold_instance(i, (0, 1, 2, 3), 4) for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="non-empty subset"):
        fold_instance(0, (), 4)


def test_scaled_fallback_routes_every_key_to_an_active_instance() -> None:
    table = routed_key_table(OperatorRouting(parallelism=P, active_instances=(1, 3)))
    keys = [f"k{i}" for i in range(200)] + ["a#3", "x#y#7"]
    instances = {table.instance_of(table.route(k)[0]) for k in keys}
    assert instances == {1, 3}
    for key in keys:
        natural = spark_partition(key, P)
        (routed,) = table.route(key)
        assert table.instance_of(routed) == fold_instance(natural, (1, 3), P)
        if natural in (1, 3) and "#" not in key:
            assert routed == key


def test_active_instances_are_validated() -> None:
    assert OperatorRouting(parallelism=P, active_instances=(0, 1, 2, 3)).active_instances is None
    with pytest.raises(ValidationError, match="ascending and distinct"):
        OperatorRouting(parallelism=P, active_instances=(2, 1))
    with pytest.raises(ValidationError, match=r"lie in \[0, 4\)"):
        OperatorRouting(parallelism=P, active_instances=(0, 4))
    with pytest.raises(ValidationError, match="inactive instances"):
        OperatorRouting(parallelism=P, table={"k": 2}, active_instances=(0, 1))
    with pytest.raises(ValidationError, match="hot keys use inactive"):
        OperatorRouting(parallelism=P, hot_keys={"h": (0, 3)}, active_instances=(0, 1))


def test_unscaled_manifests_keep_their_format_and_scaled_ones_round_trip(tmp_path: Path) -> None:
    plain = RoutingConfig(
        version=1,
        created_by="initial",
        operators={"A": OperatorRouting(parallelism=P, table={"k": 1})},
    )
    config_store.save(plain, tmp_path)
    manifest = json.loads((tmp_path / "v000001" / "manifest.json").read_text())
    assert set(manifest["operators"][0]) == {
        "name",
        "parallelism",
        "placement",
        "table_file",
        "hot_keys_file",
    }
    assert config_store.load(tmp_path, 1).operators["A"].active_instances is None
    scaled = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="scale",
        operators={"A": OperatorRouting(parallelism=P, table={"k": 1}, active_instances=(0, 1))},
    )
    saved = config_store.save(scaled, tmp_path)
    assert config_store.load(tmp_path, 2, saved.checksum) == scaled


# --- scaled routing and the hand-off -------------------------------------------------------


def test_scale_in_moves_exactly_the_keys_of_released_instances() -> None:
    keys = {f"k{i}": float(1 + i % 5) for i in range(80)}
    before = OperatorRouting(parallelism=P, table={"k0": 3, "k1": 0}, hot_keys={"k2": (1, 3)})
    after = scaled_routing(before, (0, 1), keys)
    assert after.active_instances == (0, 1)
    old_table, new_table = routed_key_table(before), routed_key_table(after)
    for key in keys:
        for routed in new_table.route(key):
            assert new_table.instance_of(routed) in (0, 1)
    old = RoutingConfig(version=1, created_by="initial", operators={"B": before})
    new = RoutingConfig(version=2, parent_version=1, created_by="scale", operators={"B": after})
    moves = state_moves(old, new, "B", P)
    moved_sources = {m.source for m in moves}
    leaving = {
        routed
        for key in keys
        for routed in old_table.route(key)
        if old_table.instance_of(routed) not in (0, 1)
    }
    assert moved_sources == leaving
    staying = {
        key for key in keys if all(old_table.instance_of(r) in (0, 1) for r in old_table.route(key))
    }
    assert all(m.key not in staying for m in moves)
    # k2 was hot on (1, 3): 3 folds onto 1, so one instance is left and k2 is tabled there.
    assert after.hot_keys == {} and after.table["k2"] == 1


def test_scale_in_then_out_keeps_every_key_reachable_and_rebalances() -> None:
    keys = {f"k{i}": 1.0 for i in range(120)}
    full = OperatorRouting(parallelism=P)
    half = scaled_routing(full, (0, 2), keys)
    again = scaled_routing(half, (0, 1, 2, 3), keys)
    assert again.active_instances is None
    table = routed_key_table(again)
    loads = [0, 0, 0, 0]
    for key in keys:
        loads[table.instance_of(table.route(key)[0])] += 1
    assert min(loads[1], loads[3]) > 0
    assert max(loads) <= 120 / 4 + 1
    old = RoutingConfig(version=2, parent_version=1, created_by="scale", operators={"B": half})
    new = RoutingConfig(version=3, parent_version=2, created_by="scale", operators={"B": again})
    half_table = routed_key_table(half)
    for move in state_moves(old, new, "B", P):
        assert move.source in half_table.route(move.key)
        assert move.target in table.route(move.key)
    for key in keys:
        if half_table.route(key) != table.route(key):
            assert any(m.key == key for m in state_moves(old, new, "B", P))


def test_choose_active_releases_the_least_loaded_instances() -> None:
    assert choose_active((0, 1, 2, 3), 2, {0: 5, 1: 50, 2: 1, 3: 40}, P) == (1, 3)
    assert choose_active((1, 3), 3, {}, P) == (0, 1, 3)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        choose_active((0, 1), 5, {}, P)


# --- decisions from metrics windows ----------------------------------------------------------


def test_steady_job_with_hand_built_metrics_is_not_congested() -> None:
    measured = measure_window(_window(), ALL, P)
    assert measured.full and measured.batches == 5
    assert measured.congested == frozenset()
    assert sum(measured.utilisation.values()) == pytest.approx(1.0)
    decision = decide_scaling(_window(), ALL, P, ScaleRequest(scale_in_utilisation=0.5))
    assert decision.action == "none" and "no operator congested" in decision.reason


def test_growing_lag_in_hand_built_metrics_scales_out_the_congested_operator() -> None:
    # Stage B's heaviest instance takes 3x A's: B holds most of each batch's time.
    window = _window(lag_step=800, load_b={0: 700, 1: 100, 2: 100, 3: 100})
    active = {"A": (0, 1, 2, 3), "B": (0, 1)}
    measured = measure_window(window, active, P)
    assert measured.congested == frozenset({"B"})
    decision = decide_scaling(window, active, P, ScaleRequest())
    assert decision.action == "out"
    assert decision.operator == "B"
    assert decision.active_after["B"] == (0, 1, 2)
    assert decision.instances_after[decision.operator] == (
        decision.instances_before[decision.operator] + 1
    )
    assert decision.etp[decision.operator] == max(decision.etp[name] for name in measured.congested)


def test_idle_job_in_hand_built_metrics_scales_in_the_smallest_etp() -> None:
    # Batches end long before the next trigger: rows arrive much slower than they run.
    window = _window(duration_ms=200, rows=1_000)
    request = ScaleRequest(scale_in_utilisation=0.5, trigger_interval_s=1.0)
    assert sum(measure_window(window, ALL, P, trigger_interval_s=1.0).utilisation.values()) == (
        pytest.approx(0.2)
    )
    decision = decide_scaling(window, ALL, P, request)
    assert decision.action == "in"
    assert decision.operator is not None
    assert decision.etp[decision.operator] == min(decision.etp.values())
    assert decision.instances_after[decision.operator] == 3


def test_idle_time_between_hand_built_batches_lets_auto_mode_scale_in() -> None:
    # Batches take 1.5 s, longer than the 1 s trigger, but are reported 5 s apart:
    # Spark skipped the triggers that found no data, and the job idled 70 % of the time.
    window = _window(duration_ms=1_500, rows=1_000)
    reported = [5.0 * i for i in range(len(window))]
    request = ScaleRequest(scale_in_utilisation=0.5, trigger_interval_s=1.0)
    busy = measure_window(window, ALL, P, trigger_interval_s=1.0)
    assert sum(busy.utilisation.values()) == pytest.approx(1.0)
    assert decide_scaling(window, ALL, P, request).action == "none"
    idle = measure_window(window, ALL, P, trigger_interval_s=1.0, reported_at_s=reported)
    assert sum(idle.utilisation.values()) == pytest.approx(0.3)
    assert idle.dag.operators[0].input_rate == pytest.approx(200.0)
    decision = decide_scaling(window, ALL, P, request, reported_at_s=reported)
    assert decision.action == "in" and decision.reason.startswith("auto scale-in")
    assert decision.instances_after[decision.operator or ""] == 3
    # Back-to-back batches: reports closer than the duration never shorten it.
    packed = measure_window(window, ALL, P, reported_at_s=[0.5 * i for i in range(len(window))])
    assert sum(packed.utilisation.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one time per record"):
        measure_window(window, ALL, P, reported_at_s=reported[1:])


def test_requested_scale_in_is_bounded_and_explained() -> None:
    window = _window()
    decision = decide_scaling(window, ALL, P, ScaleRequest(mode="in", operator="B", instances=2))
    assert decision.action == "in" and decision.operator == "B"
    assert decision.instances_before == {"A": 4, "B": 4}
    assert decision.instances_after == {"A": 4, "B": 2}
    assert decision.to_record()["active_after"]["B"] == list(decision.active_after["B"])
    floor = decide_scaling(window, {"A": (0,), "B": (0,)}, P, ScaleRequest(mode="in"))
    assert floor.action == "none" and "no operator can scale in" in floor.reason
    ceiling = decide_scaling(window, ALL, P, ScaleRequest(mode="out", operator="A", instances=9))
    assert ceiling.action == "none" and "changes nothing" in ceiling.reason


def test_auto_mode_waits_for_a_full_window_of_hand_built_metrics() -> None:
    request = ScaleRequest(congestion=CongestionSettings(window=5))
    decision = decide_scaling(_window(3, lag_step=900), ALL, P, request)
    assert decision.action == "none" and "only 2 of 5 batches" in decision.reason


def test_scale_requests_are_validated() -> None:
    with pytest.raises(ValueError, match="'C' is not a stage of the pipeline; its stages are A, B"):
        decide_scaling(_window(3, lag_step=900), ALL, P, ScaleRequest(mode="out", operator="C"))
    with pytest.raises(ValueError, match="auto mode chooses"):
        ScaleRequest(mode="auto", instances=2)


def test_a_three_stage_chain_in_hand_built_metrics_scales_out_its_congested_middle_stage() -> None:
    """Stela over a chain: the measured DAG has one operator per stage, each feeding the
    next, and the stage whose heaviest instance holds the batch is scaled out."""
    even = {i: 250 for i in range(P)}
    window = [
        BatchMetrics(
            batch_id=i,
            rows=1_000,
            duration_ms=1_000,
            input_lag=i * 1_200,
            load={"parse": even, "sessions": {0: 800, 1: 200}, "pages": even},
            hops=2_000,
        )
        for i in range(6)
    ]
    active = {"parse": (0, 1, 2, 3), "sessions": (0, 1), "pages": (0, 1, 2, 3)}
    measured = measure_window(window, active, P)
    assert [op.name for op in measured.dag.operators] == ["parse", "sessions", "pages"]
    assert [(s.source, s.target) for s in measured.dag.streams] == [
        ("parse", "sessions"),
        ("sessions", "pages"),
    ]
    assert measured.congested == frozenset({"sessions"})
    decision = decide_scaling(window, active, P, ScaleRequest())
    assert (decision.action, decision.operator) == ("out", "sessions")
    assert decision.active_after["sessions"] == (0, 1, 2)
    assert decision.active_after["parse"] == active["parse"]


# --- stage shares from measured busy time (003 §4.1) ------------------------------------------

COSTLY_B = {"A": dict.fromkeys(range(P), 25.0), "B": dict.fromkeys(range(P), 100.0)}
"""Busy milliseconds per instance of a batch whose stage B costs 4x A per tuple."""


def test_a_costly_stage_with_as_many_tuples_as_the_source_is_congested_and_scaled_out() -> None:
    """Both stages process every tuple, evenly spread, but B's aggregate takes 4x A's time
    per tuple. Judged by tuples, the stages share each batch evenly and the source looks
    congested, so ETP grows A; judged by measured time, B holds 80 % of each batch, is the
    congested operator, and ETP grows B."""
    by_tuples = _window(lag_step=1_500)
    measured_time = _window(lag_step=1_500, busy_ms=COSTLY_B)
    active = {"A": (0, 1), "B": (0, 1)}

    guessed = measure_window(by_tuples, active, P)
    assert guessed.congested == frozenset({"A"}) and guessed.timed_batches == 0
    assert decide_scaling(by_tuples, active, P, ScaleRequest()).operator == "A"

    timed = measure_window(measured_time, active, P)
    assert timed.timed_batches == timed.batches == 5
    assert timed.congested == frozenset({"B"})
    a, b = timed.dag.operators
    assert (a.execute_rate, b.execute_rate) == (pytest.approx(5_000.0), pytest.approx(1_250.0))
    decision = decide_scaling(measured_time, active, P, ScaleRequest())
    assert (decision.action, decision.operator) == ("out", "B")
    assert decision.active_after == {"A": (0, 1), "B": (0, 1, 2)}
    assert "stage times measured in 5 of 5 batches" in decision.reason
    assert decision.to_record()["timed_batches"] == 5


def test_shares_fall_back_to_tuples_unless_every_stage_reports_its_time() -> None:
    """A batch whose stages did not all time their work (the JVM stages, records written
    before busy time was reported) is shared by its most loaded instances' tuples."""
    skewed = {0: 700, 1: 100, 2: 100, 3: 100}
    only_b = _batch(1, load_b=skewed, busy_ms={"B": COSTLY_B["B"]})
    idle_a = _batch(1, busy_ms={"A": dict.fromkeys(range(P), 0.0), "B": COSTLY_B["B"]})
    for record in (only_b, _batch(1, load_b=skewed), idle_a):
        shares, timed = stage_shares(record, ("A", "B"))
        assert not timed
        busiest = max(record.load["B"].values())
        assert shares["B"] == pytest.approx(busiest / (250 + busiest))
    shares, timed = stage_shares(_batch(1, load_b=skewed, busy_ms=COSTLY_B), ("A", "B"))
    assert timed and shares == {"A": pytest.approx(0.2), "B": pytest.approx(0.8)}
    assert stage_shares(_batch(1, rows=0), ("A", "B")) == ({"A": 0.5, "B": 0.5}, False)

    # A window mixing both: the timed batches are counted, the others judged by tuples.
    window = [_batch(i, busy_ms=COSTLY_B if i % 2 else None) for i in range(6)]
    assert measure_window(window, ALL, P).timed_batches == 3


# --- saturated jobs: a backlog that never drains (003 §4.1) -------------------------------------

SATURATED_B = {"A": dict.fromkeys(range(P), 10.0), "B": dict.fromkeys(range(P), 90.0)}
"""Busy milliseconds per instance of a batch whose stage B takes 90 % of the time."""

BEHIND = 3_000
"""A steady input lag of three batches of 1,000 rows: the job reads as fast as it can."""

HALF = {"A": (0, 1), "B": (0, 1)}
"""Two of the four state partitions active per stage: room to scale out."""


def test_a_saturated_window_with_a_costly_stage_grows_that_stage() -> None:
    """Three batches always wait, so what arrives equals what is processed and, judged by
    arrivals, nothing would be congested. The window is saturated: the source is offered
    what it read plus what waits (4,000 tuples/s), B's input is bounded by A's execute
    rate, and B, executing 1,111 tuples/s, is congested; ETP grows B, in auto mode and on
    a requested scale-out that names no stage."""
    window = [_batch(i, lag=BEHIND, busy_ms=SATURATED_B) for i in range(6)]
    measured = measure_window(window, HALF, P)
    assert (measured.saturated, measured.backlog) == (True, BEHIND)
    a, b = measured.dag.operators
    assert (a.input_rate, a.execute_rate) == (pytest.approx(4_000.0), pytest.approx(10_000.0))
    assert (b.input_rate, b.execute_rate) == (pytest.approx(4_000.0), pytest.approx(1_111.111))
    assert measured.congested == frozenset({"B"})
    for request in (ScaleRequest(), ScaleRequest(mode="out")):
        decision = decide_scaling(window, HALF, P, request)
        assert (decision.action, decision.operator) == ("out", "B")
        assert decision.active_after == {"A": (0, 1), "B": (0, 1, 2)}
        assert "saturated: input lag ≥ one batch's rows through the window" in decision.reason
        assert "(at least 3,000 waiting)" in decision.reason
        assert decision.saturated and decision.to_record()["saturated"] is True

    # The same costly stage in a job that keeps up (nothing waits after a batch) is busy,
    # not congested: it has no time to spare and nothing to scale.
    caught_up = _window(busy_ms=SATURATED_B)
    kept_up = measure_window(caught_up, HALF, P)
    assert not kept_up.saturated and kept_up.congested == frozenset()
    assert sum(kept_up.utilisation.values()) == pytest.approx(1.0)
    decision = decide_scaling(caught_up, HALF, P, ScaleRequest())
    assert decision.action == "none" and "saturated" not in decision.reason
    assert decision.to_record()["saturated"] is False


def test_a_saturated_window_judged_by_tuples_grows_the_source_as_before() -> None:
    """Without busy time (JVM stages, older records) evenly loaded stages share each batch
    evenly, as if their tuples cost the same. Saturated, the source is congested (offered
    4,000 tuples/s, executing 2,000) and B is not (A passes on 2,000): ETP grows A, the
    stage the source fallback of a window that is not saturated grows too."""
    saturated = [_batch(i, lag=BEHIND) for i in range(6)]
    measured = measure_window(saturated, HALF, P)
    assert measured.saturated and measured.timed_batches == 0
    assert measured.congested == frozenset({"A"})
    decision = decide_scaling(saturated, HALF, P, ScaleRequest())
    assert (decision.action, decision.operator) == ("out", "A")
    assert "congested ['A']" in decision.reason and "saturated" in decision.reason

    kept_up = _window()
    assert measure_window(kept_up, HALF, P).congested == frozenset()
    fallback = decide_scaling(kept_up, HALF, P, ScaleRequest(mode="out"))
    assert (fallback.action, fallback.operator) == ("out", "A")
    assert fallback.active_after == decision.active_after == {"A": (0, 1, 2), "B": (0, 1)}

    # One batch waiting is saturated still (lag ≥ rows), but the source is offered 2,000
    # tuples/s against 2,000 it executes, within α: auto mode leaves the job and says why.
    one_behind = [_batch(i, lag=1_000) for i in range(6)]
    left = decide_scaling(one_behind, HALF, P, ScaleRequest())
    assert (left.action, left.saturated) == ("none", True)
    assert left.reason.startswith("no operator congested")
    assert left.reason.endswith("(at least 1,000 waiting)")


def test_a_window_that_catches_up_is_not_saturated() -> None:
    """The last batch reads 2,500 rows and leaves 800 waiting, fewer than it read: the job
    caught up, so its arrivals are its input, the backlog is not offered, nothing is
    congested, and a costly B stays as it is."""
    window = [_batch(i, lag=BEHIND, busy_ms=SATURATED_B) for i in range(5)]
    window.append(_batch(5, rows=2_500, lag=800, busy_ms=SATURATED_B))
    assert not is_saturated(window[1:]) and is_saturated(window[1:5])
    measured = measure_window(window, HALF, P)
    assert (measured.saturated, measured.backlog) == (False, 0)
    assert measured.congested == frozenset()
    # Arrivals only: 1,000 in each of four batches, 300 while the last drains 2,200.
    assert measured.dag.operators[0].input_rate == pytest.approx(860.0)
    decision = decide_scaling(window, HALF, P, ScaleRequest())
    assert decision.action == "none" and not decision.saturated
    assert "saturated" not in decision.reason
    # A batch that reads nothing and leaves nothing waiting does not count as behind.
    assert not is_saturated([_batch(0, rows=0, lag=0)]) and not is_saturated([])
