"""The wire against a bare ZeroMQ pair, and a Split step across a worker against one here.

    python bench/wire.py [--results]

- Round trips of a 1 KB, 1 MB and 64 MB float32 tensor through a spawned worker (a graph of
  one node `.at("w")` that hands its input back: sealed both ways, a msgpack header and the
  tensor's own frame, rebuilt as a tensor on both sides) against the same bytes echoed by a
  bare ZeroMQ ROUTER in another process (no seal, no tensor).
- One `Trainer.step` with the middle node trained by `Split` on a worker, against the same
  step with everything in this process.
- The floor: what sealing every byte costs by itself: the bare pair against the same
  pair where each side also takes one Poly1305 pass over what it sends and one over what it
  receives (what the seal does), at 1 MB.

Medians of round trips timed in turns (so a load that comes and goes hits both alike), one
torch thread on both sides; GB/s is the tensor's bytes over the round trip's time, for
the bare pair and for the wire.
Budget (a ceiling): within 3x the bare pair at 1 MB, at least 1 GB/s at 64 MB.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import report  # noqa: E402

from somatize import Broker, Graph, Node, Worker  # noqa: E402

ECHO = """
import sys, zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305
mac = sys.argv[1] == "mac"
s = zmq.Context().socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:*")
print(s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
key = bytes(32)
while True:
    who, data = s.recv_multipart(copy=False)
    if mac:
        Poly1305.generate_tag(key, data.buffer)
        Poly1305.generate_tag(key, data.buffer)
    s.send_multipart([who, data], copy=False)
"""


class Echo(Node):
    """Hands its input back."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return x


class Lin(Node, torch.nn.Module):
    """A linear layer and a ReLU, as a node."""

    def __init__(self, i: int, o: int) -> None:
        torch.nn.Module.__init__(self)
        self.lin = torch.nn.Linear(i, o)

    def forward(self, x: Any, ctx: Any) -> Any:
        return torch.relu(self.lin(x))


def paired(a, b, repeats: int) -> tuple[float, float]:
    """Medians of `a` and `b` timed in turns."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def echo(mac: bool = False) -> tuple[subprocess.Popen, zmq.Socket]:
    process = subprocess.Popen(
        [sys.executable, "-c", ECHO, "mac" if mac else "bare"], stdout=subprocess.PIPE, text=True
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)  # an echo that stopped is an error, not a hang
    sock.connect(process.stdout.readline().strip())
    return process, sock


def round_trips(broker: Broker) -> list[tuple]:
    process, sock = echo()
    g = Graph.somatize(Echo().at("w"))
    rows = []
    try:
        for label, size in (("1 KB", 1 << 10), ("1 MB", 1 << 20), ("64 MB", 64 << 20)):
            t = torch.randn(size // 4)
            raw = t.numpy()

            def bare(raw=raw):
                sock.send(raw, copy=False)
                sock.recv(copy=False)

            def ours(t=t):
                g.forward(t, broker=broker)

            assert torch.equal(g.forward(t, broker=broker), t)
            b, o = paired(bare, ours, 300 if size < 1 << 21 else 15)
            rows.append(
                (f"round trip, {label}", b * 1e3, o * 1e3, o / b, size / b / 1e9, size / o / 1e9)
            )
    finally:
        sock.close(0)
        process.kill()
    return rows


def split_step(broker: Broker | None, width: int, batch: int) -> Any:
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
    return lambda: t.step((x, y))


def split_rows(broker: Broker) -> list[tuple]:
    rows = []
    for batch, width in ((32, 128), (256, 1024)):
        here, there = paired(split_step(None, width, batch), split_step(broker, width, batch), 40)
        rows.append((f"Split step, {batch}x{width}", here * 1e3, there * 1e3, there / here, "", ""))
    return rows


def floor_row() -> tuple:
    """The bare pair against the pair that takes one Poly1305 pass a side each way, 1 MB."""
    (bp, bare_sock), (mp, mac_sock) = echo(), echo(mac=True)
    key = bytes(32)
    raw = torch.randn(1 << 18).numpy()
    try:

        def bare():
            bare_sock.send(raw, copy=False)
            bare_sock.recv(copy=False)

        def macs():
            Poly1305.generate_tag(key, memoryview(raw).cast("B"))
            mac_sock.send(raw, copy=False)
            Poly1305.generate_tag(key, mac_sock.recv(copy=False).buffer)

        b, o = paired(bare, macs, 300)
    finally:
        for sock, process in ((bare_sock, bp), (mac_sock, mp)):
            sock.close(0)
            process.kill()
    return (
        "floor: bare + a MAC pass a side, 1 MB",
        b * 1e3,
        o * 1e3,
        o / b,
        (1 << 20) / b / 1e9,
        (1 << 20) / o / 1e9,
    )


def main() -> None:
    torch.set_num_threads(1)
    broker = Broker.embedded({"w": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        rows = round_trips(broker) + split_rows(broker)
    finally:
        broker.close()
    rows.append(floor_row())
    report(
        "wire",
        "the wire against a bare ZeroMQ pair, and a Split step across a worker against one here",
        ["what", "plain (ms)", "somatize (ms)", "ratio", "plain GB/s", "somatize GB/s"],
        rows,
        notes="Budget (a ceiling): round trip within 3x the bare pair at 1 MB; at least 1 GB/s "
        "at 64 MB. GB/s is the tensor's bytes over a round trip (it crosses twice): where the "
        "bare pair itself stays under 1 GB/s, the machine's loopback is what holds both back, "
        "and the ratio says what the wire adds.",
    )


if __name__ == "__main__":
    main()
