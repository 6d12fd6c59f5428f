"""The event-driven start of keyplane_reconfigure: the signal's rule, and the real trigger
against the real embedded broker's metrics topic."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import make_producer, send_confirmed
from keyplane.orchestration.signals import SignalThresholds, reconfiguration_signal
from keyplane.orchestration.triggers import MetricsSignalTrigger
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig


def _batch(
    batch_id: int,
    a_load: dict[int, int],
    version: int = 1,
    lag: int = 0,
    local: int = 90,
) -> BatchMetrics:
    return BatchMetrics(
        batch_id=batch_id,
        versions={"A": version, "B": version},
        rows=100,
        hops=100,
        local_hops=local,
        input_lag=lag,
        load={"A": a_load, "B": {0: 25, 1: 25, 2: 25, 3: 25}},
    )


EVEN = {0: 25, 1: 25, 2: 25, 3: 25}
SKEWED = {0: 70, 1: 10, 2: 10, 3: 10}


def test_pure_signal_fires_on_imbalance_locality_or_lag_and_not_within_bounds() -> None:
    thresholds = SignalThresholds(imbalance_above=1.5, batches=3)
    assert reconfiguration_signal([_batch(i, EVEN) for i in range(5)], thresholds) is None
    fired = reconfiguration_signal([_batch(i, SKEWED) for i in range(5)], thresholds)
    assert fired is not None and fired["reason"] == "imbalance 2.800 > 1.5"
    assert (fired["version"], fired["first_batch"], fired["last_batch"]) == (1, 2, 4)
    # Two skewed batches are not a window of three.
    assert reconfiguration_signal([_batch(i, SKEWED) for i in range(2)], thresholds) is None
    # A window is judged on the newest version only.
    mixed = [_batch(i, SKEWED, version=1) for i in range(4)] + [_batch(4, EVEN, version=2)]
    assert reconfiguration_signal(mixed, thresholds) is None

    local = SignalThresholds(imbalance_above=None, locality_below=0.5, batches=3)
    low = reconfiguration_signal([_batch(i, EVEN, local=20) for i in range(3)], local)
    assert low is not None and low["reason"] == "locality 20.0% < 50.0%"
    lag = SignalThresholds(imbalance_above=None, lag_growth_above=100, batches=3)
    growing = reconfiguration_signal([_batch(i, EVEN, lag=500 * i) for i in range(3)], lag)
    assert growing is not None and growing["reason"] == "lag growing +500 records/batch > 100"


def test_pure_signal_counts_only_the_active_instances_after_a_scale_in() -> None:
    halves = {0: 50, 1: 0, 2: 50, 3: 0}
    thresholds = SignalThresholds(imbalance_above=1.5, batches=3)
    records = [_batch(i, halves) for i in range(3)]
    assert reconfiguration_signal(records, thresholds) is not None
    active = {1: {"A": (0, 2), "B": (0, 1, 2, 3)}}
    assert reconfiguration_signal(records, thresholds, active) is None


def test_pure_thresholds_must_watch_something() -> None:
    with pytest.raises(ValueError, match="at least one"):
        SignalThresholds(imbalance_above=None)


@pytest.mark.integration
def test_the_trigger_fires_on_the_real_metrics_topic_once_past_the_threshold(
    broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = f"{topic_name}-metrics"
    store = tmp_path / "configs"
    config_store.save(RoutingConfig.all_hash(4, OPERATORS), store)
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    monkeypatch.setenv("KEYPLANE_BOOTSTRAP_SERVERS", broker)
    monkeypatch.setenv("KEYPLANE_METRICS_TOPIC", metrics)
    monkeypatch.setenv("KEYPLANE_ROUTING_STORE", str(store))
    trigger = MetricsSignalTrigger(
        thresholds={"imbalance_above": 1.5, "batches": 3}, poll_interval_s=0.2, cooldown_s=3600
    )
    producer = make_producer(broker)

    def publish(records: list[BatchMetrics]) -> None:
        send_confirmed(producer, metrics, [(b"", r.model_dump_json().encode()) for r in records])

    async def scenario() -> tuple[Any, bool]:
        events = trigger.run().__aiter__()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(3)  # the trigger has read the topic's end
        await asyncio.to_thread(publish, [_batch(i, EVEN) for i in range(4)])
        await asyncio.sleep(3)
        fired_on_even = first.done()
        await asyncio.to_thread(publish, [_batch(i, SKEWED) for i in range(4, 8)])
        event = await asyncio.wait_for(first, timeout=60)
        first.cancel()
        await events.aclose()
        return event, fired_on_even

    try:
        event, fired_on_even = asyncio.run(scenario())
    finally:
        producer.close()

    assert not fired_on_even
    assert event.payload["reason"] == "imbalance 2.800 > 1.5"
    assert (event.payload["first_batch"], event.payload["last_batch"]) == (5, 7)
    # Round-trips as the triggerer stores it.
    path, kwargs = trigger.serialize()
    assert path == "keyplane.orchestration.triggers.MetricsSignalTrigger"
    assert MetricsSignalTrigger(**kwargs).thresholds == trigger.thresholds
