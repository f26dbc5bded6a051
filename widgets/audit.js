// The live audit: the loss curve above, a heatmap of watched places x steps below, one metric
// per cell chosen from a menu, flagged cells marked with the health verdict.
import { el, FONT_FAMILY, inkOn, number, scaleOf, viridis } from "./shapes.js";

const stores = new WeakMap();
const MAX_COLS = 240;

function storeOf(model) {
  let s = stores.get(model);
  if (!s) {
    s = { places: [], placeIndex: new Map(), steps: [], stepSet: new Set(), cells: new Map(), loss: [], metrics: new Set(), seq: 0, listeners: new Set(), flagged: 0 };
    stores.set(model, s);
  }
  return s;
}

function clear(s) {
  s.places = [];
  s.placeIndex = new Map();
  s.steps = [];
  s.stepSet = new Set();
  s.cells = new Map();
  s.loss = [];
  s.metrics = new Set();
  s.flagged = 0;
}

// Messages are columnar: loss = [steps, values]; places = [[where, steps, {metric: values},
// [[i, flags], ...]], ...], a value null where a fact did not carry that metric; the kernel
// sends the chosen metric's values only, and names every metric seen in `metrics`. From a
// kernel, values come as binary (see `plain`); the picture and a saved page's replies as JSON.
function take(s, msg) {
  for (const k of msg.metrics || []) s.metrics.add(k);
  const [lossSteps, lossValues] = msg.loss || [[], []];
  for (let i = 0; i < lossSteps.length; i++) s.loss.push([lossSteps[i], num(lossValues[i])]);
  let unsorted = false;
  for (const [where, steps, columns, flagged] of msg.places || []) {
    if (!s.placeIndex.has(where)) {
      s.placeIndex.set(where, s.places.length);
      s.places.push(where);
    }
    const flagsAt = new Map((flagged || []).map(([i, f]) => [i, f]));
    const names = Object.keys(columns || {});
    for (const k of names) s.metrics.add(k);
    for (let i = 0; i < steps.length; i++) {
      const step = steps[i];
      if (!s.stepSet.has(step)) {
        if (s.steps.length && step < s.steps[s.steps.length - 1]) unsorted = true;
        s.stepSet.add(step);
        s.steps.push(step);
      }
      const numbers = {};
      for (const k of names) {
        const v = columns[k][i];
        if (v !== null && v !== undefined) numbers[k] = num(v);
      }
      const flags = flagsAt.get(i) || [];
      const key = `${where}|${step}`;
      const had = s.cells.get(key);
      const merged = had ? { numbers: { ...had.numbers, ...numbers }, flags: [...new Set([...had.flags, ...flags])] } : { numbers, flags: [...flags] };
      if (merged.flags.length && !(had && had.flags.length)) s.flagged += 1;
      s.cells.set(key, merged);
    }
  }
  if (unsorted) s.steps.sort((a, b) => a - b);
}

// "absent" in a binary column: a NaN with a payload of its own (somatize/figures/_screen.py
// MISSING_BITS), told apart from a measured NaN by its bits; little-endian words
const HOLE_LO = 0x5a000001;
const HOLE_HI = 0x7ff8534d;

function bytesOf(b) {
  if (b instanceof ArrayBuffer) return b;
  // a DataView or typed array over part of a larger buffer, perhaps unaligned: copy it out
  return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
}

function fromBase64(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes.buffer;
}

// the bytes a binary column names: buffers[i] ({buffer: i}, from a kernel's message) or
// base64 text ({b64}, in the picture); null for a plain list
function bytesFor(c, buffers) {
  if (!c || typeof c !== "object" || Array.isArray(c)) return null;
  if (typeof c.b64 === "string") return fromBase64(c.b64);
  const raw = c.buffer !== undefined && buffers ? buffers[c.buffer] : null;
  return raw ? bytesOf(raw) : null;
}

// A column as the kernel sends it, as plain values: a list as it is; a binary one read as
// float64 (a hole as null, a measured NaN or infinity as itself), then the values kept aside
// (no numbers) put at their rows
function column(c, buffers) {
  if (Array.isArray(c)) return c;
  const bytes = bytesFor(c, buffers);
  if (!bytes) return [];
  const f = new Float64Array(bytes);
  const w = new Uint32Array(bytes);
  const out = new Array(f.length);
  for (let i = 0; i < f.length; i++) {
    const v = f[i];
    out[i] = v === v || w[2 * i] !== HOLE_LO || w[2 * i + 1] !== HOLE_HI ? v : null;
  }
  for (const [i, v] of c.odd || []) out[i] = v;
  return out;
}

