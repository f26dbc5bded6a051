"""What keeping a value costs, against plain torch doing the same job in the same run.

    python bench/store.py             # the costs
    python bench/store.py --faults    # the fault trials of docs/store.md (a few minutes)

Rows: a tensor kept and recalled (Store.keep / recall, safetensors inside, every blob checked
against its digest) against torch.save / torch.load of the same tensor to a file; a small
record of facts; decoding many small tuples through the bounded decoder against msgpack with
an unbounded hook; and a Recorder watching a graph, against the same graph unwatched. Medians
of repeats, ours and theirs timed in turns, torch.set_num_threads(1). Ratios are ours /
theirs. `--faults` runs the trials
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


def paired_us(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int = 30, inner: int = 1
) -> tuple[float, float]:
    """Medians of `ours` and `theirs` in µs, timed in turns so that a busy machine slows
    both alike."""
    ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, into in ((ours, times[0]), (theirs, times[1])):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            into.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def row(what: str, against: str, ours: Callable[[], Any], theirs: Callable[[], Any], inner=1):
    mine, other = paired_us(ours, theirs, 30, inner)
    return [what, mine, against, other, mine / other]


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

    store.keep("t/x", tensor)
    return [
        row(f"keep {label}", "torch.save", keep_fresh, lambda: torch.save(tensor, path)),
        row(f"recall {label}", "torch.load", lambda: store.recall("t/x"), lambda: torch.load(path)),
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
    rows.append(
        row(
            "keep a record of 9 facts",
            "torch.save",
            lambda: store.keep(f"r/{next(counter)}", facts),
            lambda: torch.save(facts, root / "facts.pt"),
            inner=10,
        )
    )
    data = encode([(i, float(i)) for i in range(1000)])
    rows.append(
        row(
            "decode 1000 small tuples",
            "msgpack, unbounded",
            lambda: decode(data),
            lambda: msgpack.unpackb(data, ext_hook=_tuples, raw=False),
            inner=5,
        )
    )
    graph = Graph.somatize(Linear(64) >> Linear(64) >> Linear(64) >> Linear(64))
    x = torch.randn(32, 64)
    recorder = Recorder(store, run="bench")
    with torch.no_grad():
        rows.append(
            row(
                "forward of 4 nodes, recorded",
                "unwatched forward",
                lambda: graph.forward(x, watching=recorder),
                lambda: graph.forward(x),
                inner=10,
            )
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
