"""The graph figure: a graph's nodes left to right, each open into what it is made of.

`graph_figure(g, inside=architecture(g, x), colour=probe_numbers)` is what `g.figure(...)`
and `g` alone in a cell call. The drawing is done in the browser (ELK's layered layout,
bundled); this half holds the data and saves it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from somatize.figures._page import STATIC, jsonable, page
from somatize.figures._svg import fallback_svg
from somatize.graph import as_graph

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
            f"a graph figure draws a Graph (or its plan_json() dict), not {type(graph).__name__}"
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
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"colour[{key!r}] is {value!r}; colours are numbers (take one metric "
                "out of a probe or an audit first)"
            ) from None
        out[key] = number if math.isfinite(number) else str(number)
    return out


class GraphFigure(anywidget.AnyWidget):
    """A live drawing of a graph: nodes left to right (ELK's layered layout), placement badges
    (device, host), marks for cached, frozen and mapped nodes; with insides, each node opens
    into its layers, folded `×N` blocks unfold on click, hover says kind, shape and
    parameters; `colour` paints any `{where: number}` with a legend. Change a trait and the
    drawing updates in place. `save_html` and `save_svg` keep it."""

    _esm = STATIC / "graph.js"
    _css = STATIC / "graph.css"

    plan = traitlets.Dict().tag(sync=True)
    inside = traitlets.Dict().tag(sync=True)
    opened = traitlets.List(traitlets.Unicode()).tag(sync=True)
    expanded = traitlets.List(traitlets.Unicode()).tag(sync=True)
    colour = traitlets.Dict().tag(sync=True)
    colour_label = traitlets.Unicode("").tag(sync=True)
    height = traitlets.Int(640).tag(sync=True)
    name = traitlets.Unicode("graph").tag(sync=True)
    _svg = traitlets.Unicode("").tag(sync=True)

    def recolour(self, colour: Any = None, label: str | None = None) -> None:
        """Paint `{where: number}` on the drawing (None clears it); refused, leaving the
        colours as they were, when a key is no node or node.path of this graph."""
        new = _colours(self.plan, colour)
        self.colour = new
        if label is not None:
            self.colour_label = label

    def state(self) -> dict[str, Any]:
        """The figure's data as one dict: what a saved page draws from."""
        return {
            "plan": self.plan,
            "inside": self.inside,
            "opened": list(self.opened),
            "expanded": list(self.expanded),
            "colour": self.colour,
            "colour_label": self.colour_label,
            "height": self.height,
            "name": self.name,
            "_svg": "",
        }

    def save_html(self, path: str | Path) -> Path:
        """Write a standalone HTML page with the figure alive in it (fold, unfold, hover),
        drawn offline: the bundle and the data are inside the page."""
        path = Path(path)
        path.write_text(page("graph", self.state(), title=self.name), encoding="utf-8")
        return path

    def svg(self) -> str:
        """The drawing as SVG text: what the browser last drew when the figure has been shown
        (ELK's layout, as seen), else one drawn here from a simpler layered layout."""
        return self._svg or fallback_svg(self.plan, self.inside, self.colour)

    def save_svg(self, path: str | Path) -> Path:
        """Write the drawing as an SVG file (see `svg`)."""
        path = Path(path)
        path.write_text(self.svg(), encoding="utf-8")
        return path


def graph_figure(
    graph: Any,
    inside: Any = None,
    colour: Any = None,
    *,
    colour_label: str = "",
    opened: Any = None,
    expanded: Any = (),
    height: int = 640,
    name: str | None = None,
) -> GraphFigure:
    """Draw a graph (a `Graph`, or its `plan_json()` dict) as a `GraphFigure`.

    `inside` is `{node: Inside}` (what `somatize.torch.architecture(g, x)` returns, or the
    insides' `.to_json()` dicts); every node given one opens into its layers, unless `opened`
    lists which do. `colour` is `{where: number}` keyed by `node` or `node.path.to.layer`.
    `expanded` lists folded blocks to show unfolded, as `"node:block.path"`. Refused with a
    clear error: insides or colours for nodes the graph does not have, colours that are not
    numbers."""
    plan = _plan_of(graph)
    insides = _insides(plan, inside)
    colours = _colours(plan, colour)
    if opened is None:
        opened = list(insides)
    else:
        opened = [str(o) for o in opened]
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
        name=name or "graph",
    )
