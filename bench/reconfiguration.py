"""A live reconfiguration that moves 10k keys: how many micro-batches it takes, what it costs.

The routed job runs on a backlog, so every batch takes ``--batch`` events and
a batch's duration is the job's cost for them. After a few batches the
controller rolls out v2, which moves ``--moved-keys`` stage-A keys and every
stage-B key to other instances. Two orders of paper 000 §3.4, side by side
in one run, each on a job of its own over the same topic:

* ``together`` (keyplane's rollout): PREPARE → ACK → PROPAGATE A, PROPAGATE B
  → MIGRATED A, MIGRATED B → DONE; both stages switch in one batch;
* ``one-by-one`` (the paper's order): PROPAGATE B only after MIGRATED A.

Reported per order:

* micro-batches from the job's ACK to its MIGRATED for B (the batch ids the
  job stamps on its replies), plus the batch that applies DONE;
* the throughput dip (goal ≤ 10 %): one minus the mean duration of the
  batches before the ACK over that of the batches from the ACK to
  MIGRATED(B); every batch holds the same number of events, so durations
  compare throughput. Also over the switch and install batches alone;
* every batch from the last one before the ACK to the first after MIGRATED.

    python bench/reconfiguration.py [--events 200000] [--moved-keys 10000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

from _harness import emit, private_broker, read_topic

from keyplane.config import OperatorRouting, RoutingConfig, save
from keyplane.controller import Controller
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.protocol import Reconfiguration
from keyplane.spark.counts_job import CountsJobSettings, job_command, read_output
from keyplane.testing import moved_off_hash, routed_job_topics
from keyplane.verification import compare_counts, expected_counts
from keyplane.workloads import ZipfEvolvingWorkload

P = 4
Order = Literal["together", "one-by-one"]
ORDERS: tuple[Order, ...] = ("together", "one-by-one")
TIMEOUT_S = 300


def roll_out(controller: Controller, order: Order) -> None:
    """Roll v2 out in ``order``: the controller's own rollout, or the paper's."""
    if order == "together":
        controller.rollout(2, timeout_s=TIMEOUT_S)
        return
    controller.prepare(2)
    controller.wait_ack(TIMEOUT_S)
    for operator in ("A", "B"):
        controller.propagate(operator)
        controller.wait_migrated(operator, TIMEOUT_S)
    controller.done()


def measure(
    order: Order, bootstrap: str, tmp: Path, store: Path, args: argparse.Namespace, truth: Any
) -> dict[str, Any]:
    """Run the job on the backlog, roll v2 out in ``order`` after 3 batches, and measure."""
    work = tmp / order
    topics = routed_job_topics(f"reconf-{order}")
    settings = CountsJobSettings(
        bootstrap_servers=bootstrap,
        events_topic="reconf",
        checkpoint=work / "ck",
        output=work / "out",
        shuffle_partitions=P,
        max_offsets_per_trigger=args.batch,
        stop_at_offset_total=args.events,
        routing_store=store,
        routing_version=1,
        **topics,
    )
    work.mkdir(parents=True)
    log = (work / "job.log").open("w")
    job = subprocess.Popen(job_command(settings), stdout=log, stderr=subprocess.STDOUT)
    while len(list((work / "out").glob("batch-*.parquet"))) < 3:
        if job.poll() is not None:
            raise RuntimeError((work / "job.log").read_text()[-3000:])
        time.sleep(0.2)
    started = time.monotonic()
    with ControlChannel(bootstrap, topics["control_topic"]) as channel:
        controller = Controller(channel, work / "controller.json", store)
        roll_out(controller, order)
        wall = time.monotonic() - started
        last: Reconfiguration | None = controller.state.last if controller.state else None
    if job.wait(timeout=1800) != 0:
        raise RuntimeError((work / "job.log").read_text()[-3000:])
    metrics = read_topic(bootstrap, topics["metrics_topic"])
    moved_states = len(read_topic(bootstrap, topics["migration_topic"]))
    exact = compare_counts(truth, read_output(work / "out")).exact

    assert last is not None and last.ack is not None and last.ack.batch_id is not None
    acked = last.ack.batch_id
    installs = {op: m.batch_id for op, m in last.migrated.items() if m.batch_id is not None}
    migrated = installs["B"]
    switches = {installs[op] - 1 for op in installs}
    seconds = {m["plan"]: m["duration_ms"] / 1000 for m in metrics if m["rows"]}
    before = [seconds[b] for b in seconds if 0 < b < acked]
    during = [seconds[b] for b in range(acked, migrated + 1)]
    moving = [seconds[b] for b in sorted(switches | set(installs.values()))]

    def role(batch: int) -> str:
        roles = ["ACK"] if batch == acked else []
        roles += [f"{op} switch" for op in installs if installs[op] - 1 == batch]
        roles += [f"{op} install" for op in installs if installs[op] == batch]
        return ", ".join(roles)

    batches = [
        f"| {m['plan']} | {role(m['plan'])} | "
        f"{', '.join(f'{op} v{v}' for op, v in sorted(m['versions'].items()))} | "
        f"{m['rows']:,} | {m['duration_ms'] / 1000:.1f} | {m['moved_states']:,} |"
        for m in metrics
        if acked - 1 <= m["plan"] <= migrated + 1
    ]
    return {
        "batches": migrated - acked + 1,
        "wall": wall,
        "moved": moved_states,
        "before": statistics.mean(before),
        "during": statistics.mean(during),
        "moving": statistics.mean(moving),
        "exact": exact,
        "table": batches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--moved-keys", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = ZipfEvolvingWorkload(
        n_events=args.events, n_keys=args.keys, exponent=0.6, shifts=(0.9,), seed=12
    )
    truth = expected_counts(spec)
    a_keys = truth.loc[truth["stage"] == "A"].sort_values("count", ascending=False)["key"]
    b_keys = truth.loc[truth["stage"] == "B", "key"].tolist()
    moved_a = a_keys.head(args.moved_keys).tolist()

    v1 = RoutingConfig.all_hash(P, ("A", "B"))
    v2 = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="manual",
        operators={
            "A": OperatorRouting(parallelism=P, table=moved_off_hash(moved_a, P)),
            "B": OperatorRouting(parallelism=P, table=moved_off_hash(b_keys, P)),
        },
    )
    with private_broker() as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "reconf", partitions=8)
        store = tmp / "store"
        save(v1, store)
        save(v2, store)
        results = {order: measure(order, bootstrap, tmp, store, args, truth) for order in ORDERS}

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(results[order]) for order in ORDERS) + " |"

    lines = [
        f"events: {args.events:,} zipf-evolving ({args.keys:,} keys, s = 0.6), "
        f"{args.batch:,} per batch, {P} instances, local[2]; v2 moves {len(moved_a):,} stage-A "
        f"keys and {len(b_keys)} stage-B keys",
        "",
        "| measure | " + " | ".join(ORDERS) + " |",
        "|---|" + "---:|" * len(ORDERS),
        row("micro-batches ACK → MIGRATED(B) (+1 applies DONE)", lambda r: f"{r['batches']} (+1)"),
        row("rollout wall time", lambda r: f"{r['wall']:.1f} s"),
        row("states moved (migration topic records)", lambda r: f"{r['moved']:,}"),
        row("mean batch s before the ACK", lambda r: f"{r['before']:.1f}"),
        row("mean batch s, ACK → MIGRATED(B)", lambda r: f"{r['during']:.1f}"),
        row(
            "throughput dip, ACK → MIGRATED(B)",
            lambda r: f"**{1 - r['before'] / r['during']:.0%}**",
        ),
        row("mean batch s, switch and install batches", lambda r: f"{r['moving']:.1f}"),
        row(
            "throughput dip, switch and install batches",
            lambda r: f"{1 - r['before'] / r['moving']:.0%}",
        ),
        row("counts exact", lambda r: str(r["exact"])),
    ]
    for order in ORDERS:
        lines += [
            "",
            f"{order}:",
            "",
            "| batch | rollout | routing | rows | batch s | states moved out |",
            "|---:|---|---|---:|---:|---:|",
            *results[order]["table"],
        ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
