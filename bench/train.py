"""What a training step costs through the Trainer, next to torch written by hand.

Two comparisons on the same 3-node MLP, measured in one run, interleaved, one thread, medians
of repeats:

- `Trainer.step` against a hand-written loop (zero_grad, forward, loss, backward, step, and
  `.item()` for the loss, which `step` returns); budget: at most 1.10;
- a step with the middle node trained by `Split` against a plain `Trainer.step`; budget: at
  most 1.5. Beside it, the same cut written by hand in plain torch (the middle layer's input
  and output made leaves, three `backward` calls, two optimizers) against the hand loop: what
  the cut itself costs, whoever makes it.

    python bench/train.py             # prints the table
    python bench/train.py --results   # and rewrites its section of bench/RESULTS.md
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _results import report
from torch import nn

from somatize import Graph, Node
from somatize.torch import Split, Trainer, parameters

SIZES = [
    # (name, inputs, hidden, outputs, batch)
    ("small: 64-128-128-10, batch 64", 64, 128, 10, 64),
    ("medium: 256-512-512-10, batch 128", 256, 512, 10, 128),
]


class Dense(Node, nn.Module):
    """One layer of the MLP, as a node."""

    def __init__(self, i: int, o: int, relu: bool = True) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)
        self.relu = relu

    def forward(self, x: Any, ctx: Any) -> Any:
        y = self.lin(x)
        return torch.relu(y) if self.relu else y


def graph(i: int, h: int, o: int) -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(
        Dense(i, h).named("first") >> Dense(h, h).named("mid") >> Dense(h, o, False).named("last")
    )


def time_us(fn: Any, loops: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(loops):
        fn()
    return (time.perf_counter_ns() - t0) / loops / 1e3


def measure(i: int, h: int, o: int, batch: int, loops: int, repeats: int) -> dict[str, float]:
    loss = nn.functional.cross_entropy
    x = torch.randn(batch, i)
    y = torch.randint(0, o, (batch,))

    torch.manual_seed(0)
    a, b, c = nn.Linear(i, h), nn.Linear(h, h), nn.Linear(h, o)
    hand_opt = torch.optim.SGD([*a.parameters(), *b.parameters(), *c.parameters()], lr=0.01)

    def hand() -> float:
        hand_opt.zero_grad()
        out = c(torch.relu(b(torch.relu(a(x)))))
        value = loss(out, y)
        value.backward()
        hand_opt.step()
        return value.item()

    torch.manual_seed(0)
    a2, b2, c2 = nn.Linear(i, h), nn.Linear(h, h), nn.Linear(h, o)
    outer = torch.optim.SGD([*a2.parameters(), *c2.parameters()], lr=0.01)
    inner = torch.optim.SGD(b2.parameters(), lr=0.01)

    def hand_cut() -> float:
        outer.zero_grad()
        inner.zero_grad()
        h1 = torch.relu(a2(x))
        l1 = h1.detach().requires_grad_()
        h2 = torch.relu(b2(l1))
        l2 = h2.detach().requires_grad_()
        value = loss(c2(l2), y)
        value.backward()
        torch.autograd.backward([h2], [l2.grad])
        inner.step()
        torch.autograd.backward([h1], [l1.grad])
        outer.step()
        return value.item()

    g = graph(i, h, o)
    plain = Trainer(g, objective=loss, optimizer=torch.optim.SGD(parameters(g), lr=0.01))
    g2 = graph(i, h, o)
    trains = {"mid": Split(torch.optim.SGD, lr=0.01)}
    split = Trainer(
        g2,
        objective=loss,
        optimizer=torch.optim.SGD(parameters(g2, without=trains), lr=0.01),
        trains=trains,
    )
    batch_ = (x, y)
    runs = {
        "hand": hand,
        "hand_cut": hand_cut,
        "trainer": lambda: plain.step(batch_),
        "split": lambda: split.step(batch_),
    }
    for fn in runs.values():  # warm up
        time_us(fn, loops)
    seen: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            seen[k].append(time_us(fn, loops))
    return {k: statistics.median(v) for k, v in seen.items()}


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for name, i, h, o, batch in SIZES:
        m = measure(i, h, o, batch, loops=20, repeats=41)
        rows.append(
            [
                name,
                m["hand"],
                m["trainer"],
                m["trainer"] / m["hand"],
                m["split"],
                m["split"] / m["trainer"],
                m["hand_cut"] / m["hand"],
            ]
        )
    report(
        "train",
        "Trainer.step against a hand-written loop, and a Split step against a plain one",
        [
            "MLP",
            "hand loop µs",
            "Trainer.step µs",
            "Trainer / hand (≤ 1.10)",
            "Split step µs",
            "Split / plain (≤ 1.5)",
            "cut by hand / hand loop",
        ],
        rows,
        notes=(
            "Plain SGD, cross-entropy, one thread, medians of 41 repeats of 20 steps, the runs "
            "interleaved. The last column is the same cut written by hand in plain torch: what a "
            "cut costs whoever makes it."
        ),
    )


if __name__ == "__main__":
    main()
