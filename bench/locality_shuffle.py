"""Locality-aware routing vs hash routing: bytes shuffled between executors from stage A to B.

Paper 000's claim (§4): routing correlated keys of consecutive stateful
stages to the same server removes most of the network traffic between them.
Here a server is a Spark executor: ``local-cluster[3,1,1024]`` runs three
executor JVMs, and Spark's REST API reports, per stage, the shuffle bytes
each task fetched from its own executor (local) and from the others (remote).
``--master spark://...`` with ``--bootstrap`` runs on a standalone cluster
instead, one core on each of three executors, where a remote byte crosses
the network (``stack_locality.py`` runs it on the stack's shaped links).

Both variants run the routed job in one session, one after the other, on the
same ``pairs`` streams (locality L = 0.8: 80 % of tuples pair a key with its
partner; 8 kB padding), each on a topic of its own. By default stage A
forwards every tuple with its padding, as the application of 000 §4.1 does
(``--forward tuples``), and field 2 names its keys apart from field 1's
(``--names distinct``: :class:`~keyplane.reference.workloads.PairsWorkload`'s
``relabel_b``), so that hash routing does not co-locate a key and its
partner by accident. The padding is made of random characters
(``--pad-fill random``): one repeated character, the generator's other fill,
shrinks to a few bytes under Spark's shuffle compression (on, as by default),
and would model no tuple size at all. ``--forward pairs --names shared
--pad-fill repeated`` is the earlier measurement: stage A sends one weighted
row per pair and batch, without the padding, and both fields share names.

Each variant starts on hash routing with a warm-up stream; the job's metrics
then say which executor holds each instance. The locality variant computes a
routing table with METIS over the warm-up's key pairs, one part per executor
(:func:`keyplane.algorithms.locality.build_plan`), maps each part to the instances on
that executor, and publishes it live; the hash variant keeps hash routing.
Only then is the measured stream produced, so both variants measure the same
events: remote and local shuffle bytes of the stage that reads stage A's
output (the last stage of each micro-batch job), the share of A→B tuples that
stayed on one executor, and throughput.

    python bench/locality_shuffle.py [--events 24000] [--forward tuples|pairs]
        [--master spark://HOST:PORT --bootstrap HOST:PORT]
        [--names distinct|shared] [--pad-fill random|repeated]
        [--no-shuffle-compression] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from _harness import read_topic
from _output import emit

from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.pair_statistics import PairStatistics
from keyplane.control.controller import Controller
from keyplane.control.operators import OPERATORS
from keyplane.kafka.admin import ensure_topic, high_watermarks
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.reference.events import FORWARD_MODES, Forward
from keyplane.reference.verification import compare_counts, expected_counts_of
from keyplane.reference.workloads import PadFill, PairsWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.spark.counts_job import CountsJobSettings, read_output, start_counts_query
from keyplane.spark.session import build_session
from keyplane.testing import free_port, routed_job_topics, wait_for_records

EXECUTORS = 3
P = 6
VARIANTS = ("hash", "locality")
Names = Literal["distinct", "shared"]
"""Whether field 2 names its keys apart from field 1 (``relabel_b``) or shares field 1's names."""


def rest(spark: Any, path: str) -> Any:
    sc = spark.sparkContext
    url = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/{path}"
    with urllib.request.urlopen(url) as response:
        return json.load(response)


def a_to_b_bytes(spark: Any, after_job: int) -> tuple[int, int]:
    """(remote, local) shuffle bytes read by the A→B stage of every job after ``after_job``."""
    stages = {s["stageId"]: s for s in rest(spark, "stages")}
    remote = local = 0
    for job in rest(spark, "jobs"):
        if job["jobId"] <= after_job or len(job["stageIds"]) < 3:
            continue
        reader = stages.get(max(job["stageIds"]))
        if reader is not None:
            remote += int(reader.get("shuffleRemoteBytesRead", 0))
            local += int(reader.get("shuffleLocalBytesRead", 0))
    return remote, local


def last_job(spark: Any) -> int:
    return max((job["jobId"] for job in rest(spark, "jobs")), default=-1)


def placement(metrics: list[dict[str, Any]], operator: str) -> dict[int, str]:
    """The executor each instance of ``operator`` ran on most often."""
    seen: dict[int, Counter[str]] = {}
    for record in metrics:
        for instance, executor in record["executors"][operator].items():
            seen.setdefault(int(instance), Counter())[executor] += 1
    return {instance: votes.most_common(1)[0][0] for instance, votes in seen.items()}


def executor_table(
    parts: dict[int, int], weights: dict[int, float], on_executor: dict[int, list[int]]
) -> dict[str, int]:
    """Key → an instance on the executor its METIS part stands for, lightest first."""
    load: defaultdict[int, float] = defaultdict(float)
    table = {}
    for key in sorted(parts, key=lambda k: -weights.get(k, 0.0)):
        candidates = on_executor.get(parts[key]) or [
            i for group in on_executor.values() for i in group
        ]
        instance = min(candidates, key=lambda i: load[i])
        load[instance] += weights.get(key, 0.0)
        table[str(key)] = instance
    return table


