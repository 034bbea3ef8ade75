// radixkv's charts: small SVG drawings with no library, shared by the live dashboard and the
// offline HTML reports. Each function draws into an element, replacing what it held, and marks
// the element with data attributes (points, last value, node counts) that tests read.
"use strict";
const RK = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#2f6fdf", "#e0662b", "#2a9d5b", "#9b4dca", "#c9a227", "#d43d6a", "#3bb2c4", "#7a7a7a"];
  const TIER_STROKE = { device: "none", host: "#444", "device+host": "#111", none: "#bbb", other: "#999" };

  function el(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function text(parent, x, y, s, attrs) {
    const t = el("text", Object.assign({ x, y, "font-size": 11, fill: "#333" }, attrs || {}), parent);
    t.textContent = s;
    return t;
  }

  function svg(container, width, height) {
    container.replaceChildren();
    return el("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img" }, container);
  }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
    if (a >= 1) return v.toFixed(2);
    return v.toPrecision(2);
  }

  function empty(root, width, height, message) {
    text(root, width / 2, height / 2, message, { "text-anchor": "middle", fill: "#888" });
  }

  // series: [{name, points: [[x, y], ...], dots}]; points with a null y are gaps; `dots` draws
  // each point rather than a line through them.
  function line(container, series, opts) {
    const o = Object.assign({ width: 460, height: 180, xLabel: "", yLabel: "", yMin: null, yMax: null }, opts);
    const root = svg(container, o.width, o.height);
    const pad = { l: 44, r: 10, t: 10, b: 30 };
    const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
    container.dataset.points = String(all.length);
    const first = series.find((s) => s.points.length);
    const last = first ? first.points.filter((p) => p[1] !== null).at(-1) : undefined;
    container.dataset.last = last ? String(last[1]) : "";
    if (!all.length) return empty(root, o.width, o.height, "no data yet");
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    let y0 = o.yMin ?? Math.min(0, ...ys), y1 = o.yMax ?? Math.max(...ys);
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) y1 = y0 + 1;
    const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (o.width - pad.l - pad.r);
    const Y = (y) => o.height - pad.b - ((y - y0) / (y1 - y0)) * (o.height - pad.t - pad.b);
    axes(root, o, pad, [x0, x1], [y0, y1], X, Y);
    series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      let d = "", pen = "M";
      for (const [x, y] of s.points) {
        if (y === null || y === undefined) { pen = "M"; continue; }
        d += `${pen}${X(x).toFixed(1)},${Y(y).toFixed(1)} `;
        pen = "L";
      }
      if (s.dots) {
        for (const [x, y] of s.points) if (y !== null && y !== undefined) el("circle", { cx: X(x), cy: Y(y), r: 2, fill: color, "fill-opacity": 0.5 }, root);
        return;
      }
      el("path", { d, fill: "none", stroke: color, "stroke-width": 1.6, class: "series" }, root);
      if (s.points.length === 1) el("circle", { cx: X(s.points[0][0]), cy: Y(s.points[0][1]), r: 3, fill: color }, root);
    });
    legend(root, series, o.width - pad.r);
  }

  function axes(root, o, pad, [x0, x1], [y0, y1], X, Y) {
    el("line", { x1: pad.l, y1: Y(y0), x2: o.width - pad.r, y2: Y(y0), stroke: "#999" }, root);
    el("line", { x1: pad.l, y1: Y(y0), x2: pad.l, y2: Y(y1), stroke: "#999" }, root);
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      text(root, pad.l - 4, Y(y) + 4, fmt(y), { "text-anchor": "end" });
      el("line", { x1: pad.l, y1: Y(y), x2: o.width - pad.r, y2: Y(y), stroke: "#eee" }, root);
    }
    text(root, pad.l, o.height - 14, fmt(x0));
    text(root, o.width - pad.r, o.height - 14, fmt(x1), { "text-anchor": "end" });
    text(root, (pad.l + o.width - pad.r) / 2, o.height - 2, o.xLabel, { "text-anchor": "middle", fill: "#666" });
    if (o.yLabel) text(root, pad.l + 4, pad.t + 10, o.yLabel, { fill: "#666" });
  }

  function legend(root, series, right) {
    if (series.length < 2) return;
    const left = right - 16 - 6.2 * Math.max(...series.map((s) => s.name.length));
    series.forEach((s, i) => {
      const y = 14 + i * 13;
      el("rect", { x: left, y: y - 8, width: 8, height: 8, fill: s.color || COLORS[i % COLORS.length] }, root);
      text(root, left + 12, y, s.name);
    });
  }

  // rows: [{label, parts: [{name, value}]}]: one horizontal bar a row, stacked by part.
  function bars(container, rows, opts) {
    const o = Object.assign({ width: 460, rowHeight: 20 }, opts);
    const height = Math.max(40, rows.length * (o.rowHeight + 6) + 26);
    const root = svg(container, o.width, height);
    container.dataset.rows = String(rows.length);
    if (!rows.length) return empty(root, o.width, height, "nothing to show");
    const names = [...new Set(rows.flatMap((r) => r.parts.map((p) => p.name)))];
    const top = Math.max(1, ...rows.map((r) => r.parts.reduce((a, p) => a + p.value, 0)));
    const left = 110, span = o.width - left - 60;
    rows.forEach((r, i) => {
      const y = 4 + i * (o.rowHeight + 6);
      text(root, left - 6, y + o.rowHeight * 0.7, r.label, { "text-anchor": "end" });
      let x = left, total = 0;
      for (const p of r.parts) {
        const w = (p.value / top) * span;
        const rect = el("rect", { x, y, width: Math.max(0, w), height: o.rowHeight, fill: COLORS[names.indexOf(p.name) % COLORS.length] }, root);
        el("title", {}, rect).textContent = `${r.label} ${p.name}: ${fmt(p.value)}`;
        x += w;
        total += p.value;
      }
      text(root, x + 4, y + o.rowHeight * 0.7, fmt(total));
    });
    if (names.length > 1) {
      names.forEach((n, i) => {
        const x = left + i * 80, y = height - 8;
        el("rect", { x, y: y - 8, width: 8, height: 8, fill: COLORS[i % COLORS.length] }, root);
        text(root, x + 11, y, n);
      });
    }
  }

  // A Prometheus-style histogram ({buckets: {le: cumulative}, count}) as bars of each bucket.
  function histogram(container, hist, opts) {
    const o = Object.assign({ width: 460, height: 150, unit: "s" }, opts);
    hist = hist || { buckets: {}, count: 0 };
    const root = svg(container, o.width, o.height);
    const bounds = Object.keys(hist.buckets || {}).map(Number);
    const cumulative = Object.values(hist.buckets || {});
    const counts = cumulative.map((c, i) => c - (i ? cumulative[i - 1] : 0));
    counts.push(hist.count - (cumulative.at(-1) || 0));
    container.dataset.count = String(hist.count || 0);
    if (!hist.count) return empty(root, o.width, o.height, "no requests yet");
    const top = Math.max(...counts), pad = 30, w = (o.width - 2 * pad) / counts.length;
    counts.forEach((c, i) => {
      const h = (c / top) * (o.height - 2 * pad);
      const rect = el("rect", { x: pad + i * w + 1, y: o.height - pad - h, width: w - 2, height: h, fill: COLORS[0] }, root);
      const label = i < bounds.length ? `≤ ${bounds[i]} ${o.unit}` : `> ${bounds.at(-1)} ${o.unit}`;
      el("title", {}, rect).textContent = `${label}: ${c}`;
    });
    el("line", { x1: pad, y1: o.height - pad, x2: o.width - pad, y2: o.height - pad, stroke: "#999" }, root);
    for (const i of [0, Math.floor(bounds.length / 2), bounds.length - 1]) {
      if (i >= 0 && i < bounds.length) text(root, pad + (i + 1) * w, o.height - pad + 13, String(bounds[i]), { "text-anchor": "middle" });
    }
    text(root, o.width / 2, o.height - 4, `${o.unit} (${hist.count} observed)`, { "text-anchor": "middle", fill: "#666" });
  }

  // The radix tree as an icicle: x is the token position (an edge spans its tokens), y splits a
  // parent's band among its children by the tokens under each. nodes: the snapshot's list,
  // parents first. colorBy: "age" (recently used is dark) or "hits".
  function icicle(container, nodes, opts) {
    const o = Object.assign({ width: 940, height: 320, colorBy: "age" }, opts);
    const root = svg(container, o.width, o.height);
    const shown = nodes.filter((n) => n.parent !== null);
    container.dataset.nodes = String(shown.length);
    if (!shown.length) return empty(root, o.width, o.height, "the cache holds no prefix");
    const children = new Map();
    for (const n of nodes) {
      if (n.parent === null) continue;
      if (!children.has(n.parent)) children.set(n.parent, []);
      children.get(n.parent).push(n);
    }
    const depth = Math.max(...shown.map((n) => n.start + n.tokens));
    const X = (t) => (t / depth) * (o.width - 2);
    const heat = o.colorBy === "hits" ? Math.max(1, ...shown.map((n) => n.hits)) : Math.max(1, ...shown.map((n) => n.age));
    const shade = (n) => {
      const v = o.colorBy === "hits" ? n.hits / heat : 1 - n.age / heat;
      const light = 85 - 50 * Math.max(0, Math.min(1, v));
      return n.tier === "other" ? "#ddd" : `hsl(${n.tier === "host" ? 30 : 215}, 70%, ${light}%)`;
    };
    const place = (parentId, y0, y1) => {
      const kids = children.get(parentId) || [];
      const total = kids.reduce((a, k) => a + Math.max(1, k.subtree_tokens), 0);
      let y = y0;
      for (const k of kids) {
        const h = ((y1 - y0) * Math.max(1, k.subtree_tokens)) / total;
        const rect = el("rect", {
          x: X(k.start) + 1, y, width: Math.max(1, X(k.start + k.tokens) - X(k.start) - 1), height: Math.max(0.5, h - 0.5),
          fill: shade(k), stroke: TIER_STROKE[k.tier] || "none", "stroke-width": k.tier === "device" ? 0 : 1,
          class: "node", "data-id": k.id, "data-tokens": k.tokens, "data-start": k.start,
          "data-subtree-tokens": k.subtree_tokens, "data-tier": k.tier, "data-refs": k.refs, "data-hits": k.hits,
        }, root);
        const more = k.other ? ` (${k.other} smaller branches)` : "";
        el("title", {}, rect).textContent =
          `${k.tokens} tokens at ${k.start}${more}\ntier ${k.tier}: ${k.blocks} device, ${k.host_blocks} host blocks\n` +
          `refs ${k.refs} · hits ${k.hits} · last used ${k.age} ticks ago` + (k.session ? `\nsession ${k.session}` : "");
        if (h > 12 && X(k.tokens) > 40) text(root, X(k.start) + 4, y + Math.min(h / 2 + 4, 14), String(k.tokens), { fill: "#fff", "pointer-events": "none" });
        place(k.id, y, y + h);
        y += h;
      }
    };
    place(nodes.find((n) => n.parent === null).id, 0, o.height);
  }

  return { line, bars, histogram, icicle, fmt };
})();
