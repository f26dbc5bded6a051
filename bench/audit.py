"""What auditing costs: `Trainer.fit` with `Audit(every=1)` and `Audit(every=10)` against a plain
`fit` of the same net on the same batches, all in the same run.

An MLP of three nodes (64 → 256 → 256 → 10, ReLU) on 64-sample batches, SGD, 60 steps a fit.
Targets: every=1 at most 1.5× plain, every=10 at most 1.1×. Medians of repeats, one thread,
CPU time of this process (steadier on a shared machine) and wall time beside it.

    python bench/audit.py            # the fits
    python bench/audit.py --phases   # and, at every=10, what each kind of step adds
    python bench/audit.py --cnn      # and the same kinds on a small CNN, for context (~30 s)

`--phases` times every step of a fit on its own (CPU time) and groups them by where they
fall in the cadence: a measured step (θ copied in its forward, the update taken after its
optimizer step), the snapshot step (50), the step after a measured one, and the rest.

`--cnn` fits a five-node CNN (four conv–batch-norm–ReLU blocks, 16 to 64 channels, on 32×32
RGB batches of 32, then a pooled linear head), with freed blocks kept for reuse: a step there
takes about 18 ms, so what an audit costs per measured step weighs less. It is context, not
the target: the targets are read on the MLP, whose 0.6 ms steps are close to the worst case.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node
from somatize.torch import Trainer, parameters
from somatize.torch.audit import Audit


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


def graph() -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(Dense(64, 256) >> Dense(256, 256) >> Dense(256, 10, last=True))


def cnn() -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(
        Block(3, 16) >> Block(16, 32, 2) >> Block(32, 32) >> Block(32, 64, 2) >> Head(64, 10)
    )


def warm_trainer(auditing, batches, make=graph) -> Trainer:  # noqa: ANN001
    """A Trainer of a fresh `make()` graph, after five warm-up steps on `batches`."""
    g = make()
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.01),
        auditing=auditing,
    )
    t.fit(batches[:5])
    return t


def fit_seconds(auditing, batches, make=graph) -> tuple[float, float]:  # noqa: ANN001
    t = warm_trainer(auditing, batches, make)
    t0, w0 = time.process_time(), time.perf_counter()
    t.fit(batches)
    took, wall = time.process_time() - t0, time.perf_counter() - w0
    if t.audit is not None:
        t.audit.release()
    return took, wall


def step_seconds(auditing, batches) -> list[float]:  # noqa: ANN001
    """CPU seconds of each step of a fit of `batches` (after the same five warm-up steps)."""
    t = warm_trainer(auditing, batches)
    took = []
    for b in batches:
        t0 = time.process_time()
        t.step(b)
        took.append(time.process_time() - t0)
    if t.audit is not None:
        t.audit.release()
    return took


def phases(batches, repeats: int = 15) -> None:  # noqa: ANN001
    """What each kind of step adds at every=10, medians over interleaved repeats."""
    plain: list[list[float]] = []
    audited: list[list[float]] = []
    for _ in range(repeats):
        plain.append(step_seconds(None, batches))
        audited.append(step_seconds(Audit(every=10), batches))
    # step k of the timed fit is the trainer's step 5 + k
    kinds = {
        "measured (10, 20, 30, 40, 60)": [5, 15, 25, 35, 55],
        "snapshot (50)": [45],
        "after a measured one": [6, 16, 26, 36, 46, 56],
    }
    kinds["the rest"] = [k for k in range(len(batches)) if not any(k in v for v in kinds.values())]

    def median(rows: list[list[float]], ks: list[int]) -> float:
        return statistics.median(sum(r[k] for k in ks) / len(ks) for r in rows) * 1e6

    print("| step at every=10 | plain µs | audited µs | added µs |")
    print("|---|---:|---:|---:|")
    for name, ks in kinds.items():
        p, a = median(plain, ks), median(audited, ks)
        print(f"| {name} | {p:.0f} | {a:.0f} | {a - p:+.0f} |")


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(64, 64, generator=gen), torch.randint(0, 10, (64,), generator=gen))
        for _ in range(60)
    ]
    kinds = {
        "plain fit": lambda: None,
        "Audit(every=1)": lambda: Audit(every=1),
        "Audit(every=10)": lambda: Audit(every=10),
        "Audit(every=1, channels=True, inside=True)": lambda: Audit(channels=True, inside=True),
    }
    table(kinds, batches, graph, 11, "fit of 60 steps")
    if "--phases" in sys.argv[1:]:
        print()
        phases(batches)
    if "--cnn" in sys.argv[1:]:
        print()
        images = [
            (torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen))
            for _ in range(60)
        ]
        del kinds["Audit(every=1, channels=True, inside=True)"]
        # Its activations are megabytes: glibc hands such blocks back to the system when they
        # are freed and faults them in again, 10⁵ page faults a fit in amounts that swung the
        # same fit between 1.12 and 1.58 s. Blocks kept for reuse (what a worker does) leave
        # the audit's cost.
        from somatize.remote.memory import keep_buffers

        keep_buffers()
        table(kinds, images, cnn, 7, "CNN, fit of 60 steps (context)", targets=False)


def table(kinds, batches, make, repeats, what, targets=True) -> None:  # noqa: ANN001
    """Fit `make()` on `batches` under each kind of audit, `repeats` times interleaved (so a
    busy moment hits every kind alike), and print the medians against the plain fit."""
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for name, audit in kinds.items():
            c, w = fit_seconds(audit(), batches, make)
            cpu[name].append(c)
            wall[name].append(w)
    plain, plain_wall = statistics.median(cpu["plain fit"]), statistics.median(wall["plain fit"])
    print(f"| {what} | CPU ms | × plain (CPU) | wall ms | × plain (wall) | target |")
    print("|---|---:|---:|---:|---:|---:|")
    goals = {"Audit(every=1)": "≤ 1.5×", "Audit(every=10)": "≤ 1.1×"} if targets else {}
    for name in kinds:
        ms, wms = statistics.median(cpu[name]), statistics.median(wall[name])
        print(
            f"| {name} | {ms * 1e3:.1f} | {ms / plain:.2f} | {wms * 1e3:.1f} | "
            f"{wms / plain_wall:.2f} | {goals.get(name, '')} |"
        )


if __name__ == "__main__":
    main()
