"""Does the audit tell the truth? Healthy trainings that must raise no flag, and deliberately
broken nets that must be flagged on the node that is broken, with the flag that names why.

Every run is a `Trainer.fit` with an `Audit`, its health facts judged by
`somatize.health.Verdicts` (what a live audit marks at each step, and at the end what
`diagnose` says). The healthy ones (MLPs and CNNs on scikit-learn's digits that learn, the
notebooks' nets, a small BERT at random init on a synthetic task) count as clean only if no
place holds a flag at any step. A broken one is caught when every place it breaks holds its
flag at the end; a flag raised anywhere else, on any run, counts against precision.

    python bench/health.py [--results] [--detail]    # --detail: each run's flags and numbers

Targets: recall 1.0, precision 1.0, every healthy run clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from _results import report
from torch import nn

from somatize import Graph, Node
from somatize.health import Flag, Verdicts, where_of
from somatize.torch import Audit, Trainer, parameters

# -- data ---------------------------------------------------------------------------------


def digits(batch: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8×8 digits, pixels in 0..1, the notebooks' 1500 training samples."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:1500]
    return [(x[i], y[i]) for i in order.split(batch)]


def images(batch: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.reshape(-1, 1, 8, 8), y) for x, y in digits(batch)]


def tokens(steps: int = 300, batch: int = 32, length: int = 16, vocab: int = 50):
    """A synthetic task a small transformer learns: is token 1 more frequent than token 2?"""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, length), generator=gen)
        x[:, :4] = torch.randint(1, 3, (batch, 4), generator=gen)
        y = ((x == 1).sum(1) > (x == 2).sum(1)).long()
        out.append((x, y))
    return out


# -- nodes --------------------------------------------------------------------------------


_ACT = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "none": nn.Identity}


class Dense(Node, nn.Module):
    """A linear layer and its activation; `scale` multiplies the initial weights, `bias` sets
    every bias."""

    def __init__(self, i: int, o: int, act: str = "relu", scale: float = 1.0, bias=None):  # noqa: ANN001
        super().__init__()
        self.lin = nn.Linear(i, o)
        self.act = _ACT[act]()
        with torch.no_grad():
            self.lin.weight.mul_(scale)
            if bias is not None:
                self.lin.bias.fill_(bias)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.act(self.lin(x))


class Normed(Node, nn.Module):
    """A linear layer, a layer norm without weights of its own, and ReLU: scale-invariant in
    the linear layer's weights, so under weight decay their update ratio settles at a level
    set by the learning rate (about √(2·lr·decay)) instead of fading as they grow."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.lin = nn.Linear(i, o, bias=False)
        self.norm = nn.LayerNorm(o, elementwise_affine=False)
        self.act = nn.ReLU()

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.act(self.norm(self.lin(x)))


