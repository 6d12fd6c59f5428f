// The keyplane dashboard: draws the JSON of api/state with ECharts (served from
// static/vendor, never a CDN). Every figure is computed by the server
// (keyplane.dashboard.view); this file only formats, filters by the chosen time
// range and draws. Values from records are inserted as text, never as HTML.
"use strict";

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22"];
const OLDER = "#d6cba6";
const MIGRATING = "#9a9a9a";
const charts = {};
let timer = null;
let last = null;

// --- formats: one way for each kind of number, everywhere on the page -------------
const intFmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const fmt = {
  int: (v) => (v == null ? "—" : intFmt.format(v)),
  ratio: (v) => (v == null ? "—" : v.toFixed(3)),
  pct: (v) => (v == null ? "—" : (v * 100).toFixed(1) + " %"),
  signed: (v) => (v == null ? "—" : (v >= 0 ? "+" : "") + v.toFixed(4)),
  seconds: (v) => (v == null ? "—" : v < 100 ? v.toFixed(1) + " s" : duration(v)),
  when: (ms) => (ms == null ? "—" : new Date(ms).toISOString().replace("T", " ").slice(0, 19) + " UTC"),
  time: (ms) => new Date(ms).toISOString().slice(11, 19),
};
function duration(s) {
  if (s == null) return "—";
  s = Math.round(s);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}
function plural(n, one, many) {
  return fmt.int(n) + " " + (n === 1 ? one : many || one + "s");
}
function instances(list) {
  return list.length === 1 ? String(list[0]) : "[" + list.join(", ") + "]";
}

// --- DOM helpers -----------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children.flat()) {
    if (child == null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
function td(value, cls) {
  return el("td", { class: cls }, value);
}
function table(id, headers, rows) {
  return el(
    "table",
    { id },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows)
  );
}
function fill(id, ...nodes) {
  const target = document.getElementById(id);
  target.replaceChildren(...nodes.flat().filter((n) => n != null));
}
function muted(text, id) {
  return el("p", { class: "muted", id }, text);
}
function link(href, text, cls, top) {
  return el("a", { href, class: cls, target: top ? "_top" : "_blank" }, text);
}

// --- time range ------------------------------------------------------------------
function rangeStart(state) {
  const seconds = Number(document.getElementById("range").value);
  return seconds > 0 ? state.generated_at - seconds * 1000 : null;
}
function inRange(items, start) {
  // Records without a start time (written by an older job) cannot be placed in time:
  // when none has one, the range does not apply; otherwise they show only under "all".
  if (start == null || !items.some((b) => b.t != null)) return items;
  return items.filter((b) => b.t != null && b.t >= start);
}

// --- charts ----------------------------------------------------------------------
function chart(id) {
  const node = document.getElementById(id);
  if (!charts[id]) charts[id] = echarts.init(node, null, { renderer: "canvas" });
  // No animation: a refresh every few seconds must redraw at once, not replay a transition.
  charts[id].setOption({ animation: false });
  return charts[id];
}
function colours(versions) {
  const newest = versions.slice(-PALETTE.length);
  const map = {};
  versions.forEach((v) => (map[v] = OLDER));
  newest.forEach((v, i) => (map[v] = PALETTE[i]));
  return map;
}
function lineChart(id, title, batches, value, opts) {
  const timed = batches.length > 0 && batches.every((b) => b.t != null);
  const versions = [...new Set(batches.map((b) => b.version).filter((v) => v != null))].sort((a, b) => a - b);
  const colour = colours(versions);
  const x = (b) => (timed ? b.t : b.batch);
  const series = versions.map((v) => ({
    name: "v" + v,
    type: "line",
    showSymbol: true,
    symbolSize: 4,
    color: colour[v],
    data: batches.filter((b) => b.version === v && value(b) != null).map((b) => [x(b), value(b), b.batch]),
  }));
  const mid = batches.filter((b) => b.version == null && value(b) != null);
  if (mid.length) {
    series.push({ name: "migrating", type: "scatter", color: MIGRATING, symbolSize: 6, data: mid.map((b) => [x(b), value(b), b.batch]) });
  }
  if (opts.reference != null && series.length) {
    series.push({ name: opts.referenceLabel, type: "line", color: "#333", symbol: "none", lineStyle: { type: "dashed", width: 1 }, data: [], markLine: { silent: true, symbol: "none", data: [{ yAxis: opts.reference }], lineStyle: { type: "dashed", color: "#333" }, label: { show: false } } });
  }
  chart(id).setOption(
    {
      title: { text: title, textStyle: { fontSize: 12 }, subtext: series.length ? "" : "no batches with rows in this range", subtextStyle: { color: "#666" } },
      grid: { left: 60, right: 110, top: 40, bottom: 50 },
      tooltip: { trigger: "item", formatter: (p) => `${p.seriesName} · batch ${p.data[2]}<br>${timed ? fmt.when(p.data[0]) : ""}<br>${opts.format(p.data[1])}` },
      legend: { type: "scroll", orient: "vertical", right: 0, top: 30, textStyle: { fontSize: 10 } },
      xAxis: timed ? { type: "time", name: "UTC", axisLabel: { formatter: (ms) => fmt.time(ms), hideOverlap: true } } : { type: "value", name: "micro-batch", minInterval: 1 },
      yAxis: { type: "value", name: opts.unit, min: opts.min, max: opts.max, scale: opts.min == null },
      dataZoom: [{ type: "inside" }],
      series,
    },
    true
  );
}

