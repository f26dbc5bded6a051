"""What every drawing is written with: escaped text, its width, one number format, the
colour scale and its legend, nice axis ticks. `widgets/common.js` mirrors `number`, `viridis`
and `scale` for the live audit and is tested against them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from decimal import ROUND_HALF_UP, Context, Decimal
from html import escape
from typing import Any
from unicodedata import east_asian_width

from somatize.health.verdict import as_float
from somatize.health.verdict import number as numeric

FONT = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif"
INK = "#1f2430"
MUTED = "#5d6575"
LINE = "#d7dbe3"

# advance widths of ASCII 32..126 in DejaVu Sans (the widest of the fonts FONT names, so a
# box sized with them holds its text in any of them), per 100 px, normal and bold
_NORMAL = (
    "32 40 46 84 64 95 78 27 39 39 50 84 32 36 32 34 64 64 64 64 64 64 64 64 64 64 34 34 84 84 "
    "84 53 100 68 69 70 77 63 58 77 75 29 29 66 56 86 75 79 60 79 69 63 61 73 68 99 69 61 69 39 "
    "34 39 84 50 50 61 63 55 63 62 35 63 63 28 28 58 28 97 63 61 63 63 41 52 39 63 59 82 59 59 "
    "52 64 34 64 84"
)
_BOLD = (
    "35 46 52 84 70 100 87 31 46 46 52 84 38 42 38 37 70 70 70 70 70 70 70 70 70 70 40 40 84 84 "
    "84 58 100 77 76 73 83 68 68 82 84 37 37 77 64 100 84 85 73 85 77 72 68 81 77 110 77 72 73 "
    "46 37 46 84 50 50 67 72 59 72 68 44 72 71 34 34 67 34 104 71 69 72 72 49 60 48 71 65 92 65 "
    "65 58 71 37 71 84"
)
_WIDTHS = {False: [int(w) for w in _NORMAL.split()], True: [int(w) for w in _BOLD.split()]}


def text_width(text: str, px: float = 12, bold: bool = False) -> float:
    """How wide `text` is drawn at `px` pixels (DejaVu Sans; others are narrower). A wide
    letter (Chinese, Japanese, Korean: East Asian Width W or F) is a full em in every font."""
    table, other = _WIDTHS[bold], (70 if bold else 64)
    total = 0
    for ch in str(text):
        if " " <= ch <= "~":
            total += table[ord(ch) - 32]
        elif ch in "×→←":
            total += 84
        else:
            total += 100 if east_asian_width(ch) in "WF" else other
    return total * px / 100


def counted(n: int, word: str) -> str:
    """`n` and the word, plural unless `n` is 1: "1 place", "3 places"."""
    return f"{n} {word}{'s' * (n != 1)}"


def finite(v: Any) -> bool:
    """Whether `v` is a number (not a bool) and finite, as health reads one (`verdict.number`): an int
    a float cannot hold is not."""
    n = numeric(v)
    return n is not None and math.isfinite(n)


def esc(text: Any) -> str:
    """Text made safe for SVG and HTML, quotes included."""
    return escape(str(text), quote=True)


def svg_text(
    x: float | str,
    y: float | str,
    content: Any,
    px: float = 11,
    fill: str = MUTED,
    *,
    bold: bool = False,
    italic: bool = False,
    anchor: str = "",
    cls: str = "",
    title: str = "",
) -> str:
    """An SVG `<text>` at (x, y) (a number written to one decimal, a string as it is), its
    content escaped; `cls` goes before x, `title` is a tooltip."""
    x, y = (v if isinstance(v, str) else f"{v:.1f}" for v in (x, y))
    cls = f' class="{cls}"' if cls else ""
    style = ' font-weight="700"' if bold else ' font-style="italic"' if italic else ""
    anchor = f' text-anchor="{anchor}"' if anchor else ""
    tip = f"<title>{esc(title)}</title>" if title else ""
    return (
        f'<text{cls} x="{x}" y="{y}" font-size="{px}"{style} fill="{fill}"{anchor}>'
        f"{esc(content)}{tip}</text>"
    )


def svg_open(w: float, h: float, cls: str = "", defs: str = "") -> str:
    """An SVG's opening tag, `w` by `h` (whole pixels) in the figures' font, then `defs` and
    a white background."""
    cls = f' class="{cls}"' if cls else ""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg"{cls} width="{w:.0f}" height="{h:.0f}" '
        f'viewBox="0 0 {w:.0f} {h:.0f}" font-family="{esc(FONT)}">{defs}'
        f'<rect width="{w:.0f}" height="{h:.0f}" fill="#fff"/>'
    )


def fits(text: str, width: float, px: float, end: bool = True) -> str:
    """`text` cut to `width` pixels, keeping its end (the layer of a long path) after `…`, or
    with `end=False` its start (a name) before it."""
    text = str(text)
    if text_width(text, px) <= width:
        return text
    while len(text) > 1 and text_width(text + "…", px) > width:
        text = text[1:] if end else text[:-1]
    return "…" + text if end else text + "…"


def lines(text: str, width: float) -> list[str]:
    """`text` (at 11 px) broken into lines of at most `width` pixels at word ends, at most two
    (the last cut with `…` if there is more)."""
    out, line = [], ""
    for word in str(text).split():
        trial = f"{line} {word}".strip()
        if line and text_width(trial, 11) > width:
            out.append(line)
            line = word
        else:
            line = trial
    if line:
        out.append(line)
    if len(out) > 2:
        out = out[:2]
        while text_width(out[-1] + " …", 11) > width and " " in out[-1]:
            out[-1] = out[-1].rsplit(" ", 1)[0]
        out[-1] += " …"
    return out


def number(value: Any) -> str:
    """The one way a number is written in a figure: three significant digits; k, M, G, T past
    a thousand; `1.2e-5` under a thousandth and `1.2e15` from a thousand T; `NaN`, `∞`, `−∞`;
    `–` for nothing."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        v = as_float(value)  # an int past a float's range: ±∞
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return "NaN"
    if v == 0:
        return "0"
    sign, a = "−" if v < 0 else "", abs(v)
    if math.isinf(a):
        return sign + "∞"
    if a < 1e-3 or a >= 0.9995e15:
        exponent = math.floor(math.log10(a))
        mantissa = _round(Decimal(a).scaleb(-exponent), 2)
        if mantissa >= 10:  # 9.996e-5 rounds up to 1e-4, 9.996e15 to 1e16
            mantissa, exponent = _round(mantissa / 10, 2), exponent + 1
        return f"{sign}{_trim(str(mantissa))}e{exponent}"
    for size, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= size * 0.9995:
            return f"{sign}{_sig(a / size)}{suffix}"
    return sign + _sig(a)


