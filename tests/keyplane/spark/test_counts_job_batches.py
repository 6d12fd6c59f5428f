"""The routed job runs a micro-batch only for new input (real broker, real SparkSession).

On a live topic each batch reads what arrived since the last and moves the
watermark on; Spark would follow every such batch with one of no input for
the event-time stage's timers, which keyplane's stages do not have.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.spark.counts_job import read_output, start_counts_query, stop_between_batches
from keyplane.spark.progress import progress_of
from keyplane.testing import routed_job_settings, wait_for_records

CHUNKS = 4
EVENTS_PER_CHUNK = 300


@pytest.mark.integration
def test_a_live_routed_job_runs_no_batch_without_new_events(
    spark, broker: str, topic_name: str, tmp_path: Path
) -> None:
    settings = routed_job_settings(
        broker, topic_name, tmp_path, parallelism=4, batch=10_000, trigger="0 seconds"
    )
    assert settings.routing_store is not None
    save(RoutingConfig.all_hash(4, OPERATORS), settings.routing_store)
    specs = [
        ZipfEvolvingWorkload(n_keys=60, n_categories=6, n_events=EVENTS_PER_CHUNK, seed=chunk)
        for chunk in range(CHUNKS)
    ]
    produce_workload(specs[0], broker, topic_name, partitions=2)
    query = start_counts_query(spark, settings)
    try:
        for chunk, spec in enumerate(specs):
            if chunk:
                produce_workload(spec, broker, topic_name, partitions=2)
            wait_for_records(query, (chunk + 1) * EVENTS_PER_CHUNK)
            time.sleep(2)  # time for a batch without input to run, were there one
        reports = list(query.recentProgress)
    finally:
        stop_between_batches(query)

    # Spark reports an idle trigger under the last batch's id, so a batch is
    # each id's report with the most rows.
    rows: dict[int, int] = {}
    for report in reports:
        progress = progress_of(report)
        rows[progress.batch_id] = max(rows.get(progress.batch_id, 0), progress.rows)
    assert len(rows) >= CHUNKS
    assert [batch for batch, n in sorted(rows.items()) if n == 0] == []
    assert sum(rows.values()) == CHUNKS * EVENTS_PER_CHUNK
    assert compare_counts(expected_counts_of(specs), read_output(settings.output)).exact
