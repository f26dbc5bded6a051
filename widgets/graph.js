// The graph figure: a graph's nodes left to right, each open into its layers, laid out by ELK.
import ELK from "elkjs/lib/elk.bundled.js";
import { buildScene, layoutScene, paramsText } from "./scene.js";
import { count, el, family, FONT_FAMILY, inkOn, number, outline, scaleOf, THEMES, viridis } from "./shapes.js";

const elk = new ELK();

function isDark() {
  const b = document.body;
  if (b && b.dataset && b.dataset.jpThemeLight === "false") return true;
  return false;
}

function roundedPath(points, r = 6) {
  if (points.length < 2) return "";
  let d = `M${points[0].x},${points[0].y}`;
  for (let i = 1; i < points.length - 1; i++) {
    const p = points[i - 1];
    const q = points[i];
    const n = points[i + 1];
    const d1 = Math.hypot(q.x - p.x, q.y - p.y);
    const d2 = Math.hypot(n.x - q.x, n.y - q.y);
    const rr = Math.min(r, d1 / 2, d2 / 2);
    const a = { x: q.x - ((q.x - p.x) / (d1 || 1)) * rr, y: q.y - ((q.y - p.y) / (d1 || 1)) * rr };
    const b = { x: q.x + ((n.x - q.x) / (d2 || 1)) * rr, y: q.y + ((n.y - q.y) / (d2 || 1)) * rr };
    d += ` L${a.x},${a.y} Q${q.x},${q.y} ${b.x},${b.y}`;
  }
  const last = points[points.length - 1];
  return `${d} L${last.x},${last.y}`;
}

function walk(node, fn) {
  for (const c of node.children || []) {
    fn(c);
    walk(c, fn);
  }
}

function edgesOf(node, out = []) {
  for (const e of node.edges || []) out.push(e);
  for (const c of node.children || []) edgesOf(c, out);
  return out;
}

const PILL = {
  device: ["#2f6fdf", "#fff"],
  host: ["#7a4fd0", "#fff"],
  cached: ["#c77d0a", "#fff"],
  frozen: ["#2a9fd6", "#fff"],
  mapped: ["#2f9e44", "#fff"],
};