// steps as a list, a run of consecutive steps {run: [first, count]}, or float64 ({b64})
function stepsOf(st) {
  if (Array.isArray(st)) return st;
  if (st && Array.isArray(st.run)) {
    const [first, count] = st.run;
    return Array.from({ length: count }, (_, i) => first + i);
  }
  const bytes = bytesFor(st, null);
  return bytes ? Array.from(new Float64Array(bytes)) : [];
}

// a message with binary columns and runs of steps, as the JSON shape `take` reads
function plain(msg, buffers) {
  const [lossSteps, lossValues] = msg.loss || [[], []];
  return {
    ...msg,
    loss: [stepsOf(lossSteps), column(lossValues, buffers)],
    places: (msg.places || []).map(([where, steps, columns, flagged]) => [
      where,
      stepsOf(steps),
      Object.fromEntries(Object.entries(columns || {}).map(([k, c]) => [k, column(c, buffers)])),
      flagged,
    ]),
  };
}

// JSON has no NaN or infinity: they come as text
function num(v) {
  if (typeof v !== "string") return v;
  if (v === "nan") return NaN;
  if (v === "inf") return Infinity;
  if (v === "-inf") return -Infinity;
  return v;
}

function receive(model, msg, buffers) {
  if (!msg || typeof msg !== "object") return;
  msg = plain(msg, buffers);
  const s = storeOf(model);
  if (msg.kind === "reset") {
    clear(s);
    take(s, msg);
    s.seq = msg.seq ?? 0;
  } else if (msg.kind === "append") {
    if (msg.seq !== undefined && msg.seq !== s.seq + 1 && s.seq !== 0) {
      // a gap: something was missed, ask for everything again
      model.send({ kind: "hello" });
    }
    take(s, msg);
    s.seq = msg.seq ?? s.seq + 1;
  } else return;
  s.live = true;
  for (const f of s.listeners) f();
}

// The `picture` trait: a compact copy of what the kernel saw, drawn when no kernel talks to
// this page (a saved notebook, a static page); once messages come, they win.
function fromPicture(model) {
  const s = storeOf(model);
  const p = model.get("picture");
  if (s.live || !p || !p.kind) return;
  clear(s);
  take(s, plain(p, []));
  s.seq = 0;
  for (const f of s.listeners) f();
}

function initialize({ model }) {
  const s = storeOf(model);
  const onMsg = (msg, buffers) => receive(model, msg, buffers);
  const onPicture = () => fromPicture(model);
  model.on("msg:custom", onMsg);
  model.on("change:picture", onPicture);
  s.onMsg = onMsg;
  fromPicture(model);
  // a page opened after facts arrived asks for them
  model.send({ kind: "hello" });
  return () => {
    model.off("msg:custom", onMsg);
    model.off("change:picture", onPicture);
  };
}

// a place name that would not fit the gutter keeps its end (the layer) behind an ellipsis;
// the tooltip has it whole
function fitted(name, width) {
  const most = Math.floor(width / 6.6);
  return name.length <= most ? name : `…${name.slice(name.length - most + 1)}`;
}

function bins(steps) {
  if (steps.length <= MAX_COLS) return steps.map((s) => [s]);
  const per = Math.ceil(steps.length / MAX_COLS);
  const out = [];
  for (let i = 0; i < steps.length; i += per) out.push(steps.slice(i, i + per));
  return out;
}

function lossPath(loss, x0, x1, y0, y1, stepLo, stepHi) {
  if (!loss.length) return { d: "", lo: null, hi: null };
  const vals = loss.map(([, v]) => v).filter((v) => Number.isFinite(v));
  const lo = Math.min(...vals);
  const hi = Math.max(...vals);
  const sx = (s) => (stepHi === stepLo ? (x0 + x1) / 2 : x0 + ((s - stepLo) / (stepHi - stepLo)) * (x1 - x0));
  const sy = (v) => (hi === lo ? (y0 + y1) / 2 : y1 - ((v - lo) / (hi - lo)) * (y1 - y0));
  const stride = Math.max(1, Math.floor(loss.length / 1500));
  let d = "";
  for (let i = 0; i < loss.length; i += stride) {
    const [s, v] = loss[i];
    if (!Number.isFinite(v)) continue;
    d += `${d ? "L" : "M"}${sx(s).toFixed(1)},${sy(v).toFixed(1)}`;
  }
  return { d, lo, hi };
}

