"""Workers in real processes on 127.0.0.1: forward across them, tokens, failures, no orphans."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from somatize import Broker, Graph, Node, Worker
from somatize.remote import WorkerLost, wire


class Lin(Node, nn.Module):
    """A linear layer that is a node."""

    def __init__(self, i: int = 4, o: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, x: Any, ctx: Any) -> Any:
        return self.lin(x)


class Plus(Node):
    """Adds a constant; says where it ran."""

    def __init__(self, k: float = 1.0) -> None:
        self.k = k

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + self.k


class Sum(Node):
    """Sums what its predecessors produced."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return sum(x.values())


class Pid(Node):
    """The process it runs in, beside what it was given."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return (os.getpid(), x)


class Fails(Node):
    """Raises a KeyError naming what it was given."""

    def forward(self, x: Any, ctx: Any) -> Any:
        raise KeyError(f"no such thing as {x!r}")


class Sleeps(Node):
    """Sleeps for as long as it is told."""

    def forward(self, x: Any, ctx: Any) -> Any:
        time.sleep(x)
        return x


def _tenfold(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: counts its calls and hands back the output ten times over."""
    module.fired += 1
    return output * 10


class Hooked(Node, nn.Module):
    """A module node that registers a forward hook on itself wherever it is built."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.fired = 0
        self.register_forward_hook(_tenfold)

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + 1


@pytest.fixture(scope="module")
def two():
    a, b = Worker.spawn(["--threads", "1"]), Worker.spawn(["--threads", "1"])
    broker = Broker.embedded({"a": a, "b": b})
    yield broker
    broker.close()


def local(g: Graph, x: Any) -> Any:
    """What the graph computes with every node run here, in plan order."""
    vals: dict[str, Any] = {}
    for n in g.topological_sort():
        preds = g.predecessors(n)
        arg = x if not preds else vals[preds[0]] if len(preds) == 1 else {p: vals[p] for p in preds}
        vals[n] = g.implementation(n).forward(arg, None)
    leaves = g.leaves()
    return vals[leaves[0]] if len(leaves) == 1 else {n: vals[n] for n in leaves}


def hello(broker: Broker, host: str) -> dict:
    return broker.request(host, {"op": "hello"})


def test_forward_across_two_workers_equals_running_here(two):
    g = Graph.somatize(
        Lin(4, 8).named("enc")
        >> (Lin(8, 8).named("a1") >> Plus(1.0).named("a2")).at("a")
        >> (Lin(8, 8).named("left").at("b") | Plus(2.0).named("right"))
        >> (Sum().named("join") >> Lin(8, 3).named("head")).at("b")
    )
    x = torch.randn(5, 4)
    facts: list[dict] = []
    with torch.no_grad():
        y = g.forward(x, broker=two, watching=facts.append)
        want = local(g, x)
    assert torch.allclose(y, want, atol=1e-6)
    ran = [f["node"] for f in facts if f["fact"] == "ran"]
    assert ran == g.topological_sort()
    assert facts[-1]["fact"] == "finished" and len(facts) == len(g) + 1
    assert all(f["took_us"] >= 0 for f in facts)


def test_nodes_run_in_the_worker_process_and_a_slice_is_one_round_trip(two):
    g = Graph.somatize(Plus(1.0) >> (Plus(1.0) >> Plus(1.0) >> Plus(1.0) >> Pid()).at("a"))
    pid, value = g.forward(1.0, broker=two)
    assert value == 5.0 and pid == two.workers["a"].pid != os.getpid()
    before = hello(two, "a")["served"]
    g.forward(1.0, broker=two)
    assert hello(two, "a")["served"] - before == 2  # the forward, and this hello


def test_a_repeated_forward_sends_its_slice_once_then_only_its_id(two, monkeypatch):
    g = Graph.somatize(Plus(1.0) >> (Plus(2.0) >> Plus(3.0)).at("a") >> Plus(4.0))
    sent: list[dict] = []
    pack = wire.pack

    def watched(token, message, **kw):
        if isinstance(message, dict) and message.get("op") == "run":
            sent.append(message)
        return pack(token, message, **kw)

    monkeypatch.setattr(wire, "pack", watched)
    run_record = wire.run_record

    def watched_record(token, rid, session, sid, given, input):
        frames = run_record(token, rid, session, sid, given, input)
        if frames is not None:  # else it goes through wire.pack, watched there
            sent.append(
                {"op": "run", "define": [], "sid": sid, "slice": None, "given": given}
                | {"input": input, "timed": False, "session": session, "rid": rid}
            )
        return frames

    monkeypatch.setattr(wire, "run_record", watched_record)
    assert [g.forward(float(i), broker=two) for i in range(3)] == [10.0, 11.0, 12.0]
    assert [m["slice"] is None for m in sent] == [False, True, True]
    assert not any(m["timed"] for m in sent)  # nobody watches: no per-node times asked for
    assert len({m["sid"] for m in sent}) == 1 and all(not m["define"] for m in sent[1:])
    other = Graph.somatize((Plus(5.0) >> Plus(6.0)).at("a"))  # another slice, its own id
    assert other.forward(0.0, broker=two) == 11.0 and sent[-1]["slice"] is not None
    assert sent[-1]["sid"] != sent[0]["sid"]
    assert g.forward(0.0, broker=two) == 10.0 and sent[-1]["slice"] is None


def test_a_forward_hook_on_a_module_node_fires_on_its_worker(two):
    g = Graph.somatize(Plus(1.0) >> (Hooked().named("hooked") >> Pid()).at("a"))
    pid, y = g.forward(torch.tensor(1.0), broker=two)
    assert pid == two.workers["a"].pid != os.getpid()
    assert y.item() == 30.0  # ((1 + 1) + 1) * 10: the hook ran on the worker's copy
    pid, y = g.forward(torch.tensor(2.0), broker=two)  # the slice as compiled there, by id
    assert y.item() == 40.0
    assert g.implementation("hooked").fired == 0  # the copy here never ran


def test_a_node_sent_again_is_the_one_a_slice_runs_not_the_copy_compiled_before():
    from somatize.remote.server import Server, Unknown

    server = Server("token")

    def plus(k: float) -> dict:
        cls = Plus
        return {
            "key": "k",
            "id": "p",
            "module": cls.__module__,
            "qualname": cls.__qualname__,
            "args": {"k": k},
            "state": None,
            "device": None,
            "pickled": None,
        }

    described = [[0, "k", "p", 0, None, None, "a", False, True]]
    run = {"op": "run", "session": "s", "sid": "x", "given": {}, "input": 1.0, "timed": True}
    got = server.answer({**run, "define": [plus(1.0)], "slice": described})
    assert got["out"] == {0: 2.0} and [r[0] for r in got["ran"]] == ["p"]
    assert server.answer({**run, "define": [], "slice": None})["out"] == {0: 2.0}  # by id
    with pytest.raises(Unknown):  # the node was replaced: the slice compiled on it is gone
        server.answer({**run, "define": [plus(5.0)], "slice": None})
    assert server.answer({**run, "define": [], "slice": described})["out"] == {0: 6.0}
    with pytest.raises(Unknown, match="node 'q'"):  # a slice naming a node never sent
        server.answer(
            {
                **run,
                "sid": "y",
                "define": [],
                "slice": [[0, "nope", "q", 0, None, None, "a", False, True]],
            }
        )


def test_a_connection_opens_while_a_stale_monitor_holds_pyzmqs_default_name(two):
    # pyzmq names a socket's monitor after the socket's file descriptor; a new socket reuses
    # the number of one just closed, whose monitor endpoint may not be released yet (what
    # made CI fail once with "Address already in use"). A stand-in for that stale endpoint:
    from somatize.remote.client import Connection, _zmq

    context = _zmq()
    stale = [context.socket(zmq.PAIR) for _ in range(8)]  # each takes a descriptor now
    probe = context.socket(zmq.DEALER)
    fd = probe.FD
    probe.close(0)  # the next socket takes this number (or one just after)
    for k, pair in enumerate(stale):
        pair.bind(f"inproc://monitor.s-{fd + k}")
    try:
        worker = two.workers["a"]
        connection = Connection(worker, "a", worker.token)
        try:
            assert fd <= connection.sock.FD < fd + len(stale)  # the collision was set up
            assert connection.request({"op": "hello"})["pid"] == worker.process.pid
        finally:
            connection.close()
    finally:
        for pair in stale:
            pair.close(0)


def test_a_worker_error_keeps_its_type_and_names_node_and_host(two):
    g = Graph.somatize(Plus(1) >> Fails().named("boom").at("b"))
    with pytest.raises(KeyError) as caught:
        g.forward(1, broker=two)
    notes = "\n".join(caught.value.__notes__)
    assert "no such thing as 2" in str(caught.value)
    assert "'boom'" in notes and "host 'b'" in notes


def test_an_unknown_host_is_refused_naming_it(two):
    g = Graph.somatize(Plus(1).at("elsewhere"))
    with pytest.raises(ValueError, match="'elsewhere'.*knows \\['a', 'b'\\]"):
        g.forward(1, broker=two)


def test_a_class_the_worker_cannot_import_is_refused_before_sending(two):
    Local = type("Local", (Plus,), {"__module__": "__main__"})
    g = Graph.somatize(Local(1.0).named("mine").at("a"))
    with pytest.raises(TypeError, match="'mine'.*--accept-code"):
        g.forward(1.0, broker=two)


def test_a_wrong_token_is_refused_and_nothing_runs(two):
    real = two.workers["a"]
    before = hello(two, "a")
    wrong = Broker.embedded({"a": Worker.at(real.address, token="not the token")})
    g = Graph.somatize(Pid().at("a"))
    with pytest.raises(PermissionError, match="token does not match"):
        g.forward(1, broker=wrong)
    wrong.close()
    after = hello(two, "a")
    assert after["served"] == before["served"] + 1  # only the hello that asked
    assert after["dropped"] > before["dropped"]


def test_random_bytes_never_stop_a_worker(two):
    conn = two.connection("a")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(conn.worker.address)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.binary(max_size=100), min_size=1, max_size=4))
    def send(frames):
        sock.send_multipart(frames)

    send()
    real = wire.pack(conn.token, {"op": "hello", "rid": 0, "x": torch.ones(100)})
    sock.send_multipart([bytes(memoryview(f))[:7] for f in real])  # truncated
    sock.close()
    assert hello(two, "a")["pid"] == two.workers["a"].pid


def test_encrypted_traffic_and_code_only_for_a_worker_that_accepts_it():
    class Twice(Node):  # defined here: no worker can import it
        def forward(self, x: Any, ctx: Any) -> Any:
            return 2 * x

    worker = Worker.spawn(["--accept-code"], encrypt=True)
    with Broker.embedded({"gpu": worker}) as b:
        assert worker.server_key
        assert Graph.somatize(Plus(2.0).at("gpu")).forward(torch.ones(2), broker=b).tolist() == [
            3.0,
            3.0,
        ]
        assert Graph.somatize(Twice().at("gpu")).forward(21, broker=b) == 42
    assert worker.process.poll() is not None  # closing the broker stopped it


def test_a_worker_killed_mid_forward_is_an_error_naming_the_host_quickly():
    for ours in (True, False):
        spawned = Worker.spawn()
        # not our child: only the connection can tell that it went away
        worker = spawned if ours else Worker.at(spawned.address, token=spawned.token)
        b = Broker.embedded({"gpu": worker})
        g = Graph.somatize(Sleeps().at("gpu"))
        g.forward(0.0, broker=b)
        threading.Timer(0.5, spawned.stop).start()
        began = time.monotonic()
        with pytest.raises(WorkerLost, match="host 'gpu'"):
            g.forward(60.0, broker=b)
        assert time.monotonic() - began < 10
        b.close()
        spawned.stop()


def test_a_restarted_worker_is_sent_its_nodes_again():
    port = _free_port()
    token = "restart-token"
    cmd = [sys.executable, "-m", "somatize.worker", "--listen", f"127.0.0.1:{port}"]
    env = {**os.environ, "SOMATIZE_TOKEN": token, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        first.stdout.readline()
        b = Broker.embedded({"gpu": Worker.at(f"127.0.0.1:{port}", token=token)})
        lin = Lin(4, 4)
        g = Graph.somatize(lin.at("gpu"))
        x = torch.randn(2, 4)
        y1 = g.forward(x, broker=b)
        first.terminate()
        first.wait()
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        second.stdout.readline()
        try:
            y2 = None
            for _ in range(20):  # the first requests may find the old connection going down
                try:
                    y2 = g.forward(x, broker=b)
                    break
                except WorkerLost:
                    time.sleep(0.1)
            assert y2 is not None and torch.equal(y1, y2)
            assert hello(b, "gpu")["pid"] == second.pid
        finally:
            b.close()
            second.terminate()
            second.wait()
    finally:
        first.kill()
        first.wait()


def test_a_spawned_worker_does_not_outlive_its_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from somatize import Worker
            w = Worker.spawn()
            print(w.pid, flush=True)
            if sys.argv[1] == "hang":
                time.sleep(60)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for how in ("exit", "hang"):
        parent = subprocess.Popen(
            [sys.executable, str(script), how], env=env, stdout=subprocess.PIPE, text=True
        )
        child = int(parent.stdout.readline())
        if how == "hang":
            parent.kill()  # no atexit: the worker notices on its own
        parent.wait(30)
        assert _gone(child, within=5), f"worker {child} outlived its parent ({how})"


def _gone(pid: int, within: float) -> bool:
    ends = time.monotonic() + within
    while time.monotonic() < ends:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reaped by nobody if its parent is gone: look at its state
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- training across a worker ------------------------------------------------------------


def _split_run(broker: Broker | None, every: int) -> tuple[list[float], Any, Any]:
    from somatize.torch import Split, Trainer, parameters

    torch.manual_seed(0)
    body = Lin(8, 8).named("body")
    g = Graph.somatize(
        Lin(4, 8).named("enc") >> (body.at("gpu") if broker else body) >> Lin(8, 2).named("head")
    )
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    optimizer = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
    t = Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        optimizer=optimizer,
        trains=trains,
        broker=broker,
        every=every,
    )
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(10)]
    losses = [t.step(batch) for batch in data]
    t.update()
    here = {n: dict(g.implementation(n).state_dict()) for n in ("body", "head")}
    learnt = broker.weights(g, "body") if broker else here["body"]
    exported = t.export()
    assert set(exported) == {"enc", "body", "head"}
    assert all(torch.equal(exported["body"][k], learnt[k]) for k in learnt)
    return losses, learnt, here["head"]


@pytest.mark.parametrize("every", [1, 2])
def test_split_training_across_a_worker_equals_training_here(two, every):
    here = _split_run(None, every)
    there = _split_run(Broker.embedded({"gpu": two.workers["a"]}), every)
    assert there[0] == pytest.approx(here[0], abs=1e-6)
    for a, b in ((here[1], there[1]), (here[2], there[2])):
        assert set(a) == set(b)
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert not torch.allclose(here[1]["lin.weight"], Lin(8, 8).lin.weight)  # it did learn


def test_a_stage_on_a_worker_runs_watched_only_when_someone_watches(two, monkeypatch):
    asked, answered = [], []
    request = Broker.request

    def spy(self, host, message, **kw):
        got = request(self, host, message, **kw)
        if message["op"] == "stage.forward":
            asked.append(message["watching"])
            answered.append([f["node"] for f in got["facts"] if "node" in f])
        return got

    monkeypatch.setattr(Broker, "request", spy)
    heard: list[dict] = []
    for watching in (None, heard.append):
        t = _split_trainer(Broker.embedded({"gpu": two.workers["a"]}), watching=watching)
        t.step((torch.randn(3, 4), torch.randn(3, 2)))
    # unwatched, the worker builds no facts nobody reads; watched, the node's own fact comes
    # back and reaches the Trainer's watcher
    assert asked == [False, True] and answered == [[], ["body"]]
    assert any(f.get("fact") == "ran" and f.get("node") == "body" for f in heard)


def test_weights_learnt_on_a_worker_come_back_and_can_be_sent(two):
    b = Broker.embedded({"a": two.workers["a"]})
    lin = Lin(3, 3)
    g = Graph.somatize(lin.at("a"))
    x = torch.randn(2, 3)
    before = g.forward(x, broker=b)
    sent = {k: torch.full_like(v, 0.5) for k, v in lin.state_dict().items()}
    b.load_weights(g, "lin", sent)
    got = b.weights(g, "lin")
    assert all(torch.equal(got[k], sent[k]) for k in sent)
    after = g.forward(x, broker=b)
    assert torch.allclose(after, (0.5 * x.sum(1, keepdim=True) + 0.5).expand(2, 3))
    assert not after.requires_grad  # no history came back: it does not pretend to have one
    assert not torch.allclose(before, g.forward(x, broker=b))
    with pytest.raises(ValueError, match="nothing was loaded"):
        b.load_weights(g, "lin", {"lin.weight": torch.zeros(3, 3)})
    assert torch.equal(b.weights(g, "lin")["lin.weight"], sent["lin.weight"])  # untouched


def _split_trainer(broker: Broker, watching: Any = None) -> Any:
    """A Trainer of enc >> body, with "body" on the broker's host "gpu", trained by a Split
    (told every fact when `watching` is given)."""
    from somatize.torch import Split, Trainer, parameters

    g = Graph.somatize(Lin(4, 4).named("enc") >> Lin(4, 2).named("body").at("gpu"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
        broker=broker,
        watching=watching,
    )


def test_trainer_export_and_load_reach_a_node_on_its_worker(two):
    t = _split_trainer(Broker.embedded({"gpu": two.workers["a"]}))
    t.step((torch.randn(3, 4), torch.randn(3, 2)))
    sent = {n: {k: torch.full_like(v, 0.25) for k, v in w.items()} for n, w in t.export().items()}
    t.load(sent)
    back = t.export()
    assert all(torch.equal(back[n][k], sent[n][k]) for n in sent for k in sent[n])
    with pytest.raises(ValueError, match="nothing was loaded"):
        t.load({"body": {"lin.weight": torch.zeros(9, 9), "lin.bias": torch.zeros(2)}})
    assert torch.equal(t.export()["body"]["lin.weight"], sent["body"]["lin.weight"])


def test_training_a_remote_node_without_trains_is_no_gradient_naming_it(two):
    from somatize.torch import NoGradient, Trainer, parameters

    g = Graph.somatize(Lin(4, 4).named("enc") >> Lin(4, 2).named("far").at("a"))
    t = Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        broker=Broker.embedded({"a": two.workers["a"]}),
    )
    with pytest.raises(NoGradient, match="'far'.*trains=\\{'far': Split"):
        t.step((torch.randn(2, 4), torch.randn(2, 2)))


def test_a_restarted_worker_answers_out_of_step_not_garbage():
    from somatize.torch import OutOfStep

    port = _free_port()
    cmd = [sys.executable, "-m", "somatize.worker", "--listen", f"127.0.0.1:{port}"]
    env = {**os.environ, "SOMATIZE_TOKEN": "tok", "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    second = None
    try:
        first.stdout.readline()
        t = _split_trainer(Broker.embedded({"gpu": Worker.at(f"127.0.0.1:{port}", token="tok")}))
        batch = (torch.randn(2, 4), torch.randn(2, 2))
        t.step(batch)
        out = t._stages.forward(batch[0])  # the activation now waits on the worker
        first.terminate()
        first.wait()
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        second.stdout.readline()
        loss = torch.nn.functional.mse_loss(out, batch[1])
        for _ in range(20):
            try:
                t._stages.backward(loss, True)
                raise AssertionError("a gradient was accepted for an activation that is gone")
            except WorkerLost:
                time.sleep(0.1)
                loss = torch.nn.functional.mse_loss(out, batch[1])
            except OutOfStep as e:
                assert "restarted" in str(e)
                break
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
                p.wait()


def test_a_spawned_worker_is_quiet_and_a_worker_by_hand_says_where_it_serves():
    def said(argv: list[str]) -> str:
        p = subprocess.Popen(
            [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "SOMATIZE_TOKEN": "t"},
            text=True,
        )
        try:
            assert p.stdout.readline().startswith("somatize worker ready ")
            time.sleep(0.3)
        finally:
            p.terminate()
        return p.communicate(timeout=10)[1]

    assert "serving on" in said([])
    assert "serving on" not in said(["--quiet"])
    worker = Worker.spawn()
    try:
        with open(f"/proc/{worker.pid}/cmdline", "rb") as f:
            assert b"--quiet" in f.read().split(b"\0")
    finally:
        worker.stop()
    loud = Worker.spawn(quiet=False)
    try:
        with open(f"/proc/{loud.pid}/cmdline", "rb") as f:
            assert b"--quiet" not in f.read().split(b"\0")
    finally:
        loud.stop()


def test_a_repeated_forward_of_tensors_goes_as_a_record_with_only_its_id(two, monkeypatch):
    g = Graph.somatize(Plus(1.0) >> (Plus(2.0) >> Plus(3.0)).at("a") >> Plus(4.0))
    records: list[tuple] = []
    real = wire.run_record

    def watched(token, rid, session, sid, given, input):
        frames = real(token, rid, session, sid, given, input)
        records.append((sid, frames is not None and bytes(memoryview(frames[0]))[wire._SEAL]))
        return frames

    monkeypatch.setattr(wire, "run_record", watched)
    xs = [torch.randn(3) for _ in range(3)]
    outs = [g.forward(x, broker=two) for x in xs]
    assert all(torch.allclose(o, x + 10) for o, x in zip(outs, xs, strict=True))
    # the first forward sends its slice (msgpack); the next two only its id, as records
    assert [r[1] for r in records] == [wire._RECORD, wire._RECORD]
    assert len({r[0] for r in records}) == 1
    assert torch.allclose(g.forward(xs[0], broker=two, watching=[lambda f: None]), xs[0] + 10)
    assert len(records) == 2  # a watched forward asks for times: the generic request
