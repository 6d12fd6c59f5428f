"""A user's own keyed aggregate in the routed job: split, moved live, merged exactly.

Both stages run :class:`~keyplane.aggregates.ValueCounts` (how often a key met
each value of the other field), not a count: its state is a multiset that
must travel through the migration topic as text, and its merge is not
idempotent, so a state lost or installed twice changes the answer. Real
broker, real SparkSession, the real routed job and the real controller: v1
splits a hot key of each stage; while the query runs, v2 goes live, which
merges stage A's split (d → 1, paper 001 §4.1.2), changes stage B's, and
moves tabled keys of both stages (paper 000 §3.4). Events arrive before and
after the switch; every key's merged answer equals the generator's ground
truth, pair by pair.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from keyplane.aggregates import ValueCounts
from keyplane.algorithms.partials import latest_partials
from keyplane.control.controller import Controller
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.migration_topic import read_moves
from keyplane.kafka.producer import produce_workload
from keyplane.reference.events import key_name
from keyplane.reference.workloads import GeoTagsWorkload
from keyplane.routing.config import save
from keyplane.spark.counts_job import (
    CountsJobSettings,
    job_command,
    parse_settings,
    read_partials,
    read_results,
    start_counts_query,
    stop_between_batches,
)
from keyplane.testing import routed_job_settings, split_then_unsplit

P = 4
"""Instances per operator: the ``spark`` fixture's shuffle partitions."""


def _pair_counts(specs: list[GeoTagsWorkload]) -> dict[tuple[str, str], dict[str, int]]:
    """Ground truth: for each (stage, key), how often it met each value of the other field."""
    truth: dict[tuple[str, str], Counter[str]] = {}
    for spec in specs:
        for batch in spec.batches(100_000):
            for a, b in zip(batch.a.tolist(), batch.b.tolist(), strict=True):
                truth.setdefault(("A", key_name(a)), Counter())[key_name(b)] += 1
                truth.setdefault(("B", key_name(b)), Counter())[key_name(a)] += 1
    return {key: dict(sorted(counter.items())) for key, counter in truth.items()}


@pytest.mark.integration
def test_value_counts_stay_exact_through_a_split_and_a_live_state_move(
    spark, broker: str, topic_name: str, tmp_path: Path
) -> None:
    before = GeoTagsWorkload(n_events=3_000, n_regions=12, n_tags=40, seed=11)
    after = GeoTagsWorkload(n_events=2_000, n_regions=12, n_tags=40, seed=12)
    truth = _pair_counts([before, after])
    by_size = sorted(truth, key=lambda k: (-sum(truth[k].values()), k))
    a_keys = [key for stage, key in by_size if stage == "A"]
    b_keys = [key for stage, key in by_size if stage == "B"]
    store = tmp_path / "routing"
    v1, v2 = split_then_unsplit(a_keys, b_keys, P)
    save(v1, store)
    settings = routed_job_settings(
        broker,
        topic_name,
        tmp_path,
        parallelism=P,
        batch=1_000,
        trigger="0 seconds",
        stage_a_aggregate="keyplane.aggregates:ValueCounts",
        stage_b_aggregate="keyplane.aggregates:ValueCounts",
    )
    assert produce_workload(before, broker, topic_name, partitions=2) == before.n_events
    query = start_counts_query(spark, settings)
    try:
        query.processAllAvailable()
        split = read_partials(settings.output)
        hot = split[(split["stage"] == "A") & (split["key"] == a_keys[0])]
        assert set(hot["instance"]) == {0, 1, 3}, "v1 splits A's hot key over three instances"
        with ControlChannel(broker, settings.control_topic) as channel:
            controller = Controller(channel, tmp_path / "controller.json", store)
            save(v2, store)
            assert controller.rollout(2, timeout_s=120).version == 2
        assert produce_workload(after, broker, topic_name, partitions=2) == after.n_events
        query.processAllAvailable()
        assert query.exception() is None
    finally:
        stop_between_batches(query)

    # The moved states are ValueCounts' multisets, as text, from both stages.
    moved = read_moves(broker, settings.migration_topic)
    assert {m["operator"] for m in moved} == {"A", "B"}
    hot_moves = [m for m in moved if m["operator"] == "A" and m["key"] == a_keys[0]]
    assert len(hot_moves) == 3, "each of the three partials moves to the merged routed key"
    assert all(len(json.loads(m["state"])) > 1 for m in hot_moves)

    # Every key's state lives where v2 puts it; the split partials were merged into one.
    latest = latest_partials(read_partials(settings.output))
    live = latest[latest["count"] > 0]
    held = live[(live["stage"] == "A") & (live["key"] == a_keys[0])]
    assert held["instance"].tolist() == [2]
    assert set(live.loc[(live["stage"] == "B") & (live["key"] == b_keys[0]), "instance"]) == {0, 2}

    results = read_results(settings.output, settings.aggregates())
    observed = {(s, k): r for s, k, r in results.itertuples(index=False)}
    assert observed == truth
    assert isinstance(settings.aggregates()["A"], ValueCounts)


def test_job_command_line_takes_an_aggregate_and_refuses_a_bad_one_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--bootstrap-servers", "localhost:1", "--checkpoint", str(tmp_path / "ck")]
    base += ["--output", str(tmp_path / "out"), "--routing-store", str(tmp_path / "routing")]
    good = parse_settings([*base, "--stage-b-aggregate", "keyplane.aggregates:ValueCounts"])
    assert parse_settings(job_command(good)[3:]) == good
    assert [type(a).__name__ for a in good.aggregates().values()] == [
        "RunningCount",
        "ValueCounts",
    ]
    with pytest.raises(SystemExit):
        parse_settings([*base, "--stage-a-aggregate", "keyplane.aggregates:Missing"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        "argument --stage-a-aggregate: aggregate 'keyplane.aggregates:Missing': "
        "keyplane.aggregates has no 'Missing'"
    )
    with pytest.raises(ValueError, match="need the routed job"):
        CountsJobSettings(
            bootstrap_servers="localhost:1",
            checkpoint=tmp_path / "ck",
            output=tmp_path / "out",
            stage_a_aggregate="keyplane.aggregates:ValueCounts",
        )
