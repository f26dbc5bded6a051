"""Tensors inside a value, changed one by one, with every container kept as it was."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["mapped", "refilled"]


def mapped(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with `fn(t)` in place of every tensor `t` inside it. Mappings come back as the
    type they were (an `OrderedDict`, a transformers `ModelOutput` or `BatchEncoding`, copied
    and refilled; one that cannot be changed, as a dict), tuples as tuples (a named one as
    itself), lists as lists; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return refilled(value, {k: mapped(v, fn) for k, v in value.items()})
    if isinstance(value, list):
        return [mapped(v, fn) for v in value]
    if isinstance(value, tuple):
        made = [mapped(v, fn) for v in value]
        return type(value)(*made) if hasattr(value, "_fields") else tuple(made)
    return value


def refilled(like: Mapping, items: dict) -> Any:
    """`items` as a mapping of `like`'s type: `like` copied and its values replaced (so a
    `ModelOutput` or a `BatchEncoding` stays one), or a plain dict for a dict or a mapping
    that cannot be changed."""
    if type(like) is dict or not isinstance(like, MutableMapping):
        return items
    out = copy.copy(like)
    for k, v in items.items():
        out[k] = v
    return out
