// The dashboard: polls /status every 5 s and keeps the last hour of samples
// itself, asking the server only for samples newer than the ones it has.
"use strict";

const POLL_MS = 5000;
const HOUR = 3600;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = { requests: "#1565c0", success: "#2e7d32", errors: "#c62828", limit: "#9ca3af" };
const EXPECTED = /^(200|3\d\d|404|410|UnidentifiedImageError|RobotsDisallowed|OptedOut|robots-[a-z-]+|tdmrep-[a-z]+|x-robots-tag|content-usage-header)$/

let history = [];
let lastSample = 0;

// Build DOM nodes from text only, never HTML: source names come from Redis.
function el(tag, attrs = {}, ...children) {
  const node = attrs.svg ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (k !== "svg") node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function fmt(x, digits = 1) {
  if (x === null || x === undefined) return "–";
  return Number(x).toLocaleString(undefined, { maximumFractionDigits: digits });
}

// 1, 2, 2.5 or 5 times a power of ten: round numbers on the axis.
function niceCeiling(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map(m => m * p).find(m => m >= v);
}

// Line chart of series [{color, dash, points: [[t, v|null]]}] over the last hour.
function drawChart(svg, series, now, { width, height, labels }) {
  svg.replaceChildren();
  const pad = labels ? { l: 44, r: 10, t: 10, b: 22 } : { l: 1, r: 1, t: 2, b: 2 };
  const values = series.flatMap(s => s.points.map(p => p[1])).filter(v => v !== null);
  const ymax = niceCeiling(Math.max(1, ...values) * 1.05);
  const x = t => pad.l + (width - pad.l - pad.r) * (t - (now - HOUR)) / HOUR;
  const y = v => height - pad.b - (height - pad.t - pad.b) * v / ymax;
  if (labels) {
    for (let i = 0; i <= 4; i++) {
      const v = ymax * i / 4;
      svg.append(el("line", { svg: 1, x1: pad.l, x2: width - pad.r, y1: y(v), y2: y(v), stroke: "#e5e7eb" }));
      svg.append(el("text", { svg: 1, x: pad.l - 6, y: y(v) + 4, "text-anchor": "end" }, fmt(v)));
    }
    for (const m of [60, 45, 30, 15, 0]) {
      svg.append(el("text", { svg: 1, x: x(now - m * 60), y: height - 6, "text-anchor": "middle" },
        m ? `-${m} min` : "now"));
    }
  }
  for (const s of series) {
    // A null value (no data) breaks the line instead of drawing it down to zero.
    let run = [];
    const flush = () => {
      if (run.length > 1) svg.append(el("polyline", { svg: 1, points: run.join(" "), fill: "none",
        stroke: s.color, "stroke-width": labels ? 2 : 1.5, "stroke-dasharray": s.dash || "none" }));
      if (run.length === 1) {  // a lone sample (a fresh server) is a dot, not nothing
        const [cx, cy] = run[0].split(",");
        svg.append(el("circle", { svg: 1, cx, cy, r: labels ? 3 : 2, fill: s.color }));
      }
      run = [];
    };
    for (const [t, v] of s.points) {
      if (v === null || v === undefined || t < now - HOUR) flush();
      else run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    }
    flush();
  }
}

function totalRequestsRps(sample) {
  return sample.requests_rps === undefined ? null : sample.requests_rps;
}

function renderChart(now) {
  const general = key => history.map(s => [s.time, s.general ? s.general[key] : null]);
  const series = [
    { name: "requests/s", color: COLORS.requests, points: history.map(s => [s.time, totalRequestsRps(s)]) },
    { name: "successes/s", color: COLORS.success, points: general("success_rps") },
    { name: "errors/s", color: COLORS.errors, points: general("error_rps") },
    { name: "max req/s allowed", color: COLORS.limit, dash: "6 4", points: general("global_max_rps") },
  ];
  drawChart(document.getElementById("chart"), series, now, { width: 900, height: 220, labels: true });
  document.getElementById("legend").replaceChildren(...series.map(s =>
    el("span", {}, el("i", { style: `background:${s.color}` }), s.name)));
}

function renderGeneral(update, sources) {
  const g = (update && update.general) || {};
  const halted = Object.entries(sources || {}).filter(([, s]) => s.halted).map(([n]) => n);
  const cards = [
    ["Max req/s allowed", fmt(g.global_max_rps)], ["Successes/s", fmt(g.success_rps, 2)],
    ["Errors/s", fmt(g.error_rps, 2), g.error_rps > 0], ["Processing/s", fmt(g.processing_rate, 2)],
    ["Resized", fmt(g.num_resized, 0)], ["Errors", fmt(g.resize_errors, 0)],
    ["Split/s", fmt(g.split_rate, 1)], ["Halted", !sources ? "–" : halted.length ? halted.join(", ") : "none", halted.length],
    ["Opted out", fmt(Object.values(g.opted_out || {}).reduce((a, b) => a + b, 0), 0)],
  ];
  document.getElementById("general").replaceChildren(...cards.map(([label, value, bad]) =>
    el("div", { class: bad ? "card bad" : "card" }, el("div", { class: "label" }, label),
      el("div", { class: "value" }, value))));
}

function statusList(counts, cls) {
  const entries = Object.entries(counts || {}).sort((a, b) => b[1] - a[1]);
  if (!entries.length) return el("span", { class: "muted" }, "none");
  const span = el("span", { class: cls });
  entries.forEach(([status, n], i) => {
    if (i) span.append(" ");
    span.append(el("span", { class: EXPECTED.test(status) ? "" : "bad" }, `${status}×${fmt(n, 0)}`));
  });
  return span;
}

function sourceRow(name, s, specific, now) {
  const state = s.halted ? ["halted", "halted"] : s.temp_halted ? ["paused", "paused"] : ["ok", "ok"];
  // The limit is the computed or overridden rate; the ceiling the most the adaptive back-off
  // may allow (above the limit while capacity discovery may raise the source to it).
  const known = v => v !== null && v !== undefined;
  const own = known(s.limit) ? s.limit : known(s.ceiling) ? s.ceiling : s.rate_limit;
  const ceiling = known(s.ceiling) ? s.ceiling : own;
  const limit = el("td", { class: "num" }, fmt(own, 2));
  const top = el("td", { class: "num" }, fmt(ceiling, 2));
  if (known(own) && ceiling > own) top.append(el("span", { class: "override" }, "discovery"));
  if (s.override !== null) limit.append(el("span", { class: "override" }, `override ${fmt(s.override, 2)}`));
  const allowed = el("td", { class: "num" }, fmt(s.rate_limit, 2));
  if (s.adaptive === false) allowed.append(el("span", { class: "override" }, "adaptation off"));
  else if (s.rate_limit !== null && own && s.rate_limit < own && !s.halted && !s.temp_halted)
    allowed.classList.add("slowed");
  const response = el("td", { class: "num" }, `${fmt(s.baseline_ms, 0)} / ${fmt(s.recent_ms, 0)}`);
  const use = ceiling && s.achieved_rps !== null ? Math.min(1, s.achieved_rps / ceiling) : 0;
  const errorCell = el("td", { class: "errors" }, s.error_total ? `${fmt(s.error_total, 0)}: ` : "");
  errorCell.append(statusList(s.errors, "errors"));
  const spark = el("svg", { svg: 1, viewBox: "0 0 140 28", width: 140, height: 28 });
  const points = key => history.map(h => [h.time, h.sources && h.sources[name] ? h.sources[name][key] : null]);
  drawChart(spark, [{ color: COLORS.limit, dash: "3 2", points: points("rate_limit") },
    { color: COLORS.requests, points: points("rps") }], now, { width: 140, height: 28 });
  return el("tr", { "data-source": name },
    el("td", {}, el("strong", {}, name)),
    el("td", {}, el("span", { class: `badge ${state[1]}` }, state[0])),
    limit,
    top,
    allowed,
    response,
    el("td", { class: "num" }, fmt(s.achieved_rps, 2)),
    el("td", { title: `${Math.round(use * 100)}% of the ceiling` },
      el("div", { class: "bar" }, el("span", { style: `width:${(use * 100).toFixed(0)}%` }))),
    el("td", { class: "num" }, fmt(s.successes, 0)),
    el("td", { class: "num" }, fmt(s.backlog, 0)),
    errorCell,
    el("td", { class: "opted-out" }, statusList(s.opted_out, "statuses")),
    el("td", {}, statusList(specific && specific.last_50_statuses, "statuses")),
    el("td", { class: "num" }, fmt(s.tokens, 0)),
    el("td", {}, spark));
}

function renderSources(update, sources, now) {
  const body = document.querySelector("#sources tbody");
  const names = Object.keys(sources || {}).sort();
  if (!names.length) return;
  const specific = (update && update.specific) || {};
  body.replaceChildren(...names.map(n => sourceRow(n, sources[n], specific[n], now)));
}

async function poll() {
  const banner = document.getElementById("banner");
  try {
    const response = await fetch(`/status?since=${lastSample}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`/status answered ${response.status}`);
    const status = await response.json();
    const now = status.server_time;
    history = history.concat(status.history).filter(s => s.time >= now - HOUR);
    if (history.length) lastSample = history[history.length - 1].time;
    const update = status.event ? status : null;
    banner.hidden = !status.redis_error;
    banner.textContent = status.redis_error ? `Redis is unreachable: ${status.redis_error}` : "";
    document.getElementById("updated").textContent = update
      ? `last update ${new Date(update.time).toLocaleTimeString()} · refreshed ${new Date().toLocaleTimeString()}`
      : `no monitoring_update yet · refreshed ${new Date().toLocaleTimeString()}`;
    renderGeneral(update, status.sources);
    renderChart(now);
    renderSources(update, status.sources, now);
    const omitted = document.getElementById("omitted");
    omitted.hidden = !status.sources_omitted;
    omitted.textContent = status.sources_omitted
      ? `and ${fmt(status.sources_omitted, 0)} more sources, quiet for 10 minutes or past the 1,000 shown ` +
        "(python -m crawl_monitor.ctl status lists every source)" : "";
  } catch (err) {
    banner.hidden = false;
    banner.textContent = `Cannot reach the monitor: ${err.message}`;
  }
}

poll();
setInterval(poll, POLL_MS);
