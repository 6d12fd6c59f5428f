"""The test helpers shipped with the library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pandas as pd
import pytest
from pyspark.sql.streaming import StreamingQuery

from keyplane.algorithms.statistics import read_snapshot
from keyplane.routing.routedkeys import spark_partition
from keyplane.spark.counts_job import CountsJobSettings, job_command
from keyplane.testing import (
    events_read_by_connector,
    moved_off_hash,
    moved_off_hash_config,
    paired_tuple_counts,
    routed_job_settings,
    routed_job_topics,
    stage_keys_by_count,
    wait_for_records,
    write_statistics_snapshot,
)


def test_routed_job_topics_are_settings_keywords_and_disjoint_between_jobs(
    tmp_path: Path,
) -> None:
    first, second = routed_job_topics("orders"), routed_job_topics("clicks")

    settings = CountsJobSettings(
        bootstrap_servers="127.0.0.1:9092",
        events_topic="orders",
        checkpoint=tmp_path / "checkpoint",
        output=tmp_path / "output",
        **first,
    )
    assert (settings.control_topic, settings.dead_letter_topic) == (
        "orders.control",
        "orders.dead-letter",
    )
    assert set(first.values()).isdisjoint(second.values())
    assert len(set(first.values())) == 4


@pytest.mark.parametrize("shift", [1, 2, 3, 5])
def test_moved_off_hash_moves_every_key_by_its_shift(shift: int) -> None:
    keys = [f"k{i}" for i in range(200)]

    table = moved_off_hash(keys, 4, shift)

    assert list(table) == keys
    for key, instance in table.items():
        assert instance != spark_partition(key, 4)
        assert (instance - spark_partition(key, 4)) % 4 == shift % 4


def test_moved_off_hash_refuses_a_shift_that_moves_nothing() -> None:
    with pytest.raises(ValueError, match="moves no key"):
        moved_off_hash(["k1"], 4, 8)


def test_moved_off_hash_config_moves_every_listed_key_of_each_operator_pure() -> None:
    config = moved_off_hash_config(3, {"A": ["k1", "k2"], "B": ["m"]}, 4)
    assert (config.version, config.parent_version) == (3, 2)
    assert config.operators["A"].table == moved_off_hash(["k1", "k2"], 4)
    assert config.operators["B"].table == moved_off_hash(["m"], 4)
    assert all(not routing.hot_keys for routing in config.operators.values())


def test_moved_off_hash_config_shifts_per_operator_splits_hot_keys_and_starts_at_v1_pure() -> None:
    config = moved_off_hash_config(
        1, {"A": ["k1"], "B": ["m1", "m2"]}, 4, shifts={"B": 2}, hot_keys={"A": {"h": (0, 2)}}
    )
    assert (config.version, config.parent_version, config.created_by) == (1, None, "initial")
    assert list(config.operators) == ["A", "B"]
    assert config.operators["A"].table == moved_off_hash(["k1"], 4)
    assert config.operators["A"].hot_keys == {"h": (0, 2)}
    assert config.operators["B"].table == moved_off_hash(["m1", "m2"], 4, 2)
    assert config.operators["B"].hot_keys == {}


def test_stage_keys_by_count_ranks_each_stage_and_keeps_ties_in_order_pure() -> None:
    truth = pd.DataFrame(
        {
            "stage": ["A", "A", "A", "B", "B"],
            "key": ["a1", "a2", "a3", "b1", "b2"],
            "count": [5, 9, 5, 1, 2],
        }
    )
    assert stage_keys_by_count(truth) == (["a2", "a1", "a3"], ["b2", "b1"])


def test_routed_job_settings_keep_everything_in_the_work_directory_pure(tmp_path: Path) -> None:
    settings = routed_job_settings(
        "127.0.0.1:9092", "orders", tmp_path, parallelism=3, batch=500, trigger="2 seconds"
    )
    assert (settings.checkpoint, settings.output, settings.routing_store) == (
        tmp_path / "checkpoint",
        tmp_path / "output",
        tmp_path / "routing",
    )
    assert (settings.shuffle_partitions, settings.max_offsets_per_trigger) == (3, 500)
    assert (settings.trigger_interval, settings.routing_version) == ("2 seconds", None)
    assert settings.control_topic == routed_job_topics("orders")["control_topic"]
    command = job_command(settings)
    flags = {arg.partition("=")[0] for arg in command[3:]}
    assert "--trigger-interval" in flags and "--routing-version" not in flags

    pace = {"parallelism": 3, "batch": 500, "trigger": "0 seconds"}
    on_v2 = routed_job_settings("127.0.0.1:9092", "orders", tmp_path, version=2, **pace)
    plain = routed_job_settings("127.0.0.1:9092", "orders", tmp_path, routing_store=None, **pace)
    assert (on_v2.routing_version, plain.routing_store) == (2, None)


def test_paired_tuple_counts_pair_two_a_keys_with_each_b_key_pure() -> None:
    plain = paired_tuple_counts(8, seed=1)
    hot = paired_tuple_counts(8, seed=1, hot={"3": 10})

    assert list(plain.columns) == ["a", "b", "holdout", "n"]
    assert plain.groupby("b")["a"].nunique().tolist() == [2, 2, 2, 2]
    assert plain.groupby("holdout")["n"].sum()[True] < plain.groupby("holdout")["n"].sum()[False]
    assert plain.equals(paired_tuple_counts(8, seed=1))
    window = plain[~plain["holdout"]].set_index("a")["n"]
    hot_window = hot[~hot["holdout"]].set_index("a")["n"]
    assert hot_window.drop("3").equals(window.drop("3"))
    assert hot_window["3"] > 9 * window["3"]


def test_write_statistics_snapshot_is_read_back_for_its_run(tmp_path: Path) -> None:
    grouped = paired_tuple_counts(8, seed=1)

    write_statistics_snapshot(tmp_path, "manual__1", grouped)

    snapshot = read_snapshot(tmp_path, "manual__1")
    assert snapshot.manifest.run_id == "manual__1"
    assert snapshot.manifest.events[0].end_total == int(grouped["n"].sum())


class FakeQuery:
    """A streaming query that reads ``per_poll`` events a poll until ``fails_after`` polls."""

    def __init__(self, per_poll: int, fails_after: int | None = None) -> None:
        self.per_poll, self.fails_after, self.polls = per_poll, fails_after, 0

    @property
    def recentProgress(self) -> list[dict[str, object]]:
        self.polls += 1
        return [{"batchId": i, "numInputRows": self.per_poll} for i in range(self.polls)]

    def exception(self) -> Exception | None:
        failed = self.fails_after is not None and self.polls >= self.fails_after
        return RuntimeError("stage A failed") if failed else None


def test_wait_for_records_returns_once_the_query_has_read_them_with_a_fake_query() -> None:
    query = FakeQuery(per_poll=100)
    wait_for_records(cast(StreamingQuery, query), 450, poll_s=0)
    assert query.polls == 5


def test_wait_for_records_fails_with_the_querys_error_with_a_fake_query() -> None:
    query = FakeQuery(per_poll=100, fails_after=2)
    with pytest.raises(AssertionError, match="stage A failed"):
        wait_for_records(cast(StreamingQuery, query), 1_000, poll_s=0)
    assert query.polls == 2


def test_wait_for_records_gives_up_after_its_timeout_with_a_fake_query() -> None:
    query = FakeQuery(per_poll=0)
    with pytest.raises(AssertionError, match=r"fewer than 10 events in 0\.05 s"):
        wait_for_records(cast(StreamingQuery, query), 10, timeout_s=0.05, poll_s=0.01)
    assert query.polls > 1


def test_events_read_by_connector_come_from_its_offset_in_the_newest_batch_pure(
    tmp_path: Path,
) -> None:
    """Spark's connector's own offset in the newest offset log entry counts the events it
    read; a checkpoint whose events keyplane's source read (or with no batch) has none."""
    checkpoint = tmp_path / "checkpoint"
    assert events_read_by_connector(checkpoint, "clicks") is None
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True)
    head = ["v1", json.dumps({"batchWatermarkMs": 0, "conf": {}})]

    def entry(batch: int, *sources: dict[str, object]) -> None:
        (offsets / str(batch)).write_text("\n".join([*head, *map(json.dumps, sources)]))

    entry(0, {"events": {}}, {"clicks": {"0": 10, "1": 5}})
    entry(1, {"events": {}}, {"clicks": {"0": 30, "1": 12}})
    assert events_read_by_connector(checkpoint, "clicks") == 42
    assert events_read_by_connector(checkpoint, "other") is None
    entry(2, {"events": {"clicks": {"0": 50}}})
    assert events_read_by_connector(checkpoint, "clicks") is None
