"""No key value can break the routed job's stages, on either stage engine.

The real routed job (real broker, real SparkSession) reads events whose keys
are generated to be awkward: empty, whitespace, NUL and other control
characters, U+10FFFF, keys equal to the control groups' own grouping values
and to their prefixes, very long keys; and events whose keys hold a lone
surrogate, which JSON can escape but UTF-8 cannot encode. The job keeps
running, counts every valid event exactly, and dead-letters every event it
cannot hold, one record each.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from keyplane.control.controller import Controller
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import high_watermarks
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import make_producer
from keyplane.routing.config import RoutingConfig, save
from keyplane.routing.routedkeys import CONTROL_STARTS, ESCAPE
from keyplane.spark.counts_job import (
    CountsJobSettings,
    read_output,
    start_counts_query,
    stop_between_batches,
)
from keyplane.spark.routed_counts import StageEngine
from keyplane.spark.routed_partitions import control_groups, evict_groups, install_groups
from keyplane.testing import moved_off_hash_config, routed_job_settings

P = 4
"""Instances per operator: the ``spark`` fixture's shuffle partitions."""

CONTROL_MARKERS = sorted(
    {
        *CONTROL_STARTS,
        ESCAPE,
        ESCAPE + "#0",
        *(f"{CONTROL_STARTS[0]}{stage}" for stage in ("A", "B", "I")),
        *(f"{CONTROL_STARTS[0]}install-{stage}" for stage in OPERATORS),
        *(f"{CONTROL_STARTS[1]}evict-{stage}" for stage in OPERATORS),
        *(group for stage in ("A", "B", "I") for group in control_groups(stage, P)),
        *(group for stage in OPERATORS for group in install_groups(stage, P)),
        *(group for stage in OPERATORS for group in evict_groups(stage, P)),
    }
)
"""Every string that starts a control row's grouping value, and every such value itself."""

LONE_SURROGATES = ["\ud800", "x\udfff", "\udbff#1"]
"""Keys JSON can write (``"\\ud800"``) and UTF-8 cannot: such an event is dead-lettered."""

AWKWARD = " \t\n\r\x0b\x0c\x00\x01\x1f\x7f\x85\xa0\u2028\ufeff\uffff\U0010ffff#é😀"

keys = st.one_of(
    st.just(""),
    st.sampled_from(CONTROL_MARKERS),
    st.text(alphabet=AWKWARD, max_size=6),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
    st.builds(
        str.__mul__,
        st.sampled_from(["x", "#", "\x00", "é", "\U0010ffff"]),
        st.integers(min_value=1_000, max_value=6_000),
    ),
)
"""Valid keys, awkward ones first."""

events = st.lists(
    st.tuples(keys, keys)
    | st.tuples(st.sampled_from(LONE_SURROGATES), keys)
    | st.tuples(keys, st.sampled_from(LONE_SURROGATES)),
    min_size=1,
    max_size=25,
)


def _settings(broker: str, topic: str, tmp_path: Path, engine: StageEngine) -> CountsJobSettings:
    save(RoutingConfig.all_hash(P, OPERATORS), tmp_path / "routing")
    return routed_job_settings(
        broker,
        topic,
        tmp_path,
        parallelism=P,
        batch=5_000,
        trigger="0 seconds",
        stage_engine=engine,
        max_event_bytes=1 << 20,
    )


def _send(broker: str, topic: str, pairs: Iterable[tuple[str, str]], start: int) -> int:
    """Send one event per pair, ``seq`` from ``start``; how many were sent."""
    producer = make_producer(broker)
    sent = 0
    try:
        for a, b in pairs:
            event = {"seq": start + sent, "a": a, "b": b, "ts": 1_700_000_000_000}
            # Escaped (ASCII) JSON: the only way to write a lone surrogate.
            producer.send(topic, value=json.dumps(event).encode(), partition=sent % 2)
            sent += 1
        producer.flush()
    finally:
        producer.close()
    return sent


