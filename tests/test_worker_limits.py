"""A worker as a stranger finds it, and as a careless client leaves it: what it holds before a
message verifies, when it runs out of descriptors, how long a session lives, how it is
started and what it says when it cannot start. Real processes, 127.0.0.1 only."""

from __future__ import annotations

import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from somatize import Broker, Graph, Worker

NODES = "_remote_nodes"


def _by_hand(*args: str, token: str | None = None, **popen) -> subprocess.Popen:
    """`python -m somatize.worker --listen 127.0.0.1:0 *args` as a person starts it."""
    env = {k: v for k, v in os.environ.items() if k != "SOMATIZE_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if token:
        env["SOMATIZE_TOKEN"] = token
    command = [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, **popen)


def _memory(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of process `pid` from /proc (VmRSS: held now; VmHWM: the most held at
    once), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field}")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _zmtp(address: str) -> socket.socket:
    """A TCP connection that has said ZMTP 3.0's greeting and READY as a DEALER, by hand, and
    heard the worker's (what it sends next is a message, not a part of the handshake)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    s.sendall(greeting)
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    body = b"\x05READY" + prop
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    heard = b""
    while b"READY" not in heard:
        more = s.recv(1024)
        if not more:
            raise ConnectionResetError("the worker closed the connection in its handshake")
        heard += more
    return s


def _hello(worker: Worker) -> dict:
    b = Broker.embedded({"w": Worker.at(worker.address, token=worker.token)})
    try:
        return b.request("w", {"op": "hello"}, deadline=20)
    finally:
        b.close()


def test_strangers_cannot_make_a_worker_hold_memory_and_a_client_is_told_its_limit():
    worker = Worker.spawn(["--max-message", "16MiB", "--max-pending", "4"], send=[NODES])
    try:
        before = _memory(worker.pid)
        held = []
        for announced in [256 << 20] * 8 + [15 << 20] * 8:  # over the limit, then just under
            try:
                s = _zmtp(worker.address)
                s.sendall(b"\x02" + struct.pack(">Q", announced))  # a frame that never ends
                s.sendall(bytes(8 << 20))
                held.append(s)
            except OSError:  # cut before it finished sending: what should happen
                pass
        time.sleep(1.0)
        grown = _memory(worker.pid) - before
        assert grown < 64 << 20, f"the worker grew by {grown >> 20} MiB for strangers"
        from _remote_nodes import Plus

        b = Broker.embedded({"w": Worker.at(worker.address, token=worker.token)})
        g = Graph.somatize(Plus().at("w"))
        assert g.forward(torch.ones(1000), broker=b).shape == (1000,)  # a client is served
        with pytest.raises(ValueError, match="at most 16777216.*--max-message"):
            g.forward(torch.ones(5 << 20), broker=b)  # 20 MiB: refused before it is sent
        b.close()
        for s in held:
            s.close()
    finally:
        worker.stop()


@pytest.mark.parametrize(
    "size, strangers, each",
    [(4 << 20, 4, 1 << 30), (0, 2, 32 << 20)],  # frames of 4 MiB; empty frames (64 B each held)
    ids=["large-frames", "empty-frames"],
)
def test_strangers_sending_a_message_that_never_ends_are_cut_before_the_worker_holds_it(
    size: int, strangers: int, each: int
):
    worker = Worker.spawn(["--max-message", "16MiB", "--max-pending", "4"], send=[NODES])
    try:
        before = max(_memory(worker.pid), _memory(worker.pid, "VmHWM"))
        sent = [0] * strangers
        frames = _framed([bytes(size)] * max(1, (1 << 20) // (size + 9)), more=True)

        def stranger(i: int) -> None:  # frames under the limit, "more" set: never the last
            s = _zmtp(worker.address)
            try:
                while sent[i] < each:
                    s.sendall(frames)
                    sent[i] += len(frames)
            except OSError:  # cut: what should happen
                pass
            finally:
                s.close()

        threads = [threading.Thread(target=stranger, args=(i,)) for i in range(strangers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        grown = _memory(worker.pid, "VmHWM") - before
        assert grown < (16 << 20) + (256 << 20), f"the worker held {grown >> 20} MiB at most"
        assert max(sent) < each, f"strangers sent {[n >> 20 for n in sent]} MiB uncut"
        assert _hello(worker)["pid"] == worker.pid  # a client is still served
    finally:
        worker.stop()


def _framed(frames: list[bytes], more: bool = False) -> bytes:
    """`frames` as the bytes of one ZMTP message (its last frame's "more" set with `more`)."""
    said = []
    for i, frame in enumerate(frames):
        n = memoryview(frame).nbytes
        flags = 1 if more or i < len(frames) - 1 else 0
        size = struct.pack(">Q", n) if n > 255 else bytes([n])
        said += [bytes([flags | (2 if n > 255 else 0)]), size, frame]
    return b"".join(said)


def _say(s: socket.socket, frames: list[bytes], more: bool = False) -> None:
    """Send `frames` as one ZMTP message on `s` (`_framed`)."""
    s.sendall(_framed(frames, more))


def _heard(s: socket.socket) -> list[bytes]:
    """The next ZMTP message the worker sends on `s`."""

    def read(n: int) -> bytes:
        got = b""
        while len(got) < n:
            more = s.recv(n - len(got))
            if not more:
                raise ConnectionResetError("the worker closed the connection")
            got += more
        return got

    frames = []
    while True:
        flags = read(1)[0]
        size = struct.unpack(">Q", read(8))[0] if flags & 2 else read(1)[0]
        frames.append(read(size))
        if not flags & 1:
            return frames


def test_a_token_holders_message_past_the_limit_is_refused_and_one_that_never_ends_is_cut():
    from _remote_nodes import Sum

    from somatize.remote import seal, wire

    worker = Worker.spawn(["--max-message", "16MiB"], send=[NODES])
    try:
        b = Broker.embedded({"w": Worker.at(worker.address, token=worker.token)})
        g = Graph.somatize(Sum().at("w"))
        parts = {f"p{i}": torch.ones(1 << 20) for i in range(17)}  # 4 MiB frames, 68 MiB
        with pytest.raises(ValueError, match=r"messages of at most 67108864.*--max-message"):
            g.forward(parts, broker=b)  # refused before it is sent
        assert torch.equal(g.forward({"p": torch.ones(3)}, broker=b), torch.ones(3))
        b.close()
        # a token holder that does not ask first is told, and its message is not read
        s = _zmtp(worker.address)
        _say(s, [seal.SALT_ASK])
        _, salt, _ = _heard(s)
        sealer = seal.Seal(seal.derive(worker.token, salt))
        _say(s, sealer.seal(wire.encode({"op": "hello", "rid": 1})))  # proven: a client now
        assert wire.decode(sealer.open(_heard(s)))["ok"]
        _say(s, sealer.seal([*wire.encode({"op": "hello", "rid": 2}), *[bytes(8 << 20)] * 9]))
        answer = wire.decode(sealer.open(_heard(s)))
        assert not answer["ok"] and "at most 67108864" in answer["error"]["message"]
        # ... and one whose message never ends is cut before the worker holds it
        before = max(_memory(worker.pid), _memory(worker.pid, "VmHWM"))
        sent = 0
        try:
            _say(s, sealer.seal(wire.encode({"op": "hello", "rid": 3})), more=True)
            while sent < 1 << 30:
                _say(s, [bytes(4 << 20)] * 4, more=True)
                sent += 16 << 20
        except OSError:  # cut: what should happen
            pass
        finally:
            s.close()
        grown = _memory(worker.pid, "VmHWM") - before
        assert sent < 1 << 30, f"a token holder sent {sent >> 20} MiB uncut"
        assert grown < 320 << 20, f"the worker held {grown >> 20} MiB at most"
        assert _hello(worker)["pid"] == worker.pid  # a client is still served
    finally:
        worker.stop()


def test_ctrl_c_stops_a_worker_at_once_with_exit_code_0():
    for _ in range(5):
        process = _by_hand("--quiet", token="sigint-token", stderr=subprocess.DEVNULL)
        try:
            address = process.stdout.readline().split()[3].decode()
            assert _hello(Worker.at(address, token="sigint-token"))["pid"] == process.pid
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=10) == 0
        finally:
            process.kill()
            process.wait()


def test_a_worker_out_of_descriptors_stays_responsive_and_does_not_spin():
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    token = "fd-token"
    process = _by_hand(
        "--quiet", "--max-pending", "8", token=token, stderr=subprocess.DEVNULL, preexec_fn=limited
    )
    try:
        address = process.stdout.readline().split()[3].decode()
        worker = Worker.at(address, token=token)
        b = Broker.embedded({"w": worker})
        b.request("w", {"op": "hello"})  # a client connected before the flood
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        flood = []
        for _ in range(200):
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        time.sleep(1.5)
        began = _cpu(process.pid)
        time.sleep(2.0)
        assert _cpu(process.pid) - began < 0.2, "the worker spins on a full descriptor table"
        assert len(os.listdir(f"/proc/{process.pid}/fd")) <= 64
        assert b.request("w", {"op": "hello"}, deadline=10)["pid"] == process.pid
        for s in flood:
            s.close()
        b.close()
    finally:
        process.kill()
        process.wait()


def test_an_idle_session_and_a_vanished_client_are_forgotten():
    worker = Worker.spawn(["--session-timeout", "2"], send=[NODES])
    try:
        with open(f"/proc/{worker.pid}/cmdline", "rb") as f:
            assert worker.token.encode() not in f.read()  # the token never on a command line
        client = textwrap.dedent(
            f"""
            import sys, time
            from _remote_nodes import Lin
            from somatize import Broker, Graph, Worker
            import torch
            b = Broker.embedded({{"w": Worker.at({worker.address!r}, token={worker.token!r})}})
            Graph.somatize(Lin().at("w")).forward(torch.ones(4), broker=b)
            print("defined", flush=True)
            time.sleep(60)
            """
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        child = subprocess.Popen([sys.executable, "-c", client], env=env, stdout=subprocess.PIPE)
        assert child.stdout.readline().strip() == b"defined"
        assert _hello(worker)["sessions"] >= 1
        child.send_signal(signal.SIGKILL)  # no close: its session is left behind
        child.wait()
        ends = time.monotonic() + 20
        while _hello(worker)["sessions"] > 0 and time.monotonic() < ends:
            time.sleep(0.5)
        assert _hello(worker)["sessions"] == 0  # the killed client's, and each hello's own
    finally:
        worker.stop()


def test_the_worker_says_its_session_timeout_and_reads_its_token_from_a_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-a-file\n")
    process = _by_hand(
        "--token-file", str(path), "--session-timeout", "90", stderr=subprocess.PIPE, text=True
    )
    try:
        ready = process.stdout.readline().split()
        assert ready[:3] == ["somatize", "worker", "ready"] and ready[-2:] == [
            "session-timeout",
            "90",
        ]
        worker = Worker.at(ready[3], token="from-a-file")
        assert _hello(worker)["session_timeout"] == 90
        with pytest.raises(PermissionError, match="token does not match"):
            _hello(Worker.at(ready[3], token="from-the-command-line"))
    finally:
        process.terminate()
        said = process.communicate(timeout=10)[1]
    assert "sessions expire after 90 s" in said


def test_a_worker_given_the_whole_command_line_and_the_published_keywords():
    worker = Worker.spawn(
        [sys.executable, "-m", "somatize.worker", "--threads", "1"], mode="network", send=[NODES]
    )
    try:
        with open(f"/proc/{worker.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"--accept-code" in argv and b"--quiet" in argv
        assert _hello(worker)["accept_code"] is True
    finally:
        worker.stop()
    generic = Worker.generic(mode="project", send=[NODES], python=sys.executable, quiet=False)
    try:
        with open(f"/proc/{generic.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"--quiet" not in argv and b"--accept-code" not in argv
        assert _hello(generic)["imports"].keys() == {NODES}
        b = Broker.embedded({"w": generic})
        from _remote_nodes import Plus

        assert Graph.somatize(Plus(2.0).at("w")).forward(torch.ones(2), broker=b).tolist() == [3, 3]
        b.close()
    finally:
        generic.stop()


def test_a_worker_builds_a_node_from_positional_arguments_star_args_and_keywords():
    from _remote_nodes import Gathers, Keywords

    with Broker.embedded({"w": Worker.spawn(mode="project", send=[NODES])}) as b:
        g = Graph.somatize(Gathers(1.0, 2.0, 3.0, times=10.0).at("w"))
        assert g.forward(torch.zeros(2), broker=b).tolist() == [60.0, 60.0]
        g = Graph.somatize(Keywords(2.0, args=5.0, kw=1.0).at("w"))  # args= is a keyword here
        assert g.forward(torch.zeros(2), broker=b).tolist() == [12.0, 12.0]


def test_a_worker_that_exits_at_once_is_reported_at_once_with_what_it_said(tmp_path):
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2 .*--max-message") as failed:
        Worker.spawn(["--max-message", "lots"])
    assert time.monotonic() - began < 30  # not the minute a worker is given to get ready
    assert "a size in bytes" in str(failed.value)
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*--import: No module named"):
        Worker.spawn(send=["somatize_no_such_module"])
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*holds no secret"):
        Worker.spawn(["--token-file", str(empty)])


def test_the_token_is_the_command_lines_else_the_first_line_of_its_file_else_the_environments(
    tmp_path,
):
    path = tmp_path / "token"
    path.write_text("from-the-file\nnot this line\n")
    told = {"from-the-environment", "from-the-file", "not this line", "from-the-line"}
    for argv, meant in (
        ([], "from-the-environment"),
        (["--token-file", str(path)], "from-the-file"),
        (["--token", "from-the-line", "--token-file", str(path)], "from-the-line"),
    ):
        spawned = Worker.spawn(argv, token="from-the-environment")  # as $SOMATIZE_TOKEN
        try:
            assert _hello(Worker.at(spawned.address, token=meant))["pid"] == spawned.pid
            assert _hello(Worker.at(spawned.address, token=meant.encode()))["pid"] == spawned.pid
            for other in sorted(told - {meant}):
                with pytest.raises(PermissionError, match="token does not match"):
                    _hello(Worker.at(spawned.address, token=other))
        finally:
            spawned.stop()


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:99999", "127.0.0.1:abc", "127.0.0.1", "http://127.0.0.1:7000"]
)
def test_a_worker_told_to_listen_where_it_cannot_says_so_and_does_not_start(listen):
    env = {**os.environ, "SOMATIZE_TOKEN": "t", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "somatize.worker", "--listen", listen]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    # not another port than the one asked for (ZeroMQ takes 99999 as 99999 - 65536)
    assert done.returncode != 0 and "ready" not in done.stdout
    assert f"port a number from 0 (any free one) to 65535 (say 127.0.0.1:7000), not {listen!r}" in (
        done.stderr
    )