function drawCharts(state) {
  const batches = inRange(state.batches, rangeStart(state));
  const note = state.metrics.available
    ? `${plural(state.metrics.records, "metrics record")}; ${plural(batches.length, "batch", "batches")} with rows in the range, coloured by the version every stage ran (grey: mid-migration).`
    : "metrics unavailable: " + state.metrics.problem;
  fill("metrics-note", note);
  document.getElementById("metrics-note").id = "metrics-note";
  document.getElementById("metrics-note").className = state.metrics.available ? "muted" : "notice";
  lineChart("chart-locality", "Locality: share of tuples between stages on one executor", batches, (b) => b.locality, { unit: "share", min: 0, max: 1, format: fmt.pct });
  lineChart("chart-imbalance", "Imbalance: worst stage's max / mean instance load", batches, (b) => b.imbalance, { unit: "max / mean", min: 1, reference: 1, referenceLabel: "balanced", format: fmt.ratio });
  lineChart("chart-throughput", "Throughput", batches, (b) => b.rows_per_s, { unit: "rows / s", min: 0, format: (v) => fmt.int(v) + " rows/s" });
  lineChart("chart-lag", "Input lag", batches, (b) => b.lag, { unit: "records", min: 0, format: (v) => fmt.int(v) + " records" });
}

function drawHeatmaps(state) {
  const container = document.getElementById("heatmaps");
  const start = rangeStart(state);
  const wanted = state.heatmaps.map((h) => "heatmap-" + h.stage);
  for (const id of Object.keys(charts)) {
    if (id.startsWith("heatmap-") && !wanted.includes(id)) {
      charts[id].dispose();
      delete charts[id];
    }
  }
  if (!state.heatmaps.length) {
    container.replaceChildren(muted("no per-instance load reported yet", "no-heatmap"));
    return;
  }
  container.querySelectorAll(".muted").forEach((n) => n.remove());
  for (const heat of state.heatmaps) {
    const id = "heatmap-" + heat.stage;
    let node = document.getElementById(id);
    if (!node) {
      node = el("div", { class: "heatmap", id, "data-stage": heat.stage });
      container.append(node);
    }
    const shown = inRange(heat.batches.map((b, i) => ({ ...b, i })), start);
    const index = new Map(shown.map((b, j) => [b.i, j]));
    const cells = heat.cells.filter((c) => index.has(c[0])).map((c) => [index.get(c[0]), heat.instances.indexOf(c[1]), c[2]]);
    const timed = shown.every((b) => b.t != null);
    chart(id).setOption(
      {
        title: { text: `Stage ${heat.stage}: tuples per instance per batch`, textStyle: { fontSize: 12 } },
        grid: { left: 60, right: 90, top: 35, bottom: 45 },
        tooltip: { formatter: (p) => `instance ${heat.instances[p.data[1]]} · batch ${shown[p.data[0]].batch}<br>${timed ? fmt.when(shown[p.data[0]].t) : ""}<br>${fmt.int(p.data[2])} tuples (v${shown[p.data[0]].version ?? "?"})` },
        xAxis: { type: "category", name: timed ? "UTC" : "batch", data: shown.map((b) => (timed ? fmt.time(b.t) : String(b.batch))), axisLabel: { hideOverlap: true } },
        yAxis: { type: "category", name: "instance", data: heat.instances.map(String) },
        visualMap: { min: 0, max: Math.max(1, heat.max), calculable: true, orient: "vertical", right: 5, top: 30, itemHeight: 120, text: ["tuples", ""], inRange: { color: ["#f7fbff", "#6baed6", "#08306b"] } },
        series: [{ type: "heatmap", data: cells, progressive: 5000 }],
      },
      true
    );
  }
}

