"""Soak: the routed job under steady generated load, reconfigured every minute, for N minutes.

A generator writes a zipf-evolving stream at a fixed rate for ``--minutes``
while the routed job counts it. Every ``--every-s`` seconds the controller
rolls out a new version (paper 000 §3.4): even versions move the hottest
stage-A keys and every stage-B key to the next instance, odd versions move
them back, so state moves in both directions all run long. At the end the
job's counts are compared with the generator's ground truth (exact counts:
no event lost or duplicated), and every 10 s the resident memory of the
driver (its Python process and its JVM, which in ``local[2]`` also holds the
executors), of the Python workers and of the broker is sampled.

Flatness is the least-squares slope of each RSS series over the last two
thirds of the run, in MB/min (the first third is JVM heap and code warm-up).
The embedded broker keeps every record in memory (tansu's ``memory://``
storage), so its RSS must grow with the bytes written; the report puts that
figure next to its slope.

    python bench/soak.py [--minutes 30] [--rate 250] [--every-s 60] [--out FILE] [--plot PNG]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil
from _harness import percentile, private_broker
from _output import emit

from keyplane.control.controller import Controller, RolloutTimeout
from keyplane.kafka.broker import EmbeddedBroker
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.migration_topic import count_moved_states
from keyplane.kafka.producer import produce_workload
from keyplane.reference.verification import CountReport, compare_counts, expected_counts
from keyplane.reference.workloads import ZipfEvolvingWorkload
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.spark.counts_job import CountsJobSettings, read_output
from keyplane.spark.progress import PROGRESS_PREFIX
from keyplane.testing import (
    moved_off_hash,
    routed_job_topics,
    stage_keys_by_count,
    start_job_process,
)

P = 4
SAMPLE_EVERY_S = 10.0
FLAT_FRACTION = 0.10
SERIES = ("driver (Python)", "driver (JVM)", "Python workers", "broker")


@dataclass
class MemorySamples:
    """RSS in MB per process group, sampled every :data:`SAMPLE_EVERY_S` seconds."""

    minutes: list[float] = field(default_factory=list)
    mb: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in SERIES})

    def slope(self, name: str) -> float:
        """MB/min over the last two thirds of the samples (least squares)."""
        start = len(self.minutes) // 3
        x, y = self.minutes[start:], self.mb[name][start:]
        if len(x) < 2:
            return float("nan")
        return float(np.polyfit(x, y, 1)[0])

    def flat(self, name: str, fraction: float) -> bool:
        """Whether the fitted growth over the last two thirds stays under ``fraction`` of
        the RSS at one third of the run."""
        start = len(self.minutes) // 3
        growth = self.slope(name) * (self.minutes[-1] - self.minutes[start])
        return growth <= fraction * self.mb[name][start]


def _rss_mb(process: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        return float(process.memory_info().rss) / 2**20
    return 0.0


def sample_memory(job_pid: int, broker_pid: int) -> dict[str, float]:
    """RSS of the driver's Python process, its JVM, the Python workers and the broker."""
    driver = psutil.Process(job_pid)
    jvm = workers = 0.0
    with contextlib.suppress(psutil.Error):
        for child in driver.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.name() == "java":
                    jvm += _rss_mb(child)
                elif "python" in child.name():
                    workers += _rss_mb(child)
    return {
        "driver (Python)": _rss_mb(driver),
        "driver (JVM)": jvm,
        "Python workers": workers,
        "broker": _rss_mb(psutil.Process(broker_pid)),
    }


def versions_moving(
    hot_a: list[str], b_keys: list[str], version: int, parent: int | None
) -> RoutingConfig:
    """v``version``: even versions move ``hot_a`` and ``b_keys`` one instance on, odd ones
    route everything by hash again (so each rollout moves the same keys back and forth).
    ``parent`` is the version the job runs (an aborted rollout leaves the job on its parent)."""

    def moved(keys: list[str]) -> dict[str, int]:
        return moved_off_hash(keys, P) if version % 2 == 0 else {}

    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_by="manual" if parent is not None else "initial",
        operators={
            "A": OperatorRouting(parallelism=P, table=moved(hot_a)),
            "B": OperatorRouting(parallelism=P, table=moved(b_keys)),
        },
    )


