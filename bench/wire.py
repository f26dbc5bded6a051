"""The wire against a bare ZeroMQ socket pair, and a Split step across a worker against one here.

    .venv/bin/python bench/wire.py

1. Round trip of a 1 KB, 1 MB and 64 MB float32 tensor through a spawned worker (a graph of one
   node `.at("w")` that hands its input back: signed both ways, safetensors frames, rebuilt
   as tensors on both sides) against the same bytes echoed by a bare ZeroMQ ROUTER in another
   process over a DEALER (no signature, no tensor).
2. One `Trainer.step` with the middle node trained by `Split` on a worker against the same
   step with everything in this process.

Medians of repeats (worker and bare timed in turns), one torch thread on both sides;
throughput is payload bytes / round-trip time. Every process here (this one, the bare echo, the
worker) keeps large buffers for reuse (`somatize.remote.memory`); run with
``SOMATIZE_KEEP_BUFFERS=0`` to time all of them with glibc's default malloc instead.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import zmq

sys.path.insert(0, ".")

from somatize import Broker, Graph, Node, Worker  # noqa: E402
from somatize.remote.client import _zmq  # noqa: E402
from somatize.remote.memory import keep_buffers  # noqa: E402

ECHO = """
import sys, zmq
from somatize.remote.memory import keep_buffers
keep_buffers()  # the same C heap settings as a worker, so the comparison stays fair
s = zmq.Context().socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:*")
print(s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
while True:
    s.send_multipart(s.recv_multipart(copy=False), copy=False)
"""


class Echo(Node):
    """Hands its input back."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return x


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_medians(a, b, repeats: int) -> tuple[float, float]:
    """Medians of `a` and `b` timed in turns, so a load that comes and goes hits both alike."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def wire_rows() -> list[tuple]:
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    address = echo.stdout.readline().strip()
    # The same ZeroMQ context (and so the same I/O thread and C heap) as the broker's sockets.
    sock = _zmq().socket(zmq.DEALER)
    sock.connect(address)
    broker = Broker.embedded({"w": Worker.spawn(["--accept-code", "--threads", "1"])})
    g = Graph.somatize(Echo().at("w"))
    rows = []
    try:
        for label, size in (("1 KB", 1 << 10), ("1 MB", 1 << 20), ("64 MB", 64 << 20)):
            t = torch.randn(size // 4)
            raw = t.numpy()
            repeats = 400 if size < 1 << 21 else 15

            def bare(raw=raw, small=size < 1 << 16):
                sock.send_multipart([b"x", raw], copy=small)
                sock.recv_multipart(copy=False)

            def ours(t=t):
                g.forward(t, broker=broker)

            assert torch.equal(g.forward(t, broker=broker), t)
            b, o = paired_medians(bare, ours, repeats)
            rows.append((label, b * 1e3, o * 1e3, o / b, size / o / 1e9))
    finally:
        broker.close()
        sock.close(0)
        echo.kill()
    return rows


class Lin(Node, torch.nn.Module):
    """A linear layer that is a node."""

    def __init__(self, i: int, o: int) -> None:
        torch.nn.Module.__init__(self)
        self.lin = torch.nn.Linear(i, o)

    def forward(self, x: Any, ctx: Any) -> Any:
        return torch.relu(self.lin(x))


def split_step(broker: Broker | None, width: int, batch: int) -> float:
    from somatize.torch import Split, Trainer, parameters

    body = Lin(width, width).named("body")
    g = Graph.somatize(
        Lin(64, width).named("enc") >> (body.at("w") if broker else body) >> Lin(width, 10)
    )
    trains = {"body": Split(torch.optim.SGD, lr=0.01)}
    t = Trainer(
        g,
        objective=torch.nn.functional.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.01),
        trains=trains,
        broker=broker,
    )
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    return median_s(lambda: t.step((x, y)), 30)


def main() -> None:
    keep_buffers()  # before the first ZeroMQ context, as a client does
    torch.set_num_threads(1)
    print("| tensor | bare ZeroMQ (ms) | through a worker (ms) | ratio | GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for label, b, o, r, gbs in wire_rows():
        print(f"| {label} | {b:.3f} | {o:.3f} | {r:.2f}x | {gbs:.2f} |")
    print()
    broker = Broker.embedded({"w": Worker.spawn(["--accept-code", "--threads", "1"])})
    try:
        print("| Split step (batch, width) | in-process (ms) | across a worker (ms) | ratio |")
        print("| --- | --- | --- | --- |")
        for batch, width in ((32, 128), (256, 1024)):
            here = split_step(None, width, batch)
            there = split_step(broker, width, batch)
            print(
                f"| {batch}, {width} | {here * 1e3:.3f} | {there * 1e3:.3f} | {there / here:.2f}x |"
            )
    finally:
        broker.close()


if __name__ == "__main__":
    main()
