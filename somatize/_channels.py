"""Where a layer's 3-d output holds its channels: one rule, for the audit (which measures each
channel) and a figure (which names each axis), each telling it what came before its own way."""

from __future__ import annotations

import re
from typing import Any

_ON_DIM_1 = re.compile(r"batch|instance|group|local_?response", re.I)  # norms over dim 1
_PATCHES = re.compile(r"[23]d", re.I)  # a 2-d or 3-d convolution or pool


def channels_first(kind: Any, label: Any, before: bool = False) -> bool:
    """Whether a layer's 3-d output holds its channels on dim 1, (N, C, L), rather than its
    features last, (N, T, D), as a transformer's does.

    `kind` is what `somatize.torch.kind_of` says of the layer and `label` its class or
    function name (what `label_of` starts with: `Conv1d 2→8 3`, `max_pool1d`); `before` is
    whether what came before it had its channels first (the audit: the module declared
    before it; a figure: the layer that fed it, in the same shape).

    - A 1-d convolution or pool, defined by torch on (N, C, L), puts them first whatever came
      before: an audio net's Conv1d and MaxPool1d, and a pool over a transformer's sequence
      transposed to (N, D, T) for it, which pools each feature as a channel.
    - So does a batch, instance, group or local response norm (AlexNet's): each normalises
      along dim 1.
    - An activation, a dropout, a pad, a reshape, an op between tensors and anything else
      unknown (kind `other`) keeps `before`: it leaves the axes where they were.
    - Anything else gives features last: a linear layer (a transformer's attention and MLP
      are made of them), attention, a layer or RMS norm, a recurrent layer, a block, and a
      2-d or 3-d convolution or pool, whose 4-d or 5-d output is 3-d only when it is made a
      sequence of patches (a ViT's patch embedding: `flatten(2).transpose(1, 2)`).
    """
    kind, label = str(kind or ""), str(label or "")
    if kind == "conv" or (kind == "shaping" and "pool" in label.lower()):
        return not _PATCHES.search(label)
    if kind == "norm":
        return bool(_ON_DIM_1.search(label))
    return before if kind in ("activation", "regular", "shaping", "other") else False
