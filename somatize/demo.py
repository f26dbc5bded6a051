"""The main job, headless: declare a graph, run it twice against a store, show what happened.

    python -m somatize.demo [--store DIR]

The graph fans out into two branches and joins them. Its first two nodes are `.cached()`, so
the second run over the same input finds them in the store and does not compute them again;
the demo says so, prints the plan, and reads the recorded timings back as a table.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from torch import nn

from somatize import Graph, Node, Recorder, Store
from somatize.record import timings


class Features(Node, nn.Module):
    """A fixed random projection: stateless in effect, frozen, so it may be cached."""

    def __init__(self, width: int = 32, seed: int = 0) -> None:
        nn.Module.__init__(self)
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(8, width)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(width, 8, generator=g))
            self.proj.bias.zero_()
        self.calls = 0

    def forward(self, input: Any, ctx: Any) -> Any:
        self.calls += 1
        return torch.relu(self.proj(input))


class Normalise(Node):
    """Scales each row to unit length (no state)."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, input: Any, ctx: Any) -> Any:
        self.calls += 1
        return input / input.norm(dim=1, keepdim=True).clamp_min(1e-6)


class Head(Node, nn.Module):
    """A linear read-out of one branch."""

    def __init__(self, width: int = 32, out: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(width, out)

    def forward(self, input: Any, ctx: Any) -> Any:
        return self.lin(input)


class Mix(Node):
    """Fan-in: the two heads' answers added."""

    def forward(self, input: Any, ctx: Any) -> Any:
        return input["left"] + input["right"]


def build() -> Graph:
    """The demo graph: features >> normalise >> (left | right) >> mix."""
    torch.manual_seed(0)
    return Graph.somatize(
        Features().frozen().cached()
        >> Normalise().cached()
        >> (Head().named("left") | Head().named("right"))
        >> Mix()
    )


def main(argv: list[str] | None = None) -> None:
    """Run the demo and print what it shows."""
    parser = argparse.ArgumentParser(prog="python -m somatize.demo", description=__doc__)
    parser.add_argument("--store", help="a directory for the store (default: a temporary one)")
    args = parser.parse_args(argv)
    where = args.store or tempfile.mkdtemp(prefix="somatize-demo-")
    store = Store(where)
    g = build()
    from somatize.torch import freeze

    freeze(g)  # the .frozen() features stop asking for gradients
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    print(g.plan())
    print()
    rec = Recorder(store, run="demo")
    for k in (1, 2):
        said: list[dict] = []
        y = g.forward(x, store=store, watching=[rec, said.append])
        cache = {f["node"]: f["cache"] for f in said if f["fact"] == "ran" and "cache" in f}
        hits = [n for n, c in cache.items() if c == "hit"]
        print(
            f"run {k}: output {tuple(y.shape)}, cached nodes: "
            + ", ".join(f"{n}={c}" for n, c in cache.items())
            + ("  -> all cache hits" if len(hits) == len(cache) else "")
        )
    rec.close()
    f, n = g.implementation("features"), g.implementation("normalise")
    print(f"features computed {f.calls} time(s), normalise {n.calls} time(s) over 2 runs")
    print()
    print(f"recorded timings (µs), store at {where}:")
    print(timings(store, "demo").to_string(index=False))


if __name__ == "__main__":
    main()
