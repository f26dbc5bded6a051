"""A batch cut into `micro` equal pieces along its first dimension, input and target alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from somatize.torch._modules import tensors_in
from somatize.torch._values import refilled


def pieces(x: Any, y: Any, k: int) -> tuple[list, list]:
    """`(inputs, targets)`, each cut into `k` pieces; refused before anything is cut: first
    dimensions that differ (a loss that broadcasts would be silently wrong), one that `k` does
    not divide, something that cannot be cut."""
    nx, ny = first(x), first(y)
    if nx != ny:
        raise ValueError(
            f"micro={k} cuts the input and the target into pieces along their first dimension, "
            f"and they differ: the input's is {nx}, the target's {ny}; give one target per input"
        )
    return cut(x, k, "input"), cut(y, k, "target")


def first(value: Any) -> int | None:
    """The first dimension of the first tensor inside `value`, or None."""
    return next((t.shape[0] for t in tensors_in(value) if t.dim()), None)


def cut(value: Any, k: int, what: str) -> list:
    """`value` as `k` equal pieces along its first dimension (dicts, lists, tuples of tensors
    piece by piece); `what` names it in a refusal."""
    if isinstance(value, torch.Tensor):
        n = value.shape[0] if value.dim() else None
        if n is None or n % k:
            raise ValueError(
                f"micro={k} cuts the {what} into {k} equal pieces along its first dimension, "
                f"and its shape is {tuple(value.shape)}: use a batch size that {k} divides"
            )
        return list(value.split(n // k))
    if isinstance(value, Mapping):
        parts = {key: cut(v, k, what) for key, v in value.items()}
        return [refilled(value, {key: parts[key][i] for key in parts}) for i in range(k)]
    if isinstance(value, (list, tuple)):
        parts = [cut(v, k, what) for v in value]
        return [refilled(value, [c[i] for c in parts]) for i in range(k)]
    raise TypeError(
        f"micro={k} cuts the {what} along its first dimension; a {type(value).__name__} "
        "cannot be cut: pass tensors (or dicts, lists, tuples of them), or micro=1"
    )
