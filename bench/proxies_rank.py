"""Do the proxies rank candidates the way training does? 36 MLPs on scikit-learn's bundled
digits (no download), each scored by every proxy at initialisation and then trained briefly.

Candidates: width {16, 64} × depth {1, 2, 3} × activation {relu, tanh, sigmoid} × batch norm
{off, on}. Each is trained for 4 epochs (Adam, lr 1e-3, batch 64) on 1437 images and tested on
the other 360. Prints each proxy's Spearman correlation with test accuracy, beside parameter
count as the baseline to beat, and the time the proxies take per candidate. A few minutes.

    python bench/proxies_rank.py [--results]
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.nn.functional as F
from _results import report
from scipy.stats import spearmanr
from sklearn.datasets import load_digits
from torch import nn

from somatize import Graph, Node
from somatize.torch import Trainer, parameters
from somatize.torch.inside.proxies import EVERY, proxies

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class MLP(Node, nn.Module):
    """A candidate: `depth` hidden layers of `width`, an activation, optional batch norm."""

    def __init__(self, width: int, depth: int, act: str, norm: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = 64
        for _ in range(depth):
            layers.append(nn.Linear(size, width))
            if norm:
                layers.append(nn.BatchNorm1d(width))
            layers.append(ACTIVATIONS[act]())
            size = width
        layers.append(nn.Linear(size, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.net(x)


def data() -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def main() -> None:
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = data()
    batches = [(xtr[i : i + 64], ytr[i : i + 64]) for i in range(0, len(xtr), 64)]
    probe_x, probe_y = xtr[:64], ytr[:64]
    rows = []
    took = []
    for width, depth, act, norm in itertools.product(
        (16, 64), (1, 2, 3), ACTIVATIONS, (False, True)
    ):
        torch.manual_seed(0)
        g = Graph.somatize(MLP(width, depth, act, norm))
        t0 = time.perf_counter()
        scores = proxies(g, probe_x, target=probe_y, objective=F.cross_entropy)
        took.append(time.perf_counter() - t0)
        trainer = Trainer(
            g, objective=F.cross_entropy, optimizer=torch.optim.Adam(parameters(g), lr=1e-3)
        )
        trainer.fit(batches, epochs=4)
        node = g.implementation(g.nodes()[0])
        node.eval()
        with torch.no_grad():
            accuracy = float((g.forward(xte).argmax(1) == yte).float().mean())
        count = sum(p.numel() for p in parameters(g))
        rows.append({"accuracy": accuracy, "params": count, **scores})
        print(
            f"{width:>3} {depth} {act:<7} {'bn' if norm else '  '} acc {accuracy:.3f}", flush=True
        )
    accuracy = [r["accuracy"] for r in rows]
    table = []
    for name in ("params", *EVERY):
        values = [r.get(name, float("nan")) for r in rows]
        label = "parameter count (baseline)" if name == "params" else name
        table.append([label, f"{spearmanr(values, accuracy).statistic:+.2f}"])
    report(
        "proxies_rank",
        "do the proxies rank candidates as a short training does? (36 MLPs on digits)",
        ["score", "Spearman ρ with test accuracy"],
        table,
        f"{len(rows)} candidates, test accuracy {min(accuracy):.3f}–{max(accuracy):.3f} after "
        f"4 epochs; all eight proxies per candidate: median "
        f"{statistics.median(took) * 1e3:.0f} ms.",
    )


if __name__ == "__main__":
    main()
