"""The counting job's delivery and trigger settings are validated before Spark starts (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from keyplane.kafka.producer import Delivery
from keyplane.spark.counts_job import CountsJobSettings, job_command, parse_settings


def _settings(**overrides: object) -> CountsJobSettings:
    return CountsJobSettings(
        bootstrap_servers="kafka:9092", checkpoint=Path("ck"), output=Path("out"), **overrides
    )


def test_default_delivery_is_idempotent_with_acks_all() -> None:
    assert _settings().delivery() == Delivery(acks="all", idempotent=True)


def test_relaxed_delivery_round_trips_through_the_job_command_line() -> None:
    settings = _settings(producer_acks="1", producer_idempotent=False, trigger_interval="5 seconds")
    parsed = parse_settings(job_command(settings)[3:])
    assert parsed == settings
    assert parsed.delivery() == Delivery(acks="1", idempotent=False)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"producer_acks": "1"}, "idempotent producer needs acks='all'"),
        ({"producer_acks": "0", "producer_idempotent": False}, "producer_acks"),
        ({"trigger_interval": "soon"}, "trigger_interval"),
    ],
)
def test_invalid_delivery_or_trigger_is_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _settings(**overrides)
