"""The graph figure's picture: a laid-out scene painted as one SVG, legend included; what the
live figure shows (the browser adds fit, pan, zoom, minimap), the static face and `save_svg`.
Every box carries a `<title>` (its tooltip) and, where a click changes something,
`data-click="trait key"`.
"""

from __future__ import annotations

import math
from typing import Any

from somatize.figures._layout import Point, layout
from somatize.figures._scene import Box, pill_width, reach, scene, walk
from somatize.figures._shapes import HUES, outline
from somatize.figures._svg import (
    INK,
    MUTED,
    Scale,
    colour_bar,
    esc,
    finite,
    number,
    svg_open,
    svg_text,
    text_width,
    viridis,
)

EDGE = "#7b8496"
SKIP = "#0f9d8a"
BLOCK = HUES["block"]
PILLS = {
    "device": "#2f6fdf",
    "host": "#7a4fd0",
    "cached": "#c77d0a",
    "frozen": "#2a9fd6",
    "mapped": "#2f9e44",
}


def picture(
    plan: dict,
    insides: dict,
    opened: list[str],
    expanded: list[str],
    colour: dict[str, Any],
    colour_label: str = "",
    room: tuple[float, float] = (1000.0, 600.0),
) -> str:
    """The graph drawn as SVG text (see the module's docstring); `room` is the width and
    height it is laid out to fit, wrapping what is longer."""
    root = scene(plan, insides, opened, expanded)
    routes = layout(root, room)
    return _Painter(root, routes, colour, colour_label).svg()


