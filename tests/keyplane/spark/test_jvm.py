"""The JVM stages: their jar built, found or refused in one line; the engine a job picks."""

from __future__ import annotations

import json
import os
import re
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import Row

from keyplane.aggregates import RunningCount, ValueCounts
from keyplane.algorithms.batchmetrics import TOP_PAIRS_PER_INSTANCE, traffic_metrics
from keyplane.algorithms.scaling import stage_shares
from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.kafka.ranges import OffsetRange
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.routedkeys import spark_partition
from keyplane.spark import jvm, routed_partitions, routed_reads
from keyplane.spark.counts_job import (
    CountsJobSettings,
    read_output,
    start_counts_query,
)
from keyplane.spark.routed_counts import (
    ENGINE_RECORD,
    TOP_PAIRS_PER_GROUP,
    StageEngine,
    StageEngineError,
    record_engine,
    recorded_engine,
    resolve_engine,
)
from keyplane.spark.routed_sink import latest_partials_of_batch, unpacked_partials
from keyplane.testing import routed_job_settings


def test_the_jar_builds_from_the_shipped_source(tmp_path: Path) -> None:
    jar = jvm.build_jar(tmp_path / "stages.jar")
    with zipfile.ZipFile(jar) as built:
        names = set(built.namelist())
    assert {
        "keyplane/spark/jvm/RoutedStages.class",
        "keyplane/spark/jvm/RoutedEvents.class",
    } <= names
    assert {
        "keyplane/spark/jvm/RoutedStages$StageA.class",
        "keyplane/spark/jvm/RoutedStages$StageB.class",
    } <= names
    assert not list(tmp_path.glob("*.partial")), "the jar is moved into place whole"


def test_a_named_jar_that_does_not_exist_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(jvm.JAR_ENV, str(tmp_path / "missing.jar"))
    jvm.stages_jar.cache_clear()
    try:
        with pytest.raises(jvm.JvmStagesUnavailable, match=r"KEYPLANE_JVM_JAR=.*no such file"):
            jvm.stages_jar()
        assert jvm.available_jar() is None
    finally:
        jvm.stages_jar.cache_clear()


def test_without_javac_the_build_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(jvm.JvmStagesUnavailable, match="need a JDK once"):
        jvm.build_jar(tmp_path / "stages.jar")


def test_the_session_of_the_tests_has_the_jvm_stages(spark) -> None:
    assert jvm.loaded(spark)


def test_engine_choice_pure() -> None:
    """The running count runs in the JVM where the jar is loaded; any other aggregate, or
    no jar, runs in Python under ``auto`` and is refused under ``jvm``."""
    count, other = RunningCount(), ValueCounts()
    assert resolve_engine("auto", None, None, jvm_loaded=True) == "jvm"
    assert resolve_engine("auto", count, count, jvm_loaded=True) == "jvm"
    assert resolve_engine("auto", count, other, jvm_loaded=True) == "python"
    assert resolve_engine("auto", None, None, jvm_loaded=False) == "python"
    assert resolve_engine("python", None, None, jvm_loaded=True) == "python"
    assert resolve_engine("jvm", None, None, jvm_loaded=True) == "jvm"
    with pytest.raises(StageEngineError, match="only the running count"):
        resolve_engine("jvm", other, None, jvm_loaded=True)
    with pytest.raises(StageEngineError, match="no keyplane JVM stages"):
        resolve_engine("jvm", None, None, jvm_loaded=False)


def test_both_engines_report_as_many_pairs_as_the_metrics_keep_pure() -> None:
    declared = re.search(r"int TOP_PAIRS_PER_INSTANCE = (\d+);", jvm.SOURCE.read_text())
    assert declared is not None
    assert int(declared[1]) == TOP_PAIRS_PER_GROUP == TOP_PAIRS_PER_INSTANCE