def _valid(pairs: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    for a, b in pairs:
        if a not in LONE_SURROGATES and b not in LONE_SURROGATES:
            yield a, b


def _counts(settings: CountsJobSettings) -> Counter[tuple[str, str]]:
    output = read_output(settings.output)
    return Counter(
        {
            (stage, key): int(count)
            for stage, key, count in zip(
                output["stage"], output["key"], output["count"], strict=True
            )
            if count
        }
    )


def _expected(pairs: Iterable[tuple[str, str]]) -> Counter[tuple[str, str]]:
    expected: Counter[tuple[str, str]] = Counter()
    for a, b in _valid(pairs):
        expected[("A", a)] += 1
        expected[("B", b)] += 1
    return expected


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["jvm", "python"])
def test_empty_keys_are_counted_and_the_job_keeps_running(
    spark, broker: str, topic_name: str, tmp_path: Path, engine: StageEngine
) -> None:
    """The regression: ``"a": ""`` and ``"b": ""`` failed every batch of the JVM stages,
    whose empty-key group ran before the control groups that must come first."""
    settings = _settings(broker, topic_name, tmp_path, engine)
    first = [("", "x"), ("k", ""), ("", ""), ("k", "x")]
    _send(broker, topic_name, first, 0)
    query = start_counts_query(spark, settings)
    try:
        query.processAllAvailable()
        assert _counts(settings) == _expected(first)
        then = [("", "y"), ("z", ""), ("k", "x")]
        _send(broker, topic_name, then, len(first))
        query.processAllAvailable()
        assert query.isActive and query.exception() is None
        assert _counts(settings) == _expected(first + then)
        assert _counts(settings)[("A", "")] == 3
        assert _counts(settings)[("B", "")] == 3
    finally:
        stop_between_batches(query)
    assert sum(high_watermarks(broker, settings.dead_letter_topic).values()) == 0


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["jvm", "python"])
def test_awkward_keys_move_and_split_live_and_counts_stay_exact(
    spark, broker: str, topic_name: str, tmp_path: Path, engine: StageEngine
) -> None:
    """Escaped keys in a routing table and split as hot keys, rolled out while the job
    runs: their states move through the hand-off (per instance on the JVM) exactly."""
    settings = _settings(broker, topic_name, tmp_path, engine)
    awkward = ["", "\x00A", "\x00install-B#1", "\U0010ffff", ESCAPE, "#0", "plain"]
    pairs = [(a, b) for a in awkward for b in awkward]
    _send(broker, topic_name, pairs, 0)
    query = start_counts_query(spark, settings)
    try:
        query.processAllAvailable()
        v2 = moved_off_hash_config(
            2,
            {"A": ["", "\x00A", ESCAPE], "B": ["\U0010ffff", "#0"]},
            P,
            hot_keys={"A": {"\U0010ffff": (0, 2)}, "B": {"": (1, 3), "\x00install-B#1": (0, 3)}},
        )
        assert settings.routing_store is not None
        save(v2, settings.routing_store)
        with ControlChannel(broker, settings.control_topic) as channel:
            controller = Controller(channel, tmp_path / "controller.json", settings.routing_store)
            assert controller.rollout(2, timeout_s=300).version == 2
        _send(broker, topic_name, pairs, len(pairs))
        query.processAllAvailable()
        assert query.isActive and query.exception() is None
        assert _counts(settings) == _expected(pairs + pairs)
    finally:
        stop_between_batches(query)
    assert sum(high_watermarks(broker, settings.dead_letter_topic).values()) == 0


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["jvm", "python"])
def test_generated_keys_never_break_the_job_and_counts_stay_exact(
    spark, broker: str, topic_name: str, tmp_path: Path, engine: StageEngine
) -> None:
    """One running query takes every generated batch of events: after each, every valid
    event is counted once, every lone-surrogate event is dead-lettered once, and the
    query still runs."""
    settings = _settings(broker, topic_name, tmp_path, engine)
    query = start_counts_query(spark, settings)
    sent: list[tuple[str, str]] = []

    @settings_for_the_job
    @given(batch=events)
    def one_batch(batch: list[tuple[str, str]]) -> None:
        _send(broker, topic_name, batch, len(sent))
        sent.extend(batch)
        query.processAllAvailable()
        assert query.isActive and query.exception() is None
        assert _counts(settings) == _expected(sent)
        dead = sum(high_watermarks(broker, settings.dead_letter_topic).values())
        assert dead == len(sent) - sum(1 for _ in _valid(sent))

    try:
        one_batch()
    finally:
        stop_between_batches(query)


settings_for_the_job = hypothesis_settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""A handful of generated batches through one running query: about a minute per engine."""