function render({ model, el: host }) {
  if (!stores.has(model) || !storeOf(model).onMsg) initialize({ model });
  const s = storeOf(model);
  const root = document.createElement("div");
  root.className = "smz-audit";
  root.innerHTML = `
    <div class="smz-audit-head">
      <span class="smz-audit-title"></span>
      <label>metric <select class="smz-metric"></select></label>
      <span class="smz-audit-status"></span>
    </div>
    <div class="smz-audit-body"></div>
    <div class="smz-audit-legend"></div>
    <div class="smz-tooltip" hidden></div>`;
  host.appendChild(root);
  const select = root.querySelector(".smz-metric");
  const body = root.querySelector(".smz-audit-body");
  const status = root.querySelector(".smz-audit-status");
  const legend = root.querySelector(".smz-audit-legend");
  const tooltip = root.querySelector(".smz-tooltip");
  let pending = false;
  let layout = null;

  const chosen = () => {
    const m = model.get("metric");
    // the kernel sends the chosen metric's values only: one chosen whose values are on their
    // way stays chosen
    if (m && (s.metrics.has(m) || (model.get("metrics") || []).includes(m))) return m;
    return [...s.metrics][0] ?? m ?? "";
  };

  function syncMenu() {
    const have = [...select.options].map((o) => o.value);
    const want = [...new Set([...(model.get("metrics") || []), ...s.metrics])];
    if (want.join("\u0000") !== have.join("\u0000")) {
      select.replaceChildren(...want.map((m) => Object.assign(document.createElement("option"), { value: m, textContent: m })));
    }
    select.value = chosen();
  }

  function draw() {
    pending = false;
    root.querySelector(".smz-audit-title").textContent = model.get("title") || "live audit";
    syncMenu();
    const metric = chosen();
    const W = Math.max(360, root.clientWidth || host.clientWidth || 760);
    const labelW = Math.min(220, Math.max(60, ...s.places.map((p) => p.length * 6.6 + 12)));
    const cols = bins(s.steps);
    const plotW = W - labelW - 12;
    // room for at least 60 columns: a short run fills in from the left as it goes
    const cw = Math.max(1, Math.min(18, plotW / Math.max(60, cols.length)));
    const rh = 16;
    const lossH = 96;
    const top = lossH + 18;
    const H = top + Math.max(1, s.places.length) * rh + 22;
    const svg = el("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "font-family": FONT_FAMILY, class: "smz-audit-svg" });
    // loss curve, on the same step axis as the heatmap
    const stepLo = s.steps.length ? s.steps[0] : s.loss.length ? s.loss[0][0] : 0;
    const lastStep = s.loss.length ? s.loss[s.loss.length - 1][0] : stepLo;
    const stepHi = Math.max(s.steps.length ? s.steps[s.steps.length - 1] : stepLo, lastStep);
    const x0 = labelW;
    const x1 = labelW + Math.max(1, cols.length) * cw;
    const frameR = labelW + Math.max(60, cols.length) * cw;
    el("rect", { x: x0, y: 4, width: Math.max(1, frameR - x0), height: lossH - 8, fill: "none", stroke: "#d7dbe3", "stroke-width": 1 }, svg);
    el("text", { x: labelW - 8, y: lossH / 2 + 4, "font-size": 11, fill: "#5d6575", "font-weight": 600, "text-anchor": "end" }, svg).textContent = "loss";
    const lp = lossPath(s.loss, x0 + cw / 2, x1 - cw / 2, 10, lossH - 10, stepLo, stepHi);
    if (lp.d) {
      el("path", { d: lp.d, fill: "none", stroke: "#3d6fd9", "stroke-width": 1.6, class: "smz-loss" }, svg);
      // the range in the gutter beside the frame, where the curve never runs
      el("text", { x: labelW - 8, y: 16, "font-size": 10, fill: "#5d6575", "text-anchor": "end" }, svg).textContent = number(lp.hi);
      el("text", { x: labelW - 8, y: lossH - 10, "font-size": 10, fill: "#5d6575", "text-anchor": "end" }, svg).textContent = number(lp.lo);
      const last = s.loss[s.loss.length - 1];
      el("text", { x: x0, y: lossH + 10, "font-size": 10, fill: "#3d6fd9" }, svg).textContent = `step ${last[0]}: loss ${number(last[1])}`;
    }
    // heatmap
    const values = [];
    const grid = s.places.map((where) =>
      cols.map((steps) => {
        let v = null;
        let flags = [];
        let step = steps[steps.length - 1];
        for (const st of steps) {
          const c = s.cells.get(`${where}|${st}`);
          if (!c) continue;
          if (c.numbers[metric] !== undefined && c.numbers[metric] !== null) {
            v = c.numbers[metric];
            step = st;
          }
          if (c.flags.length) flags = [...new Set([...flags, ...c.flags])];
        }
        if (typeof v === "number" && Number.isFinite(v)) values.push(v);
        return { v, flags, step, steps };
      }),
    );
    const sc = scaleOf(values);
    const g = el("g", { class: "smz-heat" }, svg);
    s.places.forEach((where, r) => {
      const y = top + r * rh;
      el("text", { x: labelW - 6, y: y + rh - 4, "font-size": 11, fill: "#1f2430", "text-anchor": "end", class: "smz-place" }, g).textContent = fitted(where, labelW - 10);
      grid[r].forEach((cell, c) => {
        if (cell.v === null && !cell.flags.length) return;
        const ok = typeof cell.v === "number" && Number.isFinite(cell.v);
        const t = ok ? sc.t(cell.v) : 0;
        el("rect", {
          x: x0 + c * cw,
          y,
          width: Math.max(1, cw - (cw > 4 ? 1 : 0)),
          height: rh - 1,
          fill: ok ? viridis(t) : "#d9480f",
          class: `smz-cell${cell.flags.length ? " smz-flagged" : ""}`,
          "data-r": r,
          "data-c": c,
        }, g);
        if (cell.flags.length) {
          el("rect", { x: x0 + c * cw + 0.75, y: y + 0.75, width: Math.max(1, cw - 2.5), height: rh - 2.5, fill: "none", stroke: "#e03131", "stroke-width": 1.5, "pointer-events": "none" }, g);
          if (cw >= 9) el("text", { x: x0 + c * cw + cw / 2, y: y + rh - 4.5, "font-size": 10, "font-weight": 700, fill: ok ? inkOn(t) : "#fff", "text-anchor": "middle", "pointer-events": "none" }, g).textContent = "!";
        }
      });
    });
    if (s.steps.length) {
      const yb = top + s.places.length * rh + 14;
      el("text", { x: x0, y: yb, "font-size": 10, fill: "#5d6575" }, svg).textContent = `step ${s.steps[0]}`;
      if (x1 - x0 > 90) el("text", { x: x1, y: yb, "font-size": 10, fill: "#5d6575", "text-anchor": "end" }, svg).textContent = `step ${s.steps[s.steps.length - 1]}`;
    } else {
      el("text", { x: x0 + 8, y: top + 12, "font-size": 11, fill: "#8a93a6" }, svg).textContent = "waiting for health facts…";
    }
    body.replaceChildren(svg);
    layout = { grid, x0, top, cw, rh, metric };
    status.textContent = `${s.places.length} places · ${s.steps.length} steps${s.flagged ? ` · ${s.flagged} flagged` : ""}`;
    if (values.length) {
      const stops = Array.from({ length: 10 }, (_, i) => `${viridis(i / 9)} ${(i / 9) * 100}%`).join(",");
      legend.innerHTML = `<span class="smz-scale-label">${metric}${sc.log ? " (log)" : ""}</span><span>${number(sc.lo)}</span><span class="smz-bar" style="background:linear-gradient(90deg,${stops})"></span><span>${number(sc.hi)}</span><span class="smz-flag-key">flagged</span>`;
    } else if (metric && s.places.length) {
      const label = Object.assign(document.createElement("span"), { className: "smz-scale-label", textContent: metric });
      legend.replaceChildren(label);
    } else legend.innerHTML = "";
    root.dataset.cells = String(g.querySelectorAll(".smz-cell").length);
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
    schedule();
  });
  body.addEventListener("mousemove", (ev) => {
    const cell = ev.target.closest(".smz-cell");
    if (!cell || !layout) {
      tooltip.hidden = true;
      return;
    }
    const r = Number(cell.dataset.r);
    const c = Number(cell.dataset.c);
    const d = layout.grid[r][c];
    const where = s.places[r];
    const numbers = s.cells.get(`${where}|${d.step}`)?.numbers || {};
    const span = d.steps.length > 1 ? `steps ${d.steps[0]}–${d.steps[d.steps.length - 1]}` : `step ${d.step}`;
    let h = `<div class="smz-tt-title">${where}</div><div>${span}</div>`;
    for (const [k, v] of Object.entries(numbers)) h += `<div><span class="smz-k">${k}</span> ${number(v)}</div>`;
    if (d.flags.length) h += `<div class="smz-flags">${d.flags.join(", ")}</div>`;
    tooltip.innerHTML = h;
    tooltip.hidden = false;
    const box = root.getBoundingClientRect();
    let x = ev.clientX - box.left + 14;
    if (x + 240 > box.width) x = Math.max(0, ev.clientX - box.left - 250);
    tooltip.style.left = `${x}px`;
    tooltip.style.top = `${ev.clientY - box.top + 14}px`;
  });
  body.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
  const onTrait = () => schedule();
  model.on("change:metric", onTrait);
  model.on("change:metrics", onTrait);
  model.on("change:title", onTrait);
  draw();
  return () => {
    s.listeners.delete(schedule);
    model.off("change:metric", onTrait);
    model.off("change:metrics", onTrait);
    model.off("change:title", onTrait);
  };
}

export default { initialize, render };
