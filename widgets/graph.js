// The graph figure's browser half: it shows the drawing the kernel made (the `drawing` trait,
// SVG) in a viewport that fits the output area, pans (drag, wheel), zooms (buttons, Ctrl or
// ⌘ with the wheel, a pinch), and shows a minimap when the drawing is bigger than the view.
// A click on a node or a folded block toggles `opened` or `expanded`; the kernel redraws.

import { counted, esc } from "./common.js";

const views = new WeakMap(); // model -> {scale, x, y, fitted}: kept when a view is made again

function tipHtml(text) {
  const [title, ...rows] = text.split("\n");
  let h = `<div class="smz-tt-title">${esc(title)}</div>`;
  for (const row of rows) {
    const at = row.indexOf(": ");
    if (at > 0) h += `<div><span class="smz-k">${esc(row.slice(0, at))}</span> ${esc(row.slice(at + 2))}</div>`;
    else h += `<div class="smz-hint">${esc(row)}</div>`;
  }
  return h;
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "smz-graph";
  root.innerHTML = `
    <div class="smz-toolbar">
      <button class="smz-fit" title="show the whole drawing">fit</button>
      <button class="smz-width" title="fit the width">width</button>
      <button class="smz-out" title="zoom out">−</button>
      <button class="smz-in" title="zoom in">+</button>
      <button class="smz-all" title="open or close every node">open all</button>
      <button class="smz-svg" title="download as SVG">SVG</button>
      <span class="smz-status"></span>
    </div>
    <div class="smz-viewport"><div class="smz-drawing"></div>
      <div class="smz-minimap" hidden><img alt=""><div class="smz-lens"></div></div>
    </div>
    <div class="smz-tooltip" hidden></div>`;
  host.appendChild(root);
  const viewport = root.querySelector(".smz-viewport");
  const drawing = root.querySelector(".smz-drawing");
  const minimap = root.querySelector(".smz-minimap");
  const lens = root.querySelector(".smz-lens");
  const tooltip = root.querySelector(".smz-tooltip");
  const status = root.querySelector(".smz-status");
  // the view: kept while the kernel redraws, fitted anew unless someone zoomed or panned
  if (!views.has(model)) views.set(model, { scale: 1, x: 0, y: 0, fitted: false, moved: false });
  const view = views.get(model);
  let svg = null;
  let W = 1;
  let H = 1;
  let shown = null;
  let minimapUrl = null;

  const room = () => Math.max(200, viewport.clientWidth || host.clientWidth || 900);
  const tallest = () => Math.max(160, model.get("height") || 640);

  // the view's height: the drawing's at this scale, at most the figure's height
  function place() {
    if (!svg) return;
    const vw = room();
    const vh = Math.min(tallest(), Math.ceil(H * view.scale) + 2);
    viewport.style.height = `${vh}px`;
    const w = vw / view.scale;
    const h = vh / view.scale;
    view.x = Math.max(Math.min(view.x, W - w), Math.min(0, (W - w) / 2));
    view.y = Math.max(Math.min(view.y, H - h), Math.min(0, (H - h) / 2));
    if (W <= w) view.x = (W - w) / 2;
    if (H <= h) view.y = 0;
    svg.setAttribute("width", vw);
    svg.setAttribute("height", vh);
    svg.setAttribute("viewBox", `${view.x} ${view.y} ${w} ${h}`);
    const big = W * view.scale > vw * 1.15 || H * view.scale > vh * 1.15;
    minimap.hidden = !big;
    if (big) {
      // the whole drawing, at most 140 px wide and a third of the view tall
      const k = Math.min(140 / W, (vh * 0.36) / H);
      minimap.style.width = `${Math.max(24, W * k)}px`;
      Object.assign(lens.style, {
        left: `${Math.max(0, view.x * k)}px`,
        top: `${Math.max(0, view.y * k)}px`,
        width: `${Math.min(W, w) * k}px`,
        height: `${Math.min(H, h) * k}px`,
      });
    }
    root.dataset.scale = view.scale.toFixed(3);
  }

  // the width fitted; and all of it when that leaves little below the view
  const fitWidth = () => {
    view.scale = Math.min(1, (room() - 2) / W);
    if (H * view.scale > tallest() && H * view.scale < tallest() * 1.3) view.scale = (tallest() - 2) / H;
    view.x = 0;
    view.y = 0;
  };
  const fitAll = () => {
    view.scale = Math.min(1, (room() - 2) / W, (tallest() - 2) / H);
    view.x = 0;
    view.y = 0;
  };

  function show() {
    const text = model.get("drawing") || "";
    if (text === shown) return;
    shown = text;
    drawing.innerHTML = text;
    svg = drawing.querySelector("svg");
    if (!svg) return;
    const box = (svg.getAttribute("viewBox") || "0 0 1 1").split(/\s+/).map(Number);
    W = box[2] || 1;
    H = box[3] || 1;
    // the titles become our tooltip (a native one would show beside it)
    for (const t of svg.querySelectorAll("title")) {
      t.parentNode.dataset.tip = t.textContent;
      t.remove();
    }
    if (minimapUrl) URL.revokeObjectURL(minimapUrl);
    minimapUrl = URL.createObjectURL(new Blob([text], { type: "image/svg+xml" }));
    minimap.querySelector("img").src = minimapUrl;
    if (!view.fitted || !view.moved) {
      fitWidth();
      view.fitted = true;
    }
    place();
    const nodes = (model.get("plan")?.nodes || []).length;
    status.textContent = counted(nodes, "node");
    const insides = Object.keys(model.get("inside") || {});
    const all = root.querySelector(".smz-all");
    all.hidden = insides.length === 0;
    all.textContent = insides.every((k) => (model.get("opened") || []).includes(k)) ? "close all" : "open all";
    root.dataset.drawn = String(Number(root.dataset.drawn || 0) + 1);
  }

  const zoom = (factor, cx, cy) => {
    view.moved = true;
    const vw = room();
    const vh = viewport.clientHeight;
    const before = view.scale;
    view.scale = Math.max(0.05, Math.min(4, view.scale * factor));
    // keep the point under (cx, cy) where it is
    const px = cx ?? vw / 2;
    const py = cy ?? vh / 2;
    view.x += px / before - px / view.scale;
    view.y += py / before - py / view.scale;
    place();
  };

  // panning by drag; a press that hardly moves is a click
  let drag = null;
  let mapDrag = false;
  viewport.addEventListener("pointerdown", (ev) => {
    if (ev.button !== 0 || minimap.contains(ev.target)) return;
    drag = { x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y, moved: false };
  });
  const onMove = (ev) => {
    if (mapDrag) jump(ev);
    if (!drag) return;
    const dx = ev.clientX - drag.x;
    const dy = ev.clientY - drag.y;
    if (!drag.moved && Math.hypot(dx, dy) < 4) return;
    drag.moved = true;
    view.moved = true;
    viewport.classList.add("smz-panning");
    view.x = drag.vx - dx / view.scale;
    view.y = drag.vy - dy / view.scale;
    place();
  };
  const onUp = () => {
    mapDrag = false;
    if (drag && drag.moved) viewport.dataset.panned = "yes";
    setTimeout(() => {
      drag = null;
      viewport.classList.remove("smz-panning");
    }, 0);
  };
  window.addEventListener("pointermove", onMove);
  window.addEventListener("pointerup", onUp);
  viewport.addEventListener(
    "wheel",
    (ev) => {
      const r = viewport.getBoundingClientRect();
      if (ev.ctrlKey || ev.metaKey) {
        ev.preventDefault();
        zoom(Math.exp(-ev.deltaY / 300), ev.clientX - r.left, ev.clientY - r.top);
        return;
      }
      // a plain wheel pans while there is drawing that way, then scrolls the page
      const vh = viewport.clientHeight / view.scale;
      const vw = room() / view.scale;
      const canY = (ev.deltaY > 0 && view.y < H - vh - 0.5) || (ev.deltaY < 0 && view.y > 0.5);
      const canX = (ev.deltaX > 0 && view.x < W - vw - 0.5) || (ev.deltaX < 0 && view.x > 0.5);
      if (!canY && !canX) return;
      ev.preventDefault();
      view.moved = true;
      view.x += ev.deltaX / view.scale;
      view.y += ev.deltaY / view.scale;
      place();
    },
    { passive: false },
  );
  const jump = (ev) => {
    const r = minimap.getBoundingClientRect();
    const k = r.width / W; // the minimap is the drawing at this scale
    view.x = (ev.clientX - r.left) / k - room() / view.scale / 2;
    view.y = (ev.clientY - r.top) / k - viewport.clientHeight / view.scale / 2;
    view.moved = true;
    place();
  };
  minimap.addEventListener("pointerdown", (ev) => {
    mapDrag = true;
    jump(ev);
    ev.stopPropagation();
  });

  const toggle = (trait, key) => {
    const now = [...(model.get(trait) || [])];
    const i = now.indexOf(key);
    if (i >= 0) now.splice(i, 1);
    else now.push(key);
    model.set(trait, now);
    model.save_changes();
    status.textContent = "drawing…";
  };
  viewport.addEventListener("click", (ev) => {
    if (drag && drag.moved) return;
    const hit = ev.target.closest("[data-click]");
    if (!hit || !viewport.contains(hit)) return;
    // a click on an open node's layers is not a click on the node
    const layer = ev.target.closest(".smz-layer");
    if (layer && hit.classList.contains("smz-node")) return;
    const [trait, ...rest] = hit.dataset.click.split(" ");
    tooltip.hidden = true;
    toggle(trait, rest.join(" "));
  });
  viewport.addEventListener("mousemove", (ev) => {
    const hit = ev.target.closest("[data-tip]");
    if (!hit || (drag && drag.moved)) {
      tooltip.hidden = true;
      return;
    }
    tooltip.innerHTML = tipHtml(hit.dataset.tip);
    tooltip.hidden = false;
    const box = root.getBoundingClientRect();
    const tw = tooltip.offsetWidth;
    const th = tooltip.offsetHeight;
    let x = ev.clientX - box.left + 14;
    let y = ev.clientY - box.top + 14;
    if (x + tw > box.width) x = Math.max(0, ev.clientX - box.left - tw - 10);
    if (y + th > box.height && ev.clientY - box.top - th - 10 > 0) y = ev.clientY - box.top - th - 10;
    tooltip.style.left = `${x}px`;
    tooltip.style.top = `${y}px`;
  });
  viewport.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
  root.querySelector(".smz-fit").onclick = () => {
    fitAll();
    view.moved = true;
    place();
  };
  root.querySelector(".smz-width").onclick = () => {
    fitWidth();
    view.moved = false;
    place();
  };
  root.querySelector(".smz-in").onclick = () => zoom(1.25);
  root.querySelector(".smz-out").onclick = () => zoom(1 / 1.25);
  root.querySelector(".smz-all").onclick = () => {
    const keys = Object.keys(model.get("inside") || {});
    const open = model.get("opened") || [];
    model.set("opened", keys.every((k) => open.includes(k)) ? [] : keys);
    model.save_changes();
    status.textContent = "drawing…";
  };
  root.querySelector(".smz-svg").onclick = () => {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([model.get("drawing") || ""], { type: "image/svg+xml" }));
    a.download = `${model.get("name") || "graph"}.svg`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  };

  // the output area's width, told to the kernel so it lays out for it (rows that fit)
  let told = model.get("width");
  let timer = null;
  const resized = () => {
    place();
    const w = Math.round(room());
    if (Math.abs(w - told) < 40) return;
    clearTimeout(timer);
    timer = setTimeout(() => {
      told = w;
      model.set("width", w);
      model.save_changes();
    }, 150);
  };
  const watcher = typeof ResizeObserver === "function" ? new ResizeObserver(resized) : null;
  if (watcher) watcher.observe(viewport);
  const onDrawing = () => show();
  const onHeight = () => place();
  model.on("change:drawing", onDrawing);
  model.on("change:height", onHeight);
  show();
  resized();
  return () => {
    model.off("change:drawing", onDrawing);
    model.off("change:height", onHeight);
    window.removeEventListener("pointermove", onMove);
    window.removeEventListener("pointerup", onUp);
    if (watcher) watcher.disconnect();
    if (minimapUrl) URL.revokeObjectURL(minimapUrl);
  };
}

export default { render };
