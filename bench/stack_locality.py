"""Locality on a network that costs something: the routed job on the shaped stack.

``local-cluster`` executors share one host, so a "remote" shuffle byte there
costs a copy through loopback. Here the executors run on the stack's Spark
standalone workers (:mod:`keyplane.stack`), each in a network namespace of
its own behind a veth link that ``tc`` shapes to a rate and a delay
(``KEYPLANE_STACK_LINK_RATE``, ``KEYPLANE_STACK_LINK_DELAY_MS``), so a byte
from one executor to another crosses two shaped links, as between two hosts
through a switch. The driver and Apache Kafka sit on the bridge. ``--stack``
brings up only Kafka, the master and the workers (not Airflow, PostgreSQL or
the managed job) and takes them down afterwards; ``--master`` and
``--bootstrap`` run on a cluster that is already up instead.

Two comparisons, in one invocation, each ``--repeats`` rounds taking turns:

* paper 000 §4: hash vs locality-aware routing on the ``pairs`` stream
  (L = 0.8, 8 kB padding), as :mod:`locality_shuffle` measures it in one
  session: remote A→B shuffle bytes per event and throughput;
* what a user would quote: keyplane's routed job on a planned configuration
  (METIS tables and FISH hot keys from the stream's first batch, as
  :mod:`engines` plans its ``routed-v2``) against plain Spark (Spark's Kafka
  connector and ``groupBy``, :func:`engines.spark_job`), each its own
  application, on a stream with hot keys whose stage-B key follows from its
  stage-A key (a Zipf stream, each key's category downstream) and on a
  uniform one: steady rows per second and p99 batch time.

The output starts with the shaping as the kernel reports it (``tc qdisc
show`` in a worker's namespace) and a TCP round trip between two workers, or
says that the stack ran unshaped and why.

    python bench/stack_locality.py --stack [--repeats 5] [--forward pairs|tuples]
        [--locality-events 4000] [--user-events 16000] [--batch 4000] [--out FILE]
    python bench/stack_locality.py --master spark://HOST:PORT --bootstrap HOST:PORT \\
        --driver-host HOST
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import engines
import locality_shuffle
from _harness import percentile, spark_conf_env, steady_rate
from _output import emit, load_average

from keyplane.kafka.producer import produce_workload
from keyplane.reference.events import FORWARD_MODES
from keyplane.reference.workloads import PairsWorkload, WorkloadSpec, ZipfEvolvingWorkload
from keyplane.settings import Settings
from keyplane.stack import network
from keyplane.stack.config import StackConfig, stack_home
from keyplane.stack.kafka import KafkaPiece
from keyplane.stack.network import Network, namespace
from keyplane.stack.piece import Piece
from keyplane.stack.spark import SparkMaster, SparkWorkers

USER_VARIANTS = ("plain-spark", "routed-v2")


def bench_stack() -> StackConfig:
    """The cluster these benches run on: 3 workers of 1 core, the jobs sizing themselves.

    ``keyplane stack up`` adds a fourth worker so the managed job has room to
    grow; these benches start their own applications, so they keep to 3.
    ``KEYPLANE_STACK_*`` still sets the ports and the shaping.
    """
    return StackConfig(workers=3, job_cores=2, job_executors_initial=None)


Workload = Literal["hot-correlated", "uniform"]
WORKLOADS: tuple[Workload, ...] = ("hot-correlated", "uniform")
GOALS = {
    "remote bytes, locality / hash": (0.3, "at most"),
    "throughput, locality / hash": (1.3, "at least"),
    "hot-correlated, keyplane / plain Spark": (1.5, "at least"),
    "uniform, keyplane / plain Spark": (0.9, "at least"),
}


@dataclass(frozen=True)
class Cluster:
    """Where the benchmark runs: the master, Kafka as the executors reach it, the address
    the driver listens on, and what the network is."""

    master: str
    bootstrap: str
    driver_host: str
    shaping: str
    workers: SparkWorkers | None = None
    """Every worker of the stack, whether up or not (None: a cluster this run did not make)."""


def verdict(value: float, goal: float, direction: str) -> str:
    """``MET`` or ``NOT MET`` for a ratio against its goal ("at least" or "at most")."""
    if direction not in ("at least", "at most"):
        raise ValueError(f"direction must be 'at least' or 'at most', got {direction!r}")
    met = value >= goal if direction == "at least" else value <= goal
    return "MET" if met else "NOT MET"


CONNECT_PROBE = """
import socket, statistics, sys, time
took = []
for _ in range(7):
    start = time.perf_counter()
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    took.append(time.perf_counter() - start)
print(f"{statistics.median(took) * 1000:.3f}")
"""
"""Run in a worker's namespace: the median of seven TCP connects to another worker, in ms."""


