"""The test helpers shipped with the library."""

from __future__ import annotations

from pathlib import Path

from keyplane.spark.counts_job import CountsJobSettings
from keyplane.testing import routed_job_topics


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
