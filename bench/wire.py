"""The wire against a bare ZeroMQ socket pair, and a Split step across a worker against one here.

    .venv/bin/python bench/wire.py           # sections 1 and 2
    .venv/bin/python bench/wire.py --floor   # and 3

1. Round trip of a 1 KB, 1 MB and 64 MB float32 tensor through a spawned worker (a graph of one
   node `.at("w")` that hands its input back: signed both ways, safetensors frames, rebuilt
   as tensors on both sides) against the same bytes echoed by a bare ZeroMQ ROUTER in another
   process over a DEALER (no signature, no tensor).
2. One `Trainer.step` with the middle node trained by `Split` on a worker against the same
   step with everything in this process.
3. With ``--floor``: what authenticating every byte costs by itself, with no somatize code on
   the way. The bare pair against the same pair where each side also takes one MAC pass over
   what it sends and one over what it receives (keyed BLAKE2b for 1 KB, AES-GCM's GMAC for
   1 MB: the cheapest the wire uses at each size), each echo in its own process, timed in
   blocks of round trips that take turns (a MAC pass slows the bare round trip right after
   it). A ratio here is the least any authenticated wire can show on this machine.

Medians of repeats (worker and bare timed in turns), one torch thread on both sides;
throughput is payload bytes / round-trip time. Every process here (this one, the bare echo, the
worker) keeps large buffers for reuse (`somatize.remote.memory`); run with
``SOMATIZE_KEEP_BUFFERS=0`` to time all of them with glibc's default malloc instead.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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


_FLOOR_KEY = bytes(range(16))
_FLOOR_GMAC = AESGCM(_FLOOR_KEY)


def floor_tag(nonce: bytes, data: Any) -> bytes:
    """Section 3's tag, the same in both processes: keyed BLAKE2b under 64 KB, GMAC (AES-GCM
    with nothing to encrypt) from there, where the wire makes the same choice."""
    if len(data) < 65536:
        return hashlib.blake2b(nonce + data, key=_FLOOR_KEY, digest_size=16).digest()
    return _FLOOR_GMAC.encrypt(nonce, b"", data)


SIGNED = """
import hmac, os, sys, zmq
sys.path.insert(0, sys.argv[1])
from wire import floor_tag as tag  # this file's, so both sides sign alike
from somatize.remote.memory import keep_buffers
keep_buffers()
s = zmq.Context().socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:*")
print(s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
while True:
    who, nonce, data, got = s.recv_multipart(copy=False)
    data = data.buffer if len(data) >= 65536 else data.bytes
    if not hmac.compare_digest(tag(nonce.bytes, data), got.bytes):
        raise SystemExit("a tag did not verify")
    n = os.urandom(12)
    s.send_multipart([who, n, data, tag(n, data)], copy=False)
"""


def floor_rows(blocks: int = 40, block: int = 20) -> list[tuple]:
    """Section 3: the bare pair against the pair with one MAC pass a side each way."""
    here = os.path.dirname(os.path.abspath(__file__))
    echoes = [
        subprocess.Popen([sys.executable, "-c", code, here], stdout=subprocess.PIPE, text=True)
        for code in (ECHO, SIGNED)
    ]
    socks = []
    for echo in echoes:
        sock = _zmq().socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)  # an echo that stopped is an error, not a hang
        sock.connect(echo.stdout.readline().strip())
        socks.append(sock)
    bare_sock, signed_sock = socks
    rows = []
    try:
        for label, size in (("1 KB", 1 << 10), ("1 MB", 1 << 20)):
            raw = torch.randn(size // 4).numpy()
            small = size < 1 << 16
            data = raw.tobytes() if small else memoryview(raw).cast("B")

            def bare(raw=raw, small=small):
                bare_sock.send_multipart([b"x", raw], copy=small)
                bare_sock.recv_multipart(copy=False)

            def signed(data=data, small=small):
                n = os.urandom(12)
                signed_sock.send_multipart([n, data, floor_tag(n, data)], copy=small)
                back, got, t = signed_sock.recv_multipart(copy=False)
                got = got.bytes if small else got.buffer
                if not hmac.compare_digest(floor_tag(back.bytes, got), t.bytes):
                    raise RuntimeError("a tag did not verify")

            times: dict[Any, list[float]] = {bare: [], signed: []}
            for _ in range(blocks):
                for fn, kept in times.items():
                    for k in range(block):
                        t0 = time.perf_counter()
                        fn()
                        if k >= block // 4:  # the first of a block still feels the other
                            kept.append(time.perf_counter() - t0)
            b, o = statistics.median(times[bare]), statistics.median(times[signed])
            rows.append((label, b * 1e3, o * 1e3, o / b))
    finally:
        for sock in socks:
            sock.close(0)
        for echo in echoes:
            echo.kill()
    return rows


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
    if "--floor" in sys.argv[1:]:
        print()
        print("| tensor | bare ZeroMQ (ms) | bare + one MAC pass a side, each way (ms) | ratio |")
        print("| --- | --- | --- | --- |")
        for label, b, o, r in floor_rows():
            print(f"| {label} | {b:.3f} | {o:.3f} | {r:.2f}x |")


if __name__ == "__main__":
    main()
