"""How sure a set of reconfiguration runs is about the dip: mean, spread and upper bound.

``bench/reconfiguration.py`` reports one dip per run, and runs of the same
code differ by 20–30 points, so a goal like "≤ 10 %" is a statement about
the mean over runs, decided by its confidence bound rather than by any single
run. This reads the per-run
values of one measure from the bench's result files and prints their
mean, standard deviation and one-sided upper confidence bound (Student's
t), the rule the dip goal is decided by (docs/benchmarks.md, "Throughput dip
while 10,000 keys move").

    python bench/dip_confidence.py FILE [FILE ...] [--measure LABEL] [--confidence 0.95] [--goal 10]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

from _output import emit
from scipy import stats

OWN_PACE = (
    "throughput dip, switch and install batches, each job at its own pace outside the rollout"
)
"""The measure the dip goal is decided by: each job's own pace, whichever process is faster."""

_PERCENT = re.compile(r"([-−]?\d+(?:\.\d+)?)%")


def runs_of(text: str, label: str, column: int) -> str:
    """The runs in cell ``column`` of the row labelled ``label`` of a result file's table.

    A bench's cell reads ``**pooled** (run1, run2, ...)``, or ``**pooled**``
    alone for a single run; this is the part in brackets, else the whole
    cell. Raises ``ValueError`` when the row is missing.
    """
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == label:
            cell = cells[column]
            return cell[cell.index("(") :] if "(" in cell else cell
    raise ValueError(f"no row {label!r} in the result file")


def run_values(text: str, measure: str) -> list[float]:
    """The per-run percentages of ``measure``'s row in one result file (its second cell)."""
    return [float(v.replace("−", "-")) for v in _PERCENT.findall(runs_of(text, measure, 1))]


def margin(values: list[float], confidence: float) -> float:
    """How far a one-sided confidence bound lies from the mean: t standard errors
    (Student's t, n − 1 degrees of freedom)."""
    if len(values) < 2:
        raise ValueError("a confidence bound needs at least two runs")
    t = float(stats.t.ppf(confidence, len(values) - 1))
    return t * statistics.stdev(values) / math.sqrt(len(values))


def upper_bound(values: list[float], confidence: float) -> float:
    """One-sided upper confidence bound of the mean."""
    return statistics.fmean(values) + margin(values, confidence)


def report(files: Iterable[Path], measure: str, confidence: float, goal: float) -> str:
    values = [v for path in files for v in run_values(path.read_text(), measure)]
    bound = upper_bound(values, confidence)
    verdict = "met" if bound <= goal else "not shown"
    return "\n".join(
        [
            f"measure: {measure}",
            "",
            "| runs | per run, % | mean % | sd, points | "
            f"{confidence:.0%} upper bound of the mean, % | goal ≤ {goal:g} % |",
            "|---:|---|---:|---:|---:|---|",
            f"| {len(values)} | {', '.join(f'{v:g}' for v in values)} | "
            f"{statistics.fmean(values):.1f} | {statistics.stdev(values):.1f} | "
            f"{bound:.1f} | {verdict} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench/reconfiguration.py results")
    parser.add_argument("--measure", default=OWN_PACE, help="the row to read")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--goal", type=float, default=10.0, help="the goal, in percent")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    emit(report(args.files, args.measure, args.confidence, args.goal), args.out)


if __name__ == "__main__":
    main()
