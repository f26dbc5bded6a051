"""What auditing costs: `Trainer.fit` with `Audit(every=1)` and `Audit(every=10)` against a plain
`fit` of the same net on the same batches, all in the same run.

An MLP of three nodes (64 → 256 → 256 → 10, ReLU) on 64-sample batches, SGD, 60 steps a fit.
Targets: every=1 at most 1.5× plain, every=10 at most 1.1×. One thread; CPU time of this
process (steadier on a shared machine), wall time beside it. 31 repeats, the kinds taking
turns; each ratio is the median over repeats of a fit against the plain fit of its own repeat,
printed with its quartiles (how far apart two runs of this bench land on this machine).

    python bench/audit.py            # the fits
    python bench/audit.py --phases   # and, at every=10, what each kind of step adds
    python bench/audit.py --cnn      # and the same kinds on a small CNN, for context (~30 s)
    python bench/audit.py --floor    # and every=10's numbers written by hand, as a floor

`--phases` times every step of a fit on its own (CPU time) and groups them by where they
fall in the cadence: a measured step (θ copied in its forward, the update taken after its
optimizer step), the snapshot step (50), the step after a measured one, and the rest.

`--cnn` fits a five-node CNN (four conv–batch-norm–ReLU blocks, 16 to 64 channels, on 32×32
RGB batches of 32, then a pooled linear head), with freed blocks kept for reuse: a step there
takes about 18 ms, so what an audit costs per measured step weighs less. It is context, not
the target: the targets are read on the MLP, whose 0.6 ms steps are close to the worst case.

`--floor` writes every=10's numbers by hand, the way a user without the library would, as
cheaply as I know how (numpy dots on views of the weights, one batched `eigvalsh` per Gram
size, a few power steps for the 256×256 update), inside a plain loop over the same net and
batches, and times that loop with and without them, interleaved with the plain and audited
`fit`s. What it prints is what the audit adds against what the numbers themselves cost.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node
from somatize.torch import Trainer, parameters
from somatize.torch.audit.audit import Audit


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


def sgd(params):  # noqa: ANN001, ANN201
    """The bench's optimizer: plain SGD, lr 0.01."""
    return torch.optim.SGD(params, lr=0.01)


def warm_trainer(auditing, batches, make=graph, optimizer=sgd) -> Trainer:  # noqa: ANN001
    """A Trainer of a fresh `make()` graph, after five warm-up steps on `batches`."""
    g = make()
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=optimizer(parameters(g)),
        auditing=auditing,
    )
    t.fit(batches[:5])
    return t


def fit_seconds(auditing, batches, make=graph, optimizer=sgd) -> tuple[float, float]:  # noqa: ANN001
    t = warm_trainer(auditing, batches, make, optimizer)
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