def plot(samples: MemorySamples, rollouts: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in SERIES:
        ax.plot(samples.minutes, samples.mb[name], label=name)
    for i, minute in enumerate(rollouts):
        ax.axvline(minute, color="grey", alpha=0.25, lw=0.8, label="rollout" if i == 0 else None)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=250, help="events per second")
    parser.add_argument("--every-s", type=float, default=60.0, help="seconds between rollouts")
    parser.add_argument("--keys", type=int, default=5_000)
    parser.add_argument("--moved-keys", type=int, default=200)
    parser.add_argument("--rollout-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--raw", type=Path, help="keep the samples and batch reports as JSON")
    parser.add_argument("--render-from", type=Path, help="only render the report of a --raw file")
    args = parser.parse_args()

    n_events = int(args.minutes * 60 * args.rate)
    spec = ZipfEvolvingWorkload(
        n_events=n_events, n_keys=args.keys, exponent=0.8, shifts=(0.5,), seed=31
    )
    truth = expected_counts(spec)
    a_keys, b_keys = stage_keys_by_count(truth)
    hot_a = a_keys[: args.moved_keys]

    if args.render_from is not None:
        raw = json.loads(args.render_from.read_text())
    else:
        raw = run_soak(args, spec, truth, hot_a, b_keys)
        if args.raw is not None:
            args.raw.write_text(json.dumps(raw))
    render(raw, args, spec, len(hot_a), len(b_keys))


def run_soak(
    args: argparse.Namespace,
    spec: ZipfEvolvingWorkload,
    truth: pd.DataFrame,
    hot_a: list[str],
    b_keys: list[str],
) -> dict[str, Any]:
    """Run the load, the rollouts and the sampling; return what the report needs (as JSON)."""
    n_events = spec.n_events
    samples = MemorySamples()
    rollout_minutes: list[float] = []
    rollout_seconds: list[float] = []
    timeouts = 0
    with private_broker() as (bootstrap, tmp):
        broker = EmbeddedBroker(tmp / "broker").status()
        assert broker is not None
        store = tmp / "store"
        save(versions_moving(hot_a, b_keys, 1, None), store)
        topics = routed_job_topics("soak")
        settings = CountsJobSettings(
            bootstrap_servers=bootstrap,
            events_topic="soak",
            checkpoint=tmp / "ck",
            output=tmp / "out",
            shuffle_partitions=P,
            max_offsets_per_trigger=20_000,
            routing_store=store,
            routing_version=1,
            **topics,
        )
        log = tmp / "job.log"
        job = start_job_process(settings, log)
        produced: list[int] = []
        generator = threading.Thread(
            target=lambda: produced.append(
                produce_workload(spec, bootstrap, "soak", partitions=8, rate=args.rate)
            ),
            daemon=True,
        )
        started = time.monotonic()
        generator.start()
        stop_sampling = threading.Event()

        def sample_every_10_s() -> None:
            while not stop_sampling.wait(SAMPLE_EVERY_S) and job.poll() is None:
                minute = (time.monotonic() - started) / 60
                measured = sample_memory(job.pid, broker.pid)
                samples.minutes.append(minute)
                for name, mb in measured.items():
                    samples.mb[name].append(mb)
                print(
                    f"{minute:5.1f} min  "
                    + "  ".join(f"{n} {measured[n]:,.0f} MB" for n in SERIES),
                    flush=True,
                )

        sampler = threading.Thread(target=sample_every_10_s, daemon=True)
        sampler.start()
        next_rollout = started + args.every_s
        version = active = 1
        stopped_min = float("nan")
        with ControlChannel(bootstrap, topics["control_topic"]) as channel:
            controller = Controller(channel, tmp / "controller.json", store)
            # Rollouts run while the load runs; then the job drains the rest and is
            # stopped between batches (SIGTERM), so no rollout is cut short.
            while job.poll() is None:
                now = time.monotonic()
                if now >= next_rollout and generator.is_alive():
                    version += 1
                    save(versions_moving(hot_a, b_keys, version, active), store)
                    rollout_minutes.append((now - started) / 60)
                    try:
                        result = controller.rollout(version, timeout_s=args.rollout_timeout_s)
                        rollout_seconds.append(result.total_s)
                        active = version
                        print(
                            f"v{version} rolled out at {rollout_minutes[-1]:.1f} min "
                            f"in {result.total_s:.1f} s",
                            flush=True,
                        )
                    except RolloutTimeout as timeout:
                        timeouts += 1
                        print(f"rollout v{version} aborted: {timeout}", flush=True)
                    next_rollout = max(next_rollout + args.every_s, time.monotonic())
                elif not generator.is_alive() and _committed(log) >= n_events:
                    # Sampling ends before the stop: RSS during shutdown is not the job's.
                    stop_sampling.set()
                    sampler.join()
                    stopped_min = (time.monotonic() - started) / 60
                    job.terminate()
                    job.wait(timeout=120)
                    break
                time.sleep(1.0)
        elapsed_min = (time.monotonic() - started) / 60
        stop_sampling.set()
        sampler.join()
        if job.returncode != 0:
            raise RuntimeError(log.read_text()[-3000:])
        generator.join()
        batches = _progress(log)
        report = compare_counts(truth, read_output(tmp / "out"))
        moved_states = count_moved_states(bootstrap, topics["migration_topic"])
    return {
        "elapsed_min": elapsed_min,
        "stopped_min": stopped_min,
        "minutes": samples.minutes,
        "rss_mb": samples.mb,
        "rollout_minutes": rollout_minutes,
        "rollout_seconds": rollout_seconds,
        "timeouts": timeouts,
        "report": vars(report),
        "batches": batches,
        "moved_states": moved_states,
        "produced": sum(produced),
    }


