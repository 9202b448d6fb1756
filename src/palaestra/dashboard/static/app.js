// The dashboard page: the runs list at "/", one run at "/runs/<id>", a group of runs (a sweep)
// at "/groups/<id>", runs overlaid at "/compare?runs=a,b". Data comes from /api/...; a page
// showing a live run is polled until it ends. Text from runs (responses, logs, errors) is only ever
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
const groupLink = (id, text) => h("a", { href: `/groups/${encodeURIComponent(id)}` }, text || id);
const compareURL = (ids) => `/compare?runs=${ids.map(encodeURIComponent).join(",")}`;
const liveState = (state) => state === "running" || state === "pending";
// Distinct colours for any number of runs: the palette, then hues spread by the golden angle.
const runColor = (i) => i < COLORS.length ? COLORS[i] : `hsl(${Math.round(i * 137.508) % 360}, 65%, 42%)`;
const swatch = (color) => h("i", { class: "swatch", style: `background:${color}` });
const valueText = (v) => v === null || v === undefined ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v);
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
    h("tr", {}, ["name", "url", "engine", "model", "checkpoint", "started", "auth"].map((c) => h("th", {}, c))),
    endpoints.map((e) => h("tr", {}, h("td", {}, e.name), h("td", { class: "mono endpoint-url" }, e.url || "–"),
      h("td", {}, e.engine || "torch"), h("td", {}, e.model || "–"),
      h("td", {}, e.run_id ? [runLink(e.run_id), e.step !== null ? ` step ${e.step}` : ""] : (e.checkpoint || "base model")),
      h("td", {}, fmt.time(e.started_at)), h("td", {}, e.authenticated ? "key" : "none"))));
}

// Runs page ---------------------------------------------------------------------------------

const selectedRuns = new Set();  // ticked on the runs list; kept while its filters change

function groupsTable(groups) {
  if (!groups.length) return h("p", { class: "empty" }, "No groups of runs.");
  const counts = (states) => Object.entries(states).map(([s, n]) => `${n} ${s}`).join(", ");
  return h("table", { id: "groups" },
    h("tr", {}, h("th", {}, "group"), h("th", {}, "status"), h("th", {}, "grid"), h("th", {}, "variants"),
      h("th", { class: "num" }, "best reward"), h("th", {}, "best run"), h("th", {}, "created")),
    groups.map((g) => h("tr", { "data-group": g.group_id },
      h("td", {}, groupLink(g.group_id, g.name || g.group_id), h("div", { class: "mono muted" }, g.group_id)),
      h("td", {}, stateBadge(g.state)), h("td", { class: "mono" }, (g.axes || []).join(", ")),
      h("td", {}, `${g.variants}` + (g.variants ? ` (${counts(g.states)})` : "") + (g.skipped ? `, ${g.skipped} skipped` : "")),
      h("td", { class: "num" }, fmt.num(g.best_reward)), h("td", { class: "mono" }, g.best_run_id ? runLink(g.best_run_id) : "–"),
      h("td", {}, fmt.time(g.created_at)))));
}