def test_a_checkpoint_keeps_its_engine_pure(tmp_path: Path) -> None:
    """A new checkpoint has no engine; a record names its engine."""
    checkpoint = tmp_path / "checkpoint"
    assert recorded_engine(checkpoint) is None
    record_engine(checkpoint, "python")
    assert recorded_engine(checkpoint) == "python"
    record_engine(checkpoint, "jvm")
    assert recorded_engine(checkpoint) == "jvm"
    (checkpoint / ENGINE_RECORD).write_text('{"engine": "rust"}')
    with pytest.raises(StageEngineError, match="unknown stage engine 'rust'"):
        recorded_engine(checkpoint)
    assert resolve_engine("auto", None, None, jvm_loaded=True, recorded="python") == "python"
    with pytest.raises(StageEngineError, match="keeps its engine for life"):
        resolve_engine("jvm", None, None, jvm_loaded=True, recorded="python")
    with pytest.raises(StageEngineError, match="keeps its engine for life"):
        resolve_engine("python", None, None, jvm_loaded=True, recorded="jvm")


@pytest.mark.integration
def test_a_python_checkpoint_resumes_in_python_with_exact_counts(
    spark, broker: str, topic_name: str, tmp_path: Path
) -> None:
    """A checkpoint the Python stages wrote goes on in Python under ``auto``, counts exact,
    and asking for the JVM is refused before Spark starts."""
    store = tmp_path / "routing"
    save(
        RoutingConfig(
            version=1,
            created_by="initial",
            operators={op: OperatorRouting(parallelism=4) for op in OPERATORS},
        ),
        store,
    )

    def settings(engine: StageEngine) -> CountsJobSettings:
        return routed_job_settings(
            broker,
            topic_name,
            tmp_path,
            parallelism=4,
            batch=2_000,
            trigger="0 seconds",
            stage_engine=engine,
        )

    def run(engine: StageEngine) -> str:
        query = start_counts_query(spark, settings(engine))
        try:
            query.processAllAvailable()
            return query._jsq.explainInternal(False)
        finally:
            query.stop()

    first = ZipfEvolvingWorkload(n_keys=200, n_categories=10, n_events=3_000, seed=8)
    second = ZipfEvolvingWorkload(n_keys=200, n_categories=10, n_events=2_000, seed=9)
    produce_workload(first, broker, topic_name, partitions=2)
    assert "TransformWithStateInPySpark" in run("python")
    produce_workload(second, broker, topic_name, partitions=2)
    with pytest.raises(StageEngineError, match="keeps its engine for life"):
        run("jvm")
    assert "TransformWithStateInPySpark" in run("auto")
    truth = expected_counts_of((first, second))
    report = compare_counts(truth, read_output(tmp_path / "output"))
    assert report.expected_events == first.n_events + second.n_events
    assert report.exact, report