function drawPredicted(state) {
  const rows = state.locality;
  chart("chart-predicted").setOption(
    {
      title: { text: "Locality per version", textStyle: { fontSize: 12 }, subtext: rows.length ? "" : "no prediction or measurement yet" },
      grid: { left: 60, right: 110, top: 40, bottom: 30 },
      tooltip: { trigger: "axis", valueFormatter: fmt.pct },
      legend: { orient: "vertical", right: 0, top: 30 },
      xAxis: { type: "category", data: rows.map((r) => "v" + r.version) },
      yAxis: { type: "value", min: 0, max: 1, name: "share" },
      series: [
        { name: "predicted", type: "bar", color: "#9ecae1", data: rows.map((r) => r.predicted) },
        { name: "measured", type: "bar", color: "#2171b5", data: rows.map((r) => r.measured) },
      ],
    },
    true
  );
  fill(
    "per-version",
    state.summaries.length
      ? table(
          "per-version-table",
          ["version", "batches", "rows", "locality predicted", "locality measured", "imbalance", "rows/s", "lag"],
          state.summaries.map((s) => {
            const p = rows.find((r) => r.version === s.version);
            return el("tr", { "data-version": s.version }, td("v" + s.version), td(fmt.int(s.batches), "num"), td(fmt.int(s.rows), "num"), td(fmt.pct(p && p.predicted), "num"), td(fmt.pct(s.locality), "num"), td(fmt.ratio(s.imbalance), "num"), td(fmt.int(s.rows_per_s), "num"), td(fmt.int(s.lag), "num"));
          })
        )
      : muted("no batch ran wholly on one version yet")
  );
}

// --- panels ----------------------------------------------------------------------
function drawHeader(state) {
  const active = state.active_version == null ? "none" : "v" + state.active_version;
  document.getElementById("active-version").textContent = active;
  const live = document.getElementById("live");
  live.textContent = state.live ? "live" : state.active_version == null ? "" : "last known: job " + state.health.state;
  live.className = "badge " + (state.live ? "live" : "stale");
  document.getElementById("updated").textContent = fmt.when(state.generated_at);
  fill("data-docs-link", state.has_data_docs ? link("data-docs/index.html", "all Data Docs") : null);
  fill("problems", state.problems.map((p) => el("p", { class: "notice problem" }, p)));
}

function drawHealth(state) {
  const h = state.health;
  const facts = [
    ["state", el("span", { class: "badge " + h.state, id: "health-state" }, h.state)],
    ["last batch", h.last_batch == null ? "—" : `${fmt.int(h.last_batch)} at ${fmt.when(h.last_batch_at)}`],
    ["age of the last batch", h.last_batch_age_s == null ? "—" : duration(h.last_batch_age_s)],
    ["dead letters (retained)", fmt.int(h.dead_letters)],
    ["invalid events (records read)", fmt.int(h.invalid_events)],
  ];
  fill(
    "health",
    table("health-table", ["", ""], facts.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)))),
    h.reasons.map((r) => el("p", { class: "notice health-reason" }, r)),
    h.lag.length
      ? table("lag-table", ["partition", "end offset", "committed", "lag"], h.lag.map((p) => el("tr", {}, td(p.partition, "num"), td(fmt.int(p.end), "num"), td(fmt.int(p.committed), "num"), td(fmt.int(p.lag), "num"))))
      : muted("lag per partition unknown (no checkpoint commit visible, or Kafka not reachable)")
  );
}

