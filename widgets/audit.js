// The live audit's browser half: the loss plot above (axes, ticks, a log scale, smoothing, a
// curve per run), a heatmap below (a row per watched place and run, a column per step, one
// metric per cell, a lane under each cell marking a flagged step), a legend for every colour
// and mark, a tooltip that explains the metric. It keeps every metric the kernel sends, so a
// metric chosen from the menu is drawn at once, also while the kernel is busy with a fit.
import { initialize, storeOf } from "./audit_store.js";
import { counted, esc, FONT_FAMILY, number, scaleOf, smoothed, tickLabels, ticks, viridis } from "./common.js";

const FAMILY = { numeric: "#e03131", signal: "#f76707", activation: "#c2255c", step: "#1971c2", capacity: "#7048e8" };
const NO_NUMBER = "#e03131";
const ABSENT = "#f1f3f5";
const RUNS = ["#3d6fd9", "#e8590c", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285"];
const ROW = 16;
// what to say of a loss that barely moves (spans under 5 % of its mean): its axis, stretched
// to fill the plot, is not to be read as a curve that learns (as _audit_face.flat_note says)
function flatNote(lo, hi, mean) {
  if (mean === 0 || hi - lo >= 0.05 * Math.abs(mean)) return "";
  return `flat: it spans ${number(hi - lo)}, ${number((100 * (hi - lo)) / Math.abs(mean))}% of its mean`;
}

// label baselines moved apart to be `gap` apart at least, each as near its wish as that
// allows, kept within [lo, hi] while there is room (as _audit_face._spread does)
function spread(ys, gap, lo, hi) {
  const order = ys.map((_, i) => i).sort((a, b) => ys[a] - ys[b]);
  const out = [...ys];
  let prev = -Infinity;
  for (const k of order) prev = out[k] = Math.max(out[k], prev + gap, lo);
  let next = Infinity;
  for (const k of [...order].reverse()) next = out[k] = Math.min(out[k], next - gap, hi);
  return out;
}

// the rows: each place, once per run that has it
function rowsOf(s) {
  const places = [];
  for (const run of s.runs.values()) for (const w of run.places.keys()) if (!places.includes(w)) places.push(w);
  const out = [];
  for (const w of places) for (const [name, run] of s.runs) if (run.places.has(w)) out.push({ where: w, run: name, place: run.places.get(w) });
  return out;
}

function render({ model, el: host }) {
  if (!storeOf(model).started) initialize({ model });
  const s = storeOf(model);
  const root = document.createElement("div");
  root.className = "smz-audit";
  root.innerHTML = `
    <div class="smz-audit-head">
      <span class="smz-audit-title"></span>
      <label>metric <select class="smz-metric"></select></label>
      <span class="smz-about"></span>
    </div>
    <div class="smz-loss-head"><label><input type="checkbox" class="smz-log"> log scale</label>
      <label>smoothing <input type="range" class="smz-smooth" min="0" max="0.99" step="0.01"></label>
      <span class="smz-audit-status"></span></div>
    <div class="smz-loss-box"></div>
    <canvas class="smz-heat"></canvas>
    <div class="smz-audit-legend"></div>`;
  host.appendChild(root);
  const tooltip = document.createElement("div");
  tooltip.className = "smz-audit-tip";
  tooltip.hidden = true;
  document.body.appendChild(tooltip); // above everything: never clipped by the output area
  const select = root.querySelector(".smz-metric");
  const lossBox = root.querySelector(".smz-loss-box");
  const canvas = root.querySelector(".smz-heat");
  const legend = root.querySelector(".smz-audit-legend");
  const status = root.querySelector(".smz-audit-status");
  const logBox = root.querySelector(".smz-log");
  const smoothBox = root.querySelector(".smz-smooth");
  let pending = false;
  let grid = null; // what the heatmap shows, for the tooltip
  let lossGeom = null;
  const explain = () => model.get("explain") || {};
  const runLabel = (name) => name || model.get("title") || "this run";

  const chosen = () => {
    const m = model.get("metric");
    if (m) return m;
    return s.metrics.includes("update_ratio") ? "update_ratio" : s.metrics.includes("grad_norm") ? "grad_norm" : s.metrics[0] || "";
  };

  function syncMenu() {
    const want = [...new Set([...(model.get("metrics") || []), ...s.metrics])];
    const have = [...select.options].map((o) => o.value);
    if (want.join("\u0000") !== have.join("\u0000")) {
      const about = explain().metrics || {};
      select.replaceChildren(...want.map((m) => Object.assign(document.createElement("option"), { value: m, textContent: m, title: about[m] || "" })));
    }
    select.value = chosen();
  }

  // with several runs, what names each curve at its end: its name cut on the right to 130 px
  // where it does not fit, and its last loss (as _audit_face._run_labels says)
  function runLabels(ctx) {
    const out = new Map();
    if (s.runs.size < 2) return out;
    ctx.font = `10px ${FONT_FAMILY}`;
    for (const [name, r] of s.runs) {
      if (!r.lossValues.length) continue;
      const full = runLabel(name);
      let cut = full;
      const wide = (t) => ctx.measureText(t).width > 130;
      while (wide(full) && cut.length > 1 && wide(`${cut}…`)) cut = cut.slice(0, -1);
      out.set(name, `${cut === full ? full : `${cut}…`} ${number(r.lossValues[r.lossValues.length - 1])}`);
    }
    return out;
  }

  function drawLoss(width, x0, x1, sx, named) {
    const h = 130;
    const runs = [...s.runs.entries()].filter(([, r]) => r.lossSteps.length);
    const all = runs.flatMap(([, r]) => r.lossValues.filter(Number.isFinite));
    const log = !!model.get("log_loss") && all.length > 0 && Math.min(...all) > 0;
    const weight = Number(model.get("smoothing") ?? 0.6);
    let svg = `<svg class="smz-loss-svg" width="${width}" height="${h + 8}" font-family="${esc(FONT_FAMILY)}">`;
    svg += `<rect x="${x0}" y="0.5" width="${x1 - x0}" height="${h}" fill="none" stroke="#d7dbe3"/>`;
    svg += `<text x="12" y="${h / 2 + 4}" font-size="11" font-weight="700" fill="#5d6575">loss${log ? " (log)" : ""}</text>`;
    if (!all.length) {
      lossBox.innerHTML = `${svg}<text x="${x0 + 8}" y="18" font-size="11" fill="#8a93a6">no loss yet</text></svg>`;
      lossGeom = null;
      return;
    }
    let lo = Math.min(...all);
    let hi = Math.max(...all);
    const note = all.length >= 10 ? flatNote(lo, hi, all.reduce((a, v) => a + v, 0) / all.length) : "";
    if (note) svg += `<text x="${x0 + 8}" y="14" font-size="10" font-style="italic" fill="#5d6575">${esc(note)}</text>`;
    if (lo === hi) [lo, hi] = log ? [lo * 0.9, hi * 1.1] : [lo - 0.5, hi + 0.5];
    const f = log ? Math.log10 : (v) => v;
    let a = f(lo);
    let b = f(hi);
    const pad = (b - a) * 0.06;
    a -= pad;
    b += pad;
    const sy = (v) => 0.5 + h - ((f(v) - a) / (b - a)) * h;
    const marks = ticks(log ? 10 ** a : a, log ? 10 ** b : b, 5, log).filter((t) => sy(t) >= 0 && sy(t) <= h + 1);
    tickLabels(marks).forEach((label, i) => {
      const y = sy(marks[i]);
      svg += `<line x1="${x0}" x2="${x1}" y1="${y.toFixed(1)}" y2="${y.toFixed(1)}" stroke="#d7dbe3" stroke-dasharray="2 3"/>`;
      svg += `<text x="${x0 - 5}" y="${(y + 3.5).toFixed(1)}" font-size="10" fill="#5d6575" text-anchor="end">${esc(label)}</text>`;
    });
    const names = [...s.runs.keys()];
    const ends = [];
    runs.forEach(([name, r], n) => {
      const colour = RUNS[names.indexOf(name) % RUNS.length];
      const stride = Math.max(1, Math.floor(r.lossSteps.length / 1500));
      const sm = smoothed(r.lossValues, weight);
      const path = (vals) => {
        let d = "";
        for (let i = 0; i < r.lossSteps.length; i += stride) {
          const v = vals[i];
          if (!Number.isFinite(v) || (log && v <= 0)) continue;
          d += `${d ? "L" : "M"}${sx(r.lossSteps[i]).toFixed(1)},${sy(v).toFixed(1)}`;
        }
        return d;
      };
      if (weight > 0) svg += `<path class="smz-loss-raw" d="${path(r.lossValues)}" fill="none" stroke="${colour}" stroke-opacity="0.28" stroke-width="1"/>`;
      svg += `<path class="smz-loss" d="${path(sm)}" fill="none" stroke="${colour}" stroke-width="1.8"/>`;
      const last = r.lossValues[r.lossValues.length - 1];
      const step = r.lossSteps[r.lossSteps.length - 1];
      if (named.size) {
        const drawn = sm.filter((v) => Number.isFinite(v) && (v > 0 || !log));
        const wish = drawn.length ? sy(drawn[drawn.length - 1]) + 3.5 : 12;
        ends.push({ colour, wish, text: named.get(name), tip: `${runLabel(name)}: step ${step}: ${number(last)}` });
        return;
      }
      svg += `<text x="${x1 + 6}" y="${12 + 13 * n}" font-size="10" fill="${colour}">${esc(`step ${step}: ${number(last)}`)}</text>`;
    });
    spread(ends.map((e) => e.wish), 12, 9.5, h + 3.5).forEach((y, i) => {
      const e = ends[i];
      svg += `<text x="${x1 + 6}" y="${y.toFixed(1)}" font-size="10" fill="${e.colour}">${esc(e.text)}<title>${esc(e.tip)}</title></text>`;
    });
    svg += `<line class="smz-cross" x1="0" x2="0" y1="0" y2="${h}" stroke="#868e96" stroke-dasharray="3 3" visibility="hidden"/></svg>`;
    lossBox.innerHTML = svg;
    lossGeom = { x0, x1, runs, weight, sx };
  }

  function draw() {
    pending = false;
    root.querySelector(".smz-audit-title").textContent = model.get("title") || "live audit";
    syncMenu();
    const metric = chosen();
    root.querySelector(".smz-about").textContent = (explain().metrics || {})[metric] || "";
    logBox.checked = !!model.get("log_loss");
    smoothBox.value = String(model.get("smoothing") ?? 0.6);
    const width = Math.max(420, root.clientWidth || host.clientWidth || 900);
    const rows = rowsOf(s);
    const many = s.runs.size > 1;
    const ctx0 = canvas.getContext("2d");
    ctx0.font = `11px ${FONT_FAMILY}`;
    let labelW = 90;
    for (const r of rows) labelW = Math.max(labelW, Math.min(220, ctx0.measureText(r.where).width + 14));
    if (many) labelW += 14;
    const x0 = labelW;
    const named = runLabels(ctx0); // measured at their 10 px
    let right = 110;
    for (const text of named.values()) right = Math.max(right, ctx0.measureText(text).width + 14);
    const x1 = width - right;
    // an audit of losses only (no place watched) draws the loss plot alone: no metric, no legend
    root.querySelector(".smz-metric").parentElement.hidden = !rows.length;
    root.querySelector(".smz-about").hidden = !rows.length;
    // the steps every place saw, in order; binned to two pixels a column at least
    const stepSet = new Set();
    for (const r of rows) for (const st of r.place.steps) stepSet.add(st);
    const steps = [...stepSet].sort((a, b) => a - b);
    const columnsMost = Math.max(1, Math.floor((x1 - x0) / 2));
    const per = Math.max(1, Math.ceil(steps.length / columnsMost));
    const nb = Math.ceil(steps.length / per);
    const binOf = new Map(steps.map((st, i) => [st, Math.floor(i / per)]));
    const cw = (x1 - x0) / Math.max(60, nb);
    const sx = (st) => {
      const k = binOf.get(st);
      if (k !== undefined) return x0 + (k + 0.5) * cw;
      if (!steps.length) {
        const ls = [...s.runs.values()].flatMap((r) => r.lossSteps);
        const lo = Math.min(...ls);
        const hi = Math.max(...ls);
        return x0 + ((st - lo) / Math.max(1, hi - lo)) * (x1 - x0);
      }
      const fr = (st - steps[0]) / Math.max(1, steps[steps.length - 1] - steps[0]);
      return x0 + cw / 2 + fr * (nb - 1) * cw;
    };
    drawLoss(width, x0, x1, sx, named);
    // the heatmap: a value per bin (its last), flags joined
    const cells = rows.map((r) => {
      const col = r.place.cols.get(metric);
      const vals = new Array(nb).fill(undefined);
      const flags = new Array(nb).fill(null);
      const raised = {};
      r.place.steps.forEach((st, i) => {
        const k = binOf.get(st);
        const v = col ? col[i] : null;
        if (v !== null && v !== undefined) vals[k] = v;
        else if (vals[k] === undefined) vals[k] = null;
        const f = r.place.flags.get(i);
        if (f && f.length) {
          flags[k] = flags[k] ? [...new Set([...flags[k], ...f])] : [...f];
          for (const x of f) raised[x] = (raised[x] || 0) + 1;
        }
      });
      return { vals, flags, raised };
    });
    const values = cells.flatMap((c) => c.vals.filter((v) => typeof v === "number" && Number.isFinite(v)));
    const kind = s.kinds[metric];
    const sc = scaleOf(values);
    const top = 6;
    const H = rows.length ? top + rows.length * ROW + 24 : 20;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(H * dpr);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${H}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, H);
    ctx.font = `11px ${FONT_FAMILY}`;
    const fam = explain().families || {};
    const families = new Set();
    const names = [...s.runs.keys()];
    rows.forEach((r, n) => {
      const y = top + n * ROW;
      ctx.fillStyle = "#1f2430";
      ctx.textAlign = "right";
      let name = r.where;
      const room = labelW - 14 - (many ? 14 : 0);
      while (name.length > 2 && ctx.measureText(name).width > room) name = `…${name.slice(2)}`;
      ctx.fillText(name, labelW - 6, y + 10);
      if (many) {
        ctx.fillStyle = RUNS[names.indexOf(r.run) % RUNS.length];
        ctx.fillRect(labelW - 4, y + 1, 3, 10);
      }
      const c = cells[n];
      for (let k = 0; k < nb; k++) {
        const v = c.vals[k];
        if (v === undefined) continue;
        const x = x0 + k * cw;
        let fill = ABSENT;
        if (typeof v === "boolean" || kind === "bool") fill = viridis(v ? 1 : 0);
        else if (typeof v === "number") fill = Number.isFinite(v) ? viridis(Math.round(sc.t(v) * 63) / 63) : NO_NUMBER;
        ctx.fillStyle = fill;
        ctx.fillRect(x, y, Math.max(0.6, cw - (cw > 3 ? 0.4 : 0)), 11);
        if (c.flags[k]) {
          const f = [...c.flags[k]].sort()[0].split("(")[0];
          const family = fam[f] || "numeric";
          families.add(family);
          ctx.fillStyle = FAMILY[family];
          ctx.fillRect(x, y + 12, Math.max(0.8, cw), 3);
        }
      }
      const raised = Object.entries(c.raised).sort((p, q) => q[1] - p[1]);
      if (raised.length) {
        ctx.textAlign = "left";
        ctx.font = `10px ${FONT_FAMILY}`;
        ctx.fillStyle = FAMILY[fam[raised[0][0].split("(")[0]] || "numeric"];
        ctx.fillText(raised.slice(0, 2).map(([f, k]) => `${f} ×${k}`).join(", "), x1 + 6, y + 10, width - x1 - 8);
        ctx.font = `11px ${FONT_FAMILY}`;
      }
    });
    // the step axis: under the heatmap, or (losses only) right under the loss plot
    const yb = rows.length ? top + rows.length * ROW : -2;
    const axis = rows.length ? steps : [...new Set([...s.runs.values()].flatMap((r) => r.lossSteps))].sort((a, b) => a - b);
    ctx.fillStyle = "#5d6575";
    ctx.font = `10px ${FONT_FAMILY}`;
    if (axis.length) {
      ctx.textAlign = "center";
      let lastX = -1e9;
      for (const t of ticks(axis[0], axis[axis.length - 1], 7, false, true)) {
        let near = axis[0];
        for (const st of axis) if (Math.abs(st - t) < Math.abs(near - t)) near = st;
        if (sx(near) - lastX < 36) continue; // labels that would touch are left out
        ctx.fillText(number(t), sx(near), yb + 14);
        lastX = sx(near);
      }
      ctx.textAlign = "right";
      ctx.fillText("step", x0 - 6, yb + 14);
    }
    grid = { rows, cells, x0, top, cw, nb, per, steps, metric, labelW };
    root.dataset.grid = `${x0} ${top} ${cw} ${ROW} ${nb}`; // where the cells are, for a test
    // the legend: every colour and mark drawn
    let h = "";
    if (values.length && kind !== "bool") {
      const stops = Array.from({ length: 10 }, (_, i) => `${viridis(i / 9)} ${(i / 9) * 100}%`).join(",");
      h += `<span class="smz-key"><b>${esc(metric)}${sc.log ? " (log)" : ""}</b> ${esc(number(sc.lo))}<span class="smz-bar" style="background:linear-gradient(90deg,${stops})"></span>${esc(number(sc.hi))}</span>`;
    } else if (kind === "bool") {
      h += `<span class="smz-key"><span class="smz-swatch" style="background:${viridis(0)}"></span>false <span class="smz-swatch" style="background:${viridis(1)}"></span>true</span>`;
    }
    if (rows.length) {
      h += `<span class="smz-key"><span class="smz-swatch" style="background:${ABSENT};border:1px solid #ced4da"></span>not measured</span>`;
      h += `<span class="smz-key"><span class="smz-swatch" style="background:${NO_NUMBER}"></span>no number (NaN, ∞)</span>`;
      for (const f of Object.keys(FAMILY)) if (families.has(f)) h += `<span class="smz-key" title="a step the health verdict flagged"><span class="smz-lane" style="background:${FAMILY[f]}"></span>flag: ${f}</span>`;
      if (many) names.forEach((n, k) => (h += `<span class="smz-key"><span class="smz-swatch" style="background:${RUNS[k % RUNS.length]}"></span>run ${esc(runLabel(n))}</span>`));
    }
    legend.innerHTML = h;
    const flagged = cells.reduce((a, c) => a + c.flags.filter(Boolean).length, 0);
    const held = s.binnedFrom > steps.length ? ` (binned from ${s.binnedFrom})` : "";
    status.textContent = !rows.length ? "" : `${counted(new Set(rows.map((r) => r.where)).size, "place")} · ${counted(steps.length, "step")}${held}${flagged ? ` · ${flagged} flagged` : ""}`;
    root.dataset.cells = String(cells.reduce((a, c) => a + c.vals.filter((v) => v !== undefined).length, 0));
    root.dataset.coloured = String(values.length);
    root.dataset.metric = metric;
  }

  const schedule = () => {
    if (pending) return;
    pending = true;
    (window.requestAnimationFrame || ((f) => setTimeout(f, 16)))(draw);
  };
  s.listeners.add(schedule);
  select.addEventListener("change", () => {
    model.set("metric", select.value);
    model.save_changes();
    draw(); // from what is already here: nothing needs to come from the kernel
  });
  logBox.addEventListener("change", () => {
    model.set("log_loss", logBox.checked);
    model.save_changes();
    draw();
  });
  smoothBox.addEventListener("input", () => {
    model.set("smoothing", Number(smoothBox.value));
    model.save_changes();
    schedule();
  });

  const place = (ev) => {
    tooltip.hidden = false;
    const tw = tooltip.offsetWidth;
    const th = tooltip.offsetHeight;
    let x = ev.clientX + 14;
    let y = ev.clientY + 14;
    if (x + tw > window.innerWidth - 4) x = Math.max(4, ev.clientX - tw - 12);
    if (y + th > window.innerHeight - 4) y = Math.max(4, ev.clientY - th - 12);
    tooltip.style.left = `${x}px`;
    tooltip.style.top = `${y}px`;
  };
  canvas.addEventListener("mousemove", (ev) => {
    if (!grid) return;
    const r = canvas.getBoundingClientRect();
    const x = ev.clientX - r.left;
    const y = ev.clientY - r.top;
    const n = Math.floor((y - grid.top) / ROW);
    const k = Math.floor((x - grid.x0) / grid.cw);
    if (n < 0 || n >= grid.rows.length || k < 0 || k >= grid.nb || grid.cells[n].vals[k] === undefined) {
      tooltip.hidden = true;
      return;
    }
    const row = grid.rows[n];
    const first = grid.steps[k * grid.per];
    const last = grid.steps[Math.min(grid.steps.length - 1, (k + 1) * grid.per - 1)];
    // the numbers of the bin's last row that has the chosen metric
    let at = -1;
    row.place.steps.forEach((st, i) => {
      if (st >= first && st <= last) at = i;
    });
    const ex = explain();
    let h = `<div class="smz-tt-title">${esc(row.where)}${s.runs.size > 1 ? ` · ${esc(runLabel(row.run))}` : ""}</div>`;
    h += `<div>${first === last ? `step ${first}` : `steps ${first}–${last}`}</div>`;
    const about = (ex.metrics || {})[grid.metric];
    if (about) h += `<div class="smz-tt-about"><b>${esc(grid.metric)}</b>: ${esc(about)}</div>`;
    if (at >= 0) {
      for (const [m, col] of row.place.cols) {
        const v = col[at];
        if (v === null || v === undefined) continue;
        const shown = s.kinds[m] === "bool" ? (v ? "true" : "false") : number(v);
        h += `<div class="${m === grid.metric ? "smz-tt-chosen" : ""}"><span class="smz-k">${esc(m)}</span> ${esc(shown)}</div>`;
      }
    }
    const flags = grid.cells[n].flags[k];
    if (flags) for (const f of flags) h += `<div class="smz-flags">${esc(f)}: ${esc((ex.flags || {})[f.split("(")[0]] || "")}</div>`;
    tooltip.innerHTML = h;
    place(ev);
  });
  canvas.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
  lossBox.addEventListener("mousemove", (ev) => {
    if (!lossGeom) return;
    const r = lossBox.getBoundingClientRect();
    const x = ev.clientX - r.left;
    const cross = lossBox.querySelector(".smz-cross");
    if (x < lossGeom.x0 || x > lossGeom.x1) {
      tooltip.hidden = true;
      if (cross) cross.setAttribute("visibility", "hidden");
      return;
    }
    let h = "";
    const names = [...s.runs.keys()];
    for (const [name, run] of lossGeom.runs) {
      // the loss step drawn nearest the pointer (steps ascend: halve the range)
      const steps = run.lossSteps;
      let lo = 0;
      let hi = steps.length - 1;
      while (hi - lo > 1) {
        const mid = (lo + hi) >> 1;
        if (lossGeom.sx(steps[mid]) < x) lo = mid;
        else hi = mid;
      }
      const best = Math.abs(lossGeom.sx(steps[lo]) - x) <= Math.abs(lossGeom.sx(steps[hi]) - x) ? lo : hi;
      const sm = smoothed(run.lossValues.slice(0, best + 1), lossGeom.weight);
      h += `<div><span style="color:${RUNS[names.indexOf(name) % RUNS.length]}">■</span> ${names.length > 1 ? `${esc(runLabel(name))} · ` : ""}step ${steps[best]}: ${esc(number(run.lossValues[best]))}${lossGeom.weight > 0 ? ` (smoothed ${esc(number(sm[sm.length - 1]))})` : ""}</div>`;
    }
    if (cross) {
      cross.setAttribute("x1", x);
      cross.setAttribute("x2", x);
      cross.setAttribute("visibility", "visible");
    }
    tooltip.innerHTML = `<div class="smz-tt-title">loss</div>${h}`;
    place(ev);
  });
  lossBox.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
    const cross = lossBox.querySelector(".smz-cross");
    if (cross) cross.setAttribute("visibility", "hidden");
  });
  const traits = ["metric", "metrics", "title", "explain", "log_loss", "smoothing"];
  for (const t of traits) model.on(`change:${t}`, schedule);
  const watcher = typeof ResizeObserver === "function" ? new ResizeObserver(schedule) : null;
  if (watcher) watcher.observe(root);
  draw();
  return () => {
    s.listeners.delete(schedule);
    for (const t of traits) model.off(`change:${t}`, schedule);
    if (watcher) watcher.disconnect();
    tooltip.remove();
  };
}

export default { initialize, render };
