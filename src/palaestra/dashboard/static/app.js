// The dashboard page: the runs list at "/", one run at "/runs/<id>". Data comes from /api/...;
// a live run is polled until it ends. Text from runs (responses, logs, errors) is only ever
// set as textContent, never parsed as HTML.
"use strict";

const POLL_MS = 1500;
const STATES = ["running", "completed", "failed", "stopped", "pending"];
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(`${response.status}: ${detail}`);
  }
  return response.json();
}

const fmt = {
  num(v, digits = 3) {
    if (v === null || v === undefined) return "–";
    return typeof v === "number" ? PalaestraChart.format(+v.toFixed(digits)) : String(v);
  },
  time(t) {
    if (!t) return "–";
    const d = new Date(t * 1000), p = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
  },
  duration(s) {
    if (s === null || s === undefined) return "–";
    s = Math.round(s);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} m ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} m`;
  },
  steps(run) {
    return run.total_steps ? `${run.step} / ${run.total_steps}` : String(run.step);
  },
};

const stateBadge = (state) => h("span", { class: `state state-${state}` }, state);
const runLink = (id) => h("a", { href: `/runs/${encodeURIComponent(id)}` }, id);
const live = (on) => { document.getElementById("live").hidden = !on; };

// One pending poll at a time; a failed fetch (server restarting) tries again next period.
// Each rendered view has a number: a fetch that returns after the view was replaced (a
// filter clicked mid-poll) neither renders nor schedules another poll.
let timer = null, currentView = 0;
function poll(fn, ms = POLL_MS) {
  clearTimeout(timer);
  timer = setTimeout(() => fn().catch(() => poll(fn, ms)), ms);
}
function newView() {
  clearTimeout(timer);
  return ++currentView;
}

// Evals -------------------------------------------------------------------------------------

function evalsTable(evals, showRun) {
  if (!evals.length) return h("p", { class: "empty" }, "No evals.");
  const table = h("table", { class: "evals" },
    h("tr", {}, h("th", {}, "created"), showRun ? h("th", {}, "model") : null,
      h("th", {}, "checkpoint"), h("th", {}, "dataset"), h("th", {}, "endpoint"),
      h("th", { class: "num" }, "mean"), h("th", { class: "num" }, "rows"), h("th", {}, "")));
  for (const e of evals) {
    const rowsCell = h("td", {});
    const row = h("tr", {}, h("td", {}, fmt.time(e.created_at)), showRun ? h("td", {}, e.model || "–") : null,
      h("td", { class: "mono" }, e.step !== null && e.step !== undefined ? `step ${e.step}` : (e.checkpoint || "base")),
      h("td", {}, e.dataset || "–"), h("td", {}, e.endpoint || "–"),
      h("td", { class: "num eval-mean" }, fmt.num(e.mean)), h("td", { class: "num" }, e.total ?? "–"), rowsCell);
    const detail = h("tr", { hidden: true }, h("td", { colspan: 8 }));
    rowsCell.appendChild(h("a", { href: "#", onclick: async (ev) => {
      ev.preventDefault();
      if (detail.hidden && !detail.dataset.loaded) {
        const full = await getJSON(`/api/evals/${encodeURIComponent(e.id)}`);
        detail.firstChild.appendChild(evalRows(full.rows || []));
        detail.dataset.loaded = "1";
      }
      detail.hidden = !detail.hidden;
    } }, "rows"));
    table.append(row, detail);
  }
  return table;
}

function evalRows(rows) {
  return h("table", { class: "eval-rows" },
    h("tr", {}, h("th", {}, "prompt"), h("th", {}, "response"), h("th", { class: "num" }, "score")),
    rows.map((r) => h("tr", {}, h("td", {}, h("pre", { class: "response prompt-text" }, r.prompt ?? "")),
      h("td", {}, h("pre", { class: "response" }, r.response ?? "")), h("td", { class: "num" }, fmt.num(r.score)))));
}

function endpointsTable(endpoints) {
  if (!endpoints.length) return h("p", { class: "empty" }, "No endpoints running.");
  return h("table", { class: "endpoints" },
    h("tr", {}, ["name", "url", "model", "checkpoint", "started", "auth"].map((c) => h("th", {}, c))),
    endpoints.map((e) => h("tr", {}, h("td", {}, e.name), h("td", { class: "mono endpoint-url" }, e.url || "–"),
      h("td", {}, e.model || "–"),
      h("td", {}, e.run_id ? [runLink(e.run_id), e.step !== null ? ` step ${e.step}` : ""] : (e.checkpoint || "base model")),
      h("td", {}, fmt.time(e.started_at)), h("td", {}, e.authenticated ? "key" : "none"))));
}

// Runs page ---------------------------------------------------------------------------------

async function runsPage() {
  const app = document.getElementById("app");
  const status = new URLSearchParams(location.search).get("status") || "";
  const filters = h("div", { class: "filters" }, ["", ...STATES].map((s) =>
    h("button", { class: s === status ? "active" : null, "data-status": s || "all", onclick: () => {
      history.replaceState(null, "", s ? `/?status=${s}` : "/");
      runsPage();
    } }, s || "all")));
  const body = h("div", {});
  app.replaceChildren(h("h1", {}, "Runs"), filters, body);
  const view = newView();

  async function refresh() {
    const query = status ? `?status=${encodeURIComponent(status)}` : "";
    const [runs, endpoints, evals] = await Promise.all([
      getJSON(`/api/runs${query}`), getJSON("/api/endpoints"), getJSON("/api/evals")]);
    if (view !== currentView) return;
    const evalsByRun = {};
    for (const e of evals) if (e.run_id) (evalsByRun[e.run_id] ||= []).push(e);
    const table = h("table", { id: "runs" },
      h("tr", {}, h("th", {}, "run"), h("th", {}, "status"), h("th", {}, "model"), h("th", {}, "dataset"),
        h("th", { class: "num" }, "step"), h("th", { class: "num" }, "reward"), h("th", {}, "started"),
        h("th", { class: "num" }, "duration"), h("th", { class: "num" }, "eval")),
      runs.map((r) => h("tr", { "data-run": r.run_id }, h("td", { class: "mono" }, runLink(r.run_id)),
        h("td", {}, stateBadge(r.state)), h("td", {}, r.model), h("td", {}, r.dataset),
        h("td", { class: "num" }, fmt.steps(r)), h("td", { class: "num" }, fmt.num(r.reward_mean)),
        h("td", {}, fmt.time(r.started_at || r.created_at)), h("td", { class: "num" }, fmt.duration(r.duration_s)),
        h("td", { class: "num" }, evalsByRun[r.run_id] ? fmt.num(evalsByRun[r.run_id][0].mean) : "–"))));
    body.replaceChildren(
      runs.length ? table : h("p", { class: "empty" }, status ? `No ${status} runs.` : "No runs yet."),
      h("h2", {}, "Endpoints"), endpointsTable(endpoints),
      h("h2", {}, "Base-model evals"), evalsTable(evals.filter((e) => !e.run_id), true));
    const anyLive = runs.some((r) => r.state === "running" || r.state === "pending");
    live(anyLive);
    poll(refresh, anyLive ? POLL_MS : 3 * POLL_MS);
  }
  await refresh();
}

// Run page ----------------------------------------------------------------------------------

const CHARTS = [
  { id: "reward", title: "Reward", keys: ["reward_mean", "eval_reward_mean"] },
  { id: "loss", title: "Loss", keys: ["loss"] },
  { id: "kl", title: "KL", keys: ["kl"] },
  { id: "entropy", title: "Entropy", keys: ["entropy"] },
  { id: "length", title: "Response length (tokens)", keys: ["response_length_mean", "response_length_max"] },
  { id: "timing", title: "Step time (s)", keys: ["rollout_s", "reward_s", "train_s", "save_s"] },
  { id: "grad_norm", title: "Gradient norm", keys: ["grad_norm"] },
];

function points(metrics, key) {
  return metrics.filter((m) => typeof m[key] === "number").map((m) => [m.step, m[key]]);
}

function renderCharts(container, metrics) {
  const figures = [];
  for (const chart of CHARTS) {
    const series = chart.keys.map((key, i) => ({ name: key, color: COLORS[i], points: points(metrics, key) }))
      .filter((s) => s.points.length);
    if (!series.length) continue;
    let bands = [];
    if (chart.id === "reward") {
      const rows = metrics.filter((m) => typeof m.reward_mean === "number");
      const std = (m) => m.reward_std || 0;
      bands = [
        { color: COLORS[0], opacity: 0.08, lo: points(rows, "reward_min"), hi: points(rows, "reward_max") },
        { color: COLORS[0], opacity: 0.2, lo: rows.map((m) => [m.step, m.reward_mean - std(m)]),
          hi: rows.map((m) => [m.step, m.reward_mean + std(m)]) },
      ];
    }
    const legend = h("div", { class: "legend" }, series.map((s) => h("span", {}, h("i", { style: `background:${s.color}` }), s.name)),
      chart.id === "reward" ? h("span", {}, "band: ± std, min–max") : null);
    figures.push(h("figure", { class: "chart", "data-chart": chart.id },
      h("figcaption", {}, chart.title), legend, PalaestraChart.line(series, bands)));
  }
  container.replaceChildren(...(figures.length ? figures : [h("p", { class: "empty" }, "No steps yet.")]));
}

function promptSnippet(text) {
  const clean = String(text || "").replace(/<\|[^|]*\|>/g, " ").replace(/\s+/g, " ").trim();
  return clean.length > 40 ? "…" + clean.slice(-40) : clean;
}

// Traces: every sample of the chosen step, grouped by prompt or sorted by a numeric column.
function tracesView() {
  const root = h("div", { id: "traces" });
  const state = { runId: null, step: null, follow: true, sort: null, desc: true, data: null };

  function sortedRows() {
    const rows = state.data.samples.slice();
    if (!state.sort) rows.sort((a, b) => a.index - b.index || a.group_index - b.group_index);
    else {
      const value = (r) => state.sort.startsWith("meta:") ? (r.metadata || {})[state.sort.slice(5)] : r[state.sort];
      rows.sort((a, b) => (state.desc ? -1 : 1) * ((value(a) ?? -Infinity) - (value(b) ?? -Infinity)));
    }
    return rows;
  }

  function render() {
    const data = state.data;
    const select = h("select", { id: "trace-step", onchange: (ev) => {
      state.step = +ev.target.value;
      state.follow = state.step === data.steps[data.steps.length - 1];
      load();
    } }, data.steps.map((s) => h("option", { value: s, selected: s === data.step }, `step ${s}`)));
    const metaKeys = [...new Set(data.samples.flatMap((r) => Object.entries(r.metadata || {})
      .filter(([, v]) => typeof v === "number").map(([k]) => k)))];
    const sortable = (key, label) => h("th", { class: "num sortable", "data-sort": key, onclick: () => {
      state.desc = state.sort === key ? !state.desc : true;
      state.sort = key;
      render();
    } }, label + (state.sort === key ? (state.desc ? " ▼" : " ▲") : ""));
    const head = h("tr", {}, h("th", { class: "sortable", "data-sort": "group", onclick: () => { state.sort = null; render(); } }, "prompt #"),
      h("th", { class: "num" }, "sample"), h("th", {}, "prompt"), h("th", {}, "response"),
      sortable("reward", "reward"), sortable("advantage", "advantage"), h("th", {}, "finish"),
      sortable("response_tokens", "tokens"), metaKeys.map((k) => sortable(`meta:${k}`, k)));
    let previous = null;
    const body = sortedRows().map((r) => {
      const first = !state.sort && r.index !== previous;
      previous = r.index;
      return h("tr", { class: first ? "trace group-start" : "trace", "data-index": r.index, "data-group-index": r.group_index },
        h("td", { class: "num" }, r.index), h("td", { class: "num" }, r.group_index),
        h("td", {}, h("details", { class: "prompt" }, h("summary", {}, promptSnippet(r.prompt)), h("pre", {}, r.prompt))),
        h("td", {}, h("pre", { class: "response" }, r.response)),
        h("td", { class: "num reward" }, fmt.num(r.reward)), h("td", { class: "num advantage" }, fmt.num(r.advantage)),
        h("td", {}, r.finish_reason || "–"), h("td", { class: "num" }, r.response_tokens ?? "–"),
        metaKeys.map((k) => h("td", { class: "num" }, fmt.num((r.metadata || {})[k]))));
    });
    root.replaceChildren(
      h("div", { class: "toolbar" }, select, h("span", { class: "muted" },
        `${data.samples.length} samples; click reward, advantage or tokens to sort, prompt # to group`)),
      data.samples.length ? h("table", { class: "traces" }, head, body) : h("p", { class: "empty" }, "No samples for this step."));
  }

  async function load() {
    const query = state.follow ? "" : `?step=${state.step}`;
    state.data = await getJSON(`/api/runs/${encodeURIComponent(state.runId)}/samples${query}`);
    state.step = state.data.step;
    if (state.data.step === null) root.replaceChildren(h("p", { class: "empty" }, "No samples yet."));
    else render();
  }

  return {
    root,
    // Reload when following the latest step and a newer one has been logged.
    async update(runId, latestStep) {
      state.runId = runId;
      if (state.data === null || (state.follow && latestStep !== state.step)) await load();
    },
  };
}

