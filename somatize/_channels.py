"""Where a layer's output holds its channels: one rule for the audit and the figures."""

from __future__ import annotations

import re
from typing import Any

#: the norms torch defines along dim 1 (a layer or RMS norm normalises the last)
CHANNEL_NORMS = re.compile(r"batch|instance|group|local_?response", re.I)
#: what reshapes an image, torch defining it on (N, C, ...): a pool, a pad, an interpolation
_IMAGE_SHAPING = re.compile(r"pool|pad\dd|upsampl|interpolate", re.I)


def image_of(kind: Any, label: Any) -> bool:
    """Whether a layer is one torch defines on (N, C, ...), its channels on dim 1: a
    convolution, a pool, an interpolation (`nn.Upsample`, `F.interpolate`), a pad of a set
    number of dims (`ZeroPad2d`, not `F.pad`), a batch, instance, group or local response
    norm. `kind` is what `kind_of` says of it, `label` its class or function name (a norm is
    known by it: a ConvNeXt's LayerNorm holds its channels last)."""
    kind, label = str(kind or ""), str(label or "")
    if kind == "conv" or (kind == "shaping" and bool(_IMAGE_SHAPING.search(label))):
        return True
    return kind == "norm" and bool(CHANNEL_NORMS.search(label))


def channels_first(kind: Any, label: Any, before: bool = False) -> bool:
    """Whether a layer's 3-d output holds its channels on dim 1, (N, C, L), rather than its
    features last, (N, T, D), as a transformer's does. `kind` is what `kind_of` says of the
    layer, `label` its class or function name (`Conv1d 2→8 3`, `max_pool1d`), `before` whether
    what came before it had them first (to the audit the module declared before it, to a
    figure the layer that fed it in the same shape).

    A 1-d convolution or pool, which torch defines on (N, C, L), puts them first whatever came
    before: an audio net's Conv1d and MaxPool1d, and a pool over a transformer's sequence
    transposed to (N, D, T) for it. So does a batch, instance, group or local response norm
    (AlexNet's), each normalising along dim 1. An activation, a dropout, a pad, a reshape, an
    op between tensors and anything unknown keep `before`. Anything else gives features last:
    a linear layer (a transformer's attention and MLP are made of them), attention, a layer or
    RMS norm, a recurrent layer, a block, and a 2-d or 3-d convolution or pool, whose output
    is 3-d only made a sequence of patches (a ViT's patch embedding, `flatten(2).transpose`).
    """
    kind, label = str(kind or ""), str(label or "")
    if image_of(kind, label):
        return kind == "norm" or not re.search(r"[23]d", label, re.I)
    return before if kind in ("activation", "regular", "shaping", "other") else False
