"""Small nodes (and modules) that the test files build graphs from, and what they check them with."""

from __future__ import annotations

import graphlib
from typing import Any

import torch
from torch import nn

from somatize import Node


class Add(Node):
    """Adds a constant; counts its calls."""

    def __init__(self, k: int = 1) -> None:
        self.k = k
        self.calls = 0

    def forward(self, input: Any, ctx: Any) -> Any:
        self.calls += 1
        return input + self.k


class Join(Node):
    """Sums what its predecessors produced."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def forward(self, input: Any, ctx: Any) -> Any:
        self.seen.append(input)
        return sum(input.values())


class Same(Node):
    """Hands its input on untouched."""

    def forward(self, input: Any, ctx: Any) -> Any:
        return input


class Lin(Node, nn.Module):
    """A node that is a module: one float32 linear layer, 2 -> 2."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(2, 2)

    def forward(self, input: Any, ctx: Any) -> Any:
        return self.lin(input)


class Layer(Node, nn.Module):
    """A float64 linear layer, then tanh unless `act=False`: a node that is a module."""

    def __init__(self, i: int, o: int, act: bool = True) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o, dtype=torch.float64)
        self.act = act

    def forward(self, x: Any, ctx: Any) -> Any:
        y = self.lin(x)
        return torch.tanh(y) if self.act else y


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2's wte and lm_head)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(self.body(self.wte(ids)))


def loops(edges: list[tuple[str, str]]) -> bool:
    """Whether these edges close a cycle somewhere."""
    sorter = graphlib.TopologicalSorter()
    for a, b in edges:
        sorter.add(b, a)
    try:
        sorter.prepare()
    except graphlib.CycleError:
        return True
    return False


class Listen(nn.Module):
    """An audio front end: (N, 2, L) through a Conv1d, AlexNet's LocalResponseNorm and a ReLU
    (N, 8, L), a Linear at each position (N, L, 6) and a MaxPool1d over the length (N, 6, L/2),
    each given the axes it works on by a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 8, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(3)
        self.act = nn.ReLU()
        self.lin = nn.Linear(8, 6)
        self.pool = nn.MaxPool1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.lrn(self.conv(x))).transpose(1, 2)
        return self.pool(self.lin(y).transpose(1, 2))
