// The live dashboard: polls /dashboard/data a few times a second and redraws (charts.js).
// The key: given once as ?key=, it is kept in this tab's sessionStorage and taken out of the
// address bar, then sent as a bearer header, so it is not left in the history or in links.
"use strict";
(() => {
  const params = new URLSearchParams(location.search);
  if (params.has("key")) {
    sessionStorage.setItem("radixkv-key", params.get("key"));
    params.delete("key");
    history.replaceState(null, "", location.pathname + (params.toString() ? "?" + params : ""));
  }
  const key = sessionStorage.getItem("radixkv-key");
  const every = Number(document.body.dataset.pollMs) || 250;
  const $ = (id) => document.getElementById(id);
  let colorBy = "age";
  let last = null;

  $("color-by").addEventListener("change", (e) => {
    colorBy = e.target.value;
    if (last) RK.icicle($("tree"), last.view.tree ? last.view.tree.nodes : [], { colorBy });
  });

  function tiles(view) {
    const m = view.metrics;
    const rate = m.prefix_cache_queries ? m.prefix_cache_hits / m.prefix_cache_queries : null;
    const items = [
      ["hit rate", rate === null ? "–" : (100 * rate).toFixed(1) + "%"],
      ["tokens saved", RK.fmt(m.prefix_cache_hits)],
      ["running", RK.fmt(m.running)],
      ["waiting", RK.fmt(m.waiting)],
      ["evicted blocks", RK.fmt(m.num_evicted_blocks)],
      ["policy", view.policy ? view.policy.name : "no cache"],
    ];
    $("tiles").replaceChildren(...items.map(([label, value]) => {
      const div = document.createElement("div");
      div.className = "tile";
      div.dataset.tile = label;
      div.innerHTML = `<span class="value"></span><span class="label"></span>`;
      div.querySelector(".value").textContent = value;
      div.querySelector(".label").textContent = label;
      return div;
    }));
  }

  function render(data) {
    last = data;
    const view = data.view;
    $("scope").textContent = data.scope === "all" ? "the whole cache" : "your key's namespace";
    $("model").textContent = data.model;
    tiles(view);
    const h = data.history;
    RK.line($("hit-rate"), [
      { name: "over the interval", points: h.map((s) => [s.t, s.hit_rate]) },
      { name: "since start", points: h.map((s) => [s.t, s.hit_rate_total]) },
    ], { yMin: 0, yMax: 1, xLabel: "seconds since the server started" });
    RK.line($("tokens-saved"), [{ name: "tokens saved", points: h.map((s) => [s.t, s.tokens_saved]) }],
      { xLabel: "seconds since the server started" });
    const tiers = Object.entries(view.blocks).map(([tier, states]) => ({
      label: tier, parts: Object.entries(states).map(([name, value]) => ({ name, value })),
    }));
    RK.bars($("blocks"), tiers);
    const share = h.filter((s) => s.window_share !== null && s.window_share !== undefined);
    $("policy-panel").hidden = !share.length;
    if (share.length) RK.line($("window-share"), [{ name: "window share", points: share.map((s) => [s.t, s.window_share]) }], { yMin: 0, yMax: 1 });
    const tree = view.tree;
    RK.icicle($("tree"), tree ? tree.nodes : [], { colorBy });
    const shown = tree ? tree.nodes.filter((n) => n.parent !== null && n.tier !== "other").length : 0;
    const unvisited = tree && tree.unvisited_blocks !== null ? `, ${tree.unvisited_blocks} blocks not visited` : "";
    $("tree-note").textContent = tree
      ? `${shown} nodes shown of ${tree.visited - 1} visited` + (tree.sampled ? `; sampled (a larger tree${unvisited})` : "")
      : "prefix caching is off";
    const usage = (counts) => Object.entries(counts || {}).map(([label, value]) => ({ label, parts: [{ name: "blocks", value }] }));
    RK.bars($("namespaces"), usage(tree && tree.namespaces));
    RK.bars($("sessions"), usage(tree && tree.sessions));
    RK.histogram($("ttft"), view.metrics.time_to_first_token_seconds);
    RK.histogram($("itl"), view.metrics.inter_token_latency_seconds);
    $("status").textContent = "live";
  }

  async function poll() {
    let data = null;
    try {
      const response = await fetch("/dashboard/data", { headers: key ? { Authorization: "Bearer " + key } : {} });
      if (response.status === 401) {
        $("status").textContent = "this server needs its API key: open /dashboard?key=KEY";
        return; // no retry: the key will not change in this tab
      }
      if (response.ok) data = await response.json();
      else $("status").textContent = `the server answered ${response.status}`;
    } catch (e) {
      $("status").textContent = "the server is not answering";
    }
    setTimeout(poll, every);
    if (data) render(data); // outside the try: a drawing error is the page's, logged as such
  }
  poll();
})();
