"""The test helpers shipped with the library."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.routedkeys import spark_partition
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import moved_off_hash, moved_off_hash_config, routed_job_topics


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
