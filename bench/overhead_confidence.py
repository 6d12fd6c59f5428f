"""How sure a set of overhead runs is: the routed job's throughput against plain Spark's.

``bench/reference_job.py`` reports each run's ratio to plain Spark
("vs plain Spark (runs)"), and runs of the same code differ by ±20 % on a
2-core machine, so the goal
"≥ 0.9×" is a statement about the mean over runs. This reads every run's
ratio of one variant from the bench's result files and prints their mean,
standard deviation and one-sided lower confidence bound (Student's t, as
``bench/dip_confidence.py`` bounds a dip from above). The rule the
overhead goal is decided by (docs/benchmarks.md): **met** if the bound
is at least the goal, **at its edge** if only the mean is, **not met** if
the mean is below it.

    python bench/overhead_confidence.py FILE [FILE ...] [--variant routed]
        [--confidence 0.95] [--goal 0.9] [--out FILE]
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

from _output import emit
from dip_confidence import margin, runs_of

_RATIO = re.compile(r"\d+\.\d+")


def run_ratios(text: str, variant: str) -> list[float]:
    """The per-run ratios of ``variant``'s row in one result file of ``bench/reference_job.py``
    (its last cell). Raises ``ValueError`` when the row is missing."""
    return [float(v) for v in _RATIO.findall(runs_of(text, variant, -1))]


def verdict(mean: float, bound: float, goal: float) -> str:
    """The pre-registered rule (module docstring), on the runs' mean and its lower bound."""
    if bound >= goal:
        return "met"
    return "at its edge" if mean >= goal else "not met"


def report(files: Iterable[Path], variant: str, confidence: float, goal: float) -> str:
    values = [v for path in files for v in run_ratios(path.read_text(), variant)]
    mean = statistics.fmean(values)
    bound = mean - margin(values, confidence)
    return "\n".join(
        [
            f"variant: {variant}, throughput against plain Spark's per run",
            "",
            "| runs | per run | mean | sd | "
            f"{confidence:.0%} lower bound of the mean | goal ≥ {goal:g}× |",
            "|---:|---|---:|---:|---:|---|",
            f"| {len(values)} | {', '.join(f'{v:.2f}' for v in values)} | "
            f"{mean:.3f} | {statistics.stdev(values):.3f} | "
            f"{bound:.3f} | {verdict(mean, bound, goal)} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench/reference_job.py results")
    parser.add_argument("--variant", default="routed", help="the row to read")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--goal", type=float, default=0.9, help="the goal, a ratio")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    emit(report(args.files, args.variant, args.confidence, args.goal), args.out)


if __name__ == "__main__":
    main()
