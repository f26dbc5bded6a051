"""The comparison table's picture (what `CompareTable` says it shows): an HTML table with
inline styles, so it reads the same with no stylesheet, a scatter of a score against what was
measured, and a legend.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from itertools import groupby
from typing import Any

from somatize.figures._page import image
from somatize.figures._svg import (
    FONT,
    INK,
    LINE,
    MUTED,
    blend,
    esc,
    finite,
    number,
    svg_open,
    svg_text,
    text_width,
    ticks,
)

WIDEST = 1400.0
NAMES = 220.0  # the widest a candidate's name is shown (cut with "…" past it)
FLAGGED = "rgba(224,49,49,0.22)"  # a probe cell's tint when the health verdict flags it

_BASE = "padding:4px 8px;border-bottom:1px solid #e1e4ea;white-space:nowrap;"
_STICKY = "position:sticky;left:0;z-index:1;background:#fff;"


def rank_colour(t: float, alpha: float = 0.55) -> str:
    """From worst (t = 0, red) through a pale middle to best (t = 1, green)."""
    r, g, b = blend([(224, 49, 49), (245, 241, 218), (47, 158, 68)], t)
    return f"rgba({r},{g},{b},{alpha})"


def ranks(values: list[Any]) -> list[float | None]:
    """Each value's rank in its column from 0 (lowest: worst) to 1 (best), ties sharing one;
    an infinity ranks too (a proxy's log 0 is the worst score there is), a NaN does not."""
    nums = [(float(v), i) for i, v in enumerate(values) if finite(v) or v in (math.inf, -math.inf)]
    out: list[float | None] = [None] * len(values)
    if len(nums) < 2:
        return out
    ordered = sorted(v for v, _ in nums)
    for v, i in nums:
        lo, hi = bisect_left(ordered, v), bisect_right(ordered, v) - 1
        out[i] = (lo + hi) / 2 / (len(ordered) - 1)
    return out


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # as they come through JSON


def html(table: dict[str, Any]) -> str:
    """The table's HTML (see the module's docstring). `table` is what CompareTable holds:
    index, columns, values, groups, hidden, explain, flagged, left_out, correlations,
    measured, sort_by, ascending, scatter."""
    cols, index = table["columns"], table["index"]
    values = [[_SPECIAL.get(v, v) if isinstance(v, str) else v for v in r] for r in table["values"]]
    table = {**table, "values": values}
    groups, hidden = table["groups"], set(table["hidden"])
    order = _order(table)
    name = f"{_STICKY}text-align:left;max-width:{NAMES:.0f}px;"
    heading = esc(table["index_name"])  # over the names
    head = "border-bottom:2px solid #c4c9d4"
    out = [
        f'<div class="smz-table-face" style="font-family:{esc(FONT)};font-size:12px;color:{INK}">',
        # its own font size: a page without a doctype or JupyterLab's would set another one
        '<div class="smz-scroll" style="max-width:100%;overflow-x:auto"><table style="'
        f"font-size:12px;color:{INK};border-collapse:separate;border-spacing:0;"
        'font-variant-numeric:tabular-nums">',
        "<thead><tr>",
        _cell("th", f' rowspan="2" class="smz-index" data-col="{heading}"', name + head, heading),
    ]
    for group, run in groupby(cols, key=lambda c: groups.get(c, "")):
        run = list(run)
        shown = sum(1 for c in run if c not in hidden)
        label, title = _GROUPS.get(group, (group, ""))
        attrs = f' class="smz-group" data-group="{esc(group)}" colspan="{shown or len(run)}"'
        style = f"text-align:center;color:{MUTED};font-weight:600;font-size:11px;"
        out.append(_cell("th", f'{attrs} title="{esc(title)}"', style, esc(label), not shown))
    out.append("</tr><tr>")
    for c in cols:
        arrow = (" ▲" if table["ascending"] else " ▼") if c == table["sort_by"] else ""
        attrs = f' data-col="{esc(c)}" data-group="{esc(groups.get(c, ""))}"'
        style = f"text-align:right;cursor:pointer;{head};"
        style += "color:#2f6fdf;" if c == table["measured"] else ""
        label = esc(c.split(":", 1)[-1]) + arrow
        attrs += f' title="{esc(table["explain"].get(c, ""))}"'
        out.append(_cell("th", attrs, style, label, c in hidden))
    out.append("</tr></thead><tbody>")
    colour = {  # every proxy and measured: higher is better
        c: ranks([row[j] for row in values])
        for j, c in enumerate(cols)
        if groups[c] in ("measured", "proxy")
    }
    for i in order:
        row = esc(index[i])
        style = name + "overflow:hidden;text-overflow:ellipsis"
        out.append(f'<tr data-row="{row}">')
        out.append(_cell("th", f' class="smz-index" title="{row}"', style, row))
        for j, c in enumerate(cols):
            v = values[i][j]
            style = "text-align:right;"
            shown = v if isinstance(v, str) else number(v)
            tip = f"{c}: {shown}"
            rank = colour.get(c, [None] * len(index))[i]
            flags = table["flagged"].get(f"{index[i]}|{c}")
            why = table["left_out"].get(index[i], {}).get(c)
            if rank is not None:
                style += f"background:{rank_colour(rank)};"
            elif flags:
                style += f"background:{FLAGGED};"
                tip += " — flagged " + ", ".join(flags)
            if why:
                style += "cursor:help;text-decoration:underline dotted;"
                tip = f"{c}: left out: {why}"
            sort = f' data-v="{float(v)!r}"' if finite(v) else ""
            attrs = f' data-col="{esc(c)}"{sort} title="{esc(tip)}"'
            out.append(_cell("td", attrs, style, esc(shown), c in hidden))
        out.append("</tr>")
    out.append("</tbody>")
    if table["measured"] and table["correlations"]:
        measured = esc(table["measured"])
        tip = f"Spearman rank correlation with {measured}: 1 ranks the candidates exactly as it"
        tip += " does"
        style = f"{_STICKY}text-align:left;font-style:italic;border-top:2px solid #c4c9d4"
        out.append('<tfoot><tr class="smz-corr">')
        out.append(_cell("th", f' class="smz-index" title="{tip}"', style, f"ρ with {measured}"))
        for c in cols:
            rho = table["correlations"].get(c)
            style = "text-align:right;font-style:italic;border-top:2px solid #c4c9d4;"
            if finite(rho) and c != table["measured"]:
                style += f"background:{rank_colour((rho + 1) / 2, 0.7)};"
            text = "" if c == table["measured"] else number(rho)
            out.append(_cell("td", f' data-col="{esc(c)}"', style, text, c in hidden))
        out.append("</tr></tfoot>")
    below = '<div class="smz-below" style="display:flex;flex-wrap:wrap;gap:24px;margin-top:8px">'
    out += ["</table></div>", _left_out(table), _tools(table)]
    out += [below, _scatters(table), _legend(table)]
    out.append("</div></div>")
    return "".join(out)


def _cell(tag: str, attrs: str, style: str, content: str, hidden: bool = False) -> str:
    """A table cell (everything given as HTML, escaped): its attributes, its style after the
    shared padding and rule; `hidden`: not displayed."""
    hide = "display:none;" if hidden else ""
    return f'<{tag}{attrs} style="{_BASE}{style}{hide}">{content}</{tag}>'


_GROUPS = {  # a group's heading and its tooltip; any other group is headed by its name
    "measured": ("measured", "what you measured after training (higher is better)"),
    "proxy": ("proxy scores · higher is better", "cheap scores taken before training"),
    "probe": ("probe at initialisation · median over places", "what somatize.torch.probe measured"),
}


def _order(table: dict[str, Any]) -> list[int]:
    """Row order: by `sort_by` (numbers first), else as given."""
    index, values, key = table["index"], table["values"], table["sort_by"]
    rows = list(range(len(index)))
    if key in table["columns"]:
        j = table["columns"].index(key)
        fin = [i for i in rows if finite(values[i][j])]
        fin.sort(key=lambda i: values[i][j], reverse=not table["ascending"])
        return fin + [i for i in rows if not finite(values[i][j])]
    if key == table["index_name"]:
        rows.sort(key=lambda i: index[i], reverse=not table["ascending"])
    return rows


def _left_out(table: dict[str, Any]) -> str:
    """A line per proxy left out of a candidate, saying why."""
    lines = "".join(
        f"<div><b>{esc(row)}</b> · {esc(c.split(':', 1)[-1])} left out: {esc(why)}</div>"
        for row, said in table["left_out"].items()
        for c, why in said.items()
    )
    style = f"margin-top:6px;color:{MUTED};font-size:11px;line-height:1.5"
    return f'<div class="smz-left-out" style="{style}">{lines}</div>' if lines else ""


def _tools(table: dict[str, Any]) -> str:
    """The toggles for hidden groups (live only: a page with no script shows them inert)."""
    hidden = Counter(table["groups"].get(c, "other") for c in table["hidden"])
    if not hidden:
        return ""
    buttons = "".join(
        f'<button class="smz-toggle" data-group="{esc(g)}" '
        'style="font:inherit;font-size:11px;margin-right:6px">'
        f"▸ {esc(_GROUPS.get(g, (g, ''))[0].split(' · ')[0])} ({n} more)</button>"
        for g, n in hidden.items()
    )
    style = f"margin-top:6px;color:{MUTED};font-size:11px"
    return f'<div class="smz-tools" style="{style}">{buttons}</div>'


def _scatters(table: dict[str, Any]) -> str:
    """A scatter of every proxy score (and the size) against `measured`, the chosen one
    shown."""
    measured = table["measured"]
    if not measured:
        return ""
    cols, values = table["columns"], table["values"]
    j_m = cols.index(measured)
    choices = [c for c in cols if c != measured and table["groups"].get(c) in ("proxy", "size")]
    choices = [c for c in choices if sum(finite(row[cols.index(c)]) for row in values) >= 2]
    if not choices:
        return ""
    chosen = table["scatter"] if table["scatter"] in choices else choices[0]
    picked = {chosen: ' selected="selected"'}
    options = "".join(
        f'<option value="{esc(c)}"{picked.get(c, "")}>{esc(c)}</option>' for c in choices
    )
    parts = [
        f'<div class="smz-scatter-box"><div style="font-size:11px;color:{MUTED};margin-bottom:2px">'
        f'<select class="smz-scatter-pick" style="font:inherit;font-size:11px">{options}</select>'
        f" against {esc(measured)}</div>"
    ]
    for c in choices:
        j = cols.index(c)
        points = [
            (float(row[j]), float(row[j_m]), table["index"][i])
            for i, row in enumerate(values)
            if finite(row[j]) and finite(row[j_m])
        ]
        show = "" if c == chosen else ' style="display:none"'
        drawn = scatter(points, c, measured, table["correlations"].get(c))
        drawn = image(drawn, f"{c} against {measured}")
        parts.append(f'<div class="smz-scatter" data-col="{esc(c)}"{show}>{drawn}</div>')
    parts.append("</div>")
    return "".join(parts)


def scatter(points: list[tuple[float, float, str]], xlabel: str, ylabel: str, rho: Any) -> str:
    """One score against what was measured, a dot per candidate, named."""
    w, h, left, bottom = 380.0, 250.0, 52.0, 34.0
    x_lo, x_hi = _padded([p[0] for p in points], 0.08)
    y_lo, y_hi = _padded([p[1] for p in points], 0.1)

    def sx(v: float) -> float:
        return left + (v - x_lo) / (x_hi - x_lo) * (w - left - 10)

    def sy(v: float) -> float:
        return h - bottom - (v - y_lo) / (y_hi - y_lo) * (h - bottom - 10)

    out = [
        svg_open(w, h),
        f'<rect x="{left:.0f}" y="10" width="{w - left - 10:.0f}" height="{h - bottom - 10:.0f}" '
        f'fill="none" stroke="{LINE}"/>',
    ]
    for t in ticks(x_lo, x_hi, 5):
        out.append(svg_text(sx(t), h - bottom + 14, number(t), 10, anchor="middle"))
    for t in ticks(y_lo, y_hi, 5):
        out.append(svg_text(left - 5, sy(t) + 3.5, number(t), 10, anchor="end"))
    said = f"{xlabel} · ρ = {number(rho)}" if finite(rho) else xlabel
    out.append(svg_text((left + w) / 2, h - 4, said, fill=INK, anchor="middle"))
    out.append(
        f'<text transform="translate(12,{(h - bottom) / 2:.1f}) rotate(-90)" font-size="11" '
        f'fill="{INK}" text-anchor="middle">{esc(ylabel)}</text>'
    )
    for x, y, name in points:
        left_side = sx(x) + 7 + text_width(name, 10) > w - 4  # a name kept inside the plot
        tx, anchor = (sx(x) - 7, "end") if left_side else (sx(x) + 7, "start")
        out.append(
            f'<g class="smz-dot"><circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4.5" fill="#3d6fd9" '
            'fill-opacity="0.8"/>'
            f"{svg_text(tx, sy(y) + 3.5, name, 10, INK, anchor=anchor)}"
            f"<title>{esc(name)}: {esc(number(x))}, {esc(number(y))}</title></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _padded(values: list[float], share: float) -> tuple[float, float]:
    """An axis' ends: the values' range (±1 around one value), widened by `share` of it."""
    lo, hi = min(values), max(values)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    pad = (hi - lo) * share
    return lo - pad, hi + pad


def _legend(table: dict[str, Any]) -> str:
    """What the colours mean, and a sentence per column."""
    swatch = "display:inline-block;width:12px;height:10px;border-radius:2px;margin-right:4px;"
    keys = [
        f'<span><span style="{swatch}vertical-align:-1px;background:{colour}"></span>{text}</span>'
        for colour, text in [
            (rank_colour(1), "best in its column"),
            (rank_colour(0.5), "middle"),
            (rank_colour(0), "worst"),
            (FLAGGED, "probe value the health verdict flags"),
        ]
    ]
    rows = "".join(
        f'<div data-col="{esc(c)}"><b>{esc(c)}</b> — {esc(table["explain"][c])}</div>'
        for c in table["columns"]
        if table["explain"].get(c)
    )
    return (
        f'<div class="smz-legend" style="flex:1 1 420px;font-size:11px;color:{MUTED};'
        'line-height:1.5"><div style="display:flex;gap:14px;flex-wrap:wrap;margin-bottom:4px">'
        f"{''.join(keys)}</div>{rows}</div>"
    )
