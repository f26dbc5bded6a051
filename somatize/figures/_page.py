"""How a figure is seen where no kernel draws it: its static face beside the live view, and a
standalone page with its browser half inside.

The face is `text/html` (its picture as an image, an SVG in a data URI, which a sanitizer keeps
for an untrusted notebook) and a `text/plain` line, for wherever no widget is drawn
(nbconvert, GitHub, a notebook reopened). Shown in a notebook, a figure is two outputs: the
live view (and its line), then the face alone, with a style that hides it once the live view
is drawn in the same page. A saved notebook that keeps the widgets' state (`jupyter nbconvert
--execute` does) is converted to HTML as the widget's view, which needs a widget manager from
the network: the face, an output of its own, is drawn there anyway. The face is brought up to
date at the end of every cell.

The browser halves (ES modules and CSS) are built from `widgets/` (`sh widgets/build.sh`) into
`static/` and shipped as package data, so nothing is fetched from the network to draw a
figure: not in a notebook, not in a saved page.
"""

from __future__ import annotations

import base64
import html
import json
import math
import warnings
import weakref
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


START = '<div class="smz-face" style="max-width:100%;overflow-x:auto">'
END = "</div><!--/smz-face-->"
# Hides a face shown on its own, and its output, once the live view (which carries the class
# smz-live-<model id>) is drawn anywhere in the page; where styles are dropped, it shows.
_HIDDEN = (
    "<style>body:has(.smz-live-{key}) .jp-OutputArea-child:has([data-smz-for='{key}']),"
    " body:has(.smz-live-{key}) [data-smz-for='{key}'] {{display:none}}</style>"
)


class Face:
    """What a figure adds to an anywidget, from its `svg()` (its picture), `face()` (that
    picture as HTML, what its output bundle carries) and `plain()` (one line saying what it
    shows): `save_svg`, `save_html`, `state`, and the bundle kept current where it was shown."""

    _bundle = ""  # its browser half in a saved page: static/<bundle>.js, as its _esm
    _saved: tuple[str, ...] = ()  # the traits a saved page draws from

    def state(self) -> dict[str, Any]:
        """The figure's traits as one dict, what it holds complete (a live audit's record
        too): what a saved page draws from."""
        self.settle()
        return {k: jsonable(getattr(self, k)) for k in self._saved}

    def save_svg(self, path: str | Path) -> Path:
        """Write the picture as an SVG file (UTF-8)."""
        return written(path, self.svg())

    def save_html(self, path: str | Path) -> Path:
        """Write a standalone page with the figure working in it as it does live (hover, fit,
        pan and zoom, a minimap; an audit's every metric and its menu; a table's sorting,
        toggles and scatter), drawn offline: its browser half and its state are inside the
        page. What needs a kernel (opening a graph's node or block) stays as it was saved."""
        return written(path, page([(self._bundle, self.state())], title=self.plain()))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data, meta = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
        face = self.__dict__["_face_shown"] = self.face()
        return {**data, "text/plain": self.plain(), "text/html": START + face + END}, meta

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self.add_class(f"smz-live-{self.model_id}")  # type: ignore[attr-defined]
        data, meta = self._repr_mimebundle_()
        live_view = {k: v for k, v in data.items() if k != "text/html"}
        display(live_view, metadata=meta, raw=True)
        handle = display(self._alone(), raw=True, display_id=True)
        if handle is not None:
            self.__dict__.setdefault("_face_handles", []).append(handle)
            _refresh_after_cells(self)

    def _alone(self) -> dict[str, str]:
        """The face last drawn as an output of its own, hidden where the live view is drawn."""
        key = self.model_id  # type: ignore[attr-defined]
        tagged = START[:-1] + f' data-smz-for="{key}">' + _HIDDEN.format(key=key)
        return {"text/html": tagged + self.__dict__["_face_shown"] + END}

    def refresh(self) -> bool:
        """Bring the face of every place this figure was shown up to date, if it changed;
        whether it had. Called at the end of each cell; call it to do it now."""
        handles = self.__dict__.get("_face_handles", [])
        if not handles:
            return False
        self.settle()
        shown = self.__dict__.get("_face_shown")
        self._repr_mimebundle_()  # draws the face once, and keeps it
        if self.__dict__["_face_shown"] == shown:
            return False
        for handle in handles:
            handle.update(self._alone(), raw=True)
        return True

    def settle(self) -> None:
        """Make what the face will show complete (a live audit sends what it holds)."""


def written(path: str | Path, text: str) -> Path:
    """Write `text` to `path` (UTF-8); answers the path."""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path


def image(svg: str, alt: str) -> str:
    """An SVG as an HTML image (a data URI), at its own size or narrower."""
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    alt = html.escape(alt, quote=True)
    return f'<img alt="{alt}" style="max-width:100%" src="data:image/svg+xml;base64,{data}"/>'


_watched: weakref.WeakSet = weakref.WeakSet()


def _refresh_after_cells(figure: Face) -> None:
    """Register (once per kernel) an end-of-cell hook that refreshes every figure shown."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    _watched.add(figure)
    if not getattr(shell, "_somatize_faces", False):
        shell._somatize_faces = True
        shell.events.register("post_run_cell", _after_cell)


def _after_cell(*_: Any) -> None:
    for figure in list(_watched):
        try:
            figure.refresh()
        except Exception as err:  # a figure that cannot draw must not break the next cell
            name = type(figure).__name__
            warnings.warn(f"{name}'s static face was not refreshed: {err}", stacklevel=1)