def _outputs_by_batch(
    spark, batches: list[list[pa.RecordBatch]], root: Path, *, end_rows: bool = True
) -> list[list[Row]]:
    """The JVM stages' output rows of each micro-batch, one input file per batch, without
    the executor columns (the same in every run of one process). Each batch ends with the
    rows the routed source sends with every batch (:func:`routed_reads.batch_end_rows`)
    unless ``end_rows`` is false."""
    inputs = root / "in"
    inputs.mkdir(parents=True)
    for i, batch in enumerate(batches):
        path = inputs / f"part-{i}.parquet"
        ends = [routed_reads.batch_end_rows("pairs", 4)] if end_rows else []
        pq.write_table(pa.Table.from_batches([*batch, *ends]), path)
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))  # the file source's order
    rows = (
        spark.readStream.schema(routed_reads.ROUTED_INPUT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(inputs))
    )
    seen: list[list[Row]] = []
    query = (
        jvm.routed_running_counts_jvm(rows, 4, tuples=False)
        .drop("executor", "upstream_executor")
        .writeStream.foreachBatch(lambda df, _: seen.append(df.collect()))
        .option("checkpointLocation", str(root / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return seen


def _events(
    a: list[str], ra: list[str], n: list[int], b: list[str] | None = None
) -> pa.RecordBatch:
    """Routed-source ``event`` rows: field 1 ``a`` on stage-A routed key ``ra``, weighing
    ``n``; field 2 ``b`` (all ``p`` unless given), stage B by hash."""
    b = ["p"] * len(a) if b is None else b
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    return routed_reads._rows(
        "pairs", len(a), kind=["event"] * len(a), a=a, b=b, ra=ra, rb=b,
        vb=pa.array([1] * len(a), pa.int32()), n=n, ts=[moment] * len(a),
    )  # fmt: skip


def _stage_a_partials(rows: list[Row]) -> dict[str, int]:
    """Stage A's latest partial per routed key in one batch, as the sink reads them."""
    output = pd.DataFrame([row.asDict() for row in rows])
    partials = latest_partials_of_batch(unpacked_partials(output))
    mine = partials[partials["stage"] == "A"]
    return dict(zip(mine["routed_key"], mine["count"], strict=True))


@pytest.mark.integration
def test_per_instance_moves_hold_every_tuple_and_install_once(spark, tmp_path: Path) -> None:
    """A per-instance hand-off over four micro-batches, for a moved key with tuples in
    the switch and install batches and one without: the evicted states hold every tuple
    of the switch batch, the installed ones add to the target's tuples, the sources
    report their zero, and an install replayed with the same marker changes nothing
    (000 §3.4)."""
    moves = (("x", "x", "x#1"), ("z", "z", "z#1"))
    evicts = next(
        routed_reads.read_evictions(
            routed_partitions.EvictPartition("A", moves, 4, 7, "pairs", "per-instance")
        )
    )
    kafka = OffsetRange("127.0.0.1:1", "migration", 0, 0, 0)
    installs = routed_reads._installs_per_instance(
        [
            {"operator": "A", "key": "x", "source": "x", "target": "x#1", "count": 6,
             "state": "6", "marker": 7},
            {"operator": "A", "key": "z", "source": "z", "target": "z#1", "count": 3,
             "state": "3", "marker": 7},
        ],
        routed_partitions.MigrationPartition(kafka, 4, "pairs", "per-instance"),
    )  # fmt: skip

    first, switch, install, replay = _outputs_by_batch(
        spark,
        [
            [_events(["x", "z"], ["x", "z"], [2, 3])],
            [_events(["x"], ["x"], [4]), evicts],
            [_events(["x"], ["x#1"], [5]), installs],
            [_events(["x", "z"], ["x#1", "z#1"], [1, 1]), installs],
        ],
        tmp_path,
    )

    assert _stage_a_partials(first) == {"x": 2, "z": 3}
    [record] = [row.state for row in switch if row.kind == "moves" and row.stage == "A"]
    left = {m["source"]: (m["target"], m["count"], m["state"], m["marker"])
            for m in json.loads(record)["moves"]}  # fmt: skip
    assert left == {"x": ("x#1", 6, "6", 7), "z": ("z#1", 3, "3", 7)}
    assert _stage_a_partials(install) == {"x#1": 11, "z#1": 3, "x": 0, "z": 0}
    assert _stage_a_partials(replay) == {"x#1": 12, "z#1": 4}


@pytest.mark.integration
def test_the_jvm_stages_time_nothing_so_stela_shares_their_batch_by_tuples(
    spark, tmp_path: Path
) -> None:
    """The JVM stages leave ``busy_ns`` null on every row, packed partials included once the
    sink unpacks them: the batch's metrics carry no busy time and Stela's stage shares
    (003 §4.1) fall back to the busiest instances' tuples."""
    a = ["x", "y", "z", "w"]
    events = _events(a, a, [1, 2, 3, 4], b=["p", "q", "p", "q"])
    [rows] = _outputs_by_batch(spark, [[events]], tmp_path)
    output = unpacked_partials(pd.DataFrame([row.asDict() for row in rows])).assign(
        executor="e", upstream_executor="e"
    )
    assert "busy_ns" in output.columns and output["busy_ns"].isna().all()
    assert set(output.loc[output["kind"] == "count", "stage"]) == set(OPERATORS)

    metrics = traffic_metrics(0, output, dict.fromkeys(OPERATORS, 4))
    assert metrics.busy_ms == {}
    assert [sum(metrics.load[stage].values()) for stage in OPERATORS] == [10, 10]
    shares, timed = stage_shares(metrics, OPERATORS)
    busiest = {stage: max(metrics.load[stage].values()) for stage in OPERATORS}
    assert not timed
    assert shares == {
        stage: pytest.approx(n / sum(busiest.values())) for stage, n in busiest.items()
    }


@pytest.mark.integration
def test_an_instances_top_pairs_are_its_heaviest_even_when_one_key_holds_them(
    spark, tmp_path: Path
) -> None:
    """Stage B reports enough pairs per key for the metrics' per-instance top pairs: here
    the heaviest five all belong to B key ``p``, and a light pair of ``q``, on the same
    instance, must not take the place of ``p``'s fourth and fifth."""
    q = next(f"q{i}" for i in range(100) if spark_partition(f"q{i}", 4) == spark_partition("p", 4))
    partners = [f"a{i}" for i in range(1, 7)]
    events = _events(
        [*partners, "c"], [*partners, "c"], [60, 50, 40, 30, 20, 10, 1], b=["p"] * 6 + [q]
    )
    [rows] = _outputs_by_batch(spark, [[events]], tmp_path)
    output = pd.DataFrame([row.asDict() for row in rows]).assign(
        executor="e", upstream_executor="e"
    )

    metrics = traffic_metrics(0, output, dict.fromkeys(OPERATORS, 4))

    assert [(p.a, p.b, p.n) for p in metrics.top_pairs[spark_partition("p", 4)]] == [
        ("a1", "p", 60),
        ("a2", "p", 50),
        ("a3", "p", 40),
        ("a4", "p", 30),
        ("a5", "p", 20),
    ]


@pytest.mark.integration
def test_a_task_without_its_closing_group_fails_rather_than_lose_counts(
    spark, tmp_path: Path
) -> None:
    """Stage A gathers a task's rows for B until the task's first closing group; a batch
    that lacks the source's end rows would end with them unwritten, so the task fails
    and says why instead of committing counts that miss B's share."""
    events = _events(["x", "y"], ["x", "y"], [2, 1])

    with pytest.raises(Exception, match="ended without its closing group"):
        _outputs_by_batch(spark, [[events]], tmp_path, end_rows=False)


@pytest.mark.integration
def test_stage_b_counts_and_traffic_match_every_event_of_a_task(spark, tmp_path: Path) -> None:
    """Stage A sends B one row per (field-2 key, routed key) and task, however many field-1
    keys the weight came from; B's counts and the task's ``hop`` rows still add up to
    every event, and the pairs keep their field-1 keys."""
    a = ["x", "y", "z", "x", "y"]
    b = ["p", "p", "p", "q", "q"]
    events = _events(a, a, [1, 2, 3, 4, 5], b=b)
    [rows] = _outputs_by_batch(spark, [[events]], tmp_path)
    output = pd.DataFrame([row.asDict() for row in rows])

    counts = output[(output["kind"] == "count") & (output["stage"] == "B")]
    assert dict(zip(counts["key"], counts["count"], strict=True)) == {"p": 6, "q": 9}
    hops = output[output["kind"] == "hop"]
    assert hops["n"].sum() == 15
    assert not hops.duplicated(["instance", "upstream"]).any()
    pairs = output[output["kind"] == "pair"]
    assert sorted(zip(pairs["detail"], pairs["key"], pairs["n"], strict=True)) == [
        ("x", "p", 1),
        ("x", "q", 4),
        ("y", "p", 2),
        ("y", "q", 5),
        ("z", "p", 3),
    ]
    for instance, key in zip(pairs["instance"], pairs["key"], strict=True):
        assert instance == spark_partition(key, 4)
