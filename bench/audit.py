"""What auditing costs: `Trainer.fit` with `Audit(every=1)` and `Audit(every=10)` against a plain
`fit` of the same net on the same batches, all in the same run.

An MLP of three nodes (64 → 256 → 256 → 10, ReLU) on 64-sample batches, 60 steps a fit, one
thread: a 0.6 ms step, close to the worst case for what a measured step adds. Budget (a
ceiling): every=1 at most 1.5× a plain fit, every=10 at most 1.15×. Each ratio is the median
over interleaved repeats of a fit's CPU time against the plain fit of its own repeat, with its
quartiles (how far two runs of this bench land apart on this machine). Most of what a
measured step adds is torch's own small ops (θ copied, Σ|a| and the zeros of each output,
‖θ‖, ‖∇θ‖, θ′ − θ and its norms), whose cost per op differs from CPU to CPU, so the ratio does
too. The same kinds under Adam, and on a small CNN (`--cnn`), are context: every optimizer is
measured the same way.

    python bench/audit.py [--cnn] [--results]
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _results import report
from torch import nn

from somatize import Graph, Node
from somatize.torch import Audit, Trainer, parameters


class Dense(Node, nn.Module):
    """Linear, then ReLU unless it is the last."""

    def __init__(self, i: int, o: int, last: bool = False) -> None:
        super().__init__()
        self.l = nn.Linear(i, o)
        self.a = nn.Identity() if last else nn.ReLU()

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.a(self.l(x))


class Block(Node, nn.Module):
    """Conv 3×3 (no bias), batch norm, ReLU."""

    def __init__(self, i: int, o: int, stride: int = 1) -> None:
        super().__init__()
        self.c = nn.Conv2d(i, o, 3, stride, 1, bias=False)
        self.n = nn.BatchNorm2d(o)
        self.a = nn.ReLU()

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.a(self.n(self.c(x)))


class Head(Node, nn.Module):
    """Global average pool, then a linear layer."""

    def __init__(self, i: int, k: int) -> None:
        super().__init__()
        self.l = nn.Linear(i, k)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.l(x.mean((2, 3)))


def mlp() -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(Dense(64, 256) >> Dense(256, 256) >> Dense(256, 10, last=True))


def cnn() -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(
        Block(3, 16) >> Block(16, 32, 2) >> Block(32, 32) >> Block(32, 64, 2) >> Head(64, 10)
    )


def sgd(params):  # noqa: ANN001, ANN201
    return torch.optim.SGD(params, lr=0.01)


def adam(params):  # noqa: ANN001, ANN201
    return torch.optim.Adam(params, lr=1e-3)


def fit_seconds(audit, batches, make, optimizer) -> float:  # noqa: ANN001
    """CPU seconds of one `fit` of `batches`, after five warm-up steps."""
    g = make()
    t = Trainer(g, objective=F.cross_entropy, optimizer=optimizer(parameters(g)), auditing=audit)
    t.fit(batches[:5])
    t0 = time.process_time()
    t.fit(batches)
    took = time.process_time() - t0
    t.close()
    return took


KINDS = {
    "plain fit": lambda: None,
    "Audit(every=1)": lambda: Audit(every=1),
    "Audit(every=10)": lambda: Audit(every=10),
}
BUDGET = {"Audit(every=1)": 1.5, "Audit(every=10)": 1.15}


def ratios(batches, make, optimizer, repeats) -> dict[str, list[float]]:  # noqa: ANN001
    """Each kind's fit against the plain fit of the same repeat, kinds taking turns."""
    took: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(repeats):
        for name, audit in KINDS.items():
            gc.collect()
            took[name].append(fit_seconds(audit(), batches, make, optimizer))
    base = took["plain fit"]
    return {k: [c / p for c, p in zip(v, base, strict=True)] for k, v in took.items()}


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    vectors = [
        (torch.randn(64, 64, generator=gen), torch.randint(0, 10, (64,), generator=gen))
        for _ in range(60)
    ]
    cases = [("MLP, SGD", vectors, mlp, sgd, 21), ("MLP, Adam", vectors, mlp, adam, 11)]
    if "--cnn" in sys.argv[1:]:
        images = [
            (torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen))
            for _ in range(60)
        ]
        cases.append(("CNN, SGD", images, cnn, sgd, 5))
    rows = []
    for what, batches, make, optimizer, repeats in cases:
        got = ratios(batches, make, optimizer, repeats)
        for name in ("Audit(every=1)", "Audit(every=10)"):
            r = sorted(got[name])
            low, mid, high = statistics.quantiles(r, n=4)
            budget = BUDGET[name] if what == "MLP, SGD" else None
            verdict = "" if budget is None else ("within" if mid <= budget else "OVER")
            rows.append([what, name, mid, f"{low:.3f}–{high:.3f}", budget or "context", verdict])
    report(
        "audit",
        "a fit with an Audit against a plain fit (CPU time, one thread, 60 steps)",
        ["net", "audit", "× plain", "quartiles", "budget", ""],
        rows,
        notes="Every optimizer is measured the same way (θ copied when a measured step "
        "begins, ‖θ′ − θ‖ after the optimizer's step).",
    )


if __name__ == "__main__":
    main()