class Conv(Node, nn.Module):
    """Conv 3×3 and ReLU; `dead` output channels get a bias of −20 (never active), and a
    `keep` mask over input channels zeroes the weights from the others, every forward."""

    def __init__(self, i: int, o: int, dead: int = 0, keep: int | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(i, o, 3, padding=1)
        self.act = nn.ReLU()
        mask = torch.ones(1, i, 1, 1)
        if keep is not None:
            mask[:, keep:] = 0.0
        self.register_buffer("mask", mask)
        with torch.no_grad():
            self.conv.bias[:dead] = -20.0

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.act(F.conv2d(x, self.conv.weight * self.mask, self.conv.bias, padding=1))


class Pool(Node, nn.Module):
    """Average over positions, then a linear read-out."""

    def __init__(self, i: int, k: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(i, k)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.fc(x.mean((2, 3)))


class Halves(Node, nn.Module):
    """Two encoders, one per half of the image, side by side: channels 0..15 see the left
    half, 16..31 the right. `copy`: the second is the first, rotated (the groups leak)."""

    def __init__(self, copy: bool = False) -> None:
        super().__init__()
        self.left = nn.Linear(32, 16)
        self.right = None if copy else nn.Linear(32, 16)
        self.register_buffer("turn", torch.linalg.qr(torch.randn(16, 16))[0])

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        img = x.reshape(-1, 8, 8)
        a = torch.relu(self.left(img[:, :, :4].reshape(-1, 32)))
        if self.right is None:
            return torch.cat([a, a @ self.turn], 1)
        return torch.cat([a, torch.relu(self.right(img[:, :, 4:].reshape(-1, 32)))], 1)


class Residual(Node, nn.Module):
    """x plus a branch (linear, ReLU, linear) whose last layer starts at zero, weights and bias:
    the identity at first, as torchvision's zero_init_residual and LoRA's B start."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.act = nn.ReLU()
        self.out = nn.Linear(d, d)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return x + self.out(self.act(self.inner(x)))


class Log(Node):
    """log|x| − 2, then log of that: NaN wherever |x| < e²."""

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return torch.log(torch.log(x.abs() + 1e-3) + 2.0)


class Text(Node, nn.Module):
    """A transformers BERT classifier at random init, from a small config (nothing fetched)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=2,
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, x, ctx):  # noqa: ANN001, ANN201
        return self.bert(input_ids=x).logits


def chain(*nodes: Node) -> Graph:
    expr = nodes[0].named("n0")
    for k, node in enumerate(nodes[1:], start=1):
        expr = expr >> node.named(f"n{k}")
    return Graph.somatize(expr)


def mlp(acts=("relu", "relu"), scale=1.0, widths=(32, 32), bias=None, at=None) -> Graph:  # noqa: ANN001
    """64 → widths → 10, each hidden layer with its activation; `bias` set on layer `at`."""
    sizes = (64, *widths)
    layers = [
        Dense(sizes[k], sizes[k + 1], acts[k], scale, bias if k == at else None)
        for k in range(len(widths))
    ]
    return chain(*layers, Dense(sizes[-1], 10, "none", scale))


def cnn(dead: int = 0, keep: int | None = None) -> Graph:
    return chain(Conv(1, 16), Conv(16, 32, dead=dead, keep=keep), Pool(32))


# -- the suite ----------------------------------------------------------------------------


def adam(lr: float) -> Callable:
    return lambda p: torch.optim.Adam(p, lr=lr)


def sgd(lr: float, momentum: float = 0.0, decay: float = 0.0) -> Callable:
    return lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, weight_decay=decay)


def normed() -> Graph:
    return chain(Normed(64, 32), Normed(32, 32), Dense(32, 10, "none"))


@dataclass
class Case:
    """One training run. `cause`: {node: flag} a broken run must raise at the end (empty:
    healthy); `also`: the nodes the same cause may show on (the broken stretch of a stack)."""

    name: str
    graph: Callable[[], Graph]
    optimizer: Callable
    data: Callable[[], list]
    epochs: int = 3
    audit: dict[str, Any] = field(default_factory=dict)
    cause: dict[str, str] = field(default_factory=dict)
    also: tuple[str, ...] = ()


def _deep(act: str, scale: float, depth: int) -> Callable[[], Graph]:
    return lambda: mlp(acts=(act,) * depth, widths=(32,) * depth, scale=scale)


