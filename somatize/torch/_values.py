"""Tensors inside a value, changed one by one, with every container kept as it was."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["mapped"]


def mapped(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with `fn(t)` in place of every tensor `t` inside it. Dicts come back as the
    type they were (a subclass too: an `OrderedDict`, a transformers `ModelOutput`, copied
    and refilled), tuples as tuples (a named one as itself), lists as lists; anything else
    as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        items = {k: mapped(v, fn) for k, v in value.items()}
        if type(value) is dict:
            return items
        out = copy.copy(value)
        for k, v in items.items():
            out[k] = v
        return out
    if isinstance(value, list):
        return [mapped(v, fn) for v in value]
    if isinstance(value, tuple):
        made = [mapped(v, fn) for v in value]
        return type(value)(*made) if hasattr(value, "_fields") else tuple(made)
    return value
