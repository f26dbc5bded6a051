"""What auditing costs: `Trainer.fit` with `Audit(every=1)` and `Audit(every=10)` against a plain
`fit` of the same net on the same batches, all in the same run.

An MLP of three nodes (64 → 256 → 256 → 10, ReLU) on 64-sample batches, SGD, 60 steps a fit.
Targets: every=1 at most 1.5× plain, every=10 at most 1.1×. Medians of repeats, one thread,
CPU time of this process (steadier on a shared machine) and wall time beside it.

    python bench/audit.py            # the fits
    python bench/audit.py --phases   # and, at every=10, what each kind of step adds

`--phases` times every step of a fit on its own (CPU time) and groups them by where they
fall in the cadence: a measured step (θ copied in its forward, the update taken after its
optimizer step), the snapshot step (50), the step after a measured one, and the rest.
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


def graph() -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(Dense(64, 256) >> Dense(256, 256) >> Dense(256, 10, last=True))


def warm_trainer(auditing, batches) -> Trainer:  # noqa: ANN001
    """A Trainer of a fresh `graph()`, after five warm-up steps on `batches`."""
    g = graph()
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.01),
        auditing=auditing,
    )
    t.fit(batches[:5])
    return t


def fit_seconds(auditing, batches) -> tuple[float, float]:  # noqa: ANN001
    t = warm_trainer(auditing, batches)
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
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(11):  # interleaved, so a busy moment hits every kind alike
        for name, make in kinds.items():
            c, w = fit_seconds(make(), batches)
            cpu[name].append(c)
            wall[name].append(w)
    plain, plain_wall = statistics.median(cpu["plain fit"]), statistics.median(wall["plain fit"])
    print("| fit of 60 steps | CPU ms | × plain (CPU) | wall ms | × plain (wall) | target |")
    print("|---|---:|---:|---:|---:|---:|")
    targets = {"Audit(every=1)": "≤ 1.5×", "Audit(every=10)": "≤ 1.1×"}
    for name in kinds:
        ms, wms = statistics.median(cpu[name]), statistics.median(wall[name])
        print(
            f"| {name} | {ms * 1e3:.1f} | {ms / plain:.2f} | {wms * 1e3:.1f} | "
            f"{wms / plain_wall:.2f} | {targets.get(name, '')} |"
        )
    if "--phases" in sys.argv[1:]:
        print()
        phases(batches)


if __name__ == "__main__":
    main()
