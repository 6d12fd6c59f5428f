"""Tests of keyplane.algorithms.elasticity: congestion, ETP, scale-out and -in (003 §4–5)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.elasticity import (
    CongestionDetector,
    CongestionSettings,
    Instance,
    Operator,
    OperatorDag,
    Stream,
    congested_operators,
    effective_reachable_sinks,
    etp,
    etp_all,
    etp_sum_by_machine,
    is_congested,
    new_instance_slots,
    project_added_instance,
    round_robin_scale_out,
    stela_scale_in,
    stela_scale_out,
)


def figure2_dag() -> OperatorDag:
    """The tree of 003 §4.3 (Figure 2), reconstructed from the text.

    The text fixes: congested operators 1, 3, 4, 6 (α = 1); sinks 4, 7, 8, 9, 10
    executing 2000, 1000, 1000, 200, 300 tuples/s; operator 3 reaches sinks
    7, 8, 9, 10, through uncongested 5 (to 7 and 8) and congested 6 (to 9 and
    10); operator 1 reaches all sinks, none along an uncongested path. Numbered
    breadth first, this is 1 → {2, 3}, 2 → 4, 3 → {5, 6}, 5 → {7, 8},
    6 → {9, 10}. The figure's other rates are not in the text; these are
    chosen to give the stated congestion.
    """
    rates = {
        "1": (6000.0, 4000.0),
        "2": (2500.0, 2500.0),
        "3": (3000.0, 2500.0),
        "4": (2500.0, 2000.0),
        "5": (2000.0, 2000.0),
        "6": (800.0, 500.0),
        "7": (1000.0, 1000.0),
        "8": (1000.0, 1000.0),
        "9": (200.0, 200.0),
        "10": (300.0, 300.0),
    }
    operators = tuple(Operator(n, 1, i, e) for n, (i, e) in rates.items())
    streams = (
        Stream("1", "2"),
        Stream("1", "3"),
        Stream("2", "4"),
        Stream("3", "5"),
        Stream("3", "6"),
        Stream("5", "7", 0.5),
        Stream("5", "8", 0.5),
        Stream("6", "9"),
        Stream("6", "10"),
    )
    return OperatorDag(operators, streams)


def linear_dag() -> OperatorDag:
    """Table 4's linear shape (a source and three bolts, six instances each), b2 congested."""
    return OperatorDag(
        (
            Operator("src", 6, 3000.0, 3000.0),
            Operator("b1", 6, 3000.0, 3000.0),
            Operator("b2", 6, 3000.0, 1800.0),
            Operator("b3", 6, 1800.0, 1800.0),
        ),
        (Stream("src", "b1"), Stream("b1", "b2"), Stream("b2", "b3")),
    )


# --- the worked example of 003 §4.3 -------------------------------------------------------


def test_figure2_workflow_throughput_is_4500() -> None:
    assert figure2_dag().throughput == pytest.approx(4500.0)


def test_figure2_congested_operators_are_1_3_4_6_at_alpha_1() -> None:
    assert congested_operators(figure2_dag(), threshold=1.0) == {"1", "3", "4", "6"}


def test_figure2_etp3_is_44_percent_through_uncongested_5() -> None:
    dag = figure2_dag()
    assert effective_reachable_sinks(dag, "3", threshold=1.0) == {"7", "8"}
    assert etp(dag, "3", threshold=1.0) == pytest.approx(2000 / 4500)
    assert round(100 * etp(dag, "3", threshold=1.0)) == 44


def test_figure2_etp1_is_zero_because_every_path_is_congested() -> None:
    assert etp(figure2_dag(), "1", threshold=1.0) == 0.0


def test_figure2_etp6_is_11_percent_and_etp4_is_44_percent() -> None:
    scores = etp_all(figure2_dag(), threshold=1.0)
    assert round(100 * scores["6"]) == 11
    assert scores["6"] == pytest.approx(500 / 4500)
    assert round(100 * scores["4"]) == 44


# --- the DAG model and ETP on DAGs --------------------------------------------------------


def test_sink_reached_along_two_uncongested_paths_counts_once() -> None:
    dag = OperatorDag(
        (
            Operator("s", 1, 100.0, 100.0),
            Operator("a", 1, 100.0, 100.0),
            Operator("b", 1, 100.0, 100.0),
            Operator("k", 1, 200.0, 200.0),
        ),
        (Stream("s", "a"), Stream("s", "b"), Stream("a", "k"), Stream("b", "k")),
    )
    assert etp(dag, "s") == pytest.approx(1.0)