class _Painter:
    def __init__(self, root: Box, routes: dict, colour: dict, label: str) -> None:
        self.root, self.routes, self.colour, self.label = root, routes, colour, label
        self.scale = Scale(colour.values())

    def shown(self, box: Box) -> tuple[Any, int]:
        """The value `box` is painted with, and which copy's it is (0: its own): a folded box
        with no value of its own shows its first copy's that has one."""
        wheres = [box.where, *box.copies] if box.where else []
        k = next((k for k, w in enumerate(wheres) if self.colour.get(w) is not None), 0)
        return (self.colour.get(wheres[k]) if wheres else None), k

    def fill(self, box: Box) -> tuple[str, str] | None:
        v = self.shown(box)[0]
        if not finite(v) or self.scale.empty:
            return None
        t = self.scale.t(v)
        return viridis(t), "#111" if t > 0.55 else "#fff"  # text dark on the bright end

    def svg(self) -> str:
        boxes, layers = [], []
        families: dict[str, None] = {}
        for box in walk(self.root):
            if box.kind == "layer":
                families[box.family] = None
                layers.append(self.layer(box))
            elif box.kind != "root":
                boxes.append(self.container(box))
        skips = self.skips()
        edges = [self.edge(points, (s, d) in skips, s, d) for (s, d), points in self.routes.items()]
        legend, lh = self.legend(list(families), bool(skips))
        w = max(self.root.w, 200.0)
        h = self.root.h + lh
        arrows = "".join(
            f'<marker id="smz-arrow-{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            f'fill="{c}"/></marker>'
            for name, c in (("edge", EDGE), ("skip", SKIP))
        )
        legend_at = f"translate(0,{self.root.h:.0f})"
        return (
            f"{svg_open(w, h, 'smz-graph-svg', f'<defs>{arrows}</defs>')}"
            f'<g class="smz-containers">{"".join(boxes)}</g><g class="smz-edges">{"".join(edges)}'
            f'</g><g class="smz-layers">{"".join(layers)}</g>'
            f'<g class="smz-legend" transform="{legend_at}">{"".join(legend)}</g></svg>'
        )

    def tip(self, box: Box) -> str:
        lines = [box.label.lstrip("▸▾ ")] + [f"{k}: {v}" if k else v for k, v in box.tip]
        value, k = self.shown(box)
        if value is not None:
            copy = f" (copy {k + 1}'s)" if k else ""
            lines.insert(1, f"{self.label or 'colour'}: {number(value)}{copy}")
        if box.copies and any(self.colour.get(w) is not None for w in box.copies):
            each = [number(self.colour.get(w)) for w in [box.where, *box.copies]]
            lines.insert(2 if value is not None else 1, f"each copy: {', '.join(each)}")
        return f"<title>{esc(chr(10).join(lines))}</title>"

    def attrs(self, box: Box) -> str:
        out = f' data-id="{esc(box.id)}" data-box="{box.x:.1f} {box.y:.1f} {box.w:.1f} {box.h:.1f}"'
        if box.click:
            out += f' data-click="{esc(box.click[0])} {esc(box.click[1])}" cursor="pointer"'
        return out

    def container(self, box: Box) -> str:
        x, y, w, h = box.x, box.y, box.w, box.h
        if box.kind == "group":
            return (
                f'<g class="smz-group"{self.attrs(box)}>{self.tip(box)}<rect {_frame(box)} rx="8" '
                f'fill="none" stroke="#7d8799" stroke-dasharray="5 4"/>'
                f"{svg_text(x + 10, y + 15, box.label)}</g>"
            )
        if box.kind == "block":
            stack = ""
            if box.stack:  # the N copies behind a folded block
                stack = (
                    f'<rect class="smz-stack" x="{x + 4:.1f}" y="{y + 4:.1f}" width="{w:.1f}" '
                    f'height="{h:.1f}" rx="6" fill="none" stroke="{BLOCK}" stroke-opacity="0.35"/>'
                )
            cls = "smz-block" + (" smz-foldable" if box.click else "")
            label = svg_text(x + 8, y + 15, box.label, fill=BLOCK, bold=True, cls="smz-block-label")
            return (
                f'<g class="{cls}"{self.attrs(box)}>{self.tip(box)}{stack}'
                f'<rect {_frame(box)} rx="6" fill="rgba(138,111,209,0.06)" stroke="{BLOCK}" '
                f'stroke-dasharray="4 3" stroke-width="1.2"/>{label}</g>'
            )
        return self.node(box)

    def node(self, box: Box) -> str:
        x, y, w = box.x, box.y, box.w
        col = self.fill(box)
        frozen = ("frozen", "frozen") in box.pills
        opened = bool(box.children)
        bg, ink = col if col and not opened else ("#f6f7fa", INK)
        cx, anchor = (x + 12, "start") if opened else (x + w / 2, "middle")
        parts = [
            f'<g class="smz-node{" smz-open" if opened else ""}"{self.attrs(box)}>{self.tip(box)}',
            f'<rect {_frame(box)} rx="8" fill="{bg}" stroke="{PILLS["frozen"] if frozen else "#9aa3b5"}" '
            f'stroke-width="{2 if frozen else 1.2}"/>',
        ]
        if col and opened:  # its colour on its title only: its layers and edges keep contrast
            bg, ink = col
            parts.append(
                f'<rect class="smz-head" x="{x + 1:.1f}" y="{y + 1:.1f}" width="{w - 2:.1f}" '
                f'height="40" rx="8" fill="{bg}"/>'
            )
        parts += [
            svg_text(cx, y + 19, box.label, 13, ink, bold=True, anchor=anchor, cls="smz-title"),
            svg_text(cx, y + 34, box.sub, fill=ink if col else MUTED, anchor=anchor),
        ]
        total = sum(pill_width(t) + 4 for _, t in box.pills) - 4  # its badges, in a row
        px = x + 12 if opened else x + (w - total) / 2
        for kind, text in box.pills:
            pw = pill_width(text)
            parts.append(
                f'<g class="smz-pill smz-pill-{kind}"><rect x="{px:.1f}" y="{y + 42:.1f}" '
                f'width="{pw:.1f}" height="14" rx="7" fill="{PILLS[kind]}"/>'
                + svg_text(px + pw / 2, y + 52.5, text, 9.5, "#fff", bold=True, anchor="middle")
                + "</g>"
            )
            px += pw + 4
        parts.append("</g>")
        return "".join(parts)

    def layer(self, box: Box) -> str:
        col = self.fill(box)
        hue = HUES[box.family]
        path = outline(box.family, box.w, box.h)
        bg, ink = col or ("#fff", INK)
        dash = ' stroke-dasharray="3 2"' if box.family == "dropout" else ""
        fill = f'<path d="{path}" fill="{bg}" stroke="{hue}" stroke-width="1.4"{dash}/>'
        if not col:  # uncoloured: tinted with its family's hue
            fill += f'<path d="{path}" fill="{hue}" fill-opacity="0.13"/>'
        mid, y0 = box.w / 2, 16 if box.sub else box.h / 2 + 4
        out = [
            f'<g class="smz-layer smz-kind-{box.family}"{self.attrs(box)} '
            f'transform="translate({box.x:.1f},{box.y:.1f})">{self.tip(box)}{fill}',
            svg_text(mid, y0, box.label, 12, ink, bold=True, anchor="middle"),
        ]
        if box.sub:
            sub_ink = ink if col else MUTED
            out.append(svg_text(mid, "30", box.sub, 10.5, sub_ink, italic=True, anchor="middle"))
        out.append("</g>")
        return "".join(out)

    def skips(self) -> set[tuple[str, str]]:
        """Edges that skip ahead: into a box whose other input the edge's source also reaches
        by another way (a residual around a block, the first input of an add after it); drawn
        in the accent colour. Inputs side by side (attention's query, key and value) are not."""
        succ: dict[str, list[str]] = {}
        into: dict[str, list[str]] = {}
        for s, d in self.routes:
            succ.setdefault(s, []).append(d)
            into.setdefault(d, []).append(s)
        return {
            (s, d)
            for d, sources in into.items()
            if len(sources) > 1
            for s in sources
            if d in reach(succ, [y for y in succ[s] if y != d], avoid=(s, d))
        }

    def edge(self, points: list[Point], skip: bool, s: str, d: str) -> str:
        colour, name = (SKIP, "skip") if skip else (EDGE, "edge")
        cls = "smz-edge smz-skip" if skip else "smz-edge"
        return (
            f'<path class="{cls}" d="{_path(points)}" fill="none" stroke="{colour}" '
            f'stroke-width="{1.6 if skip else 1.3}" marker-end="url(#smz-arrow-{name})" '
            f'data-from="{esc(s)}" data-to="{esc(d)}"/>'
        )

    def legend(self, families: list[str], skips: bool) -> tuple[list[str], float]:
        out, x, y, width = [], 12.0, 8.0, max(self.root.w, 200.0) - 12
        items = [  # (label, its mark at {x}, {y}; {my} its middle)
            (
                fam,
                f'<path transform="translate({{x}},{{y}})" d="{outline(fam, 26, 14)}" '
                f'fill="{HUES[fam]}" fill-opacity="0.2" stroke="{HUES[fam]}" stroke-width="1.3"/>',
            )
            for fam in families
        ]
        if skips:
            mark = f'<path d="M{{x}},{{my}} h26" stroke="{SKIP}" stroke-width="1.6"/>'
            items.append(("skip (residual, second input)", mark))
        for label, mark in items:
            w = 34 + text_width(label, 11)
            if x + w > width and x > 12:
                x, y = 12.0, y + 20
            out.append(mark.format(x=f"{x:.1f}", y=f"{y:.1f}", my=f"{y + 7:.1f}"))
            out.append(svg_text(x + 30, y + 11, label))
            x += w + 12
        h = y + 20 if items else 0.0
        if not self.scale.empty:
            bar_y = h + (4 if items else 8)
            colour_bar(out, 12, bar_y, 140, self.scale, self.label or "colour")
            h = bar_y + 18
        return out, h + 6 if h else 0.0


