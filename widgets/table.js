// The comparison table: candidates in rows, numbers in columns; sorts on a header click,
// colours each cell by its rank in its column, and with a measured column adds a row of each
// column's Spearman rank correlation with it.
import { number } from "./shapes.js";

const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// Rank-to-colour: the best cell green, the worst red, through a pale middle.
function rankColour(t, alpha = 0.55) {
  const a = [224, 49, 49];
  const m = [245, 241, 218];
  const b = [47, 158, 68];
  const [p, q, f] = t < 0.5 ? [a, m, t * 2] : [m, b, (t - 0.5) * 2];
  const c = p.map((x, i) => Math.round(x + (q[i] - x) * f));
  return `rgba(${c[0]},${c[1]},${c[2]},${alpha})`;
}

function ranks(values, higher) {
  // 0 = worst, 1 = best, ties share; non-numbers get null
  const idx = values.map((v, i) => [v, i]).filter(([v]) => typeof v === "number" && Number.isFinite(v));
  const out = values.map(() => null);
  if (idx.length < 2) return out;
  idx.sort((x, y) => x[0] - y[0]);
  idx.forEach(([v, i]) => {
    const lo = idx.findIndex(([w]) => w === v);
    let hi = lo;
    while (hi + 1 < idx.length && idx[hi + 1][0] === v) hi++;
    const r = (lo + hi) / 2 / (idx.length - 1);
    out[i] = higher === false ? 1 - r : r;
  });
  return out;
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "smz-table";
  host.appendChild(root);

  function draw() {
    const data = model.get("data") || { index: [], columns: [], values: [] };
    const cols = data.columns || [];
    const index = data.index || [];
    const values = data.values || [];
    const higher = model.get("higher_better") || {};
    const measured = model.get("measured") || "";
    const corr = model.get("correlations") || {};
    const sortBy = model.get("sort_by") || "";
    const asc = !!model.get("ascending");
    const order = index.map((_, i) => i);
    const ci = cols.indexOf(sortBy);
    if (sortBy === (model.get("index_name") || "candidate")) {
      order.sort((a, b) => String(index[a]).localeCompare(String(index[b])) * (asc ? 1 : -1));
    } else if (ci >= 0) {
      order.sort((a, b) => {
        const x = values[a][ci];
        const y = values[b][ci];
        const xn = typeof x === "number" && Number.isFinite(x);
        const yn = typeof y === "number" && Number.isFinite(y);
        if (!xn && !yn) return 0;
        if (!xn) return 1;
        if (!yn) return -1;
        return asc ? x - y : y - x;
      });
    }
    const colRanks = cols.map((c, j) => (higher[c] === null || higher[c] === undefined ? null : ranks(values.map((row) => row[j]), higher[c])));
    const indexName = model.get("index_name") || "candidate";
    const arrow = (c) => (c === sortBy ? (asc ? " ▲" : " ▼") : "");
    let h = '<table><thead><tr>';
    h += `<th data-col="${esc(indexName)}" class="smz-index">${esc(indexName)}${arrow(indexName)}</th>`;
    for (const c of cols) h += `<th data-col="${esc(c)}" class="${c === measured ? "smz-measured" : ""}" title="sort by ${esc(c)}">${esc(c)}${arrow(c)}</th>`;
    h += "</tr></thead><tbody>";
    for (const i of order) {
      h += `<tr data-row="${esc(index[i])}"><th class="smz-index">${esc(index[i])}</th>`;
      cols.forEach((c, j) => {
        const v = values[i][j];
        const r = colRanks[j] ? colRanks[j][i] : null;
        const bg = r === null ? "" : ` style="background:${rankColour(r)}"`;
        h += `<td data-col="${esc(c)}"${bg} title="${esc(c)}: ${esc(v)}">${esc(number(v))}</td>`;
      });
      h += "</tr>";
    }
    h += "</tbody>";
    if (measured && Object.keys(corr).length) {
      h += `<tfoot><tr class="smz-corr"><th class="smz-index" title="Spearman rank correlation with ${esc(measured)}">ρ with ${esc(measured)}</th>`;
      for (const c of cols) {
        const v = corr[c];
        const ok = typeof v === "number" && Number.isFinite(v);
        const bg = ok && c !== measured ? ` style="background:${rankColour((v + 1) / 2, 0.7)}"` : "";
        h += `<td data-col="${esc(c)}"${bg}>${c === measured ? "" : ok ? v.toFixed(2) : "–"}</td>`;
      }
      h += "</tr></tfoot>";
    }
    h += "</table>";
    const note = model.get("note");
    if (note) h += `<div class="smz-note">${esc(note)}</div>`;
    root.innerHTML = h;
  }

  root.addEventListener("click", (ev) => {
    const th = ev.target.closest("thead th");
    if (!th) return;
    const col = th.dataset.col;
    if (model.get("sort_by") === col) model.set("ascending", !model.get("ascending"));
    else {
      model.set("sort_by", col);
      model.set("ascending", false);
    }
    model.save_changes();
    draw();
  });
  const traits = ["data", "higher_better", "measured", "correlations", "sort_by", "ascending", "note"];
  for (const t of traits) model.on(`change:${t}`, draw);
  draw();
  return () => {
    for (const t of traits) model.off(`change:${t}`, draw);
  };
}

export default { render };