def locality_config(warm: PairsWorkload, metrics: list[dict[str, Any]]) -> RoutingConfig:
    batch = next(iter(warm.batches(chunk_size=warm.n_events)))
    pairs = PairStatistics(batch.a, batch.b, np.ones(batch.a.size))
    plan = build_plan(pairs, EXECUTORS, alpha=1.1)
    executors = sorted({e for op in OPERATORS for e in placement(metrics, op).values()})
    operators = {}
    for name, table in (("A", plan.table_a), ("B", plan.table_b)):
        where = placement(metrics, name)
        on_executor = {
            part: [i for i, e in where.items() if e == executors[part % len(executors)]]
            for part in range(EXECUTORS)
        }
        keys = batch.a if name == "A" else batch.b
        uniq, counts = np.unique(keys, return_counts=True)
        weights = dict(zip(uniq.tolist(), counts.astype(float).tolist(), strict=True))
        operators[name] = OperatorRouting(
            parallelism=P, table=executor_table(table, weights, on_executor)
        )
    return RoutingConfig(version=2, parent_version=1, created_by="manual", operators=operators)


class TopicInUse(RuntimeError):
    """A run's events topic already holds records (one line)."""


def run_name() -> str:
    """A name for one invocation's topics, apart from any earlier invocation's on the same
    broker (:func:`fresh_topic`)."""
    return secrets.token_hex(3)


def fresh_topic(bootstrap: str, topic: str, partitions: int) -> int:
    """Create ``topic`` with ``partitions`` and return its partition count; raise
    :class:`TopicInUse` if it already holds records.

    Why: the routed job reads its topic from the first record, and its counts
    are checked against the streams this run produced. A broker keeps its
    topics from one run to the next (the stack's Kafka keeps them on disk when
    it is taken down and brought up again), so records an earlier run left in a
    topic of the same name would be counted too.
    """
    parts = ensure_topic(bootstrap, topic, partitions)
    held = sum(high_watermarks(bootstrap, topic).values())
    if held:
        raise TopicInUse(
            f"topic {topic!r} on {bootstrap} already holds {held:,} records, left by an earlier "
            "run on this broker: give the run a name of its own (run_name())"
        )
    return parts


def run_variant(
    spark: Any,
    bootstrap: str,
    tmp: Path,
    variant: str,
    warm: PairsWorkload,
    main: PairsWorkload,
    forward: Forward,
    run: str = "",
) -> dict[str, float]:
    """Warm up on ``warm``, switch (locality only), then measure on ``main``; ``run`` names
    the run's topics and folders apart from other runs of the same variant on the broker,
    whose events topic must be new (:func:`fresh_topic`)."""
    variant_run = f"{variant}{run}"
    topic = f"pairs-{variant_run}"
    partitions = fresh_topic(bootstrap, topic, EXECUTORS * 2)
    produce_workload(warm, bootstrap, topic, topic_partitions=partitions)
    store = tmp / f"store-{variant_run}"
    save(
        RoutingConfig.all_hash(P, OPERATORS),
        store,
    )
    topics = routed_job_topics(variant_run)
    settings = CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic=topic,
        checkpoint=tmp / f"ck-{variant_run}",
        output=tmp / f"out-{variant_run}",
        shuffle_partitions=P,
        max_offsets_per_trigger=warm.n_events // 3,
        trigger_interval="0 seconds",
        routing_store=store,
        forward=forward,
        **topics,
    )
    query = start_counts_query(spark, settings)
    try:
        wait_for_records(query, warm.n_events, timeout_s=math.inf)
        if variant == "locality":
            config = locality_config(warm, read_topic(bootstrap, topics["metrics_topic"]))
            save(config, store)
            with ControlChannel(bootstrap, topics["control_topic"]) as channel:
                Controller(channel, tmp / f"controller-{variant_run}.json", store).rollout(
                    2, timeout_s=300
                )
        query.processAllAvailable()
        cutoff = last_job(spark)
        measured_from = max((p["batchId"] for p in query.recentProgress), default=-1)
        produce_workload(main, bootstrap, topic, topic_partitions=partitions)
        started = time.monotonic()
        query.processAllAvailable()
        metrics = read_topic(bootstrap, topics["metrics_topic"])
    finally:
        query.stop()
    remote, local = a_to_b_bytes(spark, cutoff)
    measured = [m for m in metrics if m["batch_id"] > measured_from]
    hops = sum(m["hops"] for m in measured)
    local_hops = sum(m["local_hops"] for m in measured)
    rows = sum(m["rows"] for m in measured)
    seconds = sum(m["duration_ms"] for m in measured) / 1000
    window = main.n_events
    truth = expected_counts_of((warm, main))
    report = compare_counts(truth, read_output(settings.output))
    return {
        "remote": remote,
        "local": local,
        "remote_share": remote / (remote + local) if remote + local else 0.0,
        "remote_per_k": 1000 * remote / window,
        "hop_locality": local_hops / hops if hops else 0.0,
        "rate": rows / seconds if seconds else 0.0,
        "elapsed": time.monotonic() - started,
        "exact": report.exact,
        "lost": report.lost,
        "duplicated": report.duplicated,
    }


