"""What a step costs when one node of an MLP is trained by each answer to the Learning hole,
against a plain `Trainer.step` on the same MLP (backpropagation through everything), in the
same run.

Each technique trains one node where it can stand: `Split` and `Synthetic` the middle layer
(the layers around it learn by backpropagation, through the cut), `Greedy` and
`ForwardForward` the first (nothing before them needs a gradient they do not send). SGD,
cross-entropy, one thread, the runs interleaved, medians of repeats. Budget: each at most 2×
a plain step.

    python bench/learning.py            # prints the table
    python bench/learning.py --results  # and rewrites its section of bench/RESULTS.md
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from _results import report
from torch import nn
from train import graph, time_us

from somatize.torch import ForwardForward, Greedy, Split, Synthetic, Trainer, parameters

SIZES = [
    # (name, inputs, hidden, outputs, batch)
    ("64-128-128-10, batch 64", 64, 128, 10, 64),
    ("256-512-512-10, batch 128", 256, 512, 10, 128),
]
BUDGET = 2.0


def techniques(h: int, o: int) -> dict[str, dict[str, Any]]:
    """Each technique, on the node it trains."""
    SGD = torch.optim.SGD
    return {
        "plain": {},
        "Split (mid)": {"mid": Split(SGD, lr=0.01)},
        "Synthetic (mid)": {"mid": Synthetic(SGD, lr=0.01)},
        "Greedy (first)": {"first": Greedy(SGD, head=nn.Linear(h, o), lr=0.01)},
        "ForwardForward (first)": {"first": ForwardForward(SGD, lr=0.01)},
    }


def measure(i: int, h: int, o: int, batch: int, loops: int, repeats: int) -> dict[str, float]:
    """Median µs a step for each technique (and plain), interleaved."""
    x = torch.randn(batch, i)
    y = torch.randint(0, o, (batch,))
    steps = {}
    for name, trains in techniques(h, o).items():
        g = graph(i, h, o)
        t = Trainer(
            g,
            objective=nn.functional.cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.01),
            trains=trains,
        )
        steps[name] = lambda t=t: t.step((x, y))
    for fn in steps.values():  # warm up
        time_us(fn, loops)
    seen: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, fn in steps.items():
            seen[k].append(time_us(fn, loops))
    return {k: statistics.median(v) for k, v in seen.items()}


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for size, i, h, o, batch in SIZES:
        m = measure(i, h, o, batch, loops=20, repeats=21)
        for name in m:
            if name != "plain":
                rows.append([size, name, m["plain"], m[name], m[name] / m["plain"]])
    report(
        "learning",
        "a step with one node trained by each technique, against a plain Trainer.step",
        ["MLP", "technique", "plain step µs", "step µs", f"ratio (≤ {BUDGET:g})"],
        rows,
        notes=(
            "Split and Synthetic train the middle layer, Greedy and ForwardForward the first; "
            "SGD, cross-entropy, one thread, medians of 21 repeats of 20 steps, interleaved."
        ),
    )


if __name__ == "__main__":
    main()
