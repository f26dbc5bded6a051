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
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
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
body {{ margin: 16px; font-family: system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif; }}
{css}
</style>
</head>
<body>
<div id="smz-figure"></div>
<script type="application/json" id="smz-state">{state}</script>
<script type="application/json" id="smz-replies">{replies}</script>
<script type="text/plain" id="smz-esm">{esm}</script>
<script type="module">
// A small stand-in for a widget model: get/set/on/off/send/save_changes, over the saved state.
const state = JSON.parse(document.getElementById("smz-state").textContent);
const replies = JSON.parse(document.getElementById("smz-replies").textContent);
const listeners = new Map();
const fire = (name, ...args) => (listeners.get(name) || []).slice().forEach((f) => f(...args));
const model = {{
  get: (k) => state[k],
  set: (k, v) => {{ const old = state[k]; state[k] = v; if (old !== v) fire(`change:${{k}}`, v); }},
  on: (name, f) => {{ if (!listeners.has(name)) listeners.set(name, []); listeners.get(name).push(f); }},
  off: (name, f) => {{ const l = listeners.get(name) || []; const i = l.indexOf(f); if (i >= 0) l.splice(i, 1); }},
  send: (msg) => {{ window.smzSent.push(msg); if (msg && msg.kind === "hello") setTimeout(() => replies.forEach((r) => fire("msg:custom", r, [])), 0); }},
  save_changes: () => {{}},
}};
window.smzSent = [];
window.smzModel = model;
window.smzDeliver = (msg) => fire("msg:custom", msg, []);
const bytes = Uint8Array.from(atob(document.getElementById("smz-esm").textContent.trim()), (c) => c.charCodeAt(0));
const url = URL.createObjectURL(new Blob([new TextDecoder().decode(bytes)], {{ type: "text/javascript" }}));
const widget = (await import(url)).default;
if (widget.initialize) await widget.initialize({{ model }});
await widget.render({{ model, el: document.getElementById("smz-figure") }});
document.body.dataset.rendered = "yes";
</script>
</body>
</html>
"""


def _script_json(value: Any) -> str:
    return json.dumps(jsonable(value)).replace("</", "<\\/")


def page(
    module: str, state: dict[str, Any], *, title: str, replies: list[dict] | None = None
) -> str:
    """A standalone HTML page that draws one figure offline.

    `module` names the bundle (`graph`, `audit`, `table`); `state` is the widget's traits;
    `replies` are the messages the page answers a `hello` from the figure with (the live
    audit asks for what it missed). The ES module is inlined (base64), so the page needs no
    server and no network."""
    esm = base64.b64encode(asset(f"{module}.js").encode("utf-8")).decode("ascii")
    css = asset(f"{module}.css").replace("</", "<\\/")
    return _PAGE.format(
        title=html.escape(title),
        css=css,
        state=_script_json(state),
        replies=_script_json(replies or []),
        esm=esm,
    )
