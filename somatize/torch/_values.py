"""Tensors inside a value, changed one by one, with every container kept as it was."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from somatize.codecs import NoCodec
from somatize.torch import _caches


def mapped(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with `fn(t)` in place of every tensor `t` inside it, each container given back
    as `refilled` makes it, and a transformers key/value cache that `_caches` rebuilds as a new
    one of its kind; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return refilled(value, {k: mapped(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return refilled(value, [mapped(v, fn) for v in value])
    if type(value) in _caches.kinds():
        try:
            fields = _caches.fields_of(value)
        except NoCodec:  # a cache no public constructor rebuilds: left as it is
            return value
        return _caches.build(type(value), {k: mapped(v, fn) for k, v in fields})
    return value


def refilled(like: Mapping | list | tuple, items: dict | list) -> Any:
    """`items` in a container of `like`'s type. A mapping: `like` copied and its values
    replaced (so an `OrderedDict`, a transformers `ModelOutput` or `BatchEncoding` stays one),
    or a plain dict for a dict or a mapping that cannot be changed. A tuple: a tuple, a named
    one as itself. A list: a list."""
    if isinstance(like, Mapping):
        if type(like) is dict or not isinstance(like, MutableMapping):
            return items
        out = copy.copy(like)
        for k, v in items.items():
            out[k] = v
        return out
    if isinstance(like, tuple):
        return type(like)(*items) if hasattr(like, "_fields") else tuple(items)
    return list(items)