def by_hand_seconds(measure: bool, batches) -> float:  # noqa: ANN001
    """CPU seconds of a plain loop of `batches` over `graph()`'s net (after the same five
    warm-up steps), and with `measure` every=10's numbers taken by hand on steps 10, 20, …
    (the snapshot's on 50): per node ‖θ‖, ‖∇θ‖, ‖θ' − θ‖/‖θ‖ (read as lr·‖∇θ‖/‖θ‖, what plain
    SGD's update is, as the audit reads it), the output's mean, zero fraction (max over a
    window of 20) and nan/inf; effective ranks and update stable ranks."""
    g = graph()  # the same net, with the same first weights, as the fits'
    nodes = [g.implementation(n) for n in g.nodes()]
    owned = [list(m.parameters()) for m in nodes]
    flat = [q for qs in owned for q in qs]
    optimizer = torch.optim.SGD(flat, lr=0.01)
    views = [q.detach().numpy().reshape(-1) for q in flat]
    zero = [deque(maxlen=20) for _ in nodes]
    ones = np.ones(64 * 256, np.float32)
    dot = np.dot

    def step(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        on = measure and k % 10 == 0
        outs = []
        h = x
        for m in nodes:
            h = m(h, None)
            outs.append(h)
        loss = F.cross_entropy(h, y)
        optimizer.zero_grad()
        loss.backward()
        loss.item()
        if on:
            squares = [float(dot(v, v)) for v in views]
            grads = [q.grad.numpy().reshape(-1) for q in flat]
            gsquares = [float(dot(v, v)) for v in grads]
            facts = []
            at = 0
            for i, o in enumerate(outs):
                a = o.detach().numpy().reshape(-1)
                total = float(dot(a, ones[: a.size]))
                zero[i].append(np.count_nonzero(np.abs(a) <= 1e-7) / a.size)
                n = len(owned[i])
                g = math.sqrt(sum(gsquares[at : at + n]))
                facts.append(
                    {
                        "param_norm": math.sqrt(sum(squares[at : at + n])),
                        "grad_norm": g,
                        "act_mean": total / a.size,
                        "zero": max(zero[i]),
                        "nan": math.isnan(total) or math.isnan(g),
                        "inf": math.isinf(total) or math.isinf(g),
                    }
                )
                at += n
        optimizer.step()
        if on:
            lr = optimizer.param_groups[0]["lr"]
            at = 0
            for i, f in enumerate(facts):
                n = len(owned[i])
                f["update_ratio"] = lr * math.sqrt(sum(gsquares[at : at + n])) / f["param_norm"]
                at += n
            if k % 50 == 0:
                snapshot(outs, [q.grad for q in flat], gsquares, facts)

    for k in range(5):
        step(k, *batches[k])
    t0 = time.process_time()
    for k, (x, y) in enumerate(batches, start=5):
        step(k, x, y)
    return time.process_time() - t0


def snapshot(outs, prev, moved, facts) -> None:  # noqa: ANN001
    """`by_hand_seconds`'s snapshot: effective ranks of the outputs (Roy & Vetterli, from the
    eigenvalues of the centred Gram matrix) and the stable rank ‖Δ‖²_F/σ_max² of each weight's
    update Δ (`prev` holds what Δ is a multiple of, the gradient; `moved` its ‖·‖²): Gram matrices of one size through one batched `eigvalsh`, the
    256×256 update's σ_max² by eight power steps in numpy."""
    with torch.no_grad():
        wide = torch.stack([outs[0], outs[1]])
        wide = wide - wide.mean(1, keepdim=True)
        w1, w3 = prev[0], prev[4]
        big = torch.cat([wide @ wide.mT, (w1.T @ w1).unsqueeze(0)])
        narrow = outs[2] - outs[2].mean(0, keepdim=True)
        small = torch.stack([narrow.T @ narrow, w3 @ w3.T])
        e64, e10 = torch.linalg.eigvalsh(big).tolist(), torch.linalg.eigvalsh(small).tolist()
    d = prev[2].numpy()
    v = np.full(d.shape[1], d.shape[1] ** -0.5, d.dtype)
    for _ in range(8):
        v = d.T @ (d @ v)
        v /= np.linalg.norm(v)
    top2 = float(np.linalg.norm(d @ v)) ** 2
    for f, e in zip(facts, (e64[0], e64[1], e10[0]), strict=True):
        s = [math.sqrt(x) for x in e if x > e[-1] * 1e-6]
        total = sum(s)
        f["effective_rank"] = math.exp(-sum(p * math.log(p) for p in (x / total for x in s)))
    for f, i, top in zip(facts, (0, 2, 4), (e64[2][-1], top2, e10[1][-1]), strict=True):
        f["update_stable_rank"] = moved[i] / top


def floor(batches, repeats: int = 11) -> None:  # noqa: ANN001
    """The plain and every=10 `fit`s against the plain loop with and without every=10's
    numbers by hand, interleaved; medians of CPU time."""
    kinds = {
        "plain fit": lambda: fit_seconds(None, batches)[0],
        "Audit(every=10)": lambda: fit_seconds(Audit(every=10), batches)[0],
        "plain loop": lambda: by_hand_seconds(False, batches),
        "loop + the numbers by hand": lambda: by_hand_seconds(True, batches),
    }
    took: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for name, run in kinds.items():
            took[name].append(run())
    ms = {k: statistics.median(v) * 1e3 for k, v in took.items()}
    print("| every=10's numbers | CPU ms | added ms | × its plain |")
    print("|---|---:|---:|---:|")
    for name, base in (
        ("Audit(every=10)", "plain fit"),
        ("loop + the numbers by hand", "plain loop"),
    ):
        print(f"| {base} | {ms[base]:.1f} | | |")
        print(
            f"| {name} | {ms[name]:.1f} | {ms[name] - ms[base]:+.1f} | {ms[name] / ms[base]:.2f} |"
        )


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
    table(kinds, batches, graph, 31, "fit of 60 steps")
    # the update ratio is read from an SGD step itself (from its momentum buffer, with
    # momentum), and taken on a copy of θ for any other optimizer: for context, the same MLP
    # under momentum SGD and under Adam, each against its own plain fit
    del kinds["Audit(every=1, channels=True, inside=True)"]
    for name, make_optimizer in (
        ("SGD, momentum 0.9", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
        ("Adam", lambda p: torch.optim.Adam(p, lr=1e-3)),
    ):
        print()
        table(kinds, batches, graph, 21, f"{name} (context)", False, make_optimizer)
    if "--phases" in sys.argv[1:]:
        print()
        phases(batches)
    if "--floor" in sys.argv[1:]:
        print()
        floor(batches)
    if "--cnn" in sys.argv[1:]:
        print()
        images = [
            (torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen))
            for _ in range(60)
        ]
        # Its activations are megabytes, which glibc hands back and faults in again: set
        # GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456 to keep them for reuse.
        table(kinds, images, cnn, 9, "CNN, fit of 60 steps (context)", targets=False)


def table(kinds, batches, make, repeats, what, targets=True, optimizer=sgd) -> None:  # noqa: ANN001
    """Fit `make()` on `batches` under each kind of audit, `repeats` times interleaved (so a
    busy moment hits every kind alike), and print, for each kind, the median over repeats of
    its CPU time against the plain fit of the same repeat (a ratio of two fits taken a few
    tenths of a second apart, so a machine that drifts over the run moves both), with the
    quartiles of those ratios: how far one run of this bench can land from another."""
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for name, audit in kinds.items():
            gc.collect()  # the kind before leaves nothing for this one to trip over
            c, w = fit_seconds(audit(), batches, make, optimizer)
            cpu[name].append(c)
            wall[name].append(w)
    base, base_wall = cpu["plain fit"], wall["plain fit"]
    print(f"| {what} | CPU ms | × plain (CPU) | quartiles | wall ms | × plain (wall) | target |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    goals = {"Audit(every=1)": "≤ 1.5×", "Audit(every=10)": "≤ 1.1×"} if targets else {}
    for name in kinds:
        ratios = sorted(c / p for c, p in zip(cpu[name], base, strict=True))
        low, mid, high = statistics.quantiles(ratios, n=4)
        walls = statistics.median(w / p for w, p in zip(wall[name], base_wall, strict=True))
        print(
            f"| {name} | {statistics.median(cpu[name]) * 1e3:.1f} | {mid:.3f} | "
            f"{low:.3f}–{high:.3f} | {statistics.median(wall[name]) * 1e3:.1f} | {walls:.3f} | "
            f"{goals.get(name, '')} |"
        )


if __name__ == "__main__":
    main()
