"""Which tensors of a forward hold the batch on their first axis, and how much of it.

A figure names a layer's output axis by axis, and the first axis is the batch only where it
is: MobileViT unfolds its feature maps into (batch × patch area, patches, dim) for its
transformer, Swin partitions a (batch, h, w, ch) map into (batch × windows, window area, ch),
and a relative position bias built from a parameter table has no batch at all. `Batches`
follows the first axis from what the node was given, through the torch functions its forward
calls and the layers drawn closed, by the sizes and what the call does to the axes:
`k` per tensor, where its first axis holds the batch merged with `k` of something else (1:
the batch itself), 0 where it came from the input and its first axis is not known to be the
batch; a tensor that does not come from the input (a parameter, a constant) has none,
unless it is as long as the batch (a buffer expanded to it: `first`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# calls that lay the same elements out again, row-major: a first axis that grows by a whole
# factor took in the axes after it, one that shrinks to a whole part split off the rest
_RESHAPES = frozenset("reshape view flatten unflatten reshape_as view_as".split())


def _moves_first(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a transpose, permute or move puts another axis first."""
    rank = args[0].dim() if args and isinstance(args[0], torch.Tensor) else 0
    if name in ("t", "T"):
        return rank > 1
    if name == "mT":
        return rank == 2
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        dims = kwargs.get("dims", dims)
        return bool(dims) and isinstance(dims[0], int) and dims[0] % max(rank, 1) != 0
    if name not in ("transpose", "swapaxes", "swapdims", "movedim", "moveaxis"):
        return False
    dims = [*args[1:3], *(v for k, v in kwargs.items() if k != "input")]
    dims = [d for x in dims for d in (x if isinstance(x, (list, tuple)) else [x])]
    picked = [d % rank for d in dims if isinstance(d, int) and rank]
    return 0 in picked and len(set(picked)) > 1


class Batches:
    """The batch on the first axis of each tensor of one forward, by tensor (held weakly: an
    id is only that tensor's while it lives)."""

    def __init__(self) -> None:
        self.size: int | None = None  # the batch: the first axis of what the node was given
        self.by: dict[int, tuple[weakref.ref, int]] = {}

    def given(self, tensors: list[torch.Tensor]) -> None:
        """What the node was given: the batch is the first axis of its first tensor that has
        one, and each given tensor as long on its first axis holds it."""
        self.size = next((t.shape[0] for t in tensors if t.dim()), None)
        for t in tensors:
            self._put(t, 1 if t.dim() and t.shape[0] == self.size else 0)

    def of(self, t: torch.Tensor) -> int | None:
        """`k`: the first axis of `t` holds the batch × k (1: the batch); 0: `t` comes from
        the input, its first axis not known to be the batch; None: not from the input."""
        known = self.by.get(id(t))
        return known[1] if known is not None and known[0]() is t else None

    def first(self, t: torch.Tensor) -> int:
        """What a figure says of the first axis of `t`: `of(t)` where it comes from the input;
        where it does not, 1 if it is as long as the batch (more than one: a buffer expanded to
        the batch, BERT's token type ids), else 0 (a table made from parameters, a position
        table's leading 1)."""
        k = self.of(t)
        if k is None:
            b = self.size
            return 1 if t.dim() and b is not None and b > 1 and t.shape[0] == b else 0
        return k

    def followed(self, name: str, args: tuple, kwargs: dict, ins: list, outs: list) -> None:
        """A call `name` on `ins` gave `outs`: each output's first axis, from its inputs'."""
        lead = [(t, k) for t in ins if (k := self.of(t)) is not None]
        if not lead:
            return
        moved = _moves_first(name, args, kwargs)
        for o in outs:
            self._put(o, self._first(name, o, lead, moved))

    def _first(self, name: str, o: torch.Tensor, lead: list, moved: bool) -> int:
        b = self.size
        if not o.dim() or not b:
            return 0
        n = o.shape[0]
        if not moved:  # an input whose first axis is this one's, the same size
            same = next((k for t, k in lead if k and t.dim() and t.shape[0] == n), None)
            if same is not None:
                return same
        first, k = lead[0]
        if name in _RESHAPES and k and first.dim() and n % b == 0:
            was = first.shape[0]
            if n % was == 0 or was % n == 0:  # merged with what follows it, or split off
                return n // b
        return 1 if n == b else 0  # from the input and as long as its batch: the batch

    def _put(self, t: torch.Tensor, k: int) -> None:
        self.by[id(t)] = (weakref.ref(t), k)


def batch_of(shape: Any, given: list[torch.Tensor]) -> int:
    """The batch on the first axis of a node's output of `shape` that is one layer, given
    `given`: 1 where it is as long as the first axis of the first tensor given, else 0."""
    size = next((t.shape[0] for t in given if t.dim()), None)
    if not shape or size is None:
        return 0
    return 1 if shape[0] == size else 0
