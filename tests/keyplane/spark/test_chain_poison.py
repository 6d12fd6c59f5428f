"""A pipeline's poison record is dead-lettered after two failures, and the job goes on.

A one-stage pipeline sums a string field with :class:`keyplane.aggregates.Sum`,
which raises on a value that is not a number. Two such events sit among good
ones. The job (its own process, real broker, no restarts of its own) fails the
batch, replays it, fails the same way, quarantines the events with that
stage's key and value, and goes on: the dead-letter topic holds them with the
aggregate's error, and every other merchant's sum is exact.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from chain_runs import P, produce, raw_records

from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.pipeline_sink import read_parquet_results
from keyplane.testing import routed_job_settings, start_job_process, wait_while_job_runs

PIPELINE_MODULE = """
from keyplane import KafkaSource, ParquetSink, Pipeline, Stage
from keyplane.aggregates import Sum

def amounts():
    return Pipeline(
        "amounts",
        KafkaSource({topic!r}, "merchant STRING, amount STRING"),
        (Stage("merchants", key="merchant", value="amount", aggregate=Sum()),),
        ParquetSink({sink!r}),
    )
"""


@pytest.mark.integration
@pytest.mark.slow
def test_a_value_the_aggregate_raises_on_is_dead_lettered_and_the_pipeline_goes_on(
    broker: str, topic_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = tmp_path / "results"
    (tmp_path / "poison_pipelines.py").write_text(
        PIPELINE_MODULE.format(topic=topic_name, sink=str(sink))
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KEYPLANE_PIPELINE", "poison_pipelines:amounts")
    good = [{"merchant": f"m{i % 7}", "amount": str(i)} for i in range(300)]
    poison = [{"merchant": "m3", "amount": "lots"}, {"merchant": "m3", "amount": "lots"}]
    assert produce(broker, topic_name, iter([*good[:150], *poison, *good[150:]])) == 302
    save(RoutingConfig.all_hash(P, ("merchants",)), tmp_path / "routing")
    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=P, batch=100_000, trigger="1 second",
        pipeline="poison_pipelines:amounts", restarts=0,
    )  # fmt: skip
    log = tmp_path / "job.log"
    job = start_job_process(settings, log)
    expected = {f"m{m}": sum(i for i in range(300) if i % 7 == m) for m in range(7)}

    def results() -> dict[str, object]:
        rows = read_parquet_results(sink)
        latest = rows.drop_duplicates(["stage", "key"], keep="last")
        return {key: json.loads(result) for key, result in latest[["key", "result"]].values}

    try:
        wait_while_job_runs(lambda: results() == expected, "every good event", job, log,
                            timeout_s=400)  # fmt: skip
        assert job.poll() is None
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert log.read_text().count("a stage's aggregate failed the batch; starting it again") == 2
    letters = [json.loads(v) for _, _, v in raw_records(broker, settings.dead_letter_topic)]
    assert [json.loads(letter["value"]) for letter in letters] == poison
    assert all(
        letter["reason"].startswith("poison: stage merchants's aggregate raised")
        for letter in letters
    )