def render(
    raw: dict[str, Any],
    args: argparse.Namespace,
    spec: ZipfEvolvingWorkload,
    n_hot_a: int,
    n_b: int,
) -> None:
    """The report table (and the plot) from a run's JSON record."""
    stopped = raw.get("stopped_min")
    if stopped is None or math.isnan(stopped):
        stopped = math.inf
    kept = [i for i, m in enumerate(raw["minutes"]) if m < stopped]
    samples = MemorySamples(
        minutes=[raw["minutes"][i] for i in kept],
        mb={name: [series[i] for i in kept] for name, series in raw["rss_mb"].items()},
    )
    batches = raw["batches"]
    report = CountReport(**raw["report"])
    rollout_minutes, rollout_seconds = raw["rollout_minutes"], raw["rollout_seconds"]
    elapsed_min = raw.get("elapsed_min", samples.minutes[-1])
    stored_mb = _encoded_bytes(spec) / 2**20

    durations = [float(b["duration_ms"]) for b in batches if b["rows"]]
    title = (
        f"soak: {elapsed_min:.0f} min, {args.rate} events/s, "
        f"{len(rollout_minutes)} rollouts, counts exact: {report.exact}"
    )
    if args.plot is not None:
        plot(samples, rollout_minutes, args.plot, title)
    rows = [
        f"| {name} | {samples.mb[name][len(samples.minutes) // 3]:,.0f} | "
        f"{samples.mb[name][-1]:,.0f} | {max(samples.mb[name]):,.0f} | "
        f"{samples.slope(name):+.2f} | {'yes' if samples.flat(name, FLAT_FRACTION) else '**no**'} |"
        for name in SERIES
    ]
    lines = [
        f"{args.minutes:.0f} min of zipf-evolving load ({spec.n_events:,} events, "
        f"{args.keys:,} keys, {args.rate} events/s), routed job with {P} instances, local[2]; "
        f"a rollout every {args.every_s:.0f} s moving {n_hot_a} stage-A and {n_b} stage-B keys; "
        f"the run took {elapsed_min:.1f} min with the drain after the load",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| events produced / expected | {raw['produced']:,} / {spec.n_events:,} |",
        f"| counts exact | **{report.exact}** (lost {report.lost}, duplicated "
        f"{report.duplicated}, wrong keys {report.wrong_keys}) |",
        f"| rollouts completed / timed out | {len(rollout_seconds)} / {raw['timeouts']} |",
        f"| rollout wall time, mean / max | {np.mean(rollout_seconds or [0]):.1f} s / "
        f"{max(rollout_seconds or [0]):.1f} s |",
        f"| micro-batches; duration p50 / p99 | {len(batches):,}; "
        f"{percentile(durations, 50) / 1000:.1f} s / {percentile(durations, 99) / 1000:.1f} s |",
        f"| largest input lag | {max(b['lag'] for b in batches):,} events |",
        f"| states moved (through the migration topic) | {raw['moved_states']:,} |",
        f"| events held in the broker's memory at the end | {stored_mb:,.0f} MB |",
        "",
        "RSS sampled every 10 s; slope over the last two thirds of the run; flat: the "
        f"fitted growth over those two thirds is under {FLAT_FRACTION:.0%} of the RSS at 1/3.",
        "",
        "| process | RSS at 1/3 (MB) | RSS at end (MB) | max (MB) | slope (MB/min) | flat |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
    ]
    emit("\n".join(lines), args.out)


def _progress(log: Path) -> list[dict[str, Any]]:
    """The job's per-batch progress reports, from its log."""
    return [
        json.loads(line[len(PROGRESS_PREFIX) :])
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith(PROGRESS_PREFIX)
    ]


def _committed(log: Path) -> int:
    """Events the job has committed so far (its last progress report)."""
    reports = _progress(log)
    return int(reports[-1]["committed"]) if reports else 0


def _encoded_bytes(spec: ZipfEvolvingWorkload) -> int:
    """Bytes of the encoded events, as the generator wrote them: what the broker holds."""
    from keyplane.reference.events import encode_batch

    return sum(len(value) for batch in spec.batches(50_000) for value in encode_batch(batch, 0))


if __name__ == "__main__":
    main()