def connect_rtt_ms(output: str) -> float | None:
    """The probe's median TCP connect time (one round trip), in ms; None when it failed."""
    try:
        return float(output.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None


def observed_shaping(made: Network, config: StackConfig) -> str:
    """What the kernel says of the links: a worker namespace's queue and a TCP round trip
    from the first worker to the second's web UI, or why the network is unshaped."""
    if not made.shaped:
        return f"UNSHAPED: every piece on loopback ({made.reason}); remote bytes cost a copy"
    first = made.namespaces[0]
    qdisc = subprocess.run(
        ["tc", "-n", first, "qdisc", "show", "dev", f"{first}n"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    lines = [f"shaped: {made.describe()}", f"`tc -n {first} qdisc show`: {qdisc or '(none)'}"]
    if len(made.namespaces) > 1:
        target = (config.address(2), str(config.spark_worker_ui_port + 1))
        probe = subprocess.run(
            ["ip", "netns", "exec", first, sys.executable, "-c", CONNECT_PROBE, *target],
            capture_output=True,
            text=True,
            check=False,
        )
        rtt = connect_rtt_ms(probe.stdout)
        lines.append(
            f"TCP connect {namespace(1)} → {namespace(2)} ({':'.join(target)}): "
            + (f"{rtt:.3f} ms median of 7" if rtt is not None else f"failed {probe.stderr[-200:]}")
        )
    return "\n".join(lines)


@contextmanager
def shaped_stack(config: StackConfig, home: Path) -> Iterator[Cluster]:
    """Kafka, the Spark master and its workers of ``config`` on shaped links, taken down
    (and the network removed) afterwards, whatever happens."""
    home.mkdir(parents=True, exist_ok=True)
    record = home / "network.json"
    made = network.make(config, record)
    bridge = config.address(0) if made.shaped else "127.0.0.1"
    external = (bridge, config.kafka_external_port) if made.shaped else None
    kafka = KafkaPiece(home, config.kafka_port, external)
    master = SparkMaster(home, config, made)
    workers = SparkWorkers(home, config, made, master)
    started: list[Piece] = []
    try:
        for piece in (kafka, master, workers):
            started.append(piece)
            piece.up()
        yield Cluster(
            master=master.url,
            bootstrap=kafka.bootstrap_servers,
            driver_host=bridge,
            shaping=observed_shaping(made, config),
            workers=workers,
        )
    finally:
        for piece in reversed(started):
            piece.down()
        network.remove(record)


def user_workload(kind: Workload, events: int, keys: int) -> WorkloadSpec:
    """``hot-correlated``: Zipf (s = 1) keys whose stage-B key is their category
    (``key % (keys // 100)``), so hot keys and a key's partner both matter;
    ``uniform``: uniform pairs with no correlation (L = 0), nothing for a plan to fix."""
    if kind == "hot-correlated":
        return ZipfEvolvingWorkload(n_events=events, n_keys=keys, exponent=1.0, shifts=(), seed=3)
    return PairsWorkload(n_events=events, n_keys=keys, locality=0.0, relabel_b=True, seed=3)


def ratio_cell(mine: Sequence[float], theirs: Sequence[float]) -> tuple[float, str]:
    """The median of the per-round ratios, and the cell ``median× (min–max)``."""
    mid, lo, hi = engines.spread(engines.ratios(mine, theirs))
    return mid, f"**{mid:.2f}×** ({lo:.2f}–{hi:.2f})"


def exact_cell(rounds: Sequence[dict[str, float]]) -> str:
    """Each round's count check: ``exact``, or what it lost and duplicated."""
    return "; ".join(
        "exact" if r["exact"] else f"{r['lost']:,.0f} lost, {r['duplicated']:,.0f} duplicated"
        for r in rounds
    )


def locality_comparison(
    cluster: Cluster, args: argparse.Namespace, tmp: Path, name: str
) -> tuple[list[str], dict[str, float]]:
    """Hash vs locality routing in one session on the cluster, ``args.repeats`` rounds, on
    topics named after ``name`` (:func:`locality_shuffle.run_name`)."""
    warm, measured = locality_shuffle.streams(
        args.locality_events, args.keys, args.pad, "random", "distinct"
    )
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in locality_shuffle.VARIANTS}
    spark = locality_shuffle.session(
        cluster.master, True, {"spark.driver.host": cluster.driver_host}
    )
    try:
        for run in range(args.repeats):
            for variant in locality_shuffle.VARIANTS:
                result = locality_shuffle.run_variant(
                    spark,
                    cluster.bootstrap,
                    tmp,
                    variant,
                    warm,
                    measured,
                    args.forward,
                    run=f"-{name}-{run}",
                )
                runs[variant].append(result)
                print(
                    f"locality round {run + 1}/{args.repeats} {variant}: "
                    f"{result['remote_per_k']:,.0f} remote B per 1k events, "
                    f"{result['rate']:,.0f} rows/s, exact {result['exact']} "
                    f"({result['lost']:,.0f} lost, {result['duplicated']:,.0f} duplicated)",
                    flush=True,
                )
    finally:
        spark.stop()

    def column(variant: str, key: str) -> list[float]:
        return [r[key] for r in runs[variant]]

    remote, remote_cell = ratio_cell(
        column("locality", "remote_per_k"), column("hash", "remote_per_k")
    )
    rate, rate_cell = ratio_cell(column("locality", "rate"), column("hash", "rate"))
    lines = [
        f"### Hash vs locality routing (paper 000 §4): {args.locality_events:,} pairs events a "
        f"round (L = 0.8, {args.keys} keys, {args.pad:,} B random padding, distinct field-2 "
        f"names), measured on the {measured.n_events:,} after a {warm.n_events:,}-event warm-up; "
        f"stage A forwards {args.forward}; one session, {locality_shuffle.EXECUTORS} executors "
        f"of 1 core, {locality_shuffle.P} instances per stage",
        "",
        "| routing | remote A→B bytes per 1k events | remote share | A→B tuples on one executor "
        "| rows/s | counts, round by round |",
        "|---|---:|---:|---:|---:|---|",
        *[
            f"| {v} | {engines.spread_cell(column(v, 'remote_per_k'), ',.0f')} "
            f"| {engines.spread_cell(column(v, 'remote_share'), '.0%')} "
            f"| {engines.spread_cell(column(v, 'hop_locality'), '.0%')} "
            f"| {engines.spread_cell(column(v, 'rate'), ',.0f')} "
            f"| {exact_cell(runs[v])} |"
            for v in locality_shuffle.VARIANTS
        ],
        "",
        f"remote A→B bytes per event, locality / hash, per round: {remote_cell}; "
        f"throughput locality / hash: {rate_cell}",
        "",
        "rounds (remote B per 1k events; rows/s): "
        + "; ".join(
            f"{v} "
            + ", ".join(f"{r['remote_per_k']:,.0f}" for r in runs[v])
            + " ; "
            + ", ".join(f"{r['rate']:,.0f}" for r in runs[v])
            for v in locality_shuffle.VARIANTS
        ),
    ]
    return lines, {"remote bytes, locality / hash": remote, "throughput, locality / hash": rate}


def user_comparison(
    cluster: Cluster, args: argparse.Namespace, tmp: Path, name: str
) -> tuple[list[str], dict[str, float]]:
    """keyplane on its planned configuration vs plain Spark, each run its own application,
    on topics named after ``name`` (:func:`locality_shuffle.run_name`)."""
    parallelism = locality_shuffle.P
    env = spark_conf_env(
        tmp / "spark-conf",
        {
            "spark.cores.max": str(locality_shuffle.EXECUTORS),
            "spark.executor.cores": "1",
            "spark.driver.host": cluster.driver_host,
        },
    ) | {"SPARK_LOCAL_IP": cluster.driver_host}
    lines = [
        f"### keyplane (planned v2) vs plain Spark: {args.user_events:,} events a run, "
        f"{args.batch:,} a micro-batch, {args.user_keys:,} keys, no padding, "
        f"{parallelism} shuffle partitions, {locality_shuffle.EXECUTORS} executors of 1 core; "
        "each run its own application",
        "",
        "| workload | variant | steady rows/s | p99 batch s | median batch s | keyplane / plain |",
        "|---|---|---:|---:|---:|---:|",
    ]
    ratios: dict[str, float] = {}
    for kind in WORKLOADS:
        spec = user_workload(kind, args.user_events, args.user_keys)
        topic = f"user-{name}-{kind}"
        partitions = locality_shuffle.fresh_topic(cluster.bootstrap, topic, engines.PARTITIONS)
        produce_workload(spec, cluster.bootstrap, topic, topic_partitions=partitions)
        planned = engines.planned_version(spec, args.batch, engines.ALPHA, parallelism)
        rates: dict[str, list[float]] = {v: [] for v in USER_VARIANTS}
        batches: dict[str, list[float]] = {v: [] for v in USER_VARIANTS}
        for run in range(args.repeats):
            for v in USER_VARIANTS:
                progress = engines.run_variant(
                    v,
                    cluster.bootstrap,
                    tmp / f"{kind}-{v}-{name}-{run}",
                    planned,
                    args.batch,
                    args.user_events,
                    master=cluster.master,
                    topic=topic,
                    parallelism=parallelism,
                    env=env,
                )
                rates[v].append(steady_rate(progress))
                batches[v] += [p["duration_ms"] / 1000 for p in progress[1:]]
                print(
                    f"{kind} round {run + 1}/{args.repeats} {v}: {rates[v][-1]:,.0f} rows/s",
                    flush=True,
                )
        mid, cell = ratio_cell(rates["routed-v2"], rates["plain-spark"])
        ratios[f"{kind}, keyplane / plain Spark"] = mid
        for v in USER_VARIANTS:
            lines.append(
                f"| {kind} | {v} | {engines.spread_cell(rates[v], ',.0f')} "
                f"| {percentile(batches[v], 99):.2f} | {statistics.median(batches[v]):.2f} "
                f"| {cell if v == 'routed-v2' else ''} |"
            )
        lines.append(
            f"| {kind} | runs (rows/s) | "
            + "; ".join(f"{v} " + ", ".join(f"{r:,.0f}" for r in rates[v]) for v in USER_VARIANTS)
            + " | | | |"
        )
        lines.append(
            f"| {kind} | planned v2 | alpha {engines.ALPHA}, from the first batch: "
            + ", ".join(
                f"stage {name} {len(op.table):,} keys in its table, {len(op.hot_keys)} hot"
                for name, op in planned.operators.items()
            )
            + " | | | |"
        )
    return lines, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stack",
        action="store_true",
        help="bring up Kafka, the Spark master and workers on shaped links, and take them down",
    )
    parser.add_argument("--master", help="a standalone master already up (spark://HOST:PORT)")
    parser.add_argument("--bootstrap", help="Kafka as the executors reach it (with --master)")
    parser.add_argument(
        "--driver-host", default="127.0.0.1", help="the address executors reach the driver at"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--locality-events", type=int, default=4_000)
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--pad", type=int, default=8_000)
    parser.add_argument("--forward", choices=FORWARD_MODES, default="pairs")
    parser.add_argument("--user-events", type=int, default=16_000)
    parser.add_argument("--user-keys", type=int, default=4_000)
    parser.add_argument("--batch", type=int, default=4_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.stack == bool(args.master):
        parser.error("give either --stack or --master (with --bootstrap)")
    if args.master and not args.bootstrap:
        parser.error("--master needs --bootstrap: Kafka as the executors reach it")

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with _cluster(args) as cluster:
            print(cluster.shaping, flush=True)
            # A stack's Kafka keeps the topics of earlier invocations.
            name = locality_shuffle.run_name()
            loc_lines, loc = locality_comparison(cluster, args, tmp / "locality", name)
            user_lines, user = user_comparison(cluster, args, tmp / "user", name)
    measured = loc | user
    lines = [
        f"## The routed job on the shaped stack ({cluster.master}, Kafka at {cluster.bootstrap})",
        "",
        cluster.shaping,
        "",
        f"{args.repeats} rounds of each comparison, variants taking turns; median (min–max) over "
        f"the rounds; ratios are per round; {time.monotonic() - started:,.0f} s in all; "
        f"load average at the end {load_average()}",
        "",
        *loc_lines,
        "",
        *user_lines,
        "",
        "| goal | measured | verdict |",
        "|---|---:|---|",
        *[
            f"| {name}: {direction} {goal}× | {measured[name]:.2f}× "
            f"| {verdict(measured[name], goal, direction)} |"
            for name, (goal, direction) in GOALS.items()
        ],
    ]
    emit("\n".join(lines), args.out)


@contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[Cluster]:
    if args.master:
        yield Cluster(
            master=args.master,
            bootstrap=args.bootstrap,
            driver_host=args.driver_host,
            shaping="as given: this run did not make the network and does not know its shaping",
        )
        return
    with shaped_stack(bench_stack(), stack_home(Settings().home) / "bench") as cluster:
        yield cluster


if __name__ == "__main__":
    main()
