"""One place an `Audit` watches: its parameters, how it saturates, and what the audit keeps of
it between a forward and the read after backward."""

from __future__ import annotations

import weakref
from collections import deque

import torch
from torch import nn

from somatize.torch.inside.kinds import kind_of

__all__ = ["_Place", "_saturation"]


def _saturation(modules: list[nn.Module]) -> str | None:
    """How this place saturates, read off the last activation it holds."""
    for m in reversed(modules):
        if kind_of(m) == "activation" and next(m.children(), None) is None:
            names = [c.__name__ for c in type(m).__mro__]
            if any("Sigmoid" in n for n in names):
                return "sigmoid"
            if any(n in ("Tanh", "Hardtanh", "Softsign") for n in names):
                return "tanh"
            return None
    return None


class _Place:
    __slots__ = (
        "where",
        "params",
        "saturates",
        "conv",
        "zero",
        "saturated",
        "alive",
        "out_grad",
        "features",
        "index",
        "at",
        "size",
        "groups",
        "hear",
        "kept",
        "held",
        "version",
        "retain",
        "later",
        "seen",
        "__weakref__",
    )

    def __init__(self, where: str, modules: list[nn.Module], window: int) -> None:
        self.where = where
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    self.params.append(p)
        every = [s for m in modules for s in m.modules()]
        self.saturates = _saturation(every)
        self.conv = any(kind_of(s) == "conv" for s in every)
        self.zero: deque[float] = deque(maxlen=window)
        self.saturated: deque[float] = deque(maxlen=window)
        self.alive: deque[torch.Tensor] = deque(maxlen=window)
        self.out_grad: torch.Tensor | None = None
        self.features: torch.Tensor | None = None
        self.index: list[int] = []  # where its parameters sit in the audit's flat list
        self.at = -1  # where this step's sums start in the audit's list (-1: none this step)
        self.size = 1
        self.groups: dict[str, list[int]] | None = None

        me = weakref.ref(self)  # not `self`: a place and its hook would be a cycle, and the
        # parameters it lists would wait for the garbage collector after the audit is dropped

        def hear(g: torch.Tensor) -> None:
            place = me()
            if place is not None:
                place.out_grad = g.detach()

        self.kept: torch.Tensor | None = None
        # ∂L/∂output by `retain_grad` (no Python call in backward) where the output is not
        # modified in place afterwards; None: not yet known (the first measured step hooks and
        # retains both, and looks), False: a tensor hook, always
        self.retain: bool | None = None
        self.held: torch.Tensor | None = None
        self.version = 0
        self.hear = hear  # the tensor hook that keeps ‖∂L/∂output‖'s gradient
        # whether the output stays as the place saw it until `observed` (nothing writes over
        # it in place), so its sums can wait for `observed` and be taken there with the norms;
        # None: not yet known (the first measured step takes them at once, and looks).
        # `seen`: the output's version when the place saw it
        self.later: bool | None = None
        self.seen = 0
