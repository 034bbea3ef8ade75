// An offline report (`replay --report-html`, `simulate --report-html`): the figures and tables
// that the embedded JSON describes, drawn with charts.js. Each figure is
// {title, kind: "line" | "bars", series | rows, opts}; each table {title, columns, rows}.
"use strict";
(() => {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  document.getElementById("title").textContent = data.title;
  document.getElementById("subtitle").textContent = data.subtitle || "";
  const main = document.getElementById("report");
  const section = (title, wide) => {
    const s = document.createElement("section");
    if (wide) s.className = "wide";
    const h = document.createElement("h2");
    h.textContent = title;
    s.appendChild(h);
    main.appendChild(s);
    return s;
  };
  for (const t of data.tables || []) {
    const s = section(t.title, true);
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    for (const c of t.columns) head.appendChild(document.createElement("th")).textContent = c;
    const body = table.createTBody();
    for (const r of t.rows) {
      const row = body.insertRow();
      for (const v of r) row.insertCell().textContent = typeof v === "number" ? RK.fmt(v) : String(v ?? "–");
    }
    s.appendChild(table);
  }
  for (const f of data.figures || []) {
    const div = document.createElement("div");
    div.className = "figure";
    section(f.title, f.wide).appendChild(div);
    const opts = Object.assign(f.wide ? { width: 940 } : {}, f.opts);
    if (f.kind === "line") RK.line(div, f.series, opts);
    else if (f.kind === "bars") RK.bars(div, f.rows, opts);
    if (f.note) {
      const p = document.createElement("p");
      p.className = "note";
      p.textContent = f.note;
      div.after(p);
    }
  }
})();