_EVERY_DIGIT = Context(prec=400)


def _round(d: Decimal, digits: int) -> Decimal:
    """`d` to `digits` decimals, a tie away from zero (as a browser's toFixed rounds), with
    room for every digit a float has (a gain of 1e45 in trillions has 34)."""
    return d.quantize(Decimal(1).scaleb(-digits), ROUND_HALF_UP, _EVERY_DIGIT)


def _sig(a: float) -> str:
    """`a` (0.001 or more) to three significant digits, without trailing zeros; whole past
    a thousand (5000, in trillions)."""
    return _trim(str(_round(Decimal(a), max(0, 2 - math.floor(math.log10(a))))))


def _trim(text: str) -> str:
    return text.rstrip("0").rstrip(".") if "." in text else text


_VIRIDIS = "440154 482878 3e4a89 31688e 26828e 1f9e89 35b779 6dcd59 b4de2c fde725"
VIRIDIS = [tuple(bytes.fromhex(rgb)) for rgb in _VIRIDIS.split()]  # sampled at ten points


def blend(stops: list[tuple[int, ...]], t: float) -> list[int]:
    """The colour `t` (0 to 1) of the way along `stops`, mixed from the two around it."""
    x = t * (len(stops) - 1)
    i = min(len(stops) - 2, int(x))
    return [round(a + (b - a) * (x - i)) for a, b in zip(stops[i], stops[i + 1], strict=True)]


def viridis(t: float) -> str:
    """A perceptual colour for t in [0, 1] (viridis, sampled)."""
    r, g, b = blend(VIRIDIS, 0.0 if not math.isfinite(t) else min(1.0, max(0.0, t)))
    return f"rgb({r},{g},{b})"


class Scale:
    """Numbers to [0, 1]: linear, or logarithmic when they are all positive and span more
    than two decades. Non-numbers and infinities are left out of the range."""

    def __init__(self, values: Iterable[Any]) -> None:
        xs = [float(v) for v in values if finite(v)]
        self.lo, self.hi = (min(xs), max(xs)) if xs else (0.0, 0.0)
        self.empty = not xs
        self.log = bool(xs) and self.lo > 0 and self.hi / self.lo > 100
        self._f = math.log10 if self.log else float
        self._a, self._b = self._f(self.lo), self._f(self.hi)

    def t(self, v: float) -> float:
        """Where `v` falls, from 0 (lowest) to 1 (highest)."""
        if self._b == self._a:
            return 0.5
        if self.log and v <= 0:
            return 0.0
        return min(1.0, max(0.0, (self._f(v) - self._a) / (self._b - self._a)))


def colour_bar(out: list[str], x: float, y: float, width: float, scale: Scale, label: str) -> float:
    """SVG for a colour legend appended to `out`: the label, the low end, a viridis bar, the
    high end; answers where it ends."""
    label += " (log)" if scale.log else ""
    out.append(svg_text(x, y + 9, label, fill=INK, bold=True))
    x += text_width(label, 11, True) + 8
    lo, hi = number(scale.lo), number(scale.hi)
    out.append(svg_text(x, y + 9, lo))
    x += text_width(lo, 11) + 6
    stops = "".join(
        f'<rect x="{x + i * width / 10:.1f}" y="{y:.1f}" width="{width / 10 + 0.4:.1f}" '
        f'height="10" fill="{viridis(i / 9)}"/>'
        for i in range(10)
    )
    out.append(f'<g class="smz-bar">{stops}</g>')
    out.append(svg_text(x + width + 6, y + 9, hi))
    return x + width + 6 + text_width(hi, 11)


def ticks(
    lo: float, hi: float, most: int = 6, log: bool = False, whole: bool = False
) -> list[float]:
    """Round values for an axis from lo to hi: at most about `most` of them (on a log axis,
    the powers of ten between, thinned to `most`; with `whole`, integers only)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        step = max(1, math.ceil((b - a + 1) / most))
        return [10.0**k for k in range(a, b + 1, step) if lo <= 10.0**k <= hi] or [lo, hi]
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(1, most - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    if whole:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    out, k = [], 0
    while first + k * step <= hi + step * 1e-9:
        out.append(round(first + k * step, 12))
        k += 1
    return out


def tick_labels(values: list[float]) -> list[str]:
    """Ticks written one way (`number`), with more digits only where two would read alike."""
    labels = [number(v) for v in values]
    digits = 4
    while len(set(labels)) < len(labels) and digits < 12:
        texts = [f"{v:.{digits}g}" for v in values]
        labels = [number(v) if "e" in t else _trim(t) for v, t in zip(values, texts, strict=True)]
        digits += 1
    return labels
