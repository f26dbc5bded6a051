"""Attacks and faults against real workers on 127.0.0.1, many times each: the table in
docs/remote.md ("What it survives").

    python bench/remote_trials.py [--results]

Each row says what was done, how many times, and what came of it, measured here: a worker
that kept answering, what it held in memory, what ran. Not a benchmark of speed.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests"), os.path.dirname(HERE)]

from _remote_nodes import Lin  # noqa: E402
from _results import report  # noqa: E402
from test_worker_limits import _cpu as cpu  # noqa: E402
from test_worker_limits import _rss as rss  # noqa: E402
from test_worker_limits import _zmtp as zmtp  # noqa: E402

from somatize import Broker, Graph, Worker  # noqa: E402
from somatize.remote import StateLost, WorkerLost, seal, wire  # noqa: E402
from somatize.torch import OutOfStep, Split, Trainer, parameters  # noqa: E402

NODES = "_remote_nodes"


def hello(worker: Worker) -> dict:
    with Broker.embedded({"w": Worker.at(worker.address, token=worker.token)}) as b:
        return b.request("w", {"op": "hello"}, deadline=30)


class Raw:
    """A DEALER that speaks to a worker by hand, as someone who knows the protocol would."""

    def __init__(self, worker: Worker, token: str | None = None) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(worker.address)
        if token:
            self.sock.send(seal.SALT_ASK)
            while not seal.is_frame((got := self.sock.recv_multipart())[0], seal.SALT):
                pass
            self.seal = seal.Seal(seal.derive(token, got[1]))
            self.sock.send_multipart(self.seal.seal(wire.encode({"op": "hello", "rid": 0})))
            assert self.answer() == "ok"  # a client now: bad messages do not cut it

    def answer(self) -> str:
        frames = self.sock.recv_multipart()
        if seal.is_frame(frames[0], seal.REFUSED):
            return "refused " + frames[2].decode()
        reply = wire.decode(self.seal.open(frames))
        return "ok" if reply["ok"] else "error " + reply["error"]["qualname"]


def noise(worker: Worker, n: int) -> str:
    raw = Raw(worker)
    rng = random.Random(0)
    before = rss(worker.pid)
    for _ in range(n):
        raw.sock.send_multipart(
            [rng.randbytes(rng.randrange(100)) for _ in range(rng.randrange(1, 5))]
        )
    time.sleep(2)
    alive = hello(worker)["pid"] == worker.pid
    return f"refused unread; answers: {alive}; {(rss(worker.pid) - before) >> 20} MiB more held"


def tampered(worker: Worker, n: int) -> str:
    raw = Raw(worker, worker.token)
    rng = random.Random(1)
    said = set()
    for _ in range(n):
        frames = [
            bytearray(memoryview(f))
            for f in raw.seal.seal(wire.encode({"op": "hello", "rid": 1, "x": torch.ones(64)}))
        ]
        k = rng.randrange(len(frames))
        if rng.random() < 0.5 and len(frames[k]):
            frames[k][rng.randrange(len(frames[k]))] ^= 1 << rng.randrange(8)
        else:
            frames[k] = frames[k][: rng.randrange(len(frames[k]))] if frames[k] else b"x"
        raw.sock.send_multipart([bytes(f) for f in frames])
        said.add(raw.answer())
    return " / ".join(sorted(said))


def sealed_nonsense(worker: Worker, n: int) -> str:
    raw = Raw(worker, worker.token)
    rng = random.Random(2)
    said = set()
    deep: tuple | None = None
    for _ in range(195):
        deep = (deep,)
    for i in range(n):
        header = wire.encode(deep)[0] if i % 10 == 0 else rng.randbytes(rng.randrange(1, 200))
        raw.sock.send_multipart(raw.seal.seal([header]))
        said.add(raw.answer())
    return " / ".join(sorted(said)) + "; alive"


def replays(worker: Worker, n: int) -> str:
    raw = Raw(worker, worker.token)
    define = {"key": "k", "id": "lin", "module": NODES, "qualname": "Lin", "args": {"i": 4, "o": 4}}
    raw.sock.send_multipart(
        raw.seal.seal(wire.encode({"op": "define", "rid": 0, "session": "s", "define": [define]}))
    )
    assert raw.answer() == "ok"
    ran = 0
    for i in range(n):
        stage = {
            "op": "load",
            "rid": i,
            "session": "s",
            "phase": "stage",
            "load": f"l{i}",
            "key": "k",
            "state": {"lin.bias": torch.full((4,), float(i))},
        }
        message = raw.seal.seal(wire.encode(stage))
        raw.sock.send_multipart(message)
        ran += raw.answer() == "ok"
        raw.sock.send_multipart(message)  # captured, sent again
        ran += raw.answer() == "ok"
    late = seal.Seal(raw.seal.key, offset=-2 * seal.WINDOW)
    stale = set()
    for _ in range(n):
        raw.sock.send_multipart(late.seal(wire.encode({"op": "hello", "rid": 0})))
        stale.add(raw.answer())
    return (
        f"{ran} of {2 * n} ran (each once); sealed {2 * seal.WINDOW:.0f} s ago: {' / '.join(stale)}"
    )


def not_allowed(worker: Worker, n: int, tmp: str) -> str:
    raw = Raw(worker, worker.token)
    names = [
        ("os", "system"),
        ("torch", "save"),
        ("json", "JSONDecoder"),
        ("somatize_nowhere", "X"),
        ("somatize.torch.training.learning", "Split"),
    ]
    said = set()
    for i in range(n):
        module, qualname = names[i % len(names)]
        args = (
            {"optimizer": wire.Named("torch.serialization", "save"), "f": tmp}
            if qualname == "Split"
            else {}
        )
        d = {"key": "k", "id": "x", "module": module, "qualname": qualname, "args": args}
        raw.sock.send_multipart(
            raw.seal.seal(wire.encode({"op": "define", "rid": i, "session": "s", "define": [d]}))
        )
        said.add(raw.answer())
    return f"{' / '.join(sorted(said))}; nothing imported or written: {not os.path.exists(tmp)}"


def unfinished(n: int) -> str:
    worker = Worker.spawn(["--max-message", "64MiB", "--max-pending", "8"])
    try:
        before = rss(worker.pid)
        said = []
        for announced, sent in ((256 << 20, 32 << 20), (60 << 20, 16 << 20)):
            held = []
            for _ in range(n):
                try:
                    s = zmtp(worker.address)
                    s.sendall(b"\x02" + struct.pack(">Q", announced) + bytes(sent))
                    held.append(s)
                except OSError:
                    pass
            time.sleep(1)
            at_once = (rss(worker.pid) - before) >> 20
            time.sleep(11)
            later = (rss(worker.pid) - before) >> 20
            said.append(f"{announced >> 20} MiB frames: +{at_once} MiB, +{later} MiB 12 s later")
            for s in held:
                s.close()
        alive = hello(worker)["pid"] == worker.pid
        return "; ".join(said) + f"; answers: {alive}"
    finally:
        worker.stop()


def descriptors(n: int) -> str:
    env = {**os.environ, "SOMATIZE_TOKEN": "t", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0", "--quiet"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)),
    )  # fmt: skip
    try:
        address = process.stdout.readline().split()[3].decode()
        worker = Worker.at(address, token="t")
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        flood = []
        for _ in range(n):
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                pass
        time.sleep(1.5)
        began = cpu(process.pid)
        time.sleep(3)
        used = (cpu(process.pid) - began) / 3
        alive = hello(worker)["pid"] == process.pid
        for s in flood:
            s.close()
        return f"{len(flood)} connected; {used:.0%} of a core while flooded; answers: {alive}"
    finally:
        process.kill()
        process.wait()


def killed_clients(n: int) -> str:
    worker = Worker.spawn(["--session-timeout", "600"], send=[NODES])
    try:
        script = textwrap.dedent(
            f"""
            import time, torch
            from _remote_nodes import Lin
            from somatize import Broker, Graph, Worker
            b = Broker.embedded({{"w": Worker.at({worker.address!r}, token={worker.token!r})}})
            Graph.somatize(Lin(256, 256).at("w")).forward(torch.ones(256), broker=b)
            print("ready", flush=True)
            time.sleep(600)
            """
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        clients = [
            subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE)
            for _ in range(n)
        ]
        for c in clients:
            c.stdout.readline()
        peak = hello(worker)["sessions"]
        for c in clients:
            c.send_signal(signal.SIGKILL)
            c.wait()
        began = time.monotonic()
        while hello(worker)["sessions"] and time.monotonic() - began < 60:
            time.sleep(0.5)
        return f"{peak} sessions, all forgotten {time.monotonic() - began:.0f} s after the kills"
    finally:
        worker.stop()


def killed_mid_request(n: int) -> str:
    waits = []
    for _ in range(n):
        worker = Worker.spawn(send=[NODES])
        b = Broker.embedded({"w": Worker.at(worker.address, token=worker.token)})
        g = Graph.somatize(Lin().at("w"))
        g.forward(torch.ones(4), broker=b)
        from _remote_nodes import Sleeps

        slow = Graph.somatize(Sleeps().at("w"))
        import threading

        threading.Timer(0.5, worker.stop).start()
        began = time.monotonic()
        try:
            slow.forward(30.0, broker=b)
        except WorkerLost:
            waits.append(time.monotonic() - began - 0.5)
        b.close()
    return f"WorkerLost {len(waits)} of {n}, at most {max(waits):.1f} s after the kill"


def restarts(n: int) -> str:
    from test_remote import Standing, _again, _batches

    standing = Standing()
    standing.start()
    outcomes = {"StateLost": 0, "stale step": 0}
    try:
        for _ in range(n):
            broker = Broker.embedded({"gpu": standing.worker()})
            torch.manual_seed(0)
            g = Graph.somatize(
                Lin(4, 8).named("enc") >> Lin(8, 8).named("body").at("gpu") >> Lin(8, 2)
            )
            trains = {"body": Split(torch.optim.SGD, lr=0.1)}
            t = Trainer(
                g,
                objective=torch.nn.functional.mse_loss,
                trains=trains,
                broker=broker,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            )
            for batch in _batches(3):
                t.step(batch)
            standing.restart()
            try:
                _again(lambda t=t: t.step(_batches(1)[0]))
                outcomes["stale step"] += 1
            except (StateLost, OutOfStep):
                try:
                    t.export()
                    outcomes["stale step"] += 1
                except StateLost:
                    outcomes["StateLost"] += 1
            broker.close()
    finally:
        standing.stop()
    return ", ".join(f"{k} {v}" for k, v in outcomes.items())


def main() -> None:
    torch.set_num_threads(1)
    worker = Worker.spawn(send=[NODES])
    rows = []
    try:
        rows.append(
            (
                "random frames from a stranger (1-4 frames, 0-99 bytes)",
                20_000,
                noise(worker, 20_000),
            )
        )
        rows.append(
            ("a sealed message with a bit flipped or cut short", 2_000, tampered(worker, 2_000))
        )
        rows.append(
            (
                "sealed nonsense, every tenth tuples nested 195 deep",
                2_000,
                sealed_nonsense(worker, 2_000),
            )
        )
        rows.append(
            ("a captured load sent again; a message sealed too long ago", 200, replays(worker, 200))
        )
        rows.append(
            (
                "definitions naming os.system, torch.save, an unimported module",
                500,
                not_allowed(worker, 500, os.path.join(HERE, ".written-by-a-worker")),
            )
        )
    finally:
        worker.stop()
    rows.append(
        ("strangers sending frames that never end (limit 64 MiB, 8 pending)", 16, unfinished(16))
    )
    rows.append(("200 connections to a worker limited to 64 descriptors", 200, descriptors(200)))
    rows.append(("clients killed without close (session timeout 600 s)", 30, killed_clients(30)))
    rows.append(("the worker killed mid-request", 10, killed_mid_request(10)))
    rows.append(("the worker restarted mid-training (Split)", 10, restarts(10)))
    report(
        "remote-trials",
        "attacks and faults against workers on 127.0.0.1",
        ["attack or fault", "trials", "result"],
        rows,
    )


if __name__ == "__main__":
    main()
