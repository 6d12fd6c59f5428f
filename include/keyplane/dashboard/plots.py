"""The dashboard's plots, drawn server-side with matplotlib.

Server-side PNGs keep the plugin free of a JavaScript build and make the page
readable wherever the Airflow UI is. Each plot is one metric over the
micro-batches, coloured by the version the batch routed with, so a rollout
shows as a change of colour and a regression as a step at that change. A
batch in the middle of a migration (operators on different versions) is grey.

A deployment that reconfigures on a schedule gathers hundreds of versions.
Only the newest :data:`LEGEND_VERSIONS` get a colour and a legend entry of
their own; the older ones share one pale colour and one entry ("and N
older"). So the colours stay distinct, the legend (beside the axes, never on
them) stays short, and a plot is a fixed number of matplotlib artists however
many versions there are, which bounds the time to draw it.

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas,
never pyplot: pyplot keeps global state, and the API server renders from
several threads.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from keyplane.dashboard.metrics import MIGRATING, BatchPoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PlotName = Literal["locality", "imbalance", "throughput", "lag"]


@dataclass(frozen=True)
class PlotSpec:
    title: str
    ylabel: str
    value: Callable[[BatchPoint], float | None]
    reference: float | None = None
    reference_label: str | None = None


PLOTS: dict[PlotName, PlotSpec] = {
    "locality": PlotSpec(
        "Locality: share of A→B tuples on one executor",
        "locality",
        lambda p: p.locality,
    ),
    "imbalance": PlotSpec(
        "Imbalance: worst operator's max / avg instance load",
        "max / avg load",
        lambda p: p.imbalance,
        reference=1.0,
        reference_label="perfect balance",
    ),
    "throughput": PlotSpec(
        "Throughput",
        "rows / s",
        lambda p: p.rows_per_s,
    ),
    "lag": PlotSpec(
        "Input lag",
        "records behind",
        lambda p: float(p.input_lag),
    ),
}

_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
)
"""One colour per version named in the legend (matplotlib's tab10 without its grey and cyan)."""

LEGEND_VERSIONS = len(_PALETTE)
"""Versions with a colour and a legend entry of their own: the newest ones."""

_OLDER_COLOUR = "#d6cba6"
_MIGRATING_COLOUR = "#9a9a9a"


def _series(
    points: Sequence[BatchPoint], value: Callable[[BatchPoint], float | None]
) -> dict[int | None, tuple[list[int], list[float]]]:
    series: dict[int | None, tuple[list[int], list[float]]] = {}
    for point in points:
        y = value(point)
        if y is None:
            continue
        xs, ys = series.setdefault(point.version, ([], []))
        xs.append(point.batch_id)
        ys.append(y)
    return series


def _joined(
    series: dict[int | None, tuple[list[int], list[float]]], versions: Sequence[int]
) -> tuple[list[float], list[float]]:
    """The points of ``versions`` as one line, broken (NaN) between versions."""
    xs: list[float] = []
    ys: list[float] = []
    for version in versions:
        if xs:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.extend(series[version][0])
        ys.extend(series[version][1])
    return xs, ys


def plot_figure(name: PlotName, points: Sequence[BatchPoint], *, dpi: int = 100) -> Figure:
    """One metric over the batches (a labelled empty frame when there are no points)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    spec = PLOTS[name]
    figure = Figure(figsize=(6.4, 3.2), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    series = _series(points, spec.value)
    versions = sorted(v for v in series if v is not None)
    older, newest = versions[:-LEGEND_VERSIONS], versions[-LEGEND_VERSIONS:]
    for colour, version in zip(_PALETTE, newest, strict=False):
        xs, ys = series[version]
        axes.plot(
            xs, ys, marker="o", markersize=3, linewidth=1.2, color=colour, label=f"v{version}"
        )
    if older:
        xs_older, ys_older = _joined(series, older)
        axes.plot(
            xs_older,
            ys_older,
            marker="o",
            markersize=2,
            linewidth=0.8,
            color=_OLDER_COLOUR,
            label=f"and {len(older)} older",
            zorder=1.5,
        )
    if None in series:
        xs, ys = series[None]
        axes.scatter(xs, ys, s=14, color=_MIGRATING_COLOUR, label=MIGRATING, zorder=3)
    changes = [
        current.batch_id
        for previous, current in itertools.pairwise(points)
        if current.version != previous.version
    ]
    if changes:
        axes.vlines(
            changes,
            0,
            1,
            transform=axes.get_xaxis_transform(),
            color="#555555",
            linewidth=0.8,
            linestyle=":",
        )
    if spec.reference is not None and series:
        axes.axhline(
            spec.reference,
            color="#333333",
            linewidth=0.8,
            linestyle="--",
            label=spec.reference_label,
        )
    if not series:
        axes.text(
            0.5,
            0.5,
            "no batches with rows yet",
            ha="center",
            va="center",
            transform=axes.transAxes,
            color="#666666",
        )
    if name == "locality":
        axes.set_ylim(-0.02, 1.02)
    axes.set_title(spec.title, fontsize=10)
    axes.set_xlabel("micro-batch")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(spec.ylabel)
    axes.grid(True, alpha=0.3)
    if series:
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return figure


def render_png(name: PlotName, points: Sequence[BatchPoint], *, dpi: int = 100) -> bytes:
    """:func:`plot_figure` as a PNG."""
    buffer = io.BytesIO()
    plot_figure(name, points, dpi=dpi).savefig(buffer, format="png")
    return buffer.getvalue()