CASES = [
    # healthy
    Case("MLP, Adam 1e-3 (notebook 05)", lambda: mlp(), adam(1e-3), digits),
    Case(
        "MLP, Adam 1e-2 (notebook 02)",
        lambda: mlp(widths=(32,), acts=("relu",)),
        adam(1e-2),
        digits,
    ),
    Case("MLP, SGD 0.1 momentum 0.9", lambda: mlp(), sgd(0.1, 0.9), digits, epochs=5),
    Case("MLP, tanh, SGD 0.2", lambda: mlp(("tanh", "tanh")), sgd(0.2), digits, epochs=10),
    Case("MLP, sigmoid, Adam 1e-2", lambda: mlp(("sigmoid", "sigmoid")), adam(1e-2), digits),
    Case("layer-normed MLP, SGD 0.1, decay 5e-4", normed, sgd(0.1, 0.9, 5e-4), digits, epochs=5),
    Case("deep MLP ×6, Adam 1e-3", _deep("relu", 1.0, 6), adam(1e-3), digits, epochs=10),
    Case("CNN, Adam 3e-3, channels", cnn, adam(3e-3), images, epochs=10, audit={"channels": True}),
    Case(
        "CNN, SGD 0.3 momentum 0.9, inside",
        cnn,
        sgd(0.3, 0.9),
        images,
        epochs=10,
        audit={"inside": True},
    ),
    Case(
        "two halves, groups",
        lambda: chain(Halves(), Dense(32, 10, "none")),
        adam(1e-3),
        digits,
        audit={"groups": {"n0": {"left": range(16), "right": range(16, 32)}}},
    ),
    Case(
        "BERT (transformers), AdamW 3e-4, inside",
        lambda: chain(Text()),
        lambda p: torch.optim.AdamW(p, lr=3e-4),
        tokens,
        epochs=1,
        audit={"inside": True},
    ),
    Case(
        "residual branch initialised at zero, Adam 1e-3, inside",
        lambda: chain(Dense(64, 32), Residual(32), Dense(32, 10, "none")),
        adam(1e-3),
        digits,
        audit={"inside": True},
    ),
    # broken
    Case(
        "dead ReLUs (bias −20)",
        lambda: mlp(bias=-20.0, at=1),
        adam(1e-3),
        digits,
        cause={"n1": "DEAD"},
    ),
    Case(
        "dead channels",
        lambda: cnn(dead=12),
        adam(1e-3),
        images,
        audit={"channels": True},
        cause={"n1": "DEAD_CHANNELS"},
    ),
    Case(
        "ignored input channels",
        lambda: cnn(keep=4),
        adam(1e-3),
        images,
        audit={"channels": True},
        cause={"n1": "IGNORED_CHANNELS"},
    ),
    Case(
        "groups that leak",
        lambda: chain(Halves(copy=True), Dense(32, 10, "none")),
        adam(1e-3),
        digits,
        audit={"groups": {"n0": {"left": range(16), "right": range(16, 32)}}},
        cause={"n0": "LEAKAGE"},
    ),
    Case(
        "exploding init (×10, 6 layers)",
        _deep("relu", 10.0, 6),
        adam(1e-3),
        digits,
        epochs=1,
        cause={"n0": "EXPLODING"},
        also=tuple(f"n{k}" for k in range(1, 7)),
    ),
    Case(
        "vanishing sigmoid stack (12)",
        _deep("sigmoid", 1.0, 12),
        sgd(0.1),
        digits,
        epochs=1,
        cause={"n0": "VANISHING"},
        also=tuple(f"n{k}" for k in range(1, 8)),
    ),
    Case(
        "overstepping lr (the same, SGD 5, decay 0.05)",
        normed,
        sgd(5.0, 0.0, 0.05),  # (at 3, n0's median ratio sat at 0.21-0.4 by the machine)
        digits,
        epochs=5,
        cause={"n0": "OVERSTEPPING", "n1": "OVERSTEPPING", "n2": "OVERSTEPPING"},
    ),
    Case(
        "saturated tanh stack (×20)",
        _deep("tanh", 20.0, 4),
        sgd(0.01),
        digits,
        epochs=1,
        cause={f"n{k}": "SATURATED" for k in range(4)},
    ),
    Case(
        "NaN from a log",
        lambda: chain(Dense(64, 32), Log(), Dense(32, 10, "none")),
        adam(1e-3),
        digits,
        epochs=1,
        cause={"n1": "NAN"},
    ),
    Case(
        "stalled (SGD 1e-7)",
        lambda: mlp(),
        sgd(1e-7),
        digits,
        epochs=1,
        cause={"n0": "STALLED", "n1": "STALLED", "n2": "STALLED"},
    ),
]


