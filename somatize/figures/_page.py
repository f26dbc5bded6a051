"""The bundled browser halves, and a page that shows one figure with nothing else.

The ES modules and CSS are built from `widgets/` (`sh widgets/build.sh`) into `static/` and
shipped as package data, so nothing is fetched from the network to draw a figure: not in a
notebook, not in a saved page.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

STATIC = Path(__file__).parent / "static"


def asset(name: str) -> str:
    """The text of one bundled file (`graph.js`, `audit.css`, ...), or a clear error if the
    bundles were never built."""
    path = STATIC / name
    if not path.exists():
        raise FileNotFoundError(
            f"the figure bundle {path} is missing: build it with `sh widgets/build.sh` "
            "(needs npm once), or reinstall somatize"
        )
    return path.read_text(encoding="utf-8")


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: tuples to lists, numpy and torch scalars to numbers, NaN and
    infinities to the strings "nan", "inf", "-inf" (JSON has no word for them), anything else
    unknown to its `str`."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>
body {{ margin: 16px 24px; font-family: system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif; color: #1f2430; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 15px; margin: 28px 0 8px; }} p.smz-note {{ color: #5d6575; max-width: 60em; }}
{css}
</style>
</head>
<body>
{body}
<script type="application/json" id="smz-figures">{figures}</script>
<script type="module">
// A small stand-in for a widget model per figure (get/set/on/off/send/save_changes over its
// saved state); each figure's browser half is loaded once and handed its model.
const figures = JSON.parse(document.getElementById("smz-figures").textContent);
const code = Object.fromEntries(
  [...document.querySelectorAll("script[data-smz-module]")].map((s) => [s.dataset.smzModule, s.textContent.trim()]),
);
const loaded = {{}};
window.smzModels = [];
window.smzSent = [];
for (const [index, figure] of figures.entries()) {{
  const state = figure.state;
  const listeners = new Map();
  const fire = (name, ...args) => (listeners.get(name) || []).slice().forEach((f) => f(...args));
  const model = {{
    get: (k) => state[k],
    set: (k, v) => {{ const old = state[k]; state[k] = v; if (old !== v) fire(`change:${{k}}`, v); }},
    on: (name, f) => {{ if (!listeners.has(name)) listeners.set(name, []); listeners.get(name).push(f); }},
    off: (name, f) => {{ const l = listeners.get(name) || []; const i = l.indexOf(f); if (i >= 0) l.splice(i, 1); }},
    send: (msg) => window.smzSent.push(msg),
    save_changes: () => {{}},
    deliver: (msg, buffers) => fire("msg:custom", msg, buffers || []),
  }};
  window.smzModels.push(model);
  if (!loaded[figure.module]) {{
    const bytes = Uint8Array.from(atob(code[figure.module]), (c) => c.charCodeAt(0));
    const url = URL.createObjectURL(new Blob([new TextDecoder().decode(bytes)], {{ type: "text/javascript" }}));
    loaded[figure.module] = (await import(url)).default;
  }}
  const widget = loaded[figure.module];
  if (widget.initialize) await widget.initialize({{ model }});
  await widget.render({{ model, el: document.getElementById(`smz-figure-${{index}}`) }});
}}
window.smzModel = window.smzModels[0];
document.body.dataset.rendered = "yes";
</script>
</body>
</html>
"""


def page(
    figures: list[tuple[str, dict[str, Any]]],
    *,
    title: str,
    intro: str = "",
    headings: list[str] | None = None,
) -> str:
    """A standalone HTML page that draws figures offline: `figures` are (bundle, state)
    pairs, the bundle naming the browser half (`graph`, `audit`, `table`) and the state the
    widget's traits. Each browser half is inlined once (base64), so the page needs no server
    and no network. `headings` (one per figure) and `intro` are written above them."""
    modules = list(dict.fromkeys(module for module, _ in figures))
    css = "\n".join(asset(f"{m}.css") for m in modules).replace("</", "<\\/")
    parts = [f"<h1>{html.escape(title)}</h1>"] if headings else []
    if intro:
        parts.append(f'<p class="smz-note">{html.escape(intro)}</p>')
    for k in range(len(figures)):
        if headings:
            parts.append(f"<h2>{html.escape(headings[k])}</h2>")
        parts.append(f'<div id="smz-figure-{k}" class="smz-host"></div>')
    for m in modules:
        esm = base64.b64encode(asset(f"{m}.js").encode("utf-8")).decode("ascii")
        parts.append(f'<script type="text/plain" data-smz-module="{m}">{esm}</script>')
    data = json.dumps(jsonable([{"module": m, "state": state} for m, state in figures]))
    return _PAGE.format(
        title=html.escape(title), css=css, body="\n".join(parts), figures=data.replace("</", "<\\/")
    )
