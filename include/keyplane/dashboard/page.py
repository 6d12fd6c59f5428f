"""The dashboard as one HTML page: tables from stored records, plots as PNG links.

Plain HTML with inline CSS, so the page needs no build and renders the same
inside the Airflow UI's iframe and on its own. All links are relative (the
page is served at ``<prefix>/``), so it works under any URL prefix or proxy.
Every value from a record is escaped: keys are user data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from html import escape
from urllib.parse import quote

from keyplane.dashboard.metrics import MetricsRead, VersionSummary
from keyplane.dashboard.plots import PLOTS
from keyplane.dashboard.timeline import Dashboard, HotKeyRow, MovedKeyRow, VersionRow

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.2em; color: #1b1b1b; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status-active { background: #e3f4e3; }
.status-in-flight { background: #fff6d6; }
.status-rolled-back, .status-refused, .status-aborted { background: #fde8e8; }
.passed { color: #17702a; } .failed { color: #b3261e; }
.notice { background: #fff6d6; border: 1px solid #e6c84f; padding: 6px 10px; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plots img { border: 1px solid #ddd; max-width: 100%; }
.muted { color: #666; }
details summary { cursor: pointer; }
pre { white-space: pre-wrap; font-size: 0.9em; margin: 0.3em 0; }
"""


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if value is None else fmt.format(value)


def _cell(text: str, css: str | None = None) -> str:
    return f'<td class="{css}">{text}</td>' if css else f"<td>{text}</td>"


