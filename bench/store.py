"""What keeping a value costs, against plain torch doing the same job in the same run.

    python bench/store.py             # the costs
    python bench/store.py --faults    # the fault trials of docs/store.md (a few minutes)

Rows: a tensor kept and recalled (Store.keep / recall, safetensors inside, every blob checked
against its digest) against torch.save / torch.load of the same tensor to a file; a small
record of facts; decoding many small tuples through the bounded decoder against msgpack with
an unbounded hook; and a Recorder watching a graph, against the same graph unwatched. Medians
of repeats, torch.set_num_threads(1). Ratios are ours / theirs. `--faults` runs the trials
of bench/_store_faults.py instead and reports them as a table of their own.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch
from _results import report

import somatize.torch  # noqa: F401  (the tensor codec)
from somatize import Graph, Node, Recorder, Store
from somatize.codecs import decode, encode


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


def tensor_rows(store: Store, root: Path, label: str, tensor: torch.Tensor) -> list[list[Any]]:
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
        [f"keep {label}", keep, "torch.save", save, keep / save],
        [f"recall {label}", recall, "torch.load", load, recall / load],
    ]


def _tuples(code: int, data: bytes) -> Any:
    return tuple(msgpack.unpackb(data, ext_hook=_tuples, raw=False, strict_map_key=False))


def costs() -> None:
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
    rows.append(["keep a record of 9 facts", keep, "torch.save", save, keep / save])

    data = encode([(i, float(i)) for i in range(1000)])
    ours = median_us(lambda: decode(data), 30, 5)
    bare = median_us(lambda: msgpack.unpackb(data, ext_hook=_tuples, raw=False), 30, 5)
    rows.append(["decode 1000 small tuples", ours, "msgpack, unbounded", bare, ours / bare])

    graph = Graph.somatize(Linear(64) >> Linear(64) >> Linear(64) >> Linear(64))
    x = torch.randn(32, 64)
    recorder = Recorder(store, run="bench")
    with torch.no_grad():
        watched = median_us(lambda: graph.forward(x, watching=recorder), 30, 10)
        plain = median_us(lambda: graph.forward(x), 30, 10)
    rows.append(
        ["forward of 4 nodes, recorded", watched, "unwatched forward", plain, watched / plain]
    )
    report(
        "store",
        "keeping and recalling values, against torch.save / torch.load in the same run",
        ["what", "ours µs", "against", "theirs µs", "ratio"],
        rows,
        notes=(
            "Big tensors pay for what the store promises: a sha256 of every blob on put and "
            "on get, and the copies safetensors and msgpack make. A Recorder writes two small "
            "files atomically per forward."
        ),
    )


if __name__ == "__main__":
    if "--faults" in sys.argv:
        from _store_faults import trials

        report(
            "store-faults",
            "attacks and faults tried on a store (python bench/store.py --faults)",
            ["attack or fault", "trials", "result"],
            trials(),
        )
    else:
        costs()
