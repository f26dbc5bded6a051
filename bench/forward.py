"""Per-node cost of `Graph.forward`, next to a plain Python loop calling the same functions.

Chains of 1, 8, 32, 64 and 256 trivial nodes, and a 16-branch fan-out joined at the end.
Prints a markdown table: microseconds per node for the graph, for the bare loop, and the
difference (what the engine adds). Medians of repeats, one thread.

    python bench/forward.py [--results]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _results import report

from somatize import Graph, Node


class Inc(Node):
    """A trivial node: one addition."""

    def forward(self, input: Any, ctx: Any) -> Any:
        return input + 1


class Sum(Node):
    """Fan-in: the sum of what arrived."""

    def forward(self, input: Any, ctx: Any) -> Any:
        return sum(input.values())


def median_us(fn, loops: int, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter_ns() - t0) / loops / 1e3)
    return statistics.median(times)


def chain(n: int) -> tuple[str, int, Any, Any]:
    nodes = [Inc() for _ in range(n)]
    expr = nodes[0]
    for node in nodes[1:]:
        expr = expr >> node
    g = Graph.somatize(expr)
    fns = [node.forward for node in nodes]

    def plain() -> Any:
        x = 0
        for f in fns:
            x = f(x, None)
        return x

    assert g.forward(0) == plain() == n
    return f"chain of {n}", n, lambda: g.forward(0), plain


def fan(k: int) -> tuple[str, int, Any, Any]:
    src, branches, join = Inc(), [Inc() for _ in range(k)], Sum()
    group = branches[0]
    for b in branches[1:]:
        group = group | b
    g = Graph.somatize(src >> group >> join)
    names = g.predecessors(g.leaves()[0])
    bf = [b.forward for b in branches]

    def plain() -> Any:
        x = src.forward(0, None)
        return join.forward({n: f(x, None) for n, f in zip(names, bf, strict=True)}, None)

    assert g.forward(0) == plain()
    return f"fan-out of {k}", k + 2, lambda: g.forward(0), plain


def main() -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    cases = [chain(n) for n in (1, 8, 32, 64, 256)] + [fan(16)]
    rows = []
    for name, n, run, plain in cases:
        loops = max(20, 20000 // n)
        g_us = median_us(run, loops) / n
        p_us = median_us(plain, loops) / n
        rows.append([name, n, g_us, p_us, g_us - p_us])
    report(
        "forward",
        "the engine's cost per node, against a plain loop calling the same forwards",
        ["graph", "nodes", "forward µs/node", "plain loop µs/node", "engine adds µs/node"],
        rows,
        notes="Budget: at most 1 µs a node at 256 nodes.",
    )


if __name__ == "__main__":
    main()
