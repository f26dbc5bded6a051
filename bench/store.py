"""What keeping a value costs, against plain torch doing the same job in the same run.

    python bench/store.py

Rows: a tensor kept and recalled (Store.keep / recall, safetensors inside, every blob checked
against its digest) against torch.save / torch.load of the same tensor to a file; a small
record of facts; and a Recorder watching a graph, against the same graph unwatched. Medians
of repeats, torch.set_num_threads(1). Ratios are ours / plain torch.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import somatize.torch  # noqa: F401  (the tensor codec)
from somatize import Graph, Node, Recorder, Store


def median_us(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(times)


class Linear(Node):
    def __init__(self, n: int) -> None:
        self.layer = torch.nn.Linear(n, n)

    def forward(self, input: Any, ctx: Any) -> Any:
        return self.layer(input)


def tensor_rows(
    store: Store, root: Path, label: str, tensor: torch.Tensor
) -> list[tuple[str, float, str, float]]:
    path = root / "plain.pt"
    counter = iter(range(10**9))

    def keep_fresh() -> None:
        i = next(counter)
        tensor[0] = i  # new bytes every time: a real write, not a deduplicated one
        store.keep(f"t/{i}", tensor)

    keep = median_us(keep_fresh, 30)
    save = median_us(lambda: torch.save(tensor, path), 30)
    store.keep("t/x", tensor)
    recall = median_us(lambda: store.recall("t/x"), 30)
    load = median_us(lambda: torch.load(path), 30)
    return [
        (f"keep {label}", keep, "torch.save", save),
        (f"recall {label}", recall, "torch.load", load),
    ]


def main() -> None:
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    store = Store(root / "store")
    rows = []
    for label, shape in [("tensor 1 KiB", (256,)), ("tensor 4 MiB", (1024, 1024))]:
        rows.extend(tensor_rows(store, root, label, torch.randn(shape)))

    facts = [
        {"fact": "ran", "node": f"n{i}", "began_us": 1.0 * i, "took_us": 2.5} for i in range(8)
    ]
    facts.append({"fact": "finished", "took_us": 30.0})
    counter = iter(range(10**9))
    keep = median_us(lambda: store.keep(f"r/{next(counter)}", facts), 30, 10)
    save = median_us(lambda: torch.save(facts, root / "facts.pt"), 30, 10)
    rows.append(("keep a record of 9 facts", keep, "torch.save", save))

    graph = Graph.somatize(Linear(64) >> Linear(64) >> Linear(64) >> Linear(64))
    x = torch.randn(32, 64)
    recorder = Recorder(store, run="bench")
    with torch.no_grad():
        watched = median_us(lambda: graph.forward(x, watching=recorder), 30, 10)
        plain = median_us(lambda: graph.forward(x), 30, 10)
    rows.append(("forward of 4 nodes, recorded", watched, "unwatched forward", plain))

    print(f"{'what':<32} {'ours µs':>10} {'against':<20} {'theirs µs':>10} {'ratio':>7}")
    for what, ours, against, theirs in rows:
        print(f"{what:<32} {ours:>10.1f} {against:<20} {theirs:>10.1f} {ours / theirs:>7.2f}")


if __name__ == "__main__":
    main()