// Paint a laid-out scene into a fresh <svg>. Returns it.
export function paint(laid, meta, { colour = {}, theme = THEMES.light } = {}) {
  const W = Math.ceil(laid.width || 10);
  const H = Math.ceil(laid.height || 10);
  const svg = el("svg", {
    xmlns: "http://www.w3.org/2000/svg",
    viewBox: `0 0 ${W} ${H}`,
    width: W,
    height: H,
    "font-family": FONT_FAMILY,
    class: "smz-graph-svg",
  });
  const defs = el("defs", {}, svg);
  for (const [name, col] of [["edge", theme.edge], ["skip", theme.skip]]) {
    const m = el("marker", { id: `smz-arrow-${name}`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: col }, m);
  }
  el("rect", { x: 0, y: 0, width: W, height: H, fill: theme.bg }, svg);
  const gBoxes = el("g", { class: "smz-containers" }, svg);
  const gEdges = el("g", { class: "smz-edges" }, svg);
  const gLeaves = el("g", { class: "smz-layers" }, svg);
  const cscale = scaleOf(Object.values(colour || {}));
  const fillFor = (key) => {
    if (!colour || !(key in colour) || typeof colour[key] !== "number") return null;
    const t = cscale.t(colour[key]);
    return { fill: viridis(t), ink: inkOn(t), value: colour[key] };
  };

  const items = [];
  walk(laid, (c) => items.push(c));
  for (const c of items) {
    const m = meta.get(c.id);
    if (!m) continue;
    if (m.type === "group") {
      const g = el("g", { class: "smz-group", "data-id": c.id }, gBoxes);
      el("rect", { x: c.x, y: c.y, width: c.width, height: c.height, rx: 8, fill: "none", stroke: theme.group, "stroke-dasharray": "5 4", "stroke-width": 1 }, g);
      el("text", { x: c.x + 10, y: c.y + 15, "font-size": 11, fill: theme.muted }, g).textContent = m.label;
    } else if (m.type === "node") {
      const col = fillFor(m.id);
      const g = el("g", { class: `smz-node${m.open ? " smz-open" : ""}`, "data-id": c.id, "data-node": m.id, cursor: m.hasInside ? "pointer" : "default" }, gBoxes);
      const frozen = !!m.node.frozen;
      el("rect", {
        x: c.x, y: c.y, width: c.width, height: c.height, rx: 8,
        fill: col ? col.fill : theme.box,
        stroke: frozen ? "#2a9fd6" : theme.boxStroke,
        "stroke-width": frozen ? 2 : 1.2,
      }, g);
      const ink = col ? col.ink : theme.text;
      const cx = m.open ? c.x + 12 : c.x + c.width / 2;
      const anchor = m.open ? "start" : "middle";
      el("text", { x: cx, y: c.y + 19, "font-size": 13, "font-weight": 700, fill: ink, "text-anchor": anchor, class: "smz-title" }, g).textContent = m.id;
      el("text", { x: cx, y: c.y + 34, "font-size": 11, fill: col ? ink : theme.muted, "text-anchor": anchor }, g).textContent =
        m.open ? `${m.node.kind ?? ""}${m.params ? ` · ${paramsText(m.params)}` : ""}  ▾` : m.sub;
      if (m.pills.length) {
        let width = m.pills.reduce((a, p) => a + p.text.length * 6 + 16, 0);
        let x = m.open ? c.x + 12 : c.x + (c.width - width) / 2;
        for (const p of m.pills) {
          const w = p.text.length * 6 + 12;
          const [bg, fg] = PILL[p.kind];
          const pg = el("g", { class: `smz-pill smz-pill-${p.kind}` }, g);
          el("rect", { x, y: c.y + 42, width: w, height: 14, rx: 7, fill: bg }, pg);
          el("text", { x: x + w / 2, y: c.y + 52.5, "font-size": 9.5, fill: fg, "text-anchor": "middle", "font-weight": 600 }, pg).textContent = p.text;
          x += w + 4;
        }
        width = 0;
      }
    } else if (m.type === "block") {
      const g = el("g", { class: `smz-block${m.foldable ? " smz-foldable" : ""}${m.open ? " smz-expanded" : ""}`, "data-id": c.id, "data-block": `${m.node}:${m.path}`, cursor: m.foldable ? "pointer" : "default" }, gBoxes);
      el("rect", { x: c.x, y: c.y, width: c.width, height: c.height, rx: 6, fill: theme.blockFill, stroke: theme.block, "stroke-dasharray": "4 3", "stroke-width": 1.2 }, g);
      const label = m.foldable ? `${m.open ? "▾" : "▸"} ${m.label}` : m.label;
      el("text", { x: c.x + 8, y: c.y + 15, "font-size": 11, "font-weight": 600, fill: theme.block, class: "smz-block-label" }, g).textContent = label;
      if (m.foldable && !m.open) {
        // the stack behind a folded block: it is N of these
        el("rect", { x: c.x + 4, y: c.y + 4, width: c.width, height: c.height, rx: 6, fill: "none", stroke: theme.block, "stroke-opacity": 0.35, "stroke-width": 1 }, g).setAttribute("class", "smz-stack");
      }
    } else if (m.type === "layer") {
      const col = fillFor(`${m.node}.${m.path}`);
      const fam = family(m.kind, m.label);
      const g = el("g", { class: `smz-layer smz-kind-${fam.name}`, "data-id": c.id, transform: `translate(${c.x},${c.y})` }, gLeaves);
      el("path", {
        d: outline(fam.name, c.width, c.height),
        fill: col ? col.fill : theme.inner,
        stroke: fam.hue,
        "stroke-width": 1.4,
        "stroke-dasharray": fam.name === "dropout" ? "3 2" : null,
      }, g);
      if (!col) el("path", { d: outline(fam.name, c.width, c.height), fill: fam.hue, "fill-opacity": 0.13, stroke: "none" }, g);
      const ink = col ? col.ink : theme.text;
      const y0 = m.sub ? 16 : c.height / 2 + 4;
      el("text", { x: c.width / 2, y: y0, "font-size": 12, "font-weight": 600, fill: ink, "text-anchor": "middle" }, g).textContent = m.label;
      if (m.sub) el("text", { x: c.width / 2, y: 30, "font-size": 10.5, "font-style": "italic", fill: col ? ink : theme.muted, "text-anchor": "middle" }, g).textContent = m.sub;
    }
  }
  // edges, with the ones that skip ahead (residuals, joins) in the accent colour
  const all = edgesOf(laid);
  const incoming = new Map();
  for (const e of all) {
    const t = e.targets[0];
    if (!incoming.has(t)) incoming.set(t, []);
    incoming.get(t).push(e);
  }
  const rank = new Map([...meta.keys()].map((k, i) => [k, i]));
  for (const e of all) {
    const sections = e.sections || [];
    const ins = incoming.get(e.targets[0]);
    const inner = !e.id.startsWith("e:top:");
    let skip = false;
    if (inner && ins.length > 1) {
      const main = ins.reduce((a, b) => ((rank.get(b.sources[0]) ?? 0) > (rank.get(a.sources[0]) ?? 0) ? b : a));
      skip = main !== e;
    }
    for (const s of sections) {
      const pts = [s.startPoint, ...(s.bendPoints || []), s.endPoint];
      el("path", {
        d: roundedPath(pts),
        fill: "none",
        stroke: skip ? theme.skip : theme.edge,
        "stroke-width": skip ? 1.6 : 1.3,
        "marker-end": `url(#smz-arrow-${skip ? "skip" : "edge"})`,
        class: skip ? "smz-edge smz-skip" : "smz-edge",
        "data-from": e.sources[0],
        "data-to": e.targets[0],
      }, gEdges);
    }
  }
  return svg;
}

