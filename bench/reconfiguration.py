"""A live reconfiguration that moves 10k keys: how many micro-batches it takes, what it costs.

The routed job runs on a backlog (so every batch is as full as the cap
allows and its rows/s is the job's capacity). After a few batches the
controller rolls out v2, which moves ``--moved-keys`` stage-A keys and every
stage-B key to other instances (paper 000 §3.4: PREPARE → ACK → PROPAGATE A,
PROPAGATE B → MIGRATED A, MIGRATED B → DONE; both stages switch in one batch).
Reported:

* micro-batches from the job's ACK to its MIGRATED for B (the batch ids the
  job stamps on its replies), plus the batch that applies DONE;
* the controller's time per step;
* rows/s of the batches during the migration vs the batches before it (the
  throughput dip; goal ≤ 10 %), over the whole rollout and over the switch
  and install batches alone, and the states moved;
* every batch from the last one before the ACK to the first after MIGRATED.

    python bench/reconfiguration.py [--events 300000] [--moved-keys 10000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

from _harness import emit, private_broker, read_topic

from keyplane.config import OperatorRouting, RoutingConfig, save
from keyplane.controller import Controller
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import produce_workload
from keyplane.routedkeys import spark_partition
from keyplane.spark.counts_job import CountsJobSettings, job_command, read_output
from keyplane.testing import routed_job_topics
from keyplane.verification import compare_counts, expected_counts
from keyplane.workloads import ZipfEvolvingWorkload

P = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300_000)
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

    def elsewhere(keys: list[str]) -> dict[str, int]:
        return {k: (spark_partition(k, P) + 1) % P for k in keys}

    v1 = RoutingConfig.all_hash(P, ("A", "B"))
    v2 = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="manual",
        operators={
            "A": OperatorRouting(parallelism=P, table=elsewhere(moved_a)),
            "B": OperatorRouting(parallelism=P, table=elsewhere(b_keys)),
        },
    )
    with private_broker() as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "reconf", partitions=8)
        store = tmp / "store"
        save(v1, store)
        save(v2, store)
        topics = routed_job_topics("reconf")
        settings = CountsJobSettings(
            bootstrap_servers=bootstrap,
            events_topic="reconf",
            checkpoint=tmp / "ck",
            output=tmp / "out",
            shuffle_partitions=P,
            max_offsets_per_trigger=args.batch,
            stop_at_offset_total=args.events,
            routing_store=store,
            routing_version=1,
            **topics,
        )
        log = (tmp / "job.log").open("w")
        job = subprocess.Popen(job_command(settings), stdout=log, stderr=subprocess.STDOUT)
        while len(list((tmp / "out").glob("batch-*.parquet"))) < 3:
            if job.poll() is not None:
                raise RuntimeError((tmp / "job.log").read_text()[-3000:])
            time.sleep(0.2)
        with ControlChannel(bootstrap, topics["control_topic"]) as channel:
            controller = Controller(channel, tmp / "controller.json", store)
            result = controller.rollout(2, timeout_s=300)
            last = controller.state.last if controller.state else None
        if job.wait(timeout=1800) != 0:
            raise RuntimeError((tmp / "job.log").read_text()[-3000:])
        metrics = read_topic(bootstrap, topics["metrics_topic"])
        moved_states = len(read_topic(bootstrap, topics["migration_topic"]))
        report = compare_counts(truth, read_output(tmp / "out"))

    assert last is not None and last.ack is not None
    acked = last.ack.batch_id
    migrated = last.migrated["B"].batch_id
    assert acked is not None and migrated is not None
    switched = min(m.batch_id for m in last.migrated.values() if m.batch_id is not None) - 1
    before = [m["rows_per_s"] for m in metrics[1:] if m["plan"] < acked and m["rows"]]
    during = [m["rows_per_s"] for m in metrics if acked <= m["plan"] <= migrated and m["rows"]]
    moving = [m["rows_per_s"] for m in metrics if switched <= m["plan"] <= migrated and m["rows"]]
    dip = 1 - statistics.mean(during) / statistics.mean(before)
    moving_dip = 1 - statistics.mean(moving) / statistics.mean(before)
    batches = [
        f"| {m['plan']} | {'ACK' if m['plan'] == acked else ''}"
        f"{'switch' if m['plan'] == switched else ''}"
        f"{'install, MIGRATED' if m['plan'] == migrated else ''} | "
        f"{', '.join(f'{op} v{v}' for op, v in sorted(m['versions'].items()))} | "
        f"{m['rows']:,} | {m['rows_per_s']:,.0f} | {m['moved_states']:,} |"
        for m in metrics
        if acked - 1 <= m["plan"] <= migrated + 1
    ]
    steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.seconds.items())
    lines = [
        f"events: {args.events:,} zipf-evolving ({args.keys:,} keys, s = 0.6), "
        f"{args.batch:,} per batch, {P} instances, local[2]; v2 moves {len(moved_a):,} stage-A "
        f"keys and {len(b_keys)} stage-B keys",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| micro-batches ACK → MIGRATED(B) (+1 applies DONE) | {migrated - acked + 1} (+1) |",
        f"| rollout wall time | {result.total_s:.1f} s |",
        f"| states moved (migration topic records) | {moved_states:,} |",
        f"| rows/s before (mean of {len(before)} batches) | {statistics.mean(before):,.0f} |",
        f"| rows/s during (mean of {len(during)} batches) | {statistics.mean(during):,.0f} |",
        f"| throughput dip, ACK → MIGRATED(B) | **{dip:.0%}** |",
        f"| rows/s in the switch and install batches (mean of {len(moving)}) | "
        f"{statistics.mean(moving):,.0f} |",
        f"| throughput dip, switch and install batches only | {moving_dip:.0%} |",
        f"| counts exact | {report.exact} |",
        "",
        f"controller steps: {steps}",
        "",
        "| batch | rollout | routing | rows | rows/s | states moved out |",
        "|---:|---|---|---:|---:|---:|",
        *batches,
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
