"""One place an `Audit` watches: what it holds, and what the audit keeps of it between a
forward and the read after backward, and from one measured step to the next."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
from torch import nn

from somatize.node import unwrap
from somatize.torch.audit._measures import activity, first_float, floats_in, norm, rows_of, sums_of
from somatize.torch.inside.kinds import kind_of

__all__ = ["Place", "_saturation"]


def _saturation(modules: list[nn.Module]) -> str | None:
    """How this place saturates, read off the last module it holds (in the order they were
    declared, which is the order most forwards apply them): "sigmoid" (flat near 0 and 1)
    or "tanh" (flat near ±1) when that is such an activation, else None."""
    leaves = [m for m in modules if next(m.children(), None) is None]
    last = leaves[-1] if leaves else None
    if last is None or kind_of(last) != "activation":
        return None
    names = [c.__name__ for c in type(last).__mro__]
    if any("Sigmoid" in n for n in names):
        return "sigmoid"
    if any(n in ("Tanh", "Hardtanh", "Softsign") for n in names):
        return "tanh"
    return None


class Place:
    """A node (`inside` None) or a module inside one (`inside` its dotted path under the
    node). `params`: the weights it trains, each once. Between a forward and `observed` it
    holds this step's sums, out-gradient norms and channel numbers, all as tensors."""

    def __init__(
        self, node: str, inside: str | None, modules: list[nn.Module], window: int
    ) -> None:
        self.node = node
        self.inside = inside
        self.where = node if inside is None else f"{node}.{inside}"
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
        self.index: list[int] = []  # where its parameters sit in the audit's flat list
        self.groups: dict[str, list[int]] | None = None
        # across measured steps
        self.zero: deque[float] = deque(maxlen=window)
        self.saturated: deque[float] = deque(maxlen=window)
        self.alive: deque[torch.Tensor] = deque(maxlen=window)
        self.norms: deque[tuple[int, float]] = deque(maxlen=window)
        self.has_moved = False  # some update has moved its weights
        self.inherited: bool | None = None  # its NaN/inf came from elsewhere (None: finite)
        self.step = -1  # the measured step its hooks belong to
        self.clear()

    def clear(self) -> None:
        """Forget this step's numbers (after `observed` read them)."""
        self.sums: list[list[torch.Tensor]] = []
        self.size = 0
        self.inputs: list[torch.Tensor] = []
        self.heard: list[torch.Tensor] = []  # ‖∂L/∂output‖ per call, from a tensor hook
        self.activity: list[torch.Tensor] = []  # per-channel mean |a|, per call
        self.in_heard: list[torch.Tensor] = []  # per-channel mean |∂L/∂input|, per call
        self.in_channels = 0
        self.rows: torch.Tensor | None = None

    def saw(self, input: Any, out: Any, step: int, channels: bool, rows: bool) -> None:
        """What came out of the place on a measured step (and what went in): its sums left as
        tensors, a tensor hook for the gradient that will come back to it, and with `channels`
        its channels' activity and a hook on its input's gradient; with `rows`, a copy of up
        to `_ROWS` samples for a snapshot or a CKA."""
        t = first_float(unwrap(out))
        if t is None:
            return
        self.step = step
        a = t.detach()
        self.sums.append(sums_of(a, self.saturates))
        self.size += a.numel()
        self.inputs += floats_in(unwrap(input))
        me = weakref.ref(self)  # a hook holding the place would keep it (and its weights) alive
        if t.requires_grad:
            t.register_hook(_hear(me, step, "heard", None))
        if channels:
            self.activity.append(activity(a, self.conv))
            x = next((x for x in self.inputs if x.requires_grad), None)
            if x is not None and x.dim() >= 2:
                self.in_channels = x.shape[1] if self.conv or x.dim() >= 4 else x.shape[-1]
                x.register_hook(_hear(me, step, "in_heard", self.conv))
        if rows and self.rows is None:
            self.rows = rows_of(a, self.conv)


def _hear(place: weakref.ref, step: int, into: str, conv: bool | None) -> Any:
    """A tensor hook that keeps a number about the gradient it is handed: its norm (`conv`
    None) or each channel's mean magnitude; only for the step it was registered in."""

    def hook(g: torch.Tensor) -> None:
        p = place()
        if p is not None and p.step == step:
            getattr(p, into).append(norm(g) if conv is None else activity(g, conv))

    return hook