function tooltipHtml(m, colour) {
  const esc = (s) => String(s).replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]);
  const row = (k, v) => `<div><span class="smz-k">${esc(k)}</span> ${esc(v)}</div>`;
  if (m.type === "node") {
    const n = m.node;
    let h = `<div class="smz-tt-title">${esc(m.id)}</div>${row("kind", n.kind ?? "?")}`;
    if (m.params !== null && m.params !== undefined) h += row("parameters", count(m.params));
    h += row("device", n.device ?? "anywhere");
    if (n.host) h += row("host", n.host);
    if (n.cached) h += row("cached", n.salt !== null && n.salt !== undefined ? `yes, salt ${n.salt}` : "yes");
    if (n.frozen) h += row("frozen", "yes");
    if (n.mapped) h += row("mapped", "over the items of a list");
    if (colour && m.id in colour) h += row("colour", number(colour[m.id]));
    if (m.hasInside) h += `<div class="smz-hint">click to ${m.open ? "close" : "open"}</div>`;
    return h;
  }
  if (m.type === "layer") {
    let h = `<div class="smz-tt-title">${esc(m.label)}</div>${row("kind", m.kind ?? "?")}${row("path", `${m.node}.${m.path}`)}`;
    h += row("shape", Array.isArray(m.shape) ? `[${m.shape.join(", ")}]` : "unknown");
    h += row("parameters", count(m.params ?? 0));
    const key = `${m.node}.${m.path}`;
    if (colour && key in colour) h += row("colour", number(colour[key]));
    return h;
  }
  if (m.type === "block") {
    let h = `<div class="smz-tt-title">${esc(m.label)}</div>${row("block", `${m.node}.${m.path}`)}`;
    if (m.foldable) h += `<div class="smz-hint">×${m.times} — click to ${m.open ? "fold" : "unfold"}</div>`;
    return h;
  }
  if (m.type === "group") return `<div class="smz-tt-title">branches</div>${row("from", m.from)}${row("to", m.to ?? "the end")}${row("nodes", m.members.join(", "))}`;
  return "";
}