async function runsPage() {
  const app = document.getElementById("app");
  const status = new URLSearchParams(location.search).get("status") || "";
  const filters = h("div", { class: "filters" }, ["", ...STATES].map((s) =>
    h("button", { class: s === status ? "active" : null, "data-status": s || "all", onclick: () => {
      history.replaceState(null, "", s ? `/?status=${s}` : "/");
      runsPage();
    } }, s || "all")));
  const compareBar = h("div", { class: "toolbar", id: "compare-bar" });
  const body = h("div", {});
  app.replaceChildren(h("h1", {}, "Runs"), filters, compareBar, body);
  const view = newView();

  function showSelection() {
    const ids = [...selectedRuns];
    const clear = h("a", { href: "#", onclick: (ev) => {
      ev.preventDefault();
      selectedRuns.clear();
      for (const box of body.querySelectorAll("input.select-run")) box.checked = false;
      showSelection();
    } }, "clear");
    compareBar.replaceChildren(ids.length >= 2
      ? h("a", { id: "compare-link", class: "button", href: compareURL(ids) }, `Compare ${ids.length} runs`)
      : h("span", { id: "compare-link", class: "button disabled" }, "Compare"),
    h("span", { class: "muted" }, ids.length ? `${ids.length} selected` : "tick two or more runs to compare them"),
    ...(ids.length ? [clear] : []));
  }
  const selectBox = (id) => h("input", { type: "checkbox", class: "select-run", "data-run": id,
    checked: selectedRuns.has(id), "aria-label": `select ${id}`, onchange: (ev) => {
      if (ev.target.checked) selectedRuns.add(id); else selectedRuns.delete(id);
      showSelection();
    } });
  showSelection();

  async function refresh() {
    const query = status ? `?status=${encodeURIComponent(status)}` : "";
    const [runs, endpoints, evals, groups] = await Promise.all([
      getJSON(`/api/runs${query}`), getJSON("/api/endpoints"), getJSON("/api/evals"), getJSON("/api/groups")]);
    if (view !== currentView) return;
    const evalsByRun = {};
    for (const e of evals) if (e.run_id) (evalsByRun[e.run_id] ||= []).push(e);
    const table = h("table", { id: "runs" },
      h("tr", {}, h("th", {}, "run"), h("th", {}, "status"), h("th", {}, "model"), h("th", {}, "dataset"),
        h("th", { class: "num" }, "step"), h("th", { class: "num" }, "reward"), h("th", {}, "started"),
        h("th", { class: "num" }, "duration"), h("th", { class: "num" }, "eval")),
      runs.map((r) => h("tr", { "data-run": r.run_id }, h("td", { class: "mono" }, selectBox(r.run_id), " ", runLink(r.run_id)),
        h("td", {}, stateBadge(r.state)), h("td", {}, r.model), h("td", {}, r.dataset),
        h("td", { class: "num" }, fmt.steps(r)), h("td", { class: "num" }, fmt.num(r.reward_mean)),
        h("td", {}, fmt.time(r.started_at || r.created_at)), h("td", { class: "num" }, fmt.duration(r.duration_s)),
        h("td", { class: "num" }, evalsByRun[r.run_id] ? fmt.num(evalsByRun[r.run_id][0].mean) : "–"))));
    body.replaceChildren(
      runs.length ? table : h("p", { class: "empty" }, status ? `No ${status} runs.` : "No runs yet."),
      h("h2", {}, "Groups"), groupsTable(groups),
      h("h2", {}, "Endpoints"), endpointsTable(endpoints),
      h("h2", {}, "Base-model evals"), evalsTable(evals.filter((e) => !e.run_id), true));
    const anyLive = runs.some((r) => liveState(r.state)) || groups.some((g) => liveState(g.state));
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
  { id: "timing", title: "Step time (s)", keys: ["rollout_s", "reward_s", "train_s", "weight_sync_s", "save_s"] },
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

// A multi-turn trace as a conversation, turn by turn, after the prompt's own messages: the
// model's turns (trained on) apart from what the environment or a tool wrote (never trained).
function conversation(r) {
  const turns = (r.messages || []).filter((m) => "trained" in m);
  const trained = (r.mask_spans || []).reduce((n, [a, b]) => n + b - a, 0);
  return h("div", { class: "conversation" },
    turns.map((m, i) => h("div", { class: `turn ${m.trained ? "trained" : "environment"}`, "data-turn": i },
      h("span", { class: "role" }, m.trained ? `${m.role} · trained` : m.role),
      h("pre", {}, m.content))),
    h("div", { class: "muted turn-summary" },
      `${turns.filter((m) => m.trained).length} model turns, ${trained} of ${r.response_tokens} tokens trained`));
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
        h("td", {}, r.mask_spans ? conversation(r) : h("pre", { class: "response" }, r.response)),
        h("td", { class: "num reward" }, fmt.num(r.reward)), h("td", { class: "num advantage" }, fmt.num(r.advantage)),
        h("td", {}, r.status && r.status !== "completed" ? r.status : r.finish_reason || "–"),
        h("td", { class: "num" }, r.response_tokens ?? "–"),
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
        run.group_id ? h("div", { id: "run-group" }, h("span", {}, "group"), groupLink(run.group_id),
          run.group_overrides ? h("span", { class: "mono" }, " " + Object.entries(run.group_overrides)
            .map(([k, v]) => `${k}=${valueText(v)}`).join(", ")) : null) : null,
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

// Runs overlaid: the compare page and a group's page -----------------------------------------

// runs: /api/compare's answer, each given its colour. One chart per metric, a line per run, and
// one legend naming each run by its label (the config fields that set it apart).
function renderOverlay(container, runs) {
  const evalKeys = [...new Set(runs.flatMap((r) => r.metrics.flatMap((m) =>
    Object.keys(m).filter((k) => k.startsWith("eval_") && typeof m[k] === "number"))))].sort();
  const charts = [{ id: "reward", title: "Reward (mean)", key: "reward_mean" }, { id: "loss", title: "Loss", key: "loss" },
    ...evalKeys.map((key) => ({ id: key, title: `Eval: ${key.slice(5)}`, key }))];
  const figures = [];
  for (const chart of charts) {
    const series = runs.map((r) => ({ name: r.run_id, label: r.label, color: r.color, points: points(r.metrics, chart.key) }))
      .filter((s) => s.points.length);
    if (series.length) {
      figures.push(h("figure", { class: "chart", "data-chart": chart.id, "data-key": chart.key },
        h("figcaption", {}, chart.title), PalaestraChart.line(series)));
    }
  }
  const legend = h("div", { class: "legend run-legend", id: "overlay-legend" }, runs.map((r) =>
    h("span", { "data-run": r.run_id }, h("i", { style: `background:${r.color}` }), r.label)));
  container.replaceChildren(legend, figures.length ? h("div", { class: "charts" }, figures) : h("p", { class: "empty" }, "No steps yet."));
}

function rewards(metrics) {
  return metrics.map((m) => m.reward_mean).filter((v) => typeof v === "number");
}

async function comparePage(runIds) {
  const app = document.getElementById("app");
  const table = h("div", {}), overlay = h("div", { id: "overlay" });
  app.replaceChildren(h("h1", {}, "Compare runs"), table, overlay);
  document.title = "compare · palaestra";
  const view = newView();
  if (!runIds.length) {
    table.replaceChildren(h("p", { class: "empty" }, "No runs chosen: tick runs on the runs list, then Compare."));
    return;
  }
  async function refresh() {
    let runs;
    try {
      runs = await getJSON(`/api/compare?runs=${runIds.map(encodeURIComponent).join(",")}`);
    } catch (error) {
      table.replaceChildren(h("div", { class: "error" }, h("strong", {}, "Cannot compare these runs. "), error.message));
      return;
    }
    if (view !== currentView) return;
    runs.forEach((r, i) => { r.color = runColor(i); });
    table.replaceChildren(h("table", { id: "compare-runs" },
      h("tr", {}, h("th", {}, "run"), h("th", {}, "label"), h("th", {}, "status"), h("th", { class: "num" }, "steps"),
        h("th", { class: "num" }, "final reward"), h("th", { class: "num" }, "best reward")),
      runs.map((r) => {
        const got = rewards(r.metrics), last = r.metrics[r.metrics.length - 1];
        return h("tr", { "data-run": r.run_id }, h("td", { class: "mono" }, swatch(r.color), " ", runLink(r.run_id)),
          h("td", { class: "mono run-label" }, r.label), h("td", {}, stateBadge(r.state)),
          h("td", { class: "num" }, last ? last.step : "–"),
          h("td", { class: "num final-reward" }, fmt.num(got.length ? got[got.length - 1] : null)),
          h("td", { class: "num best-reward" }, fmt.num(got.length ? Math.max(...got) : null)));
      })));
    renderOverlay(overlay, runs);
    const anyLive = runs.some((r) => liveState(r.state));
    live(anyLive);
    if (anyLive) poll(refresh);
  }
  await refresh();
}

async function groupPage(groupId) {
  const app = document.getElementById("app");
  const header = h("div", {}), variants = h("div", {}), overlay = h("div", { id: "overlay" }), about = h("div", {});
  app.replaceChildren(header, h("h2", {}, "Variants"), variants, h("h2", {}, "Curves"), overlay, about);
  document.title = `${groupId} · palaestra`;
  const view = newView();
  async function refresh() {
    let group;
    try {
      group = await getJSON(`/api/groups/${encodeURIComponent(groupId)}`);
    } catch (error) {
      app.replaceChildren(h("h1", {}, groupId), h("div", { class: "error" }, h("strong", {}, "Cannot show this group. "), error.message));
      return;
    }
    const rows = group.variants.slice().sort((a, b) => a.index - b.index);
    let runs = [], overlayError = null;
    if (rows.length) {
      try {
        runs = await getJSON(`/api/compare?runs=${rows.map((v) => encodeURIComponent(v.run_id)).join(",")}`);
      } catch (error) { overlayError = error; }
    }
    if (view !== currentView) return;
    const colors = Object.fromEntries(rows.map((v, i) => [v.run_id, runColor(i)]));
    runs.forEach((r) => { r.color = colors[r.run_id]; });
    const axes = group.axes || Object.keys(group.grid || {});
    const anyError = rows.some((v) => v.error);
    header.replaceChildren(h("h1", {}, group.name || group.group_id),
      h("div", { class: "facts" },
        h("div", {}, stateBadge(group.state)),
        h("div", {}, h("span", {}, "group"), h("span", { class: "mono", id: "group-id" }, group.group_id)),
        h("div", {}, h("span", {}, "variants"), rows.length),
        h("div", {}, h("span", {}, "at once"), group.max_parallel ?? "–"),
        h("div", {}, h("span", {}, "created"), fmt.time(group.created_at)),
        rows.length ? h("div", {}, h("a", { href: compareURL(rows.map((v) => v.run_id)) }, "open in compare")) : null),
      h("table", { class: "kv", id: "grid" }, Object.entries(group.grid || {}).map(([field, values]) =>
        h("tr", {}, h("td", { class: "mono" }, field), h("td", { class: "mono" }, values.map(valueText).join(", "))))));
    variants.replaceChildren(rows.length ? h("table", { id: "variants" },
      h("tr", {}, h("th", { class: "num" }, "#"), axes.map((a) => h("th", { class: "mono" }, a)), h("th", {}, "status"),
        h("th", { class: "num" }, "step"), h("th", { class: "num" }, "final reward"), h("th", { class: "num" }, "best reward"),
        h("th", {}, "run"), anyError ? h("th", {}, "error") : null),
      rows.map((v) => h("tr", { "data-run": v.run_id, "data-index": v.index },
        h("td", { class: "num" }, swatch(colors[v.run_id]), " ", v.index + 1),
        axes.map((a) => h("td", { class: "mono override", "data-field": a }, valueText((v.overrides || {})[a]))),
        h("td", {}, stateBadge(v.state)), h("td", { class: "num" }, fmt.steps(v)),
        h("td", { class: "num final-reward" }, fmt.num(v.final_reward)), h("td", { class: "num best-reward" }, fmt.num(v.best_reward)),
        h("td", { class: "mono" }, runLink(v.run_id)), anyError ? h("td", { class: "variant-error" }, v.error || "") : null)))
      : h("p", { class: "empty" }, "No variants."));
    if (overlayError) overlay.replaceChildren(h("div", { class: "error" }, h("strong", {}, "Cannot overlay the variants. "), overlayError.message));
    else renderOverlay(overlay, runs);
    const skipped = group.skipped || [];
    about.replaceChildren(...(skipped.length ? [h("h2", {}, "Skipped combinations"), h("table", { id: "skipped" },
      h("tr", {}, h("th", {}, "values"), h("th", {}, "why")),
      skipped.map((s) => h("tr", {}, h("td", { class: "mono" }, valueText(s.overrides)), h("td", {}, s.error))))] : []));
    const anyLive = liveState(group.state) || rows.some((v) => liveState(v.state));
    live(anyLive);
    if (anyLive) poll(refresh);
  }
  await refresh();
}

async function main() {
  getJSON("/api/home").then((info) => { document.getElementById("home-path").textContent = info.home; });
  const path = location.pathname;
  const run = path.match(/^\/runs\/([^/]+)\/?$/), group = path.match(/^\/groups\/([^/]+)\/?$/);
  if (run) await runPage(decodeURIComponent(run[1]));
  else if (group) await groupPage(decodeURIComponent(group[1]));
  else if (/^\/compare\/?$/.test(path)) {
    const params = new URLSearchParams(location.search);
    const ids = [...(params.get("runs") || "").split(","), ...params.getAll("run")].map((id) => id.trim()).filter(Boolean);
    await comparePage([...new Set(ids)]);
  } else await runsPage();
}

main();
