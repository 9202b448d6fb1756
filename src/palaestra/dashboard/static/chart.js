// Line charts over training steps, drawn as SVG: lines, a point per step, optional bands.
// Small on purpose: the dashboard needs steps on x, a few series on y (several runs overlaid
// on shared axes when comparing), and nothing else.
"use strict";

const PalaestraChart = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 460, H = 200, M = { left: 52, right: 12, top: 10, bottom: 26 };

  function el(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (parent) parent.appendChild(node);
    return node;
  }

  // About `count` round tick values covering [lo, hi].
  function ticks(lo, hi, count) {
    const span = hi - lo;
    const raw = span / Math.max(count, 1);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
    // Multiples of the step, not a running sum: adding 0.2 five times to 1 passes 2 and would
    // drop the last tick.
    const out = [];
    for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) {
      out.push(+(i * step).toPrecision(12));
    }
    return out;
  }

  function format(value) {
    const a = Math.abs(value);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return value.toExponential(1);
    return String(+value.toPrecision(4));
  }

  function extent(values) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (!isFinite(lo)) return [0, 1];
    if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
    return [lo, hi];
  }

  // series: [{name, label?, color, points: [[x, y], ...]}] (name: the data-series attribute,
  // label: what a point's tooltip calls it); bands: [{color, lo: [[x, y]], hi: [[x, y]]}]
  function line(series, bands) {
    bands = bands || [];
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    const xs = [], ys = [];
    for (const s of series) for (const [x, y] of s.points) { xs.push(x); ys.push(y); }
    for (const b of bands) for (const [, y] of b.lo.concat(b.hi)) ys.push(y);
    const [x0, x1] = xs.length > 1 ? extent(xs) : [(xs[0] || 0) - 1, (xs[0] || 0) + 1];
    const [y0, y1] = extent(ys);
    const px = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
    const py = (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);

    const axes = el("g", { class: "axes", "font-size": 10, fill: "#68717a" }, svg);
    for (const t of ticks(y0, y1, 4)) {
      el("line", { x1: M.left, x2: W - M.right, y1: py(t), y2: py(t), stroke: "#eceff2" }, axes);
      el("text", { x: M.left - 6, y: py(t) + 3, "text-anchor": "end" }, axes).textContent = format(t);
    }
    const xticks = ticks(x0, x1, 6).filter((t) => Number.isInteger(t));
    for (const t of xticks) {
      el("text", { x: px(t), y: H - M.bottom + 14, "text-anchor": "middle" }, axes).textContent = t;
    }
    el("text", { x: W - M.right, y: H - 2, "text-anchor": "end" }, axes).textContent = "step";

    for (const b of bands) {
      if (!b.lo.length) continue;
      const top = b.hi.map(([x, y]) => `${px(x)},${py(y)}`);
      const bottom = b.lo.slice().reverse().map(([x, y]) => `${px(x)},${py(y)}`);
      el("polygon", { class: "band", points: top.concat(bottom).join(" "), fill: b.color,
        "fill-opacity": b.opacity || 0.15, stroke: "none" }, svg);
    }
    for (const s of series) {
      const g = el("g", { class: "series", "data-series": s.name }, svg);
      if (s.points.length > 1) {
        const d = s.points.map(([x, y], i) => `${i ? "L" : "M"}${px(x)},${py(y)}`).join("");
        el("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.8 }, g);
      }
      for (const [x, y] of s.points) {
        const dot = el("circle", { class: "point", cx: px(x), cy: py(y), r: 2.6, fill: s.color,
          "data-step": x, "data-value": y }, g);
        el("title", {}, dot).textContent = `${s.label || s.name} at step ${x}: ${format(y)}`;
      }
    }
    return svg;
  }

  return { line, format };
})();
