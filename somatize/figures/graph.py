"""The graph figure: a graph's nodes left to right, each open into what it is made of.

`graph_figure(g, inside=architecture(g, x), colour=probe_numbers)` is what `g.figure(...)`
and `g` alone in a cell call. This half checks the data, lays it out and draws it as SVG
(`_scene`, `_layout`, `_draw`); the browser half shows that drawing and sends back clicks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import anywidget
import traitlets

from somatize.figures._draw import picture
from somatize.figures._page import STATIC, Face, image, jsonable
from somatize.figures._svg import counted
from somatize.graph import as_graph
from somatize.health.verdict import as_float

__all__ = ["GraphFigure", "graph_figure"]


def _plan_of(graph: Any) -> dict[str, Any]:
    if isinstance(graph, Mapping):
        plan = dict(graph)
    elif hasattr(graph, "plan_json"):
        plan = graph.plan_json()
    elif callable(graph) and not isinstance(graph, type):
        plan = as_graph(graph).plan_json()  # a bare module: a graph of one node
    else:
        raise TypeError(
            "a graph figure draws a Graph, a bare module (or a plan_json() dict), not "
            f"{type(graph).__name__}"
        )
    if not isinstance(plan.get("nodes"), list) or not isinstance(plan.get("edges"), list):
        raise ValueError("a graph's plan needs 'nodes' and 'edges' lists (see Graph.plan_json())")
    return jsonable(plan)


def _inside_json(node: str, value: Any) -> dict[str, Any]:
    if hasattr(value, "to_json"):
        value = value.to_json()
    if not isinstance(value, Mapping) or not isinstance(value.get("layers"), list):
        raise TypeError(
            f"inside[{node!r}] is a {type(value).__name__}; it should be an Inside "
            "(somatize.torch.architecture) or its .to_json() dict with a 'layers' list"
        )
    out = jsonable(dict(value))
    for layer in out["layers"]:
        if not isinstance(layer, dict) or "path" not in layer:
            raise ValueError(f"inside[{node!r}] has a layer without a 'path': {layer!r}")
        layer["path"] = str(layer["path"])
    return out


def _keyed(given: Any, takes: str) -> Mapping:
    """`given` (a `colour=` or `inside=`) as a mapping, None as empty; refused otherwise."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(f"{takes}, not {type(given).__name__}")
    return given


def _insides(plan: dict[str, Any], inside: Any) -> dict[str, Any]:
    inside = _keyed(inside, "inside= takes {node: Inside} (what architecture(g, x) returns)")
    ids = [str(n["id"]) for n in plan["nodes"]]
    out = {}
    for node, value in inside.items():
        if str(node) not in ids:
            raise ValueError(
                f"inside= names node {node!r}, which is not in this graph (its nodes: "
                f"{', '.join(ids)})"
            )
        if value is not None:
            out[str(node)] = _inside_json(str(node), value)
    return out


def _colours(plan: dict[str, Any], colour: Any) -> dict[str, Any]:
    colour = _keyed(colour, "colour= takes {where: number} keyed by node or node.path.to.layer")
    ids = {str(n["id"]) for n in plan["nodes"]}
    out: dict[str, Any] = {}
    for where, value in colour.items():
        key = str(where)
        if key not in ids and not any(key.startswith(f"{n}.") for n in ids):
            raise ValueError(
                f"colour= has {key!r}, which is neither a node of this graph nor "
                f"node.path.to.layer inside one (nodes: {', '.join(sorted(ids))})"
            )
        try:  # an int a float cannot hold: past the scale's end, as inf; NaN and inf as text
            out[key] = jsonable(as_float(value))
        except (TypeError, ValueError):
            raise TypeError(
                f"colour[{key!r}] is {value!r}; colours are numbers (take one metric "
                "out of a probe or an audit first)"
            ) from None
    return out


