"""``bench/locality_shuffle.py``: each run counts the events of its own topics (real broker)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.producer import produce_workload


@pytest.fixture
def locality(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("locality_shuffle")


def test_a_run_refuses_a_topic_an_earlier_run_on_the_broker_filled(
    locality: ModuleType, engine_broker: str, topic_name: str, tmp_path: Path
) -> None:
    warm, main = locality.streams(40, 10, 10, "random", "distinct")
    run = f"-{topic_name}"
    # An earlier run of the same name on this broker left its warm-up in the topic.
    produce_workload(warm, engine_broker, f"pairs-hash{run}", partitions=6)

    # Refused before any Spark work: the job would count the earlier run's events too.
    with pytest.raises(locality.TopicInUse, match=r"already holds 10 records"):
        locality.run_variant(None, engine_broker, tmp_path, "hash", warm, main, "pairs", run)

    assert sum(high_watermarks(engine_broker, f"pairs-hash{run}").values()) == 10


def test_a_new_topic_is_made_with_its_partitions_and_no_records(
    locality: ModuleType, engine_broker: str, topic_name: str
) -> None:
    assert locality.fresh_topic(engine_broker, topic_name, 6) == 6
    assert high_watermarks(engine_broker, topic_name) == dict.fromkeys(range(6), 0)


def test_each_invocation_names_its_topics_apart_pure(locality: ModuleType) -> None:
    names = {locality.run_name() for _ in range(20)}
    assert len(names) == 20
    assert all(name.isalnum() for name in names)