def test_sources_and_sinks_follow_the_streams() -> None:
    dag = figure2_dag()
    assert dag.sources == ("1",)
    assert set(dag.sinks) == {"4", "7", "8", "9", "10"}
    assert dag.topological_order.index("3") < dag.topological_order.index("5")


def test_cycle_is_rejected_with_the_operators_named() -> None:
    ops = (Operator("a", 1, 1.0, 1.0), Operator("b", 1, 1.0, 1.0))
    with pytest.raises(ValueError, match="cycle"):
        OperatorDag(ops, (Stream("a", "b"), Stream("b", "a")))


def test_stream_to_unknown_operator_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown operator 'x'"):
        OperatorDag((Operator("a", 1, 1.0, 1.0),), (Stream("a", "x"),))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"parallelism": 0}, "parallelism"),
        ({"input_rate": -1.0}, "input_rate"),
        ({"execute_rate": math.nan}, "execute_rate"),
        ({"max_parallelism": 1, "parallelism": 2}, "max_parallelism"),
    ],
)
def test_operator_validation(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"parallelism": 1, "input_rate": 1.0, "execute_rate": 1.0}
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Operator("op", **base)


def test_threshold_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match=r">= 1\.0"):
        etp(figure2_dag(), "3", threshold=0.5)


def test_congestion_is_strictly_above_the_threshold() -> None:
    assert not is_congested(Operator("x", 1, 120.0, 100.0), 1.2)
    assert is_congested(Operator("x", 1, 121.0, 100.0), 1.2)
    assert is_congested(Operator("x", 1, 1.0, 0.0), 1.2)
    assert not is_congested(Operator("x", 1, 0.0, 0.0), 1.2)


# --- congestion detector ------------------------------------------------------------------


def test_detector_waits_for_a_full_window() -> None:
    detector = CongestionDetector(CongestionSettings(threshold=1.2, window=3))
    detector.observe("op", 300.0, 100.0)
    detector.observe("op", 300.0, 100.0)
    assert not detector.is_congested("op")
    detector.observe("op", 300.0, 100.0)
    assert detector.is_congested("op")
    assert detector.congested() == {"op"}


def test_detector_averages_over_the_window_so_one_spike_is_ignored() -> None:
    detector = CongestionDetector(CongestionSettings(threshold=1.2, window=4))
    for input_rate in (100.0, 100.0, 100.0, 170.0):
        detector.observe("op", input_rate, 100.0)
    assert detector.window_rates("op") == pytest.approx((117.5, 100.0))
    assert not detector.is_congested("op")


def test_detector_window_slides_so_old_congestion_expires() -> None:
    detector = CongestionDetector(CongestionSettings(threshold=1.2, window=2))
    detector.observe("op", 500.0, 100.0)
    detector.observe("op", 500.0, 100.0)
    assert detector.is_congested("op")
    detector.observe("op", 100.0, 100.0)
    detector.observe("op", 110.0, 100.0)
    assert detector.window_rates("op") == pytest.approx((105.0, 100.0))
    assert not detector.is_congested("op")


def test_detector_measured_dag_carries_window_rates() -> None:
    dag = linear_dag()
    detector = CongestionDetector(CongestionSettings(window=2))
    detector.observe("b1", 3000.0, 1000.0)
    detector.observe("b1", 3000.0, 2000.0)
    detector.observe("b3", 10.0, 10.0)
    measured = detector.measured_dag(dag)
    assert measured.operator("b1").execute_rate == pytest.approx(1500.0)
    assert measured.operator("b3") == dag.operator("b3")
    assert congested_operators(measured) == {"b1", "b2"}


def test_detector_settings_validation() -> None:
    with pytest.raises(ValueError, match="window"):
        CongestionSettings(window=0)
    with pytest.raises(ValueError, match="threshold"):
        CongestionSettings(threshold=0.9)


# --- scale-out ----------------------------------------------------------------------------


def test_new_instance_slots_follow_table4_and_keep_the_average() -> None:
    assert new_instance_slots(24, 6, 1) == 4  # linear and diamond: 6 → 7 machines
    assert new_instance_slots(12, 4, 1) == 3  # star: 4 → 5 machines
    assert new_instance_slots(10, 4, 2) == 6  # 2.5 rounds up to 3 per machine
    assert new_instance_slots(1, 8, 1) == 1