def _instances(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else "[" + ", ".join(map(str, values)) + "]"


def _when(value: datetime | None) -> str:
    return "—" if value is None else escape(value.strftime("%Y-%m-%d %H:%M:%S %Z"))


def _timeline_row(row: VersionRow) -> str:
    validation = "—" if row.validation is None else escape(row.validation)
    if row.validation_summary:
        verdict = escape(row.validation or "unreadable")
        validation = (
            f"<details><summary class='{verdict}'>{validation}</summary>"
            f"<pre>{escape(row.validation_summary)}</pre></details>"
        )
    gain = _num(row.gain, "{:+.4f}")
    if row.cost is not None:
        gain += f" <span class='muted'>(cost {row.cost:.4f})</span>"
    if row.decision:
        gain += f"<br><span class='muted'>{escape(row.decision)}</span>"
    migration = "—" if row.migration is None else escape(row.migration.detail)
    if row.migration is not None:
        migration += f" <span class='muted'>[{row.migration.source}]</span>"
    docs = (
        "<br>".join(
            f'<a class="data-docs" href="data-docs/{escape(link.path)}" target="_blank">'
            f"{escape(link.label)}</a>"
            for link in row.data_docs
        )
        or "—"
    )
    parent = "—" if row.parent_version is None else f"v{row.parent_version}"
    status = escape(row.status) + (f"<br>{escape(row.problem)}" if row.problem else "")
    css = "status-" + row.status.replace(" ", "-")
    return (
        f'<tr class="version-row {css}" data-version="{row.version}">'
        + _cell(f"<b>v{row.version}</b>")
        + _cell(parent)
        + _cell(_when(row.created_at))
        + _cell(escape(row.created_by))
        + _cell(status)
        + _cell(validation)
        + _cell(gain)
        + _cell(migration)
        + _cell(escape(row.rollback) if row.rollback else "—")
        + _cell(_run_link(row))
        + _cell(docs)
        + "</tr>"
    )


def _run_link(row: VersionRow) -> str:
    """The run that stored the version, linked to its page in the Airflow UI."""
    if not row.run_id:
        return "—"
    if not row.dag_id:
        return escape(row.run_id)
    href = f"/dags/{quote(row.dag_id, safe='')}/runs/{quote(row.run_id, safe='')}"
    return f'<a class="run" href="{escape(href)}">{escape(row.run_id)}</a>'


def _table(headers: Iterable[str], rows: Iterable[str], table_id: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _summary_rows(summaries: Sequence[VersionSummary]) -> list[str]:
    return [
        f'<tr data-version="{s.version}">'
        + _cell(f"v{s.version}")
        + _cell(str(s.batches), "num")
        + _cell(str(s.rows), "num")
        + _cell(_num(s.locality), "num")
        + _cell(_num(s.imbalance), "num")
        + _cell(_num(s.rows_per_s, "{:,.0f}"), "num")
        + _cell(_num(s.lag, "{:,.0f}"), "num")
        + "</tr>"
        for s in summaries
    ]


def _hot_rows(rows: Sequence[HotKeyRow]) -> list[str]:
    return [
        "<tr class='hot-key'>"
        + _cell(escape(r.operator))
        + _cell(f"<code>{escape(r.key)}</code>")
        + _cell(str(r.split), "num")
        + _cell(_instances(r.instances))
        + _cell(_num(r.weight, "{:,.0f}"), "num")
        + "</tr>"
        for r in rows
    ]


def _moved_rows(rows: Sequence[MovedKeyRow]) -> list[str]:
    return [
        "<tr class='moved-key'>"
        + _cell(escape(r.operator))
        + _cell(f"<code>{escape(r.key)}</code>")
        + _cell(f"{_instances(r.old)} → {_instances(r.new)}")
        + _cell(escape(r.kind))
        + _cell(_num(r.weight, "{:,.0f}"), "num")
        + "</tr>"
        for r in rows
    ]


def render_page(
    dashboard: Dashboard,
    metrics: MetricsRead,
    summaries: Sequence[VersionSummary],
    *,
    generated_at: datetime,
    metrics_topic: str,
    has_data_docs: bool,
) -> str:
    """The whole page. ``summaries`` are the per-version figures of ``metrics``."""
    active = "none" if dashboard.active_version is None else f"v{dashboard.active_version}"
    docs = " · <a href='data-docs/index.html' target='_blank'>all Data Docs</a>"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>keyplane: routing dashboard</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>keyplane: routing dashboard</h1>",
        f"<p>Active version: <b id='active-version'>{escape(active)}</b> · "
        f"read at {_when(generated_at)} · metrics topic <code>{escape(metrics_topic)}</code>"
        + (docs if has_data_docs else "")
        + "</p>",
    ]
    parts.extend(f"<p class='notice problem'>{escape(p)}</p>" for p in dashboard.problems)
    parts.append("<h2>Configuration versions</h2>")
    parts.append(
        _table(
            [
                "version",
                "parent",
                "created at",
                "created by",
                "status",
                "validation",
                "backtest gain",
                "migration",
                "rollback",
                "run",
                "Data Docs",
            ],
            (_timeline_row(r) for r in dashboard.rows),
            "timeline",
        )
    )
    if dashboard.hidden:
        parts.append(
            f"<p class='muted' id='hidden-versions'>{dashboard.hidden} planned "
            f"{'version' if dashboard.hidden == 1 else 'versions'} not published are not "
            "listed (<code>keyplane config list --all</code> shows them).</p>"
        )
    parts.append("<h2>Measured per version</h2>")
    if not metrics.available:
        parts.append(
            f"<p class='notice' id='metrics-unavailable'>metrics unavailable: "
            f"{escape(metrics.problem or '')}</p>"
        )
    else:
        parts.append(
            f"<p class='muted'>{len(metrics.records)} metrics records; batches that routed "
            "events, coloured by the version all operators ran; grey: mid-migration.</p>"
        )
        parts.append(
            _table(
                ["version", "batches", "rows", "locality", "imbalance", "rows/s", "lag"],
                _summary_rows(summaries),
                "per-version",
            )
        )
        parts.append("<div class='plots'>")
        parts.extend(
            f'<img class="plot" id="plot-{name}" src="plots/{name}.png" alt="{escape(spec.title)}" '
            'width="640" height="320">'
            for name, spec in PLOTS.items()
        )
        parts.append("</div>")
    parts.append("<h2>Hot keys of the active version</h2>")
    if dashboard.hot_keys:
        parts.append(
            _table(
                ["operator", "key", "split d", "instances", "weight (last snapshot)"],
                _hot_rows(dashboard.hot_keys),
                "hot-keys",
            )
        )
    else:
        parts.append("<p class='muted'>no hot keys</p>")
    if dashboard.moved_from is not None and dashboard.moved_to is not None:
        parts.append(
            f"<h2>Top moved keys of the last migration "
            f"(v{dashboard.moved_from} → v{dashboard.moved_to})</h2>"
        )
        if dashboard.moved_keys is None:
            parts.append("<p class='muted' id='moved-keys-unknown'>— (see the problems above)</p>")
        elif dashboard.moved_keys:
            parts.append(
                _table(
                    ["operator", "key", "instances", "kind", "weight (last snapshot)"],
                    _moved_rows(dashboard.moved_keys),
                    "moved-keys",
                )
            )
        else:
            parts.append("<p class='muted'>no key moved</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
