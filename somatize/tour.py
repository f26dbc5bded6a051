"""The tour, headless: run `notebooks/01_tour.ipynb` in a fresh kernel and write it as one HTML
page with its widgets alive in it, which opens offline in any browser.

    python -m somatize.tour [--notebook notebooks/01_tour.ipynb] [--out demo.html]

The notebook runs top to bottom (nothing is read from its saved outputs); nbconvert writes the
page, and each widget is drawn from the state it had when the notebook finished, by a small
stand-in for the widget manager written into the page: it loads each anywidget's own ES module
(which is in that state) and hands it a model over the saved traits. What a widget does in the
browser alone, it does here — a graph figure folds, unfolds, hovers and pans; what needs the
kernel (a trait set from Python after the page was written) does not happen. Nothing is loaded
from the network: no require.js, no widget manager from a CDN, no MathJax.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOUR = ROOT / "notebooks" / "01_tour.ipynb"
_STATE = "application/vnd.jupyter.widget-state+json"

# Renders every widget-view output of the page from the saved widget state; anywidget models
# only (their ES module travels in the state), anything else says it needs a kernel.
_RENDERER = r"""
const stateEl = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
const saved = stateEl ? JSON.parse(stateEl.textContent).state || {} : {};
const shared = JSON.parse(document.getElementById("smz-tour-modules").textContent);
const models = new Map();
const styled = new Set();
const unshared = (v) => (typeof v === "string" && v.startsWith("smz-shared:") ? shared[Number(v.slice(11))] : v);

function put(obj, path, value) {
  let at = obj;
  for (const key of path.slice(0, -1)) at = at[key];
  at[path[path.length - 1]] = value;
}

function dataView(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new DataView(bytes.buffer);
}

function model(id) {
  if (models.has(id)) return models.get(id);
  const entry = saved[id];
  if (!entry) return null;
  const data = structuredClone(entry.state || {});
  for (const key of ["_esm", "_css"]) data[key] = unshared(data[key]);
  for (const b of entry.buffers || []) put(data, b.path, dataView(b.data));
  const listeners = new Map();
  const fire = (name, ...args) => (listeners.get(name) || []).slice().forEach((f) => f(...args));
  const m = {
    id,
    get: (key) => data[key],
    set: (key, value) => {
      const old = data[key];
      data[key] = value;
      fire(`change:${key}`, value, old);
      fire("change");
    },
    on: (names, cb) => names.split(/\s+/).forEach((n) => {
      if (!listeners.has(n)) listeners.set(n, []);
      listeners.get(n).push(cb);
    }),
    off: (names, cb) => {
      if (!names) return listeners.clear();
      names.split(/\s+/).forEach((n) => {
        if (!cb) listeners.delete(n);
        else listeners.set(n, (listeners.get(n) || []).filter((f) => f !== cb));
      });
    },
    send: () => {},
    save_changes: () => {},
    widget_manager: { get_model: async (other) => model(other) },
  };
  models.set(id, m);
  return m;
}

async function widgetOf(m) {
  if (m._widget) return m._widget;
  const css = m.get("_css");
  if (css && !styled.has(css)) {
    styled.add(css);
    const style = document.createElement("style");
    style.textContent = css;
    document.head.appendChild(style);
  }
  const url = URL.createObjectURL(new Blob([m.get("_esm")], { type: "text/javascript" }));
  const mod = await import(url);
  let widget = mod.default ?? mod;
  if (typeof widget === "function") widget = await widget();
  if (widget.initialize) await widget.initialize({ model: m, experimental: {} });
  m._widget = widget;
  return widget;
}

function note(el, text) {
  const p = document.createElement("p");
  p.className = "smz-tour-note";
  p.textContent = text;
  el.appendChild(p);
}

for (const tag of document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')) {
  const view = JSON.parse(tag.textContent);
  const el = document.createElement("div");
  el.className = "smz-tour-widget";
  tag.after(el);
  const m = model(view.model_id);
  if (!m || typeof m.get("_esm") !== "string") {
    note(el, "(a widget that needs a live kernel: open the notebook in JupyterLab)");
    continue;
  }
  try {
    const widget = await widgetOf(m);
    await widget.render({ model: m, el, experimental: {} });
    el.dataset.rendered = "true";
  } catch (err) {
    console.error(err);
    note(el, `(this widget failed to draw: ${err})`);
  }
}
document.body.dataset.widgets = "done";
"""

_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block jupyter_widgets %}
<style>.smz-tour-note { color: #777; font-style: italic; }</style>
<script type="application/json" id="smz-tour-modules">{{ resources.somatize_modules }}</script>
<script type="module">{{ resources.somatize_renderer }}</script>
{% endblock jupyter_widgets %}
"""


def run(notebook: Path = TOUR, *, timeout: int = 300) -> dict:
    """Runs a notebook top to bottom in a fresh kernel (in a temporary working directory) and
    returns it with its outputs and the widgets' state; a cell that raises stops it, with the
    cell and the error in the message."""
    import nbformat
    from nbclient import NotebookClient

    if not notebook.exists():
        raise FileNotFoundError(
            f"no notebook at {notebook}: the tour lives in the repository's notebooks/ folder "
            "(run from a checkout, or pass --notebook PATH)"
        )
    nb = nbformat.read(notebook, as_version=4)
    with tempfile.TemporaryDirectory(prefix="somatize-tour-") as where:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            store_widget_state=True,
            resources={"metadata": {"path": where}},
        )
        client.execute()
    return nb


def page(nb: dict) -> str:
    """The executed notebook as one HTML page whose widgets draw offline."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"somatize_tour.html.j2": _TEMPLATE})],
    )
    exporter.template_file = "somatize_tour.html.j2"
    nb, shared = _shared_modules(nb)
    body, _ = exporter.from_notebook_node(
        nb,
        resources={
            "somatize_renderer": _RENDERER,
            "somatize_modules": json.dumps(shared).replace("</", "<\\/"),
        },
    )
    return body


def _shared_modules(nb: Any) -> tuple[Any, list[str]]:
    """The notebook with each widget's `_esm` and `_css` written once: two figures of one kind
    carry the same bundle, so the page holds it once and each model points at it."""
    nb = copy.deepcopy(nb)
    state = nb.metadata.get("widgets", {}).get(_STATE, {}).get("state", {})
    shared: list[str] = []
    index: dict[str, int] = {}
    for entry in state.values():
        traits = entry.get("state", {})
        for key in ("_esm", "_css"):
            text = traits.get(key)
            if isinstance(text, str) and len(text) > 200:
                if text not in index:
                    index[text] = len(shared)
                    shared.append(text)
                traits[key] = f"smz-shared:{index[text]}"
    return nb, shared


def main(argv: list[str] | None = None) -> int:
    """Command line: run the tour and write the page."""
    parser = argparse.ArgumentParser(prog="python -m somatize.tour", description=__doc__)
    parser.add_argument("--notebook", type=Path, default=TOUR, help="the notebook to run")
    parser.add_argument("--out", type=Path, default=Path("demo.html"), help="the page to write")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    nb = run(args.notebook)
    text = page(nb)
    args.out.write_text(text, encoding="utf-8")
    widgets = sum(
        1
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in out.get("data", {})
    )
    print(
        f"wrote {args.out} ({len(text) / 1e6:.1f} MB, {widgets} live widget(s)) from "
        f"{args.notebook.name} in {time.perf_counter() - began:.1f} s; it opens offline"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