def train(case: Case) -> tuple[list[dict], float, float]:
    """The run's health facts, its first and last loss."""
    torch.manual_seed(0)
    g = case.graph()
    facts: list[dict] = []
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=case.optimizer(parameters(g)),
        auditing=Audit(**case.audit),
        watching=lambda f: facts.append(f) if f["fact"] == "health" else None,
    )
    result = t.fit(case.data(), epochs=case.epochs)
    t.close()
    return facts, result.history[0], result.history[-1]


def judge(case: Case, facts: list[dict]) -> dict[str, Any]:
    """The flags each place held at any step and at the end, scored against the case: a flag
    is right when its node is broken by the case's cause and it names that cause (a flag on a
    module inside a node counts as that node's)."""
    v = Verdicts()
    ever: set[tuple[str, str]] = set()
    for fact in facts:
        ever |= {(where_of(fact), Flag(f).name) for f in v.add(fact) or ()}
    final = {(where, Flag(f).name) for where, flags in v.flags().items() for f in flags}
    allowed = set(case.cause.items()) | {(w, f) for w in case.also for f in case.cause.values()}
    right = {(w, f) for w, f in ever if (w.split(".")[0], f) in allowed}
    return {
        "final": final,
        "caught": set(case.cause.items()) <= final,
        "right": right,
        "wrong": ever - right,
        "numbers": v.numbers(),
    }


def main() -> None:
    torch.set_num_threads(1)
    detail = "--detail" in sys.argv[1:]
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    rows = []
    tp = fp = 0
    caught = broken = clean = healthy = 0
    for case in CASES:
        if only and not any(o in case.name for o in only):
            continue
        began = time.perf_counter()
        facts, first, last = train(case)
        took = time.perf_counter() - began
        got = judge(case, facts)
        tp += len(got["right"])
        fp += len(got["wrong"])
        if case.cause:
            broken += 1
            caught += got["caught"]
            outcome = "caught" if got["caught"] else "MISSED"
        else:
            healthy += 1
            clean += not got["wrong"]
            outcome = "clean" if not got["wrong"] else "FLAGGED"
        shown = _listed(got["final"])
        wrong = _listed(got["wrong"])
        rows.append([case.name, f"{first:.2f} → {last:.2f}", shown, outcome, wrong])
        print(f"{case.name}: {outcome} ({took:.1f} s)", file=sys.stderr)
        if detail:
            _detail(got)
    recall = caught / broken if broken else float("nan")
    precision = tp / (tp + fp) if tp + fp else 1.0
    rows.append(["**recall** (broken nets caught on their cause)", "", "", f"{recall:.2f}", ""])
    rows.append(["**precision** (flags that name the cause)", "", "", f"{precision:.2f}", ""])
    rows.append(["**healthy runs clean** (at every step)", "", "", f"{clean}/{healthy}", ""])
    report(
        "health",
        "the audit's flags on healthy and deliberately broken trainings",
        ["run", "loss", "flags at the end", "outcome", "flags elsewhere"],
        rows,
        notes="Targets: recall 1.0, precision 1.0, every healthy run clean. Flags are "
        "`somatize.health.Verdicts`' (each place over its last 20 measured steps), at the end "
        "of the run and, for a healthy run, at any step.",
    )


def _listed(pairs: set[tuple[str, str]]) -> str:
    """`n0 DEAD, n1 DEAD` — or, past four, how many, so a row stays readable."""
    names = [f"{w} {f}" for w, f in sorted(pairs)]
    if not names:
        return "—"
    return (
        ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more"
    )


def _detail(got: dict[str, Any]) -> None:
    keys = (
        "grad_norm",
        "update_ratio",
        "zero_frac_max",
        "sat_frac_max",
        "out_grad_norm",
        "dead_channels",
        "ignored_channels",
        "cka",
        "effective_rank",
        "rank_room",
    )
    for where, n in got["numbers"].items():
        shown = {k: round(n[k], 5) if isinstance(n[k], float) else n[k] for k in keys if k in n}
        print(f"    {where}: {shown}", file=sys.stderr)
    print(f"    wrong: {sorted(got['wrong'])}", file=sys.stderr)


if __name__ == "__main__":
    main()