function keyValues(object) {
  return h("table", { class: "kv" }, Object.entries(object || {}).map(([k, v]) =>
    h("tr", {}, h("td", {}, k), h("td", { class: "mono" }, v !== null && typeof v === "object" ? JSON.stringify(v) : String(v)))));
}

async function runPage(runId) {
  const app = document.getElementById("app");
  const header = h("div", {}), errorBox = h("div", {}), charts = h("div", { class: "charts" });
  const traces = tracesView();
  const evals = h("div", {}), checkpoints = h("div", {}), logBox = h("pre", { class: "log", id: "log" });
  const config = h("div", { class: "columns" });
  app.replaceChildren(header, errorBox, charts, h("h2", {}, "Traces"), traces.root,
    h("h2", {}, "Evals"), evals, h("h2", {}, "Checkpoints"), checkpoints,
    h("h2", {}, "Configuration"), config, h("h2", {}, "Log"), logBox);
  document.title = `${runId} · palaestra`;

  let configShown = false;
  const view = newView();
  async function refresh() {
    const base = `/api/runs/${encodeURIComponent(runId)}`;
    let run;
    try {
      run = await getJSON(base);
    } catch (error) {
      app.replaceChildren(h("h1", {}, runId), h("div", { class: "error" }, h("strong", {}, "Cannot show this run. "), error.message));
      return;
    }
    const [metrics, log] = await Promise.all([getJSON(`${base}/metrics`),
      fetch(`${base}/log?lines=200`, { cache: "no-store" }).then((r) => r.text())]);
    if (view !== currentView) return;
    const last = metrics[metrics.length - 1] || {};
    header.replaceChildren(h("h1", {}, run.run_id),
      h("div", { class: "facts" },
        h("div", {}, stateBadge(run.state)),
        h("div", {}, h("span", {}, "step"), h("strong", { id: "step-count" }, fmt.steps(run))),
        h("div", {}, h("span", {}, "reward"), fmt.num(last.reward_mean)),
        h("div", {}, h("span", {}, "model"), run.model),
        h("div", {}, h("span", {}, "dataset"), run.dataset),
        h("div", {}, h("span", {}, "started"), fmt.time(run.started_at || run.created_at)),
        h("div", {}, h("span", {}, "duration"), fmt.duration(run.duration_s)),
        last.step_s ? h("div", {}, h("span", {}, "last step"), fmt.duration(last.step_s)) : null));
    errorBox.replaceChildren(...(run.state === "failed" ? [h("div", { class: "error", id: "run-error" },
      h("strong", {}, "Failed: "), run.status.error || "no error recorded",
      run.status.traceback ? h("details", {}, h("summary", {}, "traceback"), h("pre", {}, run.status.traceback)) : null)] : []));
    renderCharts(charts, metrics);
    await traces.update(runId, last.step ?? null);
    evals.replaceChildren(evalsTable(run.evals, false),
      run.endpoints.length ? h("div", {}, h("h3", {}, "Serving"), endpointsTable(run.endpoints)) : "");
    checkpoints.replaceChildren(run.checkpoints.length ? h("table", { id: "checkpoints" },
      h("tr", {}, h("th", { class: "num" }, "step"), h("th", {}, "path")),
      run.checkpoints.map((c) => h("tr", {}, h("td", { class: "num" }, c.step), h("td", { class: "mono" }, c.path))))
      : h("p", { class: "empty" }, "No checkpoints yet."));
    if (!configShown) {
      const cfg = run.config;
      config.replaceChildren(
        h("div", {}, h("h3", {}, `Recipe (${(cfg.recipe || {}).class || "Recipe"})`), keyValues(cfg.recipe)),
        h("div", {}, h("h3", {}, "Model"), keyValues(cfg.model), h("h3", {}, "Dataset"), keyValues(cfg.dataset),
          cfg.checkpoint ? [h("h3", {}, "Started from"), h("p", { class: "mono" }, cfg.checkpoint)] : null));
      configShown = true;
    }
    const atBottom = logBox.scrollHeight - logBox.scrollTop - logBox.clientHeight < 20;
    logBox.textContent = log || "(no output yet)";
    if (atBottom) logBox.scrollTop = logBox.scrollHeight;
    const isLive = run.state === "running" || run.state === "pending";
    live(isLive);
    if (isLive) poll(refresh);
  }
  await refresh();
}

async function main() {
  getJSON("/api/home").then((info) => { document.getElementById("home-path").textContent = info.home; });
  const match = location.pathname.match(/^\/runs\/([^/]+)\/?$/);
  if (match) await runPage(decodeURIComponent(match[1]));
  else await runsPage();
}

main();
