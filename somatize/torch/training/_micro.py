"""A batch cut into `micro` equal pieces along its batch dimension, input and target alike:
what is cut, what every piece is handed whole and what is refused is in docs/training.md
(`micro=k`), as `size` and `cut` do it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from somatize.torch._values import refilled

PLAIN = (str, bytes, bool, int, float, complex, type(None))


def pieces(x: Any, y: Any, k: int) -> tuple[list, list]:
    """`(inputs, targets)`, each cut into `k` pieces as the module says; refused before anything
    is cut: a batch size `k` does not divide, a value that cannot be cut or handed on whole."""
    n, where = size(x, "input") or size(y, "target") or (None, "")
    if n is None or n % k:
        said = (
            f"this one has {n} examples (the first dimension of {where})"
            if n
            else "this one holds a single example (no tensor or list in it has a first "
            "dimension other than 1)"
        )
        raise ValueError(
            f"micro={k} cuts a batch into {k} equal pieces along its batch dimension, and "
            f"{said}: use a batch size that {k} divides (a DataLoader's last batch is smaller "
            "unless drop_last=True), or micro=1"
        )
    return cut(x, k, n, "input", where), cut(y, k, n, "target", where)


def rows(value: Any) -> bool:
    """Whether `value` is a list of plain values, one per example (strings, token id lists)."""
    return type(value) is list and bool(value) and all(plain(v) for v in value)


def plain(value: Any) -> bool:
    """Whether `value` is a plain value, or a list or tuple of them (no tensor inside)."""
    return isinstance(value, PLAIN) or (
        isinstance(value, (list, tuple)) and all(plain(v) for v in value)
    )


def size(value: Any, path: str) -> tuple[int, str] | None:
    """`(batch size, where it was read)`: the first first dimension other than 1 in `value`."""
    if isinstance(value, torch.Tensor):
        n = value.shape[0] if value.dim() else 1
    elif rows(value):
        n = len(value)
    elif isinstance(value, Mapping):
        found = (size(v, f"{path}[{key!r}]") for key, v in value.items())
        return next((f for f in found if f), None)
    elif isinstance(value, (list, tuple)):
        return next((f for i, v in enumerate(value) if (f := size(v, f"{path}[{i}]"))), None)
    else:
        return None
    return (n, path) if n != 1 else None


def cut(value: Any, k: int, n: int, path: str, where: str) -> list:
    """`value` as `k` pieces of a batch of `n` (read at `where`); `path` names it."""
    if isinstance(value, torch.Tensor) and (not value.dim() or value.shape[0] in (1, n)):
        return list(value.split(n // k)) if value.dim() and value.shape[0] == n else [value] * k
    listed = rows(value)
    if listed and len(value) == n:
        return [value[i * (n // k) : (i + 1) * (n // k)] for i in range(k)]
    if isinstance(value, PLAIN):
        return [value] * k
    if isinstance(value, Mapping):
        parts = {key: cut(v, k, n, f"{path}[{key!r}]", where) for key, v in value.items()}
        return [refilled(value, {key: parts[key][i] for key in parts}) for i in range(k)]
    if isinstance(value, (list, tuple)) and not listed:
        parts = [cut(v, k, n, f"{path}[{i}]", where) for i, v in enumerate(value)]
        return [refilled(value, [c[i] for c in parts]) for i in range(k)]
    batch = f"the batch size, {n} (the first dimension of {where})"
    if isinstance(value, torch.Tensor):
        raise ValueError(
            f"micro={k} cuts a batch along its first dimension, and {path} has shape "
            f"{tuple(value.shape)}: its first dimension differs from {batch}, and is not 1. "
            "Give it one row per example, or a first dimension of 1 to share it (a sequence "
            "laid out (time, batch, ...) would be cut along time: put the batch first), "
            "or micro=1"
        )
    if listed:
        raise ValueError(
            f"micro={k} cuts a list of plain values as one item per example, and {path} is a "
            f"list of {len(value)}, not {batch}: give one item per example, a tuple to hand "
            "it to every piece as it is, or micro=1"
        )
    raise TypeError(
        f"micro={k} cuts tensors and lists of one item per example, and hands None, bools, "
        f"numbers and strings to every piece; {path} is a {type(value).__name__}, which it "
        "cannot cut: pass tensors (in dicts, lists, tuples), or micro=1"
    )