def _frame(box: Box) -> str:
    """Where a box is, as a rect's attributes."""
    return f'x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}"'


def _path(points: list[Point]) -> str:
    """A route as SVG path data: S-curves between layers (down an open node, across the
    graph), straight lines (rounded at their corners) elsewhere."""
    d = [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
    n = len(points)
    for k in range(1, n):
        (px, py, _), (x, y, curve) = points[k - 1], points[k]
        if curve and (abs(px - x) > 0.5 and abs(py - y) > 0.5):
            if curve == "v":
                my = (py + y) / 2
                d.append(f"C{px:.1f},{my:.1f} {x:.1f},{my:.1f} {x:.1f},{y:.1f}")
            else:
                mx = (px + x) / 2
                d.append(f"C{mx:.1f},{py:.1f} {mx:.1f},{y:.1f} {x:.1f},{y:.1f}")
            continue
        if k < n - 1 and not points[k + 1][2]:
            nx, ny, _ = points[k + 1]
            r = min(6.0, math.dist((px, py), (x, y)) / 2, math.dist((x, y), (nx, ny)) / 2)
            if r > 0.5 and (abs((x - px) * (ny - y) - (y - py) * (nx - x)) > 1e-6):
                a = _toward((x, y), (px, py), r)
                b = _toward((x, y), (nx, ny), r)
                d.append(f"L{a[0]:.1f},{a[1]:.1f}Q{x:.1f},{y:.1f} {b[0]:.1f},{b[1]:.1f}")
                continue
        d.append(f"L{x:.1f},{y:.1f}")
    return "".join(d)


def _toward(p: tuple[float, float], q: tuple[float, float], r: float) -> tuple[float, float]:
    dist = math.dist(p, q) or 1.0
    return p[0] + (q[0] - p[0]) / dist * r, p[1] + (q[1] - p[1]) / dist * r