def session(master: str, compression: bool, extra: dict[str, str] | None = None) -> Any:
    """The benchmark's Spark session on ``master``: ``local-cluster[3,1,1024]`` by default,
    or a standalone cluster whose application gets one core on each of ``EXECUTORS``
    executors."""
    conf = {
        "spark.ui.port": str(free_port()),
        "spark.shuffle.compress": str(compression).lower(),
        **(extra or {}),
    }
    if master.startswith("spark://"):
        conf |= {"spark.cores.max": str(EXECUTORS), "spark.executor.cores": "1"}
    return build_session("keyplane-locality-bench", master, shuffle_partitions=P, extra=conf)


def streams(
    events: int, keys: int, pad: int, pad_fill: PadFill, names: Names
) -> tuple[PairsWorkload, PairsWorkload]:
    """The warm-up stream (a quarter of ``events``) and the measured one: ``pairs``, L = 0.8."""

    def pairs(n_events: int, seed: int) -> PairsWorkload:
        return PairsWorkload(
            n_events=n_events,
            n_keys=keys,
            locality=0.8,
            pad_min=pad,
            pad_max=pad,
            pad_fill=pad_fill,
            seed=seed,
            relabel_b=names == "distinct",
        )

    warmup = events // 4
    return pairs(warmup, 8), pairs(events - warmup, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=24_000)
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--pad", type=int, default=8_000)
    parser.add_argument(
        "--master",
        default=f"local-cluster[{EXECUTORS},1,1024]",
        help="Spark master: a standalone cluster (spark://host:port) of at least "
        f"{EXECUTORS} one-core workers, or the default local cluster",
    )
    parser.add_argument(
        "--bootstrap",
        help="Kafka bootstrap servers the executors can reach; by default an embedded broker "
        "of this run",
    )
    parser.add_argument(
        "--forward",
        choices=FORWARD_MODES,
        default="tuples",
        help="what stage A sends stage B: every tuple with its padding, or a weight per pair",
    )
    parser.add_argument(
        "--names",
        choices=get_args(Names),
        default="distinct",
        help="field 2's key names: apart from field 1's, or the same",
    )
    parser.add_argument(
        "--pad-fill",
        choices=get_args(PadFill),
        default="random",
        help="padding of random characters, or of one repeated character (compresses away)",
    )
    parser.add_argument(
        "--shuffle-compression",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compress shuffle blocks (Spark's default)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    warm, main_spec = streams(args.events, args.keys, args.pad, args.pad_fill, args.names)
    warmup = warm.n_events
    results = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        broker = None
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = EmbeddedBroker(tmp / "broker", free_port())
            bootstrap = broker.start().bootstrap_servers
        spark = session(args.master, args.shuffle_compression)
        run = f"-{run_name()}"
        try:
            for variant in VARIANTS:
                results[variant] = run_variant(
                    spark, bootstrap, tmp, variant, warm, main_spec, args.forward, run
                )
        finally:
            spark.stop()
            if broker is not None:
                broker.stop()
    hash_, loc = results["hash"], results["locality"]
    lines = [
        f"events: {args.events:,} pairs (L = 0.8, {args.keys} keys, {args.pad:,} B "
        f"{args.pad_fill} padding, "
        f"{args.names} field-2 names); stage A forwards {args.forward}; shuffle compression "
        f"{'on' if args.shuffle_compression else 'off'}; "
        f"{args.master}, {P} instances per stage; "
        f"measured on the {main_spec.n_events:,} events produced after a {warmup:,}-event "
        "warm-up (and, for locality, after the live switch)",
        "",
        "| routing | A→B remote bytes | A→B local bytes | remote bytes per 1k events "
        "| remote share | A→B tuples on one executor | rows/s | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *[
            f"| {v} | {r['remote']:,.0f} | {r['local']:,.0f} | {r['remote_per_k']:,.0f} "
            f"| {r['remote_share']:.0%} | {r['hop_locality']:.0%} | {r['rate']:,.0f} "
            f"| {r['exact']} |"
            for v, r in results.items()
        ],
        "",
        "remote A→B bytes per event, locality / hash: "
        f"**{loc['remote_per_k'] / hash_['remote_per_k']:.2f}** (remote share "
        f"{loc['remote_share'] / hash_['remote_share']:.2f}×); "
        f"throughput locality / hash: **{loc['rate'] / hash_['rate']:.2f}**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
