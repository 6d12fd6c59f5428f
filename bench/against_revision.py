"""The routed job of this checkout against the same job at another git revision, side by side.

A change to the job's data path is judged by what it does to the job's
throughput, measured against the code it replaces in one run: the two
revisions take turns on one topic of a private Apache Kafka broker, the
workload and settings of ``bench/engines.py`` (its ``routed-v1`` variant:
the routed job as ``keyplane job start`` runs it, all-hash v1, stages in the
JVM). The other revision is checked out with ``git worktree`` into a scratch
directory and put first on the job process's ``PYTHONPATH``, so the driver
and its Python workers import its ``keyplane``; the JVM stages' jar is this
checkout's, so the revisions must not differ there. Each run's output shows
which sink wrote it (a batch file, or a directory of parts), as a check that
each revision ran its own code.

    python bench/against_revision.py --baseline REV [--events 300000] [--batch 20000]
        [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from _harness import private_broker, steady_rate
from _output import emit
from engines import PARTITIONS, TOPIC, ratios, run_variant, runs_line, spread_cell

from keyplane.kafka.producer import produce_workload
from keyplane.reference.workloads import PairsWorkload
from keyplane.routing.config import RoutingConfig

ROOT = Path(__file__).resolve().parent.parent


def checkout(revision: str, into: Path) -> str:
    """``revision`` checked out at ``into`` (a detached worktree); its full commit id."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(into), revision],
        check=True,
    )
    return subprocess.run(
        ["git", "-C", str(into), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def sink_shape(work: Path) -> str:
    """``parts`` when the run's batch files are directories of parts, else ``file``."""
    batches = sorted((work / "out").glob("batch-*.parquet"))
    if not batches:
        raise RuntimeError(f"{work}: the run wrote no batch file")
    return "parts" if batches[-1].is_dir() else "file"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=4_000, help="distinct keys in each field")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    spec = PairsWorkload(n_events=args.events, n_keys=args.keys, relabel_b=True, seed=3)
    unused = RoutingConfig.all_hash(1, ("A", "B"))
    rates: dict[str, list[float]] = {"this": [], "baseline": []}
    shapes: dict[str, set[str]] = {"this": set(), "baseline": set()}
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        baseline = checkout(args.baseline, tree)
        env = {**os.environ, "PYTHONPATH": f"{tree / 'include'}"}
        try:
            with private_broker("kafka") as (bootstrap, tmp):
                produce_workload(spec, bootstrap, TOPIC, partitions=PARTITIONS)
                for run in range(args.repeats):
                    for name, job_env in (("this", None), ("baseline", env)):
                        work = tmp / f"{name}-{run}"
                        progress = run_variant(
                            "routed-v1", bootstrap, work, unused, args.batch, args.events,
                            env=job_env,
                        )  # fmt: skip
                        rates[name].append(steady_rate(progress))
                        shapes[name].add(sink_shape(work))
                        print(
                            f"run {run + 1}/{args.repeats} {name}: {rates[name][-1]:,.0f} rows/s",
                            flush=True,
                        )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
            )
    lines = [
        f"routed-v1 of {head[:10]} (this) against {baseline[:10]} (baseline), taking turns; "
        f"Apache Kafka (one KRaft node), {args.events:,} pairs events ({args.keys:,} keys a "
        f"field) in {PARTITIONS} partitions, {args.batch:,} per micro-batch, local[2]; "
        f"median (min–max) over {args.repeats} runs",
        "",
        "| revision | batch files | steady rows/s | vs baseline |",
        "|---|---|---:|---:|",
        *[
            f"| {name} | {', '.join(sorted(shapes[name]))} | {spread_cell(rates[name], ',.0f')} "
            f"| {spread_cell(ratios(rates[name], rates['baseline']), '.2f')} |"
            for name in rates
        ],
        "",
        runs_line(rates),
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