function legendHtml(colour, label, meta) {
  const fams = new Map();
  for (const m of meta.values()) {
    if (m.type !== "layer") continue;
    const f = family(m.kind, m.label);
    fams.set(f.name, f);
  }
  let h = "";
  if (fams.size) {
    h += '<div class="smz-kinds">';
    for (const f of fams.values()) {
      h += `<span class="smz-kind"><svg width="26" height="14" viewBox="0 0 26 14"><path d="${outline(f.name, 26, 14)}" fill="${f.hue}" fill-opacity="0.2" stroke="${f.hue}" stroke-width="1.3"/></svg>${f.name}</span>`;
    }
    h += "</div>";
  }
  const vals = Object.values(colour || {}).filter((v) => typeof v === "number" && Number.isFinite(v));
  if (vals.length) {
    const s = scaleOf(vals);
    const stops = Array.from({ length: 10 }, (_, i) => `${viridis(i / 9)} ${(i / 9) * 100}%`).join(",");
    h += `<div class="smz-scale"><span class="smz-scale-label">${label || "colour"}${s.log ? " (log)" : ""}</span><span>${number(s.lo)}</span><span class="smz-bar" style="background:linear-gradient(90deg,${stops})"></span><span>${number(s.hi)}</span></div>`;
  }
  return h;
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "smz-graph";
  root.innerHTML = `
    <div class="smz-toolbar">
      <button class="smz-fit" title="fit the width">fit</button>
      <button class="smz-out" title="zoom out">−</button>
      <button class="smz-in" title="zoom in">+</button>
      <button class="smz-all" title="open or close every node">open all</button>
      <button class="smz-svg" title="download as SVG">SVG</button>
      <span class="smz-status"></span>
    </div>
    <div class="smz-viewport"></div>
    <div class="smz-legend"></div>
    <div class="smz-tooltip" hidden></div>`;
  host.appendChild(root);
  const viewport = root.querySelector(".smz-viewport");
  const tooltip = root.querySelector(".smz-tooltip");
  const status = root.querySelector(".smz-status");
  let scale = 1;
  let fitted = false;
  let current = null; // {svg, meta, W, H}
  let token = 0;

  const applyScale = () => {
    if (!current) return;
    current.svg.setAttribute("width", Math.round(current.W * scale));
    current.svg.setAttribute("height", Math.round(current.H * scale));
  };
  const fit = () => {
    if (!current) return;
    const avail = viewport.clientWidth || 900;
    scale = Math.max(0.6, Math.min(1, (avail - 4) / current.W));
    applyScale();
  };

  async function draw() {
    const mine = ++token;
    const t0 = performance.now();
    const insides = model.get("inside") || {};
    const scene = buildScene(model.get("plan"), insides, model.get("opened") || [], model.get("expanded") || []);
    const meta = scene.meta;
    let laid;
    try {
      laid = await layoutScene(elk, scene);
    } catch (err) {
      status.textContent = `layout failed: ${err && err.message ? err.message : err}`;
      return;
    }
    if (mine !== token) return;
    const colour = model.get("colour") || {};
    const theme = isDark() ? THEMES.dark : THEMES.light;
    const svg = paint(laid, meta, { colour, theme });
    viewport.replaceChildren(svg);
    current = { svg, meta, W: Math.ceil(laid.width), H: Math.ceil(laid.height) };
    if (!fitted) {
      fit();
      fitted = true;
    } else applyScale();
    root.querySelector(".smz-legend").innerHTML = legendHtml(colour, model.get("colour_label"), meta);
    const nodes = (model.get("plan")?.nodes || []).length;
    const ms = performance.now() - t0;
    status.textContent = `${nodes} nodes`;
    root.dataset.layoutMs = String(Math.round(ms));
    root.dataset.drawn = String(mine);
    const allOpen = Object.keys(insides).every((k) => (model.get("opened") || []).includes(k));
    const allBtn = root.querySelector(".smz-all");
    allBtn.textContent = allOpen ? "close all" : "open all";
    allBtn.hidden = Object.keys(insides).length === 0;
    // what the kernel keeps for save_svg
    const copy = svg.cloneNode(true);
    copy.setAttribute("width", current.W);
    copy.setAttribute("height", current.H);
    model.set("_svg", new XMLSerializer().serializeToString(copy));
    model.save_changes();
  }

  const toggle = (trait, key) => {
    const now = [...(model.get(trait) || [])];
    const i = now.indexOf(key);
    if (i >= 0) now.splice(i, 1);
    else now.push(key);
    model.set(trait, now);
    model.save_changes();
  };

  viewport.addEventListener("click", (ev) => {
    const block = ev.target.closest("[data-block]");
    if (block && block.classList.contains("smz-foldable")) {
      tooltip.hidden = true;
      toggle("expanded", block.dataset.block);
      return;
    }
    const node = ev.target.closest("[data-node]");
    if (node && current && current.meta.get(node.dataset.id)?.hasInside) {
      // a click inside an open node's layers is not a click on its title
      if (ev.target.closest(".smz-layer")) return;
      tooltip.hidden = true;
      toggle("opened", node.dataset.node);
    }
  });
  viewport.addEventListener("mousemove", (ev) => {
    const hit = ev.target.closest("[data-id]");
    const m = hit && current ? current.meta.get(hit.dataset.id) : null;
    if (!m) {
      tooltip.hidden = true;
      return;
    }
    tooltip.innerHTML = tooltipHtml(m, model.get("colour") || {});
    tooltip.hidden = false;
    const box = root.getBoundingClientRect();
    let x = ev.clientX - box.left + 14;
    const y = ev.clientY - box.top + 14;
    if (x + 260 > box.width) x = Math.max(0, ev.clientX - box.left - 270);
    tooltip.style.left = `${x}px`;
    tooltip.style.top = `${y}px`;
  });
  viewport.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
  root.querySelector(".smz-fit").onclick = fit;
  root.querySelector(".smz-in").onclick = () => {
    scale = Math.min(3, scale * 1.25);
    applyScale();
  };
  root.querySelector(".smz-out").onclick = () => {
    scale = Math.max(0.1, scale / 1.25);
    applyScale();
  };
  root.querySelector(".smz-all").onclick = () => {
    const keys = Object.keys(model.get("inside") || {});
    const open = model.get("opened") || [];
    model.set("opened", keys.every((k) => open.includes(k)) ? [] : keys);
    model.save_changes();
  };
  root.querySelector(".smz-svg").onclick = () => {
    const text = model.get("_svg");
    if (!text) return;
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([text], { type: "image/svg+xml" }));
    a.download = `${model.get("name") || "graph"}.svg`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  };
  viewport.style.maxHeight = `${model.get("height") || 640}px`;

  // a drawing replaces what the tooltip was about: hide it until the pointer moves again
  const redraw = () => {
    tooltip.hidden = true;
    draw();
  };
  const traits = ["plan", "inside", "opened", "expanded", "colour", "colour_label"];
  for (const t of traits) model.on(`change:${t}`, redraw);
  const onHeight = () => {
    viewport.style.maxHeight = `${model.get("height") || 640}px`;
  };
  model.on("change:height", onHeight);
  draw();
  return () => {
    for (const t of traits) model.off(`change:${t}`, redraw);
    model.off("change:height", onHeight);
  };
}

export default { render };
