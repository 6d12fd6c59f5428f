"""Committing state through Hadoop's FileContext or FileSystem API, side by side.

Each state store partition commits every micro-batch by writing one small
changelog file into the checkpoint and renaming it into place. Spark writes
checkpoint files through ``FileContext`` by default; keyplane's sessions
switch to ``FileSystem`` (:func:`keyplane.spark.session.use_file_system_checkpoint_manager`),
whose rename on the local file system is the POSIX ``rename(2)``.

The routed job runs on the same topic with each manager, taking turns, and
Spark's event log gives, per steady batch, each stateful operator's
``commitTimeMs`` summed over its partitions, and the batch's duration.

    python bench/checkpoint_manager.py [--events 200000] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from _harness import event_log_env, private_broker, run_job
from _output import emit

from keyplane.kafka.producer import produce_workload
from keyplane.spark.counts_job import CountsJobSettings
from keyplane.spark.session import CHECKPOINT_FILE_MANAGER_KEY, FILE_SYSTEM_CHECKPOINT_MANAGERS
from keyplane.testing import routed_job_topics
from keyplane.workloads import GeoTagsWorkload

MANAGERS = {
    "FileContext": "org.apache.spark.sql.execution.streaming.checkpointing."
    "FileContextBasedCheckpointFileManager",
    "FileSystem": FILE_SYSTEM_CHECKPOINT_MANAGERS[0],
}


def progress_events(log_dir: Path) -> list[dict[str, Any]]:
    """The query's progress reports from the event log, in batch order."""
    found = []
    for path in sorted(p for p in log_dir.iterdir() if p.is_file()):
        for line in path.read_text().splitlines():
            if "QueryProgressEvent" in line:
                found.append(json.loads(line)["progress"])
    return sorted(found, key=lambda p: p["batchId"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    commits: dict[str, list[float]] = {name: [] for name in MANAGERS}
    durations: dict[str, list[float]] = {name: [] for name in MANAGERS}
    with private_broker() as (bootstrap, tmp):
        produce_workload(
            GeoTagsWorkload(n_events=args.events, n_tags=2_000, seed=3), bootstrap, "commits"
        )
        for run in range(args.repeats):
            for name, manager in MANAGERS.items():
                work = tmp / f"{name}-{run}"
                env = event_log_env(work / "events")
                conf = Path(env["SPARK_CONF_DIR"]) / "spark-defaults.conf"
                conf.write_text(conf.read_text() + f"{CHECKPOINT_FILE_MANAGER_KEY} {manager}\n")
                run_job(
                    CountsJobSettings(
                        bootstrap_servers=bootstrap,
                        events_topic="commits",
                        checkpoint=work / "ck",
                        output=work / "out",
                        max_offsets_per_trigger=args.batch,
                        stop_at_offset_total=args.events,
                        routing_store=work / "store",
                        **routed_job_topics(f"{name}-{run}"),
                    ),
                    env=env,
                )
                # Steady batches: all but the first, with rows.
                for p in progress_events(work / "events")[1:]:
                    if not sum(source.get("numInputRows", 0) for source in p["sources"]):
                        continue
                    durations[name].append(p["durationMs"]["triggerExecution"] / 1000)
                    commits[name] += [op["commitTimeMs"] for op in p["stateOperators"]]
                print(f"run {run + 1}/{args.repeats} {name}: done", flush=True)

    ratio = statistics.median(durations["FileSystem"]) / statistics.median(durations["FileContext"])
    lines = [
        f"events: {args.events:,} geo-tags in 8 partitions, {args.batch:,} per batch, the routed "
        f"job on local[2] (2 stateful operators, 4 partitions each); {args.repeats} run(s) of "
        "each manager, taking turns; steady batches",
        "",
        "| checkpoint files through | median commitTimeMs per operator and batch "
        "(4 partitions summed) | median batch s |",
        "|---|---:|---:|",
        *[
            f"| {name} | {statistics.median(commits[name]):.0f} | "
            f"{statistics.median(durations[name]):.2f} |"
            for name in MANAGERS
        ],
        "",
        f"FileSystem / FileContext median batch: **{ratio:.2f}**",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
