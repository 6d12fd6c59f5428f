"""What keyplane's two remedies for the JIT's traps cost a job that does not reconfigure.

The routed job (JVM stages) runs on a backlog with no rollout in three
settings, taking turns, ``--repeats`` times:

* keyplane's defaults: every batch carries the hand-off primers
  (``keyplane.spark.routed_source.primer_rows``), the JVM keeps its own
  JIT settings;
* no primers (``KEYPLANE_HANDOFF_PRIMERS=false``);
* no primers, and ``KEYPLANE_JVM_JIT_OPTIONS`` set to ``--options`` (by
  default keyplane's ``NO_TRAP_JIT_OPTIONS``).

All read the same events in batch *n*, so the summed seconds of the same
steady batches (all but each run's first two) compare the settings side by
side. What each saves a rollout is measured by ``bench/reconfiguration.py``
run with the variables set.

    python bench/steady_cost.py [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from _harness import private_broker, routed_on_backlog, run_job
from _output import emit

from keyplane.control.operators import OPERATORS
from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import RoutingConfig, save
from keyplane.settings import NO_TRAP_JIT_OPTIONS

P = 4
FIRST_STEADY_BATCH = 2
"""Batches 0 and 1 start the JVM and warm it up."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--options", default=NO_TRAP_JIT_OPTIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = ZipfEvolvingWorkload(
        n_events=args.events, n_keys=20_000, exponent=0.6, shifts=(0.9,), seed=12
    )
    variants = {
        "keyplane's defaults (primers)": {},
        "no primers": {"KEYPLANE_HANDOFF_PRIMERS": "false"},
        f"no primers, {args.options}": {
            "KEYPLANE_HANDOFF_PRIMERS": "false",
            "KEYPLANE_JVM_JIT_OPTIONS": args.options,
        },
    }
    default_name = next(iter(variants))
    seconds: dict[str, list[dict[int, float]]] = {name: [] for name in variants}
    with private_broker() as (bootstrap, tmp):
        produce_workload(spec, bootstrap, "jit", partitions=8)
        store = tmp / "store"
        save(RoutingConfig.all_hash(P, OPERATORS), store)
        for run in range(args.repeats):
            for index, (name, variables) in enumerate(variants.items()):
                settings = routed_on_backlog(
                    bootstrap,
                    "jit",
                    tmp / f"{index}-{run}",
                    store,
                    parallelism=P,
                    batch=args.batch,
                    events=args.events,
                )
                env = {
                    **os.environ,
                    "KEYPLANE_HANDOFF_PRIMERS": "true",
                    "KEYPLANE_JVM_JIT_OPTIONS": "",
                    **variables,
                }
                seconds[name].append(
                    {
                        p["batch_id"]: p["duration_ms"] / 1000
                        for p in run_job(settings, env)
                        if p["rows"] and p["batch_id"] >= FIRST_STEADY_BATCH
                    }
                )

    def steady(name: str) -> list[float]:
        return [s for run in seconds[name] for s in run.values()]

    default = sum(steady(default_name))
    lines = [
        f"events: {args.events:,} zipf-evolving (20,000 keys, s = 0.6), {args.batch:,} per "
        f"batch, {P} instances, local[2], no rollout; {args.repeats} run(s) of each setting, "
        f"taking turns; steady batches: from batch {FIRST_STEADY_BATCH}",
        "",
        "| setting | steady batches | mean s | median s | summed s | vs keyplane's defaults |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in variants:
        values = steady(name)
        lines.append(
            f"| {name} | {len(values)} | {statistics.mean(values):.3f} | "
            f"{statistics.median(values):.3f} | {sum(values):.2f} | "
            f"{sum(values) / default:.3f}× |"
        )
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