class GraphFigure(Face, anywidget.AnyWidget):
    """A live drawing of a graph: its nodes left to right, placement badges (device, host),
    marks for cached, frozen and mapped nodes; with insides, each node opens into its layers
    (a shape per kind, output shapes named by axis), a block folded `×N` unfolds on click, a
    residual edge in the accent colour, branches framed. `colour` paints any
    `{where: number}` with a legend. A graph too long for its output area wraps into rows, a
    network too deep into columns; the browser fits it to the output area, pans, zooms (wheel
    with Ctrl) and shows a minimap past a screenful.

    The drawing is made here, in Python (`drawing`, SVG): the browser shows it, and a click
    that opens a node or unfolds a block changes `opened` or `expanded`, which redraws it.
    The same SVG is the figure's static face in a saved notebook and what `save_svg`
    writes."""

    _bundle = "graph"
    _esm = STATIC / "graph.js"
    _css = STATIC / "graph.css"
    _drawn = ("plan", "inside", "opened", "expanded", "colour", "colour_label", "height", "width")
    _saved = (*_drawn, "name", "drawing")

    plan = traitlets.Dict().tag(sync=True)
    inside = traitlets.Dict().tag(sync=True)
    opened = traitlets.List(traitlets.Unicode()).tag(sync=True)
    expanded = traitlets.List(traitlets.Unicode()).tag(sync=True)
    colour = traitlets.Dict().tag(sync=True)
    colour_label = traitlets.Unicode("").tag(sync=True)
    height = traitlets.Int(640).tag(sync=True)
    width = traitlets.Int(1000).tag(sync=True)
    name = traitlets.Unicode("graph").tag(sync=True)
    drawing = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **traits: Any) -> None:
        super().__init__(**traits)
        self._draw()
        self.observe(lambda _: self._draw(), list(self._drawn))

    def _draw(self) -> None:
        room = (max(320.0, self.width - 24.0), max(240.0, self.height - 40.0))
        self.drawing = picture(
            self.plan, self.inside, self.opened, self.expanded, self.colour, self.colour_label, room
        )

    def recolour(self, colour: Any = None, label: str | None = None) -> None:
        """Paint `{where: number}` on the drawing (None clears it); refused, leaving the
        colours as they were, when a key is no node or node.path of this graph."""
        new = _colours(self.plan, colour)
        with self.hold_trait_notifications():
            self.colour = new
            if label is not None:
                self.colour_label = label

    def svg(self) -> str:
        """The drawing as SVG text (each box's tooltip in its `<title>`)."""
        return self.drawing

    def face(self) -> str:
        """The drawing as an image for a notebook's output, without what only a live view
        reads (tooltips, what a click changes): a picture shows no tooltip."""
        live = r'<title>[^<]*</title>| data-[a-z]+="[^"]*"| cursor="pointer"'
        return image(re.sub(live, "", self.drawing), self.plain())

    def plain(self) -> str:
        """One line: how many nodes, which ones, which are open."""
        ids = [str(n["id"]) for n in self.plan.get("nodes", [])]
        shown = ", ".join(ids[:6]) + (", …" if len(ids) > 6 else "")
        opened = f"; open: {', '.join(self.opened)}" if self.opened else ""
        return f"{self.name}: {counted(len(ids), 'node')} ({shown}){opened}"


def graph_figure(
    graph: Any,
    inside: Any = None,
    colour: Any = None,
    *,
    colour_label: str = "",
    opened: Any = None,
    expanded: Any = (),
    height: int = 640,
    width: int = 1000,
    name: str | None = None,
) -> GraphFigure:
    """Draw a graph (a `Graph`, a bare module as a graph of one node, or a `plan_json()`
    dict) as a `GraphFigure`.

    `inside` is `{node: Inside}` (what `somatize.torch.architecture(g, x)` returns, or the
    insides' `.to_json()` dicts); every node given one opens into its layers, unless `opened`
    lists which do. `colour` is `{where: number}` keyed by `node` or `node.path.to.layer`
    (NaN, ∞ and an int past what a float holds, read as ∞, leave their box unpainted).
    `expanded` lists folded blocks to show unfolded, as `"node:block.path"`. `width` and
    `height` are the output area's, in pixels, which the drawing is laid out to fit (a graph
    longer than the width wraps into rows, a network deeper than the height into columns); the
    browser tells the figure its real width once it is shown. Refused with a
    clear error: insides or colours for nodes the graph does not have, colours that are not
    numbers."""
    plan = _plan_of(graph)
    insides = _insides(plan, inside)
    colours = _colours(plan, colour)
    opened = list(insides) if opened is None else [str(o) for o in opened]
    unknown = [o for o in opened if o not in insides]
    if unknown:
        raise ValueError(
            f"opened= names {', '.join(map(repr, unknown))}, which have no inside "
            f"(insides were given for: {', '.join(insides) or 'none'})"
        )
    return GraphFigure(
        plan=plan,
        inside=insides,
        opened=opened,
        expanded=[str(e) for e in expanded],
        colour=colours,
        colour_label=colour_label,
        height=int(height),
        width=int(width),
        name=name or "graph",
    )