function drawRollout(state) {
  const r = state.rollout;
  if (!r) {
    fill("rollout", muted("no rollout recorded by the controller"));
    return;
  }
  const steps = r.steps.map((s) =>
    el(
      "li",
      { class: "step " + (s.done ? (s.step === "ABORT" ? "aborted" : "done") : "pending"), "data-step": s.step, "data-stage": s.stage },
      s.step + (s.stage ? " " + s.stage : ""),
      el("span", { class: "when" }, s.at == null ? "waiting" : fmt.when(s.at))
    )
  );
  fill(
    "rollout",
    el("p", { id: "rollout-summary" }, `v${r.base} → v${r.version}: ${r.state}` + (r.seconds != null ? `, ${fmt.seconds(r.seconds)} from PREPARE to ${r.steps[r.steps.length - 1].step}` : "") + (r.states_moved != null ? `, ${plural(r.states_moved, "state")} moved` : "")),
    r.refused ? el("p", { class: "notice" }, "refused by the job: " + r.refused) : null,
    el("ol", { class: "steps", id: "rollout-steps" }, steps)
  );
}

function drawVersions(state) {
  const rows = state.versions.map((v) => {
    const validation = v.validation_summary
      ? el("details", {}, el("summary", { class: v.validation || "unreadable" }, v.validation || "—"), el("pre", {}, v.validation_summary))
      : v.validation || "—";
    const gain = el("span", {}, fmt.signed(v.gain), v.cost != null ? el("span", { class: "muted" }, ` (cost ${v.cost.toFixed(4)})`) : null, v.decision ? el("div", { class: "muted" }, v.decision) : null);
    const migration = v.migration ? el("span", {}, v.migration, el("span", { class: "muted" }, ` [${v.migration_source}]`)) : "—";
    const run = v.run_id ? (v.run_url ? link(v.run_url, v.run_id, "run", true) : v.run_id) : "—";
    const docs = v.data_docs.length ? v.data_docs.map((d) => el("div", {}, link("data-docs/" + d.path, d.label, "data-docs"))) : "—";
    return el(
      "tr",
      { class: "version-row status-" + v.status.replace(/ /g, "-"), "data-version": v.version },
      td(el("b", {}, "v" + v.version)),
      td(v.parent == null ? "—" : "v" + v.parent),
      td(fmt.when(v.created_at), "when"),
      td(v.created_by),
      td(el("span", {}, v.status, v.problem ? el("div", {}, v.problem) : null)),
      td(validation),
      td(gain),
      td(fmt.pct(v.predicted_locality), "num"),
      td(migration),
      td(v.rollback || "—"),
      td(run),
      td(docs)
    );
  });
  fill(
    "versions",
    table("timeline", ["version", "parent", "created at", "created by", "status", "validation", "backtest gain", "predicted locality", "migration", "rollback", "run", "Data Docs"], rows),
    state.hidden_versions ? muted(`${plural(state.hidden_versions, "planned version")} not published ${state.hidden_versions === 1 ? "is" : "are"} not listed (keyplane config list --all shows them).`, "hidden-versions") : null
  );
}

function drawRouting(state) {
  const r = state.routing;
  if (!r) {
    fill("routing", muted("the active version's configuration is not readable"));
    return;
  }
  fill(
    "routing",
    r.stages.map((s) =>
      el(
        "div",
        { class: "routing-stage", "data-stage": s.stage },
        el("h3", {}, `Stage ${s.stage} (v${r.version}): ${plural(s.active.length, "active instance")} of ${fmt.int(s.parallelism)}; ${plural(s.table_keys, "pinned key")}, ${plural(s.hot_keys, "hot key")}; share left to the hash fallback: ${fmt.pct(s.hash_share)}`),
        table("routing-" + s.stage, ["instance", "pinned keys", "hot keys split onto it"], s.instances.map((i) => el("tr", { class: "routing-row" }, td(i.instance, "num"), td(fmt.int(i.pinned), "num"), td(fmt.int(i.hot), "num"))))
      )
    )
  );
}

