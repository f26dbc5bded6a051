"""The live audit's picture as SVG, in the layout the page draws live (`widgets/audit.js`):
the loss plot above, the heatmap of one metric below (a row per place and run, a column per
step, binned past 240), flags in a lane under their cells, a legend for every colour and mark.
An audit that holds only losses (no place watched) is drawn as the loss plot alone, with its
own step axis; with several runs each curve is named at its end.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from somatize.figures._history import History
from somatize.figures._svg import (
    INK,
    LINE,
    Scale,
    colour_bar,
    finite,
    fits,
    lines,
    number,
    svg_open,
    svg_text,
    text_width,
    tick_labels,
    ticks,
    viridis,
)
from somatize.health import METRICS, family

FAMILY_COLOURS = {
    "numeric": "#e03131",
    "signal": "#f76707",
    "activation": "#c2255c",
    "step": "#1971c2",
    "capacity": "#7048e8",
}
NO_NUMBER = "#e03131"
ABSENT = "#f1f3f5"
WAITING = "#8a93a6"  # what is said before anything came
RUN_COLOURS = ["#3d6fd9", "#e8590c", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285"]
MOST_COLUMNS = 240
ROW = 16  # a cell of 11 px, a lane of 3 for its flags


def smoothed(values: list[float], weight: float) -> list[float]:
    """An exponential moving average, its start debiased (what TensorBoard draws):
    `weight` 0 is the raw curve, near 1 very smooth. NaN and infinities are passed over."""
    out, acc, n = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            acc = weight * acc + (1 - weight) * v
            n += 1
            out.append(acc / (1 - weight**n) if weight > 0 else v)
        else:
            out.append(math.nan)
    return out


def picture(
    history: History,
    metric: str,
    title: str,
    *,
    log: bool = False,
    smoothing: float = 0.6,
    width: float = 900.0,
) -> str:
    """The audit drawn as SVG text (see the module's docstring)."""
    out: list[str] = []
    runs = list(history.runs)
    rows = [(w, r) for w in history.places() for r in runs if w in history.runs[r].places]
    many = len(runs) > 1
    label_w = min(220.0, max([90.0] + [text_width(w, 11) + 14 for w, _ in rows])) + 14 * many
    named = _run_labels(history, runs, title) if many else {}
    right = max([110.0] + [text_width(t, 10) + 14 for t in named.values()])
    x0, x1 = label_w, width - right
    steps = sorted({s for r in history.runs.values() for p in r.places.values() for s in p.steps})
    every_step = steps + [s for r in history.runs.values() for s in r.loss_steps]
    s_lo, s_hi = (min(every_step), max(every_step)) if every_step else (0, 1)
    per = max(1, math.ceil(len(steps) / MOST_COLUMNS))
    columns = -(-len(steps) // per)
    column_of = {s: k // per for k, s in enumerate(steps)}
    cw = (x1 - x0) / max(60, columns)

    def sx(step: float) -> float:
        # a step's place on the shared axis: the middle of its column
        if not steps:
            return x0 + (step - s_lo) / max(1, s_hi - s_lo) * (x1 - x0)
        k = column_of.get(step)
        if k is None:  # a loss step between health steps: along the same scale
            f = (step - steps[0]) / max(1, steps[-1] - steps[0])
            return x0 + cw / 2 + f * (columns - 1) * cw
        return x0 + (k + 0.5) * cw

    y = 8.0
    out.append(svg_text("8", y + 12, title, 13, INK, bold=True))
    about = METRICS.get(metric, "") if rows else ""
    at = 8 + text_width(title, 13, True) + 14
    if rows:  # the metric the heatmap shows: none without places
        out.append(svg_text(at, y + 12, metric or "no metric yet", fill=INK, bold=True))
        at += text_width(metric or "no metric yet", 11, True) + 10
    said = lines(about, width - at - 8) if about else []
    for k, line in enumerate(said):
        out.append(svg_text(at, y + 12 + 14 * k, line))
    y += 24 + 14 * max(0, len(said) - 1)
    # the loss plot ends where the columns do, so its curves fill it; its labels go after it
    ends = x0 + columns * cw if steps else x1
    y = _loss(out, history, runs, sx, x0, ends, y, log, smoothing, width, named, title)
    if not rows:  # losses only: a step axis under the loss plot, and nothing of health
        if every_step:
            _step_axis(out, sorted(set(every_step)), sx, x0, ends, y - 10)
        return svg_open(width, y + 16, "smz-audit-svg") + "".join(out) + "</svg>"
    scale = Scale(v for w, r in rows for v in history.runs[r].places[w].columns.get(metric, ()))
    top = y + 6
    families: dict[str, None] = {}
    levels: dict[str, list[str]] = {}
    marks: dict[str, list[str]] = {}
    wide = max(0.6, cw - (0.4 if cw > 3 else 0))
    for n, (where, run) in enumerate(rows):
        ry = top + n * ROW
        place = history.runs[run].places[where]
        name = fits(where, label_w - 14 - (14 if many else 0), 11)
        tip = f"{where} ({run})" if many else where
        out.append(svg_text(label_w - 6, ry + 10, name, fill=INK, anchor="end", title=tip))
        if many:
            colour = RUN_COLOURS[runs.index(run) % len(RUN_COLOURS)]
            rect = f'x="{label_w - 4:.1f}" y="{ry + 1:.1f}" width="3" height="10"'
            out.append(f'<rect {rect} fill="{colour}"/>')
        column = place.columns.get(metric)
        cells: dict[int, Any] = {}  # column -> the last value in it
        flagged: dict[int, set[str]] = {}
        raised: Counter[str] = Counter()
        for r, step in enumerate(place.steps):
            k = column_of[step]
            value = None if column is None else column[r]
            if value is not None or k not in cells:  # a bin shows its last value
                cells[k] = value
            if place.flags[r]:
                flagged.setdefault(k, set()).update(place.flags[r])
                raised.update(place.flags[r])
        for k, value in cells.items():
            cx = x0 + k * cw
            if value is None:
                fill = ABSENT
            elif isinstance(value, bool):
                fill = viridis(1.0 if value else 0.0)
            elif not finite(value):
                fill = NO_NUMBER
            else:
                fill = viridis(round(scale.t(value) * 63) / 63)
            levels.setdefault(fill, []).append(f"M{cx:.1f},{ry:.1f}h{wide:.1f}v11h{-wide:.1f}z")
        lane = max(0.8, cw)
        for k, flags in flagged.items():
            fam = family(sorted(flags)[0])
            families[fam] = None
            lanes = marks.setdefault(FAMILY_COLOURS[fam], [])
            lanes.append(f"M{x0 + k * cw:.1f},{ry + 12:.1f}h{lane:.1f}v3h{-lane:.1f}z")
        if raised:
            text = ", ".join(f"{f} ×{c}" for f, c in raised.most_common(2))
            colour = FAMILY_COLOURS[family(max(raised, key=raised.get))]
            out.append(svg_text(ends + 6, ry + 10, fits(text, width - ends - 8, 10), 10, colour))
    for fill, paths in [*levels.items(), *marks.items()]:
        out.append(f'<path fill="{fill}" d="{"".join(paths)}"/>')
    y = top + len(rows) * ROW
    _step_axis(out, steps, sx, x0, ends, y)
    named_runs = [r or title or "this run" for r in runs] if many else []  # as on the curves
    y = _legend(out, y + 26, scale, metric, families, named_runs, width)
    return svg_open(width, y, "smz-audit-svg") + "".join(out) + "</svg>"


def _step_axis(out, steps, sx, x0, x1, y) -> None:
    """A step axis from x0 to x1 at y + 2, its labels under it (at the steps nearest round
    numbers; labels that would touch are left out)."""
    at = f"{y + 2:.1f}"
    out.append(f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{at}" y2="{at}" stroke="{LINE}"/>')
    last_x = -1e9
    for t in ticks(steps[0], steps[-1], 7, whole=True):
        tx = sx(min(steps, key=lambda s: abs(s - t)))
        if tx - last_x >= 36:
            out.append(svg_text(tx, y + 14, number(t), 10, anchor="middle"))
            last_x = tx
    out.append(svg_text(x0 - 6, y + 14, "step", 10, anchor="end"))


def _run_labels(history, runs, title) -> dict[str, str]:
    """What names each run's curve at its end: the run's name (the unnamed run's is the
    title), cut from the right to 130 px, and its last loss."""
    out = {}
    for run in runs:
        values = history.runs[run].loss_values
        if values:
            name = fits(run or title or "this run", 130, 10, end=False)
            out[run] = f"{name} {number(values[-1])}"
    return out


def _spread(ys: list[float], gap: float, lo: float, hi: float) -> list[float]:
    """Label baselines moved apart to be `gap` apart at least, each as near its wish as
    that allows, kept within [lo, hi] while there is room."""
    order = sorted(range(len(ys)), key=ys.__getitem__)
    out = list(ys)
    prev = -math.inf
    for k in order:  # down, past the one above
        out[k] = max(out[k], prev + gap, lo)
        prev = out[k]
    nxt = math.inf
    for k in reversed(order):  # then up, off the bottom and the one below
        out[k] = min(out[k], nxt - gap, hi)
        nxt = out[k]
    return out


def _loss(out, history, runs, sx, x0, x1, y, log, smoothing, width, named, title) -> float:
    """The loss plot from x0 to x1, with its axes, and the last loss of each run after it
    (within `width`): with `named` runs, each run's label (its full name in a tooltip) at its
    curve's end, moved apart from the others; answers where the next part starts."""
    h = 130.0
    series = [(r, history.runs[r].loss_steps, history.runs[r].loss_values) for r in runs]
    series = [s for s in series if s[1]]
    every = [v for _, _, vs in series for v in vs if math.isfinite(v)]
    log = log and bool(every) and min(every) > 0
    out.append(
        f'<rect x="{x0:.1f}" y="{y:.1f}" width="{x1 - x0:.1f}" height="{h:.1f}" fill="none" '
        f'stroke="{LINE}"/>'
    )
    out.append(svg_text("12", y + h / 2 + 4, "loss (log)" if log else "loss", bold=True))
    if not every:
        out.append(svg_text(x0 + 8, y + 18, "no loss yet", fill=WAITING))
        return y + h + 8
    lo, hi = min(every), max(every)
    note = flat_note(lo, hi, sum(every) / len(every)) if len(every) >= 10 else ""
    if note:
        out.append(svg_text(x0 + 8, y + 14, note, 10, italic=True))
    if lo == hi:
        lo, hi = (lo * 0.9, hi * 1.1) if log else (lo - 0.5, hi + 0.5)
    f = math.log10 if log else float
    a, b = f(lo), f(hi)
    pad = (b - a) * 0.06
    a, b = a - pad, b + pad

    def sy(v: float) -> float:
        return y + h - (f(v) - a) / (b - a) * h

    marks = ticks(10**a if log else a, 10**b if log else b, 5, log)
    marks = [t for t in marks if y - 0.5 <= sy(t) <= y + h + 0.5]
    for t, label in zip(marks, tick_labels(marks), strict=True):
        ty = sy(t)
        out.append(
            f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="{LINE}" '
            'stroke-dasharray="2 3"/>'
        )
        out.append(svg_text(x0 - 5, ty + 3.5, label, 10, anchor="end"))

    def curve(steps: list[int], values: list[float], keep: range) -> str:
        drawn = [k for k in keep if math.isfinite(values[k]) and (values[k] > 0 or not log)]
        points = [f"{sx(steps[k]):.1f},{sy(values[k]):.1f}" for k in drawn]
        return "M" + "L".join(points) if points else ""

    ends = []
    for n, (run, steps, values) in enumerate(series):
        colour = RUN_COLOURS[runs.index(run) % len(RUN_COLOURS)]
        keep = range(0, len(steps), max(1, len(steps) // 1500))
        if smoothing > 0:
            out.append(
                f'<path class="smz-loss-raw" d="{curve(steps, values, keep)}" fill="none" '
                f'stroke="{colour}" stroke-opacity="0.28" stroke-width="1"/>'
            )
        smooth = smoothed(values, smoothing)
        line = curve(steps, smooth, keep)
        out.append(
            f'<path class="smz-loss" d="{line}" fill="none" stroke="{colour}" stroke-width="1.8"/>'
        )
        if not named:
            label = f"{run + ': ' if run else ''}step {steps[-1]}: {number(values[-1])}"
            label = fits(label, width - x1 - 14, 10)
            out.append(svg_text(x1 + 6, y + 12 + 13 * n, label, 10, colour))
            continue
        drawn = [v for v in smooth if math.isfinite(v) and (v > 0 or not log)]
        wish = sy(drawn[-1]) + 3.5 if drawn else y + 12
        ends.append((run, colour, wish, steps[-1], values[-1]))
    at = _spread([e[2] for e in ends], 12.0, y + 9, y + h + 3)
    for (run, colour, _, step, value), ty in zip(ends, at, strict=True):
        tip = f"{run or title}: step {step}: {number(value)}"
        out.append(svg_text(x1 + 6, ty, named[run], 10, colour, title=tip))
    return y + h + 8


def flat_note(lo: float, hi: float, mean: float) -> str:
    """What to say of a loss that barely moves (spans under 5 % of its mean), so its axis,
    stretched to fill the plot, is not read as a curve that learns."""
    if mean == 0 or (hi - lo) >= 0.05 * abs(mean):
        return ""
    return f"flat: it spans {number(hi - lo)}, {number(100 * (hi - lo) / abs(mean))}% of its mean"


def _legend(out, y, scale, metric, families, runs, width) -> float:
    """Every colour and mark drawn, named; answers the picture's height."""
    x = 12.0
    if not scale.empty:
        x = colour_bar(out, x, y, 140, scale, metric) + 26
    items = [(ABSENT, "not measured"), (NO_NUMBER, "no number (NaN, ∞)")]
    items += [(FAMILY_COLOURS[f], f"flag: {f}") for f in FAMILY_COLOURS if f in families]
    items += [(RUN_COLOURS[k % len(RUN_COLOURS)], f"run {r}") for k, r in enumerate(runs)]
    for colour, text in items:
        w = 16 + text_width(text, 11)
        if x + w > width - 8:
            x, y = 12.0, y + 18
        lane = text.startswith("flag")
        out.append(
            f'<rect x="{x:.1f}" y="{y + (7 if lane else 0):.1f}" width="12" '
            f'height="{3 if lane else 10}" fill="{colour}" '
            f'stroke="{"#ced4da" if colour == ABSENT else "none"}"/>'
        )
        out.append(svg_text(x + 16, y + 9, text))
        x += w + 14
    return y + 20