def test_projection_scales_the_target_and_feeds_its_descendants() -> None:
    projected = project_added_instance(linear_dag(), "b2")
    b2 = projected.operator("b2")
    assert b2.parallelism == 7
    assert b2.execute_rate == pytest.approx(1800.0 * 7 / 6)
    assert projected.operator("b3").input_rate == pytest.approx(2100.0)
    assert projected.operator("b3").execute_rate == pytest.approx(1800.0)
    assert projected.operator("b1") == linear_dag().operator("b1")


def test_projection_applies_the_stream_ratio() -> None:
    projected = project_added_instance(figure2_dag(), "3")
    # 3 can now execute 5000 tuples/s of its 3000 input: it passes on 500 more,
    # which 5 and 6 each receive; 5 is capped at its measured 2000, so 7 and 8
    # see no change.
    assert projected.operator("3").execute_rate == pytest.approx(5000.0)
    assert projected.operator("5").input_rate == pytest.approx(2500.0)
    assert projected.operator("6").input_rate == pytest.approx(1300.0)
    assert projected.operator("7").input_rate == pytest.approx(1000.0)


def test_scale_out_picks_the_congested_operator_with_the_highest_etp() -> None:
    dag = OperatorDag(
        (
            Operator("src", 2, 1000.0, 1000.0),
            Operator("hot", 2, 1000.0, 400.0),
            Operator("warm", 2, 1000.0, 700.0),
            Operator("big_sink", 2, 700.0, 700.0),
            Operator("small_sink", 2, 400.0, 400.0),
        ),
        (
            Stream("src", "hot"),
            Stream("src", "warm"),
            Stream("hot", "small_sink"),
            Stream("warm", "big_sink"),
        ),
    )
    plan = stela_scale_out(dag, 1)
    assert etp(dag, "warm") > etp(dag, "hot")
    assert plan.operators == ("warm",)
    assert plan.choices[0].projected_etp == pytest.approx(700 / 1100)
    assert plan.choices[0].reason == "highest_etp"


def test_scale_out_on_linear_chain_follows_projected_etp() -> None:
    # b2 is the bottleneck; after two instances its output congests b3
    # (measured execute rate 1800 is all Stela knows of b3), whose ETP is then
    # 100 % while b2's drops to 0, so b3 gets the third slot and b2 the fourth.
    plan = stela_scale_out(linear_dag(), 4)
    assert plan.operators == ("b2", "b2", "b3", "b2")
    assert plan.added_instances() == {"b2": 3, "b3": 1}
    assert plan.projected.operator("b2").parallelism == 9


@st.composite
def random_dags(draw: st.DrawFn) -> OperatorDag:
    n = draw(st.integers(2, 7))
    names = [f"o{i}" for i in range(n)]
    streams: list[Stream] = []
    for j in range(1, n):
        parents = draw(st.sets(st.integers(0, j - 1), min_size=1, max_size=min(2, j)))
        streams.extend(Stream(names[p], names[j]) for p in sorted(parents))
    rate = st.floats(10.0, 1000.0)
    operators = tuple(
        Operator(name, draw(st.integers(1, 4)), draw(rate), draw(rate)) for name in names
    )
    return OperatorDag(operators, tuple(streams))


@settings(max_examples=60, deadline=None)
@given(dag=random_dags(), slots=st.integers(1, 6))
def test_every_scale_out_choice_has_the_highest_projected_etp(dag: OperatorDag, slots: int) -> None:
    plan = stela_scale_out(dag, slots)
    assert len(plan.choices) == slots
    current = dag
    for choice in plan.choices:
        congested = congested_operators(current)
        if congested:
            best = max(etp(current, n) for n in congested)
            assert choice.operator in congested
            assert choice.reason == "highest_etp"
        else:
            best = max(etp(current, n) for n in current.sources)
            assert choice.operator in current.sources
            assert choice.reason == "source_fallback"
        assert choice.projected_etp == pytest.approx(best)
        assert etp(current, choice.operator) == pytest.approx(best)
        current = project_added_instance(current, choice.operator)
    assert current == plan.projected
    assert plan.projected.total_instances == dag.total_instances + slots


def test_scale_out_falls_back_to_a_source_when_nothing_is_congested() -> None:
    dag = OperatorDag(
        (
            Operator("s1", 1, 50.0, 50.0),
            Operator("s2", 1, 50.0, 50.0),
            Operator("k", 1, 1.0, 100.0),
        ),
        (Stream("s1", "k"), Stream("s2", "k")),
    )
    plan = stela_scale_out(dag, 2)
    assert {c.reason for c in plan.choices} == {"source_fallback"}
    assert sorted(plan.operators) == ["s1", "s2"]


