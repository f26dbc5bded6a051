"""A shape and a hue per family of layer, and a layer's output shape named by axis.

The family comes from the layer's kind (`somatize.torch.kind_of`: learned, conv, recurrent,
attention, norm, activation, regular, shaping, block, other), refined by its label (an
Embedding among the learned, a pool among the shaping, an add among the others).
"""

from __future__ import annotations

import re
from typing import Any

HUES = {
    "conv": "#1a9c8c",
    "attention": "#8d5bd6",
    "linear": "#3d6fd9",
    "embedding": "#c2457a",
    "norm": "#8a8f99",
    "activation": "#2f9e44",
    "pool": "#d08a16",
    "dropout": "#9a9a9a",
    "recurrent": "#d2691e",
    "reshape": "#6b7a90",
    "op": "#5f6b7d",
    "block": "#8a6fd1",
    "other": "#6c7a96",
    "input": "#4a5568",
}

# kinds drawn as the family of their name; a regulariser as dropout
_SAME = ("conv", "attention", "recurrent", "norm", "activation", "embedding", "pool", "op", "block")
_BY_KIND = {k: k for k in _SAME} | {"regular": "dropout"}
# where no kind says: the first of these the label matches (case aside)
_BY_LABEL = (
    ("conv", "conv"),
    ("attn|attention", "attention"),
    ("lstm|gru|rnn", "recurrent"),
    ("norm", "norm"),
    ("dropout|droppath", "dropout"),
    ("embed", "embedding"),
    ("linear|dense", "linear"),
    ("pool", "pool"),
    (r"^(add|sub|mul|truediv|div|matmul|cat|concat|stack|sum|\+|×|getitem)\b", "op"),
    ("relu|gelu|tanh|sigmoid|silu|swish|softmax|elu|mish|softplus", "activation"),
)


def family(kind: Any, label: Any) -> str:
    """The family a layer is drawn as: conv, attention, linear, embedding, norm, activation,
    pool, dropout, recurrent, reshape, op, block or other."""
    k, text = str(kind or "").lower(), str(label or "")
    # The kind says what a layer computes with (GPT-2's Conv1D is learned: a linear layer);
    # the label only refines a kind (an embedding, a pool), or stands in where no kind says.
    if k in _BY_KIND:
        return _BY_KIND[k]
    if k in ("learned", "linear"):
        return "embedding" if re.search("embed", text, re.I) else "linear"
    if k == "shaping":
        return "pool" if re.search("pool", text, re.I) else "reshape"
    return next((fam for pattern, fam in _BY_LABEL if re.search(pattern, text, re.I)), "other")


def outline(fam: str, w: float, h: float) -> str:
    """The SVG path of a box of this family, w × h at (0, 0)."""
    s = min(12.0, w / 6)
    m = h / 2
    if fam == "conv":  # parallelogram
        return f"M{s:.1f},0H{w:.1f}L{w - s:.1f},{h:.1f}H0Z"
    if fam == "linear":  # trapezoid, wide at the bottom
        return f"M{s:.1f},0H{w - s:.1f}L{w:.1f},{h:.1f}H0Z"
    if fam == "pool":  # trapezoid, wide at the top
        return f"M0,0H{w:.1f}L{w - s:.1f},{h:.1f}H{s:.1f}Z"
    if fam == "activation":  # pointed at both ends
        return f"M0,{m:.1f}L{s:.1f},0H{w - s:.1f}L{w:.1f},{m:.1f}L{w - s:.1f},{h:.1f}H{s:.1f}Z"
    if fam == "norm":  # bevelled corners
        b = s / 2
        return (
            f"M{b:.1f},0H{w - b:.1f}L{w:.1f},{b:.1f}V{h - b:.1f}L{w - b:.1f},{h:.1f}"
            f"H{b:.1f}L0,{h - b:.1f}V{b:.1f}Z"
        )
    if fam == "attention":  # capsule
        arc = f"A{m:.1f},{m:.1f} 0 0 1"
        return f"M{m:.1f},0H{w - m:.1f}{arc} {w - m:.1f},{h:.1f}H{m:.1f}{arc} {m:.1f},0Z"
    if fam == "embedding":  # barrel
        right, left = f"Q{w:.1f},{m:.1f} {w - s:.1f},{h:.1f}", f"Q0,{m:.1f} {s:.1f},0"
        return f"M{s:.1f},0H{w - s:.1f}{right}H{s:.1f}{left}Z"
    if fam == "op":  # rounded
        r = min(6.0, m)
        return (
            f"M{r:.1f},0H{w - r:.1f}Q{w:.1f},0 {w:.1f},{r:.1f}V{h - r:.1f}Q{w:.1f},{h:.1f} "
            f"{w - r:.1f},{h:.1f}H{r:.1f}Q0,{h:.1f} 0,{h - r:.1f}V{r:.1f}Q0,0 {r:.1f},0Z"
        )
    return f"M0,0H{w:.1f}V{h:.1f}H0Z"


def shape_text(
    shape: Any,
    kind: Any = None,
    label: Any = None,
    first: bool = False,
    axes: Any = (),
    batch: Any = None,
) -> str:
    """An output shape named by axis: `4 batch · 8 ch · 8 h · 8 w`; '' when unknown. `axes`,
    one name an axis, are those the layer's call said (`Layer.axes`), taken as they are.

    A 3-d output is `batch · len · dim` (a sequence) unless its channels come first (`first`,
    as `channels_first` answers for the layer). A 4-d or 5-d one is `batch · ch · h · w` (or
    `ch · d · h · w`) where it is known to be an image, channels on dim 1 (`first`: a conv's
    output, a channel norm's, a pool's, and what follows them in that layout), and `batch ·
    heads · seq · dim` from an attention layer itself. Anything else has its axes numbered:
    an attention's views of its heads, a Swin's (batch, h, w, ch) patches are not an image's
    channels and rows.

    The first axis is called the batch only where it is: `batch` is what a run followed it
    to hold (`Layer.batch`): 1 the batch, `k` the batch merged with `k` of something else,
    `batch×4` (MobileViT's unfolded patches, Swin's windows), 0 none of it, numbered `d0`
    (a table made from parameters); None, nothing followed, takes it as the batch."""
    if not isinstance(shape, (list, tuple)) or not shape:
        return ""
    n = len(shape)
    own = str(kind or "").lower() == "attention"
    own = own or bool(re.search(r"attn|attention", str(label or ""), re.I))
    if axes and len(axes) == n:
        names = list(axes)
    elif n == 1:  # (the batch only where a run followed it there: a distance per pair)
        names = ["batch" if batch == 1 else "dim"]
    elif n == 2:
        names = ["batch", "dim"]
    elif n == 3:
        names = ["batch", "ch", "len"] if first else ["batch", "len", "dim"]
    elif n in (4, 5) and first:
        names = ["batch", "ch", "h", "w"] if n == 4 else ["batch", "ch", "d", "h", "w"]
    elif n == 4 and own:
        names = ["batch", "heads", "seq", "dim"]
    else:
        names = ["batch"] + [f"d{i}" for i in range(1, n)]
    if names[0] == "batch" and batch is not None and batch != 1:
        names[0] = f"batch×{batch}" if batch else "d0"
    return " · ".join(f"{v} {name}" for v, name in zip(shape, names, strict=True))
