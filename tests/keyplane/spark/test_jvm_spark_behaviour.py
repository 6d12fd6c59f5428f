"""The Spark behaviour the JVM stages rely on is checked when the job starts.

The probe runs the stages' own operator (``RoutedStages.probe``) on a real
SparkSession; the checks of its rows are pure, and are shown to fail on rows
that a Spark behaving otherwise would give.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.routing.routedkeys import spark_partition
from keyplane.spark import counts_job
from keyplane.spark import jvm as jvm_stages
from keyplane.spark.jvm import ProbeRow, behaviour_problems, probe_values
from keyplane.spark.routed_counts import StageEngineError
from keyplane.testing import routed_job_settings

P = 4


def _rows(values: list[str]) -> list[ProbeRow]:
    """The rows of a Spark that behaves as the stages need."""
    calls: dict[int, int] = {}
    rows = []
    for value in sorted(values, key=str.encode):
        partition = spark_partition(value, P)
        rows.append((value, partition, calls.get(partition, 0), True))
        calls[partition] = calls.get(partition, 0) + 1
    return rows


def test_the_probe_covers_both_ends_of_every_partition_pure() -> None:
    values = probe_values(P)
    for partition in range(P):
        here = [v for v in values if spark_partition(v, P) == partition]
        assert any(v.startswith("\x00install-") for v in here)
        assert any(v.startswith("\U0010ffffevict-") for v in here)
        assert any(not v.startswith(("\x00", "\U0010ffff")) for v in values)
    assert behaviour_problems(_rows(values), values, P) == []


def test_each_behaviour_the_stages_rely_on_is_named_when_it_fails_pure() -> None:
    values = probe_values(P)
    good = _rows(values)
    first, second = (row for row in good if row[1] == 0 and row[2] < 2)
    swapped = [
        (r[0], r[1], second[2], r[3])
        if r == first
        else (r[0], r[1], first[2], r[3])
        if r == second
        else r
        for r in good
    ]
    (problem,) = behaviour_problems(swapped, values, P)
    assert "out of grouping-value order" in problem and "partition 0" in problem

    moved = [(r[0], (r[1] + 1) % P, r[2], r[3]) if r == first else r for r in good]
    assert any("on partition 1, not on 0" in p for p in behaviour_problems(moved, values, P))

    not_redirected = [(*r[:3], r is not first) for r in good]
    (problem,) = behaviour_problems(not_redirected, values, P)
    assert "ImplicitGroupingKeyTracker" in problem

    (problem,) = behaviour_problems(good[1:], values, P)
    assert f"called {len(values) - 1} groups for {len(values)}" in problem


@pytest.mark.integration
def test_this_spark_behaves_as_the_jvm_stages_need(spark) -> None:
    assert jvm_stages.loaded(spark)
    assert jvm_stages.spark_behaviour_problems(spark, P) == []
    # The probe leaves the session's adaptive execution as it found it.
    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"


@pytest.mark.integration
def test_the_job_refuses_the_jvm_stages_in_one_line_when_spark_misbehaves_stand_in_probe(
    spark, broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's verdict is replaced by a problem: the start fails before any batch."""
    problem = "transformWithState called group 'b' before 'a' in the task of partition 0"
    monkeypatch.setattr(jvm_stages, "spark_behaviour_problems", lambda spark, n: [problem])
    monkeypatch.setattr(counts_job, "_JVM_STAGES_CHECKED", set())
    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=P, batch=100, trigger="0 seconds",
        stage_engine="jvm",
    )  # fmt: skip
    with pytest.raises(StageEngineError) as refused:
        counts_job.start_counts_query(spark, settings)
    message = str(refused.value)
    assert message == f"stage engine 'jvm': {problem}; run the job with --stage-engine python"
    assert not (settings.checkpoint / "commits").exists()
