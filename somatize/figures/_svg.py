"""An SVG of a graph drawn without a browser: a plain layered layout, left to right.

The live figure draws with ELK in the browser and hands its SVG back; this is what `save_svg`
writes for a figure that was never shown. Each node is a box in the column of its longest
path from a root; an inside is listed in the box, a folded block as one row `×N`.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

_VIRIDIS = [
    (68, 1, 84),
    (62, 74, 137),
    (38, 130, 142),
    (53, 183, 121),
    (253, 231, 37),
]


def _viridis(t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(_VIRIDIS) - 1)
    i = min(len(_VIRIDIS) - 2, int(t))
    f = t - i
    c = [round(a + (b - a) * f) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1], strict=True)]
    return f"rgb({c[0]},{c[1]},{c[2]})"


def _scale(colour: dict[str, Any]):
    xs = [v for v in colour.values() if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return lambda v: None
    lo, hi = min(xs), max(xs)
    log = lo > 0 and hi / lo > 100
    f = math.log10 if log else (lambda v: v)
    a, b = f(lo), f(hi)

    def fill(v: Any) -> tuple[str, str] | None:
        """(fill, ink) for a value, or None."""
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        t = 0.5 if a == b else (f(v) - a) / (b - a)
        return _viridis(t), ("#111" if t > 0.55 else "#fff")

    return fill


def _rows(inside: dict[str, Any]) -> list[tuple[int, str, str]]:
    """(indent, text, path) per row: leaf layers, and a folded block's header."""
    layers = inside.get("layers", [])
    blocks = {layer.get("block") for layer in layers if layer.get("block")}
    times = {layer["path"]: layer.get("times", 1) for layer in layers}
    rows = []
    for layer in layers:
        depth, b = 0, layer.get("block")
        while b:
            depth += 1
            parent = next((x for x in layers if x["path"] == b), None)
            b = parent.get("block") if parent else None
        text = str(layer.get("label") or layer.get("kind") or layer["path"])
        if layer.get("times", 1) > max(1, times.get(layer.get("block"), 1)):
            text += f"  ×{layer['times']}"
        shape = layer.get("shape")
        if layer["path"] not in blocks and isinstance(shape, list) and shape:
            text += "  [" + "×".join(map(str, shape)) + "]"
        rows.append((depth, text, layer["path"]))
    return rows


def fallback_svg(plan: dict[str, Any], insides: dict[str, Any], colour: dict[str, Any]) -> str:
    """The graph as SVG text, laid out here (see the module's docstring)."""
    nodes = [str(n["id"]) for n in plan.get("nodes", [])]
    kinds = {str(n["id"]): str(n.get("kind", "")) for n in plan.get("nodes", [])}
    edges = [(str(a), str(b)) for a, b in plan.get("edges", [])]
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        preds.setdefault(b, []).append(a)
    column: dict[str, int] = {}
    order = plan.get("order") or nodes
    for n in order:
        column[n] = max((column.get(p, 0) + 1 for p in preds.get(n, [])), default=0)
    fill = _scale(colour)
    size = {}
    for n in nodes:
        rows = _rows(insides[n]) if n in insides else []
        width = max([len(n) * 8, len(kinds[n]) * 7] + [len(t) * 6.6 + 14 * d for d, t, _ in rows])
        size[n] = (width + 28, 46 + 20 * len(rows) + (8 if rows else 0))
    cols: dict[int, list[str]] = {}
    for n in nodes:
        cols.setdefault(column[n], []).append(n)
    x, pos = 16.0, {}
    height = 0.0
    for c in sorted(cols):
        y = 16.0
        for n in cols[c]:
            pos[n] = (x, y)
            y += size[n][1] + 24
        height = max(height, y)
        x += max(size[n][0] for n in cols[c]) + 56
    width = x - 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="system-ui, \'DejaVu Sans\', '
        f'sans-serif">',
        '<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#7b8496"/></marker>'
        "</defs>",
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#fff"/>',
    ]
    for a, b in edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        x1, y1 = xa + size[a][0], ya + 23
        x2, y2 = xb, yb + 23
        mid = (x1 + x2) / 2
        out.append(
            f'<path d="M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"'
            ' fill="none" stroke="#7b8496" stroke-width="1.3" marker-end="url(#a)"/>'
        )
    for n in nodes:
        (x0, y0), (w, h) = pos[n], size[n]
        bg, ink = fill(colour.get(n)) or ("#f6f7fa", "#1f2430")
        out.append(
            f'<g class="node"><rect x="{x0:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'rx="8" fill="{bg}" stroke="#9aa3b5"/>'
            f'<text x="{x0 + 12:.1f}" y="{y0 + 19:.1f}" font-size="13" font-weight="700" '
            f'fill="{ink}">{escape(n)}</text>'
            f'<text x="{x0 + 12:.1f}" y="{y0 + 34:.1f}" font-size="11" fill="{ink}" '
            f'fill-opacity="0.75">{escape(kinds[n])}</text>'
        )
        if n in insides:
            for i, (depth, text, path) in enumerate(_rows(insides[n])):
                ry = y0 + 46 + 20 * i
                lf, link = fill(colour.get(f"{n}.{path}")) or ("#ffffff", "#1f2430")
                rx = x0 + 10 + 14 * depth
                out.append(
                    f'<rect x="{rx:.1f}" y="{ry:.1f}" width="{x0 + w - 10 - rx:.1f}" height="17" '
                    f'rx="3" fill="{lf}" stroke="#b9c0cd"/>'
                    f'<text x="{rx + 6:.1f}" y="{ry + 12.5:.1f}" font-size="11" fill="{link}">'
                    f"{escape(text)}</text>"
                )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)