def test_scale_out_respects_max_parallelism() -> None:
    dag = OperatorDag(
        (Operator("s", 1, 100.0, 100.0), Operator("k", 1, 100.0, 10.0, max_parallelism=2)),
        (Stream("s", "k"),),
    )
    plan = stela_scale_out(dag, 3)
    assert plan.operators[0] == "k"
    assert "k" not in plan.operators[1:]
    assert plan.projected.operator("k").parallelism == 2


def test_round_robin_deals_slots_in_topological_order() -> None:
    plan = round_robin_scale_out(linear_dag(), 6, start=1)
    assert plan.operators == ("b1", "b2", "b3", "src", "b1", "b2")
    assert {c.reason for c in plan.choices} == {"round_robin"}


# --- scale-in -----------------------------------------------------------------------------


def figure2_layout() -> dict[str, list[Instance]]:
    """Machines holding instances of the Figure 2 operators (ETP 0 for 1, 2; 0.44 for 3, 4)."""
    return {
        "m_low": [Instance("1", 0), Instance("2", 0)],
        "m_mid": [Instance("6", 0), Instance("9", 0)],
        "m_high": [Instance("3", 0), Instance("4", 0)],
        "m_other": [Instance("5", 0), Instance("7", 0), Instance("8", 0), Instance("10", 0)],
    }


def test_etp_sum_adds_the_etp_of_each_instance() -> None:
    sums = etp_sum_by_machine(figure2_dag(), figure2_layout(), threshold=1.0)
    assert sums["m_low"] == pytest.approx(0.0)
    assert sums["m_mid"] == pytest.approx(500 / 4500 + 200 / 4500)
    assert sums["m_high"] == pytest.approx(4000 / 4500)


def test_scale_in_removes_lowest_etp_sum_and_deals_round_robin_from_lowest() -> None:
    plan = stela_scale_in(figure2_dag(), figure2_layout(), 2, threshold=1.0)
    assert plan.removed_machines == ("m_low", "m_mid")
    # receivers in increasing ETPSum: m_high (4000/4500) before m_other (4300/4500)
    assert plan.etp_sums["m_other"] == pytest.approx(4300 / 4500)
    assert [m.to_machine for m in plan.moves] == ["m_high", "m_other", "m_high", "m_other"]
    assert [m.instance for m in plan.moves] == [
        Instance("1", 0),
        Instance("2", 0),
        Instance("6", 0),
        Instance("9", 0),
    ]
    assert plan.layout["m_high"] == (
        Instance("3", 0),
        Instance("4", 0),
        Instance("1", 0),
        Instance("6", 0),
    )


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, list[Instance]]:
    dag = figure2_dag()
    names = list(dag.topological_order)
    n_machines = draw(st.integers(2, 6))
    layout: dict[str, list[Instance]] = {f"m{i}": [] for i in range(n_machines)}
    for k, op in enumerate(draw(st.lists(st.sampled_from(names), min_size=1, max_size=25))):
        layout[f"m{draw(st.integers(0, n_machines - 1))}"].append(Instance(op, k))
    return layout


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), data=st.data())
def test_scale_in_conserves_instances_and_drops_the_lowest_etp_sums(
    layout: dict[str, list[Instance]], data: st.DataObject
) -> None:
    remove = data.draw(st.integers(0, len(layout) - 1))
    dag = figure2_dag()
    plan = stela_scale_in(dag, layout, remove, threshold=1.0)
    before = Counter(i for instances in layout.values() for i in instances)
    after = Counter(i for instances in plan.layout.values() for i in instances)
    assert after == before
    assert len(plan.removed_machines) == remove
    assert set(plan.layout) == set(layout) - set(plan.removed_machines)
    kept = [plan.etp_sums[m] for m in plan.layout]
    for m in plan.removed_machines:
        assert plan.etp_sums[m] <= min(kept) + 1e-12
    moved = sum(len(layout[m]) for m in plan.removed_machines)
    assert len(plan.moves) == moved
    gained = [len(plan.layout[m]) - len(layout[m]) for m in plan.layout]
    assert max(gained) - min(gained) <= 1


def test_scale_in_must_leave_a_machine() -> None:
    with pytest.raises(ValueError, match="at least one must remain"):
        stela_scale_in(figure2_dag(), figure2_layout(), 4)


def test_scale_in_rejects_an_instance_placed_twice() -> None:
    layout = {"a": [Instance("1", 0)], "b": [Instance("1", 0)]}
    with pytest.raises(ValueError, match="placed twice"):
        stela_scale_in(figure2_dag(), layout, 1)
