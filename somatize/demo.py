"""The main job, headless: declare a graph, run it twice against a store (the second run
from the cache), train it audited, compare it with other candidates, and write one page with
the three figures, which opens offline.

    python -m somatize.demo [--store DIR] [--out demo.html] [--pictures DIR]

`--pictures DIR` also writes each figure's picture (graph.svg, audit.svg, table.svg, what
`save_svg` writes): what the README shows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from somatize import Graph, Node, Recorder, Store
from somatize.record import timings


class Features(Node, nn.Module):
    """A fixed random projection and a small conv stack: frozen, so it may be cached."""

    def __init__(self, width: int = 32, seed: int = 0) -> None:
        nn.Module.__init__(self)
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(8, width)
        self.mix = nn.Sequential(
            nn.Conv1d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 1, 3, padding=1)
        )
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(width, 8, generator=g))
            self.proj.bias.zero_()
        self.calls = 0

    def forward(self, input: Any, ctx: Any) -> Any:
        self.calls += 1
        h = torch.relu(self.proj(input))
        return h + self.mix(h.unsqueeze(1)).squeeze(1)


class Normalise(Node):
    """Scales each row to unit length (no state)."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, input: Any, ctx: Any) -> Any:
        self.calls += 1
        return input / input.norm(dim=1, keepdim=True).clamp_min(1e-6)


class Head(Node, nn.Module):
    """A small read-out of one branch."""

    def __init__(self, width: int = 32, hidden: int = 16, out: int = 4) -> None:
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, out))

    def forward(self, input: Any, ctx: Any) -> Any:
        return self.net(input)


class Mix(Node):
    """Fan-in: the two heads' answers added."""

    def forward(self, input: Any, ctx: Any) -> Any:
        return input["left"] + input["right"]


def build(hidden: int = 16) -> Graph:
    """The demo graph: features >> normalise >> (left | right) >> mix, the features frozen
    (they stop asking for gradients), the rest as initialised."""
    from somatize.torch import freeze

    torch.manual_seed(0)
    g = Graph.somatize(
        Features().frozen().cached()
        >> Normalise().cached()
        >> (Head(hidden=hidden).named("left") | Head(hidden=hidden).named("right"))
        >> Mix()
    )
    freeze(g)
    return g


def data(seed: int = 2, batches: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A small task to learn: four classes by the sign of two sums of the input."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        x = torch.randn(32, 8, generator=g)
        y = (x[:, :4].sum(1) > 0).long() * 2 + (x[:, 4:].sum(1) > 0).long()
        out.append((x, y))
    return out


def accuracy(g: Graph, batches: list) -> float:
    """The share of the batches' samples the graph classifies right."""
    with torch.no_grad():
        right = sum(int((g.forward(x).argmax(1) == y).sum()) for x, y in batches)
    return right / sum(len(y) for _, y in batches)


def cached_runs(store: Store) -> None:
    """The main job: the graph run twice against a store, the second from the cache."""
    g = build()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    print(g.plan())
    print()
    rec = Recorder(store, run="demo")
    for k in (1, 2):
        said: list[dict] = []
        y = g.forward(x, store=store, watching=[rec, said.append])
        cache = {f["node"]: f["cache"] for f in said if f["fact"] == "ran" and "cache" in f}
        print(
            f"run {k}: output {tuple(y.shape)}, cached nodes: "
            + ", ".join(f"{n}={c}" for n, c in cache.items())
            + ("  -> all cache hits" if all(c == "hit" for c in cache.values()) else "")
        )
    rec.close()
    f, n = g.implementation("features"), g.implementation("normalise")
    print(f"features computed {f.calls} time(s), normalise {n.calls} time(s) over 2 runs")
    print()
    print(f"recorded timings (µs), store at {store.where}:")
    print(timings(store, "demo").to_string(index=False))


def figures() -> list[tuple[str, Any]]:
    """The three figures: the graph with insides, a live audit of a short fit, and four
    candidates compared (proxies before training, accuracy after)."""
    from somatize.figures import CompareTable, LiveAudit, compare
    from somatize.torch import Audit, Trainer, architecture, parameters

    train, test = data(2), data(3, batches=4)
    loss = nn.functional.cross_entropy
    g = build()
    drawn = g.figure(inside=architecture(g, train[0][0]))
    audit = LiveAudit(title="a short audited fit")
    adam = torch.optim.Adam(parameters(g), lr=3e-3)
    t = Trainer(g, objective=loss, optimizer=adam, auditing=Audit(every=1), watching=audit)
    t.fit(train, epochs=5)
    hidden = {f"hidden {h}": h for h in (2, 4, 16, 64)}
    measured = {}
    for name, h in hidden.items():
        c = build(hidden=h)
        adam = torch.optim.Adam(parameters(c), lr=1e-2)
        Trainer(c, objective=loss, optimizer=adam).fit(train, epochs=3)
        measured[name] = accuracy(c, test)
    candidates = {name: build(hidden=h) for name, h in hidden.items()}  # proxies: as initialised
    x, y = train[0]
    cells = compare(candidates, x, target=y, objective=loss, measured=measured)
    return [("graph", drawn), ("audit", audit), ("table", CompareTable(cells, measured="measured"))]


HEADINGS = {
    "graph": "The graph, with what each node is made of",
    "audit": "A live audit of a short fit",
    "table": "Four candidates compared",
}


def write_page(drawn: list[tuple[str, Any]], path: Path) -> None:
    """One page with the figures alive in it, drawn offline."""
    from somatize.figures._page import page

    states = [(kind, fig.state()) for kind, fig in drawn]
    text = page(
        states,
        title="somatize: the three figures",
        intro="Made by python -m somatize.demo. Hover, pan, zoom, sort, choose a metric: the "
        "figures work here without a kernel; opening a node needs one.",
        headings=[HEADINGS[kind] for kind, _ in drawn],
    )
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    """Run the demo and print what it shows."""
    parser = argparse.ArgumentParser(prog="python -m somatize.demo", description=__doc__)
    parser.add_argument("--store", help="a directory for the store (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=Path("demo.html"), help="the page to write")
    parser.add_argument("--pictures", type=Path, help="a folder to write each figure's picture to")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    torch.set_num_threads(1)  # tensors this small only wait on a second thread
    cached_runs(Store(args.store or tempfile.mkdtemp(prefix="somatize-demo-")))
    drawn = figures()
    write_page(drawn, args.out)
    print()
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB): the graph, the audit and "
        f"the table, which open offline; {time.perf_counter() - began:.1f} s in all"
    )
    if args.pictures:
        args.pictures.mkdir(parents=True, exist_ok=True)
        for kind, fig in drawn:
            fig.save_svg(args.pictures / f"{kind}.svg")
        print(f"pictures in {args.pictures}: " + ", ".join(f"{k}.svg" for k, _ in drawn))


if __name__ == "__main__":
    main()