function drawDiff(state) {
  const d = state.diff;
  fill(
    "diff",
    d
      ? table(
          "version-diff",
          [`stage (v${d.from} → v${d.to})`, "active instances", "pinned keys added", "removed", "moved", "hot keys added", "hot keys removed"],
          d.stages.map((s) => el("tr", { "data-stage": s.stage }, td(s.stage), td(`${s.active[0] ? instances(s.active[0]) : "—"} → ${s.active[1] ? instances(s.active[1]) : "—"}`), td(fmt.int(s.pinned_added), "num"), td(fmt.int(s.pinned_removed), "num"), td(fmt.int(s.pinned_moved), "num"), td(s.hot_added.join(", ") || "—"), td(s.hot_removed.join(", ") || "—")))
        )
      : muted("no migration between two readable versions")
  );
  if (state.moved_keys == null) {
    fill("moved", muted("— (see the problems above)", "moved-keys-unknown"));
  } else if (!state.moved_keys.length) {
    fill("moved", muted("no key moved"));
  } else {
    fill(
      "moved",
      el("h3", {}, "Top moved keys (ranked by the weight in the snapshot the new version was planned from)"),
      table("moved-keys", ["stage", "key", "instances", "kind", "weight"], state.moved_keys.map((m) => el("tr", { class: "moved-key" }, td(m.stage), td(el("code", {}, m.key)), td(`${instances(m.old)} → ${instances(m.new)}`), td(m.kind), td(fmt.int(m.weight), "num"))))
    );
  }
}

function drawHot(state) {
  fill(
    "hot",
    state.hot_keys.length
      ? table("hot-keys", ["stage", "key", "split d", "instances", "weight (last snapshot)"], state.hot_keys.map((h) => el("tr", { class: "hot-key" }, td(h.stage), td(el("code", {}, h.key)), td(fmt.int(h.split), "num"), td(instances(h.instances)), td(fmt.int(h.weight), "num"))))
      : muted("no hot keys")
  );
}

function drawQuality(state) {
  fill(
    "quality",
    state.quality.length
      ? table(
          "quality-table",
          ["version", "created at", "verdict", "summary", "Data Docs"],
          state.quality.map((q) =>
            el("tr", { class: "quality-row", "data-version": q.version }, td("v" + q.version), td(fmt.when(q.at), "when"), td(q.success == null ? "—" : q.success ? "passed" : "failed", q.success ? "passed" : "failed"), td(q.summary ? el("details", {}, el("summary", {}, q.summary.split("\n")[0]), el("pre", {}, q.summary)) : "—"), td(q.data_docs.length ? q.data_docs.map((d) => el("div", {}, link("data-docs/" + d.path, d.label, "data-docs"))) : "—"))
          )
        )
      : muted("no validation recorded yet")
  );
}

function drawFailed(state) {
  if (state.failed_runs == null) {
    fill("failed", muted("Airflow's run history could not be read"));
    return;
  }
  fill(
    "failed",
    state.failed_runs.length
      ? table(
          "failed-runs",
          ["DAG", "run", "ended", "failed tasks (log)"],
          state.failed_runs.map((r) => el("tr", { class: "failed-run" }, td(r.dag_id), td(link(r.url, r.run_id, "run", true)), td(fmt.when(r.ended_at), "when"), td(r.tasks.length ? r.tasks.map((t) => el("div", {}, link(t.url, t.task_id + (t.map_index >= 0 ? `[${t.map_index}]` : ""), "task-log", true))) : "—")))
        )
      : muted("no failed run of keyplane's DAGs", "no-failed-runs")
  );
}

function draw(state) {
  drawHeader(state);
  drawHealth(state);
  drawRollout(state);
  drawCharts(state);
  drawHeatmaps(state);
  drawPredicted(state);
  drawVersions(state);
  drawRouting(state);
  drawDiff(state);
  drawHot(state);
  drawQuality(state);
  drawFailed(state);
  document.body.dataset.loaded = String(state.generated_at);
}

async function refresh() {
  try {
    const response = await fetch("api/state", { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(`api/state answered ${response.status}`);
    last = await response.json();
    draw(last);
  } catch (error) {
    fill("problems", el("p", { class: "notice problem", id: "refresh-failed" }, "refresh failed: " + error.message));
  }
}

function schedule() {
  if (timer) clearInterval(timer);
  const seconds = Number(document.getElementById("refresh").value);
  timer = seconds > 0 ? setInterval(refresh, seconds * 1000) : null;
}

document.getElementById("range").addEventListener("change", () => last && draw(last));
document.getElementById("refresh").addEventListener("change", schedule);
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));
refresh();
schedule();
