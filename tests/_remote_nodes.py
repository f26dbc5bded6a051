"""Nodes that the remote tests send to workers (which import this module: `--import`)."""

from __future__ import annotations

import os
import time
from typing import Any

from torch import nn

from somatize import Node, codec


class Lin(Node, nn.Module):
    """A linear layer that is a node."""

    def __init__(self, i: int = 4, o: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, x: Any, ctx: Any) -> Any:
        return self.lin(x)


class Plus(Node):
    """Adds a constant."""

    def __init__(self, k: float = 1.0) -> None:
        self.k = k

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + self.k


class Gathers(Node):
    """Adds what it was built with: one number, any number more, times a keyword's."""

    def __init__(self, first: float, *more: float, times: float = 1.0) -> None:
        self.total = (first + sum(more)) * times

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + self.total


class Keywords(Node):
    """Adds its one number times every keyword it was given (**kwargs may hold one named args)."""

    def __init__(self, x: float, **more: float) -> None:
        self.total = x * sum(more.values())

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + self.total


class Sum(Node):
    """Sums what its predecessors produced."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return sum(x.values())


class Pid(Node):
    """The process it runs in, beside what it was given."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return (os.getpid(), x)


class Fails(Node):
    """Raises a KeyError naming what it was given."""

    def forward(self, x: Any, ctx: Any) -> Any:
        raise KeyError(f"no such thing as {x!r}")


class Sleeps(Node):
    """Sleeps for as long as it is told."""

    def forward(self, x: Any, ctx: Any) -> Any:
        time.sleep(x)
        return x


def _tenfold(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: counts its calls and hands back the output ten times over."""
    module.fired += 1
    return output * 10


class Hooked(Node, nn.Module):
    """A module node that registers a forward hook on itself wherever it is built."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.fired = 0
        self.register_forward_hook(_tenfold)

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + 1


class Applies(Node):
    """Applies the function it was built with."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def forward(self, x: Any, ctx: Any) -> Any:
        return self.fn(x)


def negated(x: Any) -> Any:
    """A function of this module, which a worker that imports it may be handed by name."""
    return -x


class Box:
    """A value of a type no codec is registered for."""

    def __init__(self, x: Any) -> None:
        self.x = x


class Boxes(Node):
    """Hands back what it was given in a `Box`, which no codec writes down."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return Box(x)


class Fragile:
    """A value its codec writes down and cannot read back."""


def _unreadable(data: bytes) -> Fragile:
    raise ValueError("a Fragile cannot be read back")


codec("fragile", Fragile, dump=lambda value: b"", load=_unreadable)


class Breaks(Node):
    """Hands back a `Fragile`, which the worker writes down and nobody reads back."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return Fragile()


class Normed(Node, nn.Module):
    """A linear layer then a batch norm: what it gives depends on its train or eval mode."""

    def __init__(self, n: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(n, n)
        self.norm = nn.BatchNorm1d(n)

    def forward(self, x: Any, ctx: Any) -> Any:
        return self.norm(self.lin(x))


class Rectified(Node, nn.Module):
    """A linear layer then a ReLU (with a very negative bias, a dead one)."""

    def __init__(self, i: int = 4, o: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, x: Any, ctx: Any) -> Any:
        return self.lin(x).relu()
