"""Workers in real processes on 127.0.0.1: forwards and training across them, how nodes travel,
tokens and keys, and what a dead or restarted worker does to a client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import zmq
from _remote_nodes import (
    Box,
    Boxes,
    Breaks,
    Fails,
    Hooked,
    Lin,
    Normed,
    Pid,
    Plus,
    Rectified,
    Sleeps,
    Sum,
)

from somatize import Broker, Graph, NoCodec, Node, Opaque, Worker
from somatize.remote import StateLost, WorkerLost, seal, wire
from somatize.remote.wire import Malformed

NODES = "_remote_nodes"


class Here(Plus):
    """Defined in this test module, which no worker here is started to import."""


@pytest.fixture(scope="module")
def two():
    a = Worker.spawn(["--threads", "1"], send=[NODES])
    b = Worker.spawn(["--threads", "1"], send=[NODES])
    broker = Broker.embedded({"a": a, "b": b})
    yield broker
    with warnings.catch_warnings():  # what the tests' nodes learnt there is not wanted
        warnings.simplefilter("ignore", RuntimeWarning)
        broker.close()


def hello(broker: Broker, host: str) -> dict:
    return broker.request(host, {"op": "hello"})


def local(g: Graph, x: Any) -> Any:
    """What the graph computes with every node run here, in plan order."""
    vals: dict[str, Any] = {}
    for n in g.topological_sort():
        preds = g.predecessors(n)
        arg = x if not preds else vals[preds[0]] if len(preds) == 1 else {p: vals[p] for p in preds}
        vals[n] = g.implementation(n).forward(arg, None)
    leaves = g.leaves()
    return vals[leaves[0]] if len(leaves) == 1 else {n: vals[n] for n in leaves}


def test_forward_across_two_workers_equals_running_here(two):
    g = Graph.somatize(
        Lin(4, 8).named("enc")
        >> (Lin(8, 8).named("a1") >> Plus(1.0).named("a2")).at("a")
        >> (Lin(8, 8).named("left").at("b") | Plus(2.0).named("right"))
        >> (Sum().named("join") >> Lin(8, 3).named("head")).at("b")
    )
    x = torch.randn(5, 4, dtype=torch.float32)
    facts: list[dict] = []
    with torch.no_grad():
        y = g.forward(x, broker=two, watching=facts.append)
        want = local(g, x)
    # the same float32 kernels on the same machine: equal up to a few roundings of each sum
    assert torch.allclose(y, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps * 8**0.5)
    ran = [f["node"] for f in facts if f["fact"] == "ran"]
    assert ran == g.topological_sort()
    began = [f["began_us"] for f in facts if f["fact"] == "ran"]
    assert began == sorted(began)  # a worker's times are counted from this forward's start
    assert facts[-1]["fact"] == "finished" and len(facts) == len(g) + 1
    assert not y.requires_grad  # no history came back: it does not pretend to have one


def test_nodes_run_in_the_worker_process_and_a_slice_is_one_round_trip(two):
    g = Graph.somatize(Plus(1.0) >> (Plus(1.0) >> Plus(1.0) >> Plus(1.0) >> Pid()).at("a"))
    pid, value = g.forward(1.0, broker=two)
    assert value == 5.0 and pid == two.workers["a"].pid != os.getpid()
    before = hello(two, "a")["served"]
    assert g.forward(2.0, broker=two)[1] == 6.0
    assert hello(two, "a")["served"] - before == 2  # the forward, and this hello
    there = Graph.somatize(Plus(1.0).at("a"))
    assert there.forward(Opaque(1.0), broker=two) == 2.0  # taken off before it travels


def test_a_forward_hook_on_a_module_node_fires_on_its_worker(two):
    g = Graph.somatize(Plus(1.0) >> (Hooked().named("hooked") >> Pid()).at("a"))
    pid, y = g.forward(torch.tensor(1.0), broker=two)
    assert pid == two.workers["a"].pid and y.item() == 30.0  # ((1 + 1) + 1) * 10 there
    assert g.forward(torch.tensor(2.0), broker=two)[1].item() == 40.0
    assert g.implementation("hooked").fired == 0  # the copy here never ran


def test_a_worker_error_keeps_its_type_and_names_node_and_host(two):
    g = Graph.somatize(Plus(1) >> Fails().named("boom").at("b"))
    with pytest.raises(KeyError) as caught:
        g.forward(1, broker=two)
    notes = "\n".join(caught.value.__notes__)
    assert "no such thing as 2" in str(caught.value)
    assert "'boom'" in notes and "host 'b'" in notes


def test_a_value_no_codec_writes_down_is_no_codec_naming_its_node_either_way(two):
    what = "register it with somatize.codec\\(kind, type"
    # made on a worker: named by the node whose output it is
    g = Graph.somatize(Plus(1) >> Boxes().named("boxes").at("a") >> Plus(0).named("back"))
    with pytest.raises(NoCodec, match=f"Box in the output of node 'boxes';.*{what}") as caught:
        g.forward(1, broker=two)
    assert "host 'a'" in "\n".join(caught.value.__notes__)
    # sent to a worker: named by the node that made it and the node it was sent to
    g = Graph.somatize(Boxes().named("here") >> Plus(1).named("there").at("b"))
    sent = "Box in the output of node 'here', sent to node 'there' on host 'b';"
    with pytest.raises(NoCodec, match=f"{sent}.*{what}"):
        g.forward(1, broker=two)
    g = Graph.somatize(Plus(1).named("first").at("a"))
    with pytest.raises(NoCodec, match="Box in the graph's input, sent to node 'first' on host 'a'"):
        g.forward(Box(1), broker=two)
    assert g.forward(1, broker=two) == 2  # nothing was left half done


def test_an_answer_that_cannot_be_read_here_is_an_error_at_once_not_a_wait():
    worker = Worker.spawn(["--threads", "1"], send=[NODES], deadline=60.0)
    with Broker.embedded({"a": worker}) as broker:
        g = Graph.somatize(Breaks().named("breaks").at("a"))
        began = time.monotonic()
        with pytest.raises(Malformed, match="answer of .* cannot be read here.*Fragile cannot"):
            g.forward(1, broker=broker)
        assert time.monotonic() - began < 30.0  # it waited out the deadline before
        assert Graph.somatize(Plus(1).at("a")).forward(1, broker=broker) == 2


def test_an_unknown_host_is_refused_naming_it(two):
    g = Graph.somatize(Plus(1).at("elsewhere"))
    with pytest.raises(ValueError, match="'elsewhere'.*knows \\['a', 'b'\\]"):
        g.forward(1, broker=two)


def test_a_class_the_worker_cannot_build_is_refused_before_anything_is_sent(two):
    before = hello(two, "a")["served"]
    Main = type("Main", (Plus,), {"__module__": "__main__"})
    with pytest.raises(TypeError, match="'mine'.*__main__.*mode='network'"):
        Graph.somatize(Main(1.0).named("mine").at("a")).forward(1.0, broker=two)
    with pytest.raises(PermissionError, match=f"'here'.*--import {__name__}"):
        Graph.somatize(Here(1.0).named("here").at("a")).forward(1.0, broker=two)
    assert hello(two, "a")["served"] == before + 1  # only this hello reached it


def test_a_wrong_token_is_refused_and_nothing_runs(two):
    before = hello(two, "a")
    wrong = Broker.embedded({"a": Worker.at(two.workers["a"].address, token="not the token")})
    with pytest.raises(PermissionError, match="token does not match"):
        Graph.somatize(Pid().at("a")).forward(1, broker=wrong)
    wrong.close()
    after = hello(two, "a")
    assert after["served"] == before["served"] + 1  # only the hello that asked
    assert after["dropped"] > before["dropped"]


def test_random_and_replayed_bytes_never_stop_a_worker_nor_run_twice(two):
    import random

    worker = two.workers["a"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(worker.address)
    rng = random.Random(0)
    for _ in range(200):
        sock.send_multipart([rng.randbytes(rng.randrange(80)) for _ in range(rng.randrange(1, 4))])
    sock.send(seal.SALT_ASK)
    while True:  # refusals of the noise first, then the salt
        frames = sock.recv_multipart()
        if seal.is_frame(frames[0], seal.SALT):
            break
    mine = seal.Seal(seal.derive(worker.token, frames[1]))
    message = mine.seal(wire.encode({"op": "hello", "rid": 1, "x": torch.ones(100)}))
    sock.send_multipart([bytes(memoryview(f))[:7] for f in message])  # cut short
    sock.send_multipart(message)
    sock.send_multipart(message)  # captured and sent again
    answers = []
    while len(answers) < 3:
        frames = sock.recv_multipart()
        answers.append(bytes(frames[2]) if seal.is_frame(frames[0], seal.REFUSED) else "ok")
    sock.close()
    assert answers == [b"seal", "ok", b"replay"]
    assert hello(two, "a")["pid"] == worker.pid


def test_code_only_travels_to_a_worker_started_to_accept_it(two):
    class Twice(Node):  # defined here: it can only travel as code
        def forward(self, x: Any, ctx: Any) -> Any:
            return 2 * x

    standing = two.workers["a"]
    refused = Broker.embedded(
        {"a": Worker.at(standing.address, token=standing.token, mode="network")}
    )
    with pytest.raises(PermissionError, match="--accept-code"):
        Graph.somatize(Twice().at("a")).forward(1, broker=refused)
    refused.close()
    missing = Broker.embedded(
        {"a": Worker.at(standing.address, token=standing.token, mode="project", send=["json"])}
    )
    with pytest.raises(ImportError, match="--import json"):
        Graph.somatize(Plus().at("a")).forward(1, broker=missing)
    missing.close()
    worker = Worker.spawn(mode="network", encrypt=True)
    with Broker.embedded({"gpu": worker}) as b:
        assert worker.server_key
        assert Graph.somatize(Twice().at("gpu")).forward(21, broker=b) == 42
        wrong = Worker.at(
            worker.address, token=worker.token, server_key=zmq.curve_keypair()[0].decode()
        )
        with pytest.raises(PermissionError, match="CURVE key is not the one given"):
            Graph.somatize(Twice().at("gpu")).forward(1, broker=Broker.embedded({"gpu": wrong}))
    assert worker.process.poll() is not None  # closing the broker stopped it


def test_a_worker_killed_mid_forward_is_an_error_naming_the_host_quickly():
    for ours in (True, False):
        spawned = Worker.spawn(send=[NODES])
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


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "node3:70000", "node3:7000x", "http://node3:7000", ":7000", "", "node3:0"],
)
def test_an_address_a_worker_cannot_have_is_refused_when_it_is_declared(address):
    with pytest.raises(ValueError, match=r"'host:port'.*1 to 65535.*not " + repr(address)):
        Worker.at(address, token="t")
    assert Worker.at("tcp://node3:7000").address == Worker.at("node3:7000").address


def test_a_worker_nobody_answers_for_is_worker_lost_after_one_wait_not_two():
    worker = Worker.at(f"127.0.0.1:{_free_port()}", token="t", send=[NODES])
    worker.connect_within = 2.0  # seconds before nothing answering is WorkerLost
    g = Graph.somatize(Lin(4, 4).at("gpu"))
    began = time.monotonic()
    with pytest.raises(WorkerLost, match="nothing answers for host 'gpu'"):
        g.forward(torch.randn(2, 4), broker=Broker.embedded({"gpu": worker}))
    assert time.monotonic() - began < 2 * worker.connect_within  # it waited once


def test_code_from_a_module_the_worker_cannot_import_says_to_send_it_and_sent_it_runs(tmp_path):
    spawned = Worker.spawn(["--threads", "1"], mode="network")  # its import path is set now
    (tmp_path / "later_nodes.py").write_text(
        "from somatize import Node\n\n"
        "class Scale(Node):\n"
        "    def __init__(self, k):\n"
        "        self.k = k\n\n"
        "    def forward(self, x, ctx):\n"
        "        return x * self.k\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import later_nodes

        g = Graph.somatize(later_nodes.Scale(3).at("w"))
        plain = Worker.at(spawned.address, token=spawned.token, mode="network")
        with Broker.embedded({"w": plain}) as b:
            with pytest.raises(ModuleNotFoundError, match=r"'later_nodes'.*send=\['later_nodes'"):
                g.forward(2, broker=b)
        sending = Worker.at(
            spawned.address, token=spawned.token, mode="network", send=["later_nodes"]
        )
        with Broker.embedded({"w": sending}) as b:
            assert g.forward(2, broker=b) == 6
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("later_nodes", None)
        spawned.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Standing:
    """A worker on a fixed port, started (and started again) by hand."""

    def __init__(self, *extra: str) -> None:
        self.port = _free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "somatize.worker",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--import",
            NODES,
            "--quiet",
            *extra,
        ]
        self.env = {**os.environ, "SOMATIZE_TOKEN": "tok", "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE)
        assert self.process.stdout.readline().startswith(b"somatize worker ready")

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def worker(self) -> Worker:
        return Worker.at(f"127.0.0.1:{self.port}", token="tok")


def _again(fn: Any) -> Any:
    """`fn()`, again while the old connection is still found going down."""
    for _ in range(40):
        try:
            return fn()
        except WorkerLost:
            time.sleep(0.1)
    return fn()


def _split_trainer(broker: Broker | None, watching: Any = None, every: int = 1) -> Any:
    """enc >> body >> head, "body" on the broker's host "gpu" (here without a broker),
    trained by a Split."""
    from somatize.torch import Split, Trainer, parameters

    torch.manual_seed(0)
    body = Lin(8, 8).named("body")
    g = Graph.somatize(
        Lin(4, 8).named("enc") >> (body.at("gpu") if broker else body) >> Lin(8, 2).named("head")
    )
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
        broker=broker,
        watching=watching,
        every=every,
    )


def _batches(n: int = 10) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(n)]


@pytest.mark.filterwarnings("ignore:closing the broker:RuntimeWarning")  # on purpose
def test_a_restarted_worker_gets_what_it_held_and_never_trains_on_from_older_weights():
    from somatize.torch import OutOfStep

    standing = Standing()
    standing.start()
    try:
        broker = Broker.embedded({"gpu": standing.worker()})
        plain = Graph.somatize(Lin(4, 4).at("gpu"))
        x = torch.randn(2, 4)
        first = plain.forward(x, broker=broker)
        t = _split_trainer(broker)
        data = _batches(6)
        for batch in data[:3]:
            t.step(batch)
        kept = t.export()
        for batch in data[3:5]:
            t.step(batch)
        standing.restart()
        # a node that learnt nothing there is sent again from what it held, silently
        assert torch.equal(_again(lambda: plain.forward(x, broker=broker)), first)
        assert hello(broker, "gpu")["pid"] == standing.process.pid
        with pytest.raises((StateLost, OutOfStep)):  # never a step from older weights
            t.step(data[5])
        with pytest.raises(StateLost, match="'body'") as lost:
            t.step(data[5])
        with pytest.raises(StateLost):
            t.export()  # never the weights it started from, nor the stale copy
        assert torch.equal(lost.value.exported["body"]["lin.weight"], kept["body"]["lin.weight"])
        t.load(lost.value.exported)
        assert torch.equal(t.export()["body"]["lin.weight"], kept["body"]["lin.weight"])
        t.step(data[5])
        learnt = t.export()  # read back: nothing learnt since, so a restart is no loss
        standing.restart()
        assert torch.equal(_again(t.export)["body"]["lin.weight"], learnt["body"]["lin.weight"])
        t.step(data[0])
        broker.close()
    finally:
        standing.stop()


def test_the_first_request_after_a_restart_may_be_as_large_as_a_client_s():
    """A worker weighs what a connection that has not yet proven itself sends (a stranger's
    messages together at most --max-message): after the restart, the client proves itself
    (a small sealed hello) before its large message."""
    standing = Standing("--max-message", "16MiB")
    standing.start()
    try:
        broker = Broker.embedded({"gpu": standing.worker()})
        g = Graph.somatize(Sum().at("gpu"))
        parts = {f"p{i}": torch.full((250_000,), float(i)) for i in range(64)}  # 64 MB
        want = torch.full((250_000,), 2016.0)
        assert torch.equal(g.forward(parts, broker=broker), want)
        standing.restart()
        assert torch.equal(_again(lambda: g.forward(parts, broker=broker)), want)
        assert hello(broker, "gpu")["pid"] == standing.process.pid
        broker.close()
    finally:
        standing.stop()


@pytest.mark.filterwarnings("ignore:closing the broker:RuntimeWarning")  # on purpose
def test_state_lost_names_the_nodes_not_what_trains_them_there():
    from somatize.torch import Greedy, OutOfStep, Trainer, parameters

    standing = Standing("--accept-code")  # Greedy's head travels as code
    standing.start()
    try:
        broker = Broker.embedded({"gpu": standing.worker()})
        torch.manual_seed(0)
        g = Graph.somatize(  # a frozen node there too: it learnt nothing, so it is not lost
            Lin(4, 8).named("enc").frozen().at("gpu")
            >> Lin(8, 8).named("body").at("gpu")
            >> Lin(8, 2).named("head")
        )
        trains = {"body": Greedy(torch.optim.SGD, head=torch.nn.Linear(8, 2), lr=0.1)}
        t = Trainer(
            g,
            objective=torch.nn.functional.mse_loss,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
            broker=broker,
        )
        data = _batches(3)
        t.step(data[0])
        kept = t.export()["body"]  # read back: the node's weights and its Greedy's head
        t.step(data[1])  # learnt there since: lost with the worker
        standing.restart()
        deadline = time.monotonic() + 60  # the old connection found down, however slowly
        while True:
            try:
                t.step(data[1])
            except (WorkerLost, OutOfStep):  # as the test above meets them
                assert time.monotonic() < deadline
                time.sleep(0.1)
            except StateLost as error:
                lost = error
                break
            else:
                pytest.fail("a step from older weights")
        assert lost.nodes == ["body"]  # its Greedy (head and all) lost with it
        assert "['body']" in str(lost) and "body/learning" not in str(lost)
        # what was read back, the head it brought included, keyed as Trainer.export keys it
        assert sorted(lost.exported) == ["body"]
        assert sorted(lost.exported["body"]) == sorted(kept) and "learning/head.weight" in kept
        for key, value in kept.items():
            assert torch.equal(lost.exported["body"][key], value)
        t.load(lost.exported)
        t.step(data[2])  # resumed from them
        broker.close()
    finally:
        standing.stop()


@pytest.mark.parametrize("every", [1, 2])
def test_split_training_across_a_worker_equals_training_here(two, every):
    here = _split_trainer(None, every=every)
    there = _split_trainer(Broker.embedded({"gpu": two.workers["a"]}), every=every)
    for batch in _batches():
        assert there.step(batch) == pytest.approx(here.step(batch), rel=1e-6)
    here.update(), there.update()
    a, b = here.export(), there.export()
    assert set(a) == set(b) == {"enc", "body", "head"}
    eps = torch.finfo(torch.float32).eps
    for n in a:
        for k in a[n]:
            assert torch.allclose(a[n][k], b[n][k], rtol=0, atol=64 * eps), (n, k)
    assert not torch.equal(b["body"]["lin.weight"], Lin(8, 8).lin.weight)  # it did learn


def test_a_stage_on_a_worker_tells_a_watcher_what_ran_there(two):
    heard: list[dict] = []
    t = _split_trainer(Broker.embedded({"gpu": two.workers["a"]}), watching=heard.append)
    t.step(_batches(1)[0])
    assert any(f.get("fact") == "ran" and f.get("node") == "body" for f in heard)


def test_weights_learnt_on_a_worker_come_back_and_can_be_sent(two):
    from somatize.torch import Trainer

    b = Broker.embedded({"a": two.workers["a"]})
    lin = Lin(3, 3)
    g = Graph.somatize(Lin(3, 3).named("here") >> lin.at("a").frozen())
    x = torch.randn(2, 3)
    g.forward(x, broker=b)
    sgd = torch.optim.SGD(g.implementation("here").parameters(), lr=0.1)
    t = Trainer(g, objective=torch.nn.functional.mse_loss, broker=b, optimizer=sgd)
    sent = {k: torch.full_like(v, 0.5) for k, v in lin.state_dict().items()}
    t.load({"here": {"lin.weight": torch.eye(3), "lin.bias": torch.zeros(3)}, "lin": sent})
    got = b.weights(g, "lin")
    assert all(torch.equal(got[k], sent[k]) for k in sent)
    want = (0.5 * x.sum(1, keepdim=True) + 0.5).expand(2, 3)
    assert torch.allclose(g.forward(x, broker=b), want)
    with pytest.raises(ValueError, match="nothing was loaded"):
        t.load({"lin": {"lin.weight": torch.zeros(4, 4)}})
    assert torch.equal(b.weights(g, "lin")["lin.weight"], sent["lin.weight"])  # untouched


def test_trainer_load_is_all_or_nothing_across_workers(two):
    from somatize.torch import Trainer

    g = Graph.somatize(
        Lin(4, 4).named("here")
        >> Plus().named("plus")
        >> Lin(4, 4).named("on_a").at("a").frozen()
        >> Lin(4, 4).named("on_b").at("b").frozen()
    )
    broker = Broker.embedded(dict(two.workers))
    t = Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        broker=broker,
        optimizer=torch.optim.SGD(g.implementation("here").parameters(), lr=0.1),
    )
    before = t.export()
    halves = {n: {k: torch.full_like(v, 0.5) for k, v in w.items()} for n, w in before.items()}
    bad = {**halves, "on_b": {"lin.weight": torch.empty(4, 4, device="meta")}}
    with pytest.raises(ValueError, match="'on_b'.*meta.*nothing was loaded"):
        t.load(bad)
    with pytest.raises(ValueError, match="'plus', which this graph holds no weights in"):
        t.load({"plus": {}})
    with pytest.raises(ValueError, match="'nowhere', which this graph does not have"):
        t.load({"nowhere": {}})
    now = t.export()
    assert all(torch.equal(now[n][k], before[n][k]) for n in before for k in before[n])
    t.load({"on_a": {"lin.bias": torch.ones(4, dtype=torch.float64)}})  # a subset, cast
    assert torch.equal(t.export()["on_a"]["lin.bias"], torch.ones(4))
    assert torch.equal(t.export()["on_a"]["lin.weight"], before["on_a"]["lin.weight"])


def test_a_dead_worker_mid_load_leaves_every_weight_as_it_was(two):
    from somatize.torch import Trainer

    dying = Worker.spawn(send=[NODES])
    broker = Broker.embedded({"a": two.workers["a"], "b": dying})
    try:
        g = Graph.somatize(
            Lin(4, 4).named("here")
            >> Lin(4, 4).named("on_a").at("a").frozen()
            >> Lin(4, 4).named("on_b").at("b").frozen()
        )
        t = Trainer(
            g,
            objective=torch.nn.functional.mse_loss,
            broker=broker,
            optimizer=torch.optim.SGD(g.implementation("here").parameters(), lr=0.1),
        )
        before = t.export()
        dying.stop()
        halves = {n: {k: torch.full_like(v, 0.5) for k, v in w.items()} for n, w in before.items()}
        with pytest.raises(WorkerLost):
            t.load(halves)
        assert torch.equal(broker.weights(g, "on_a")["lin.weight"], before["on_a"]["lin.weight"])
        assert torch.equal(g.implementation("here").lin.weight, before["here"]["lin.weight"])
    finally:
        dying.stop()


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


def test_a_module_as_it_is_travels_as_code_and_only_as_code(two):
    from torch import nn

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    refused = Graph.somatize(Node.of(body).named("body").at("a"))
    with pytest.raises(TypeError, match=r"'body' is a Sequential as it is.*mode='network'"):
        refused.forward(x, broker=two)
    fine = Graph.somatize(Lin(4, 3).named("lin").at("a"))
    assert fine.forward(x, broker=two).shape == (5, 3)  # the refusal left the broker as it was

    worker = Worker.spawn(["--threads", "1"], mode="network")
    broker = Broker.embedded({"gpu": worker})
    try:
        g = Graph.somatize(Node.of(body).named("body").at("gpu"))
        there = g.forward(x, broker=broker)
        with torch.no_grad():
            here = body(x)
        tol = 8 * torch.finfo(torch.float32).eps * max(1.0, float(here.abs().max()))
        assert torch.allclose(there, here, rtol=0, atol=tol)
    finally:
        broker.close()


def test_a_learning_s_objective_from_a_sent_module_travels_by_value_as_nodes_do(tmp_path):
    """In mode='network' the code of a module named in send= travels by value, for a Greedy's
    objective as for a node: the worker, which cannot import that module, trains as here."""
    import importlib

    from torch import nn

    from somatize.torch import Greedy, Trainer, parameters

    name = "somatize_test_sent_objective"
    worker = Worker.spawn(["--threads", "1"], mode="network", send=[name])
    (tmp_path / f"{name}.py").write_text(
        "def objective(out, target):\n    return ((out - target) ** 2).mean()\n"
    )
    sys.path.insert(0, str(tmp_path))  # only here: the worker was started before
    try:
        objective = importlib.import_module(name).objective
    finally:
        sys.path.remove(str(tmp_path))

    def trainer(broker: Broker | None) -> Any:
        torch.manual_seed(0)
        a = Lin(4, 8).named("a")
        g = Graph.somatize((a.at("gpu") if broker else a) >> Lin(8, 2).named("head"))
        trains = {"a": Greedy(torch.optim.SGD, head=nn.Linear(8, 2), lr=0.1)}
        opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
        return Trainer(g, objective=objective, optimizer=opt, trains=trains, broker=broker)

    broker = Broker.embedded({"gpu": worker})
    try:
        here, there = trainer(None), trainer(broker)
        for batch in _batches(4):
            assert there.step(batch) == pytest.approx(here.step(batch), rel=1e-6)
        a, b = here.export()["a"], there.export()["a"]
        assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    finally:
        broker.close()
        sys.modules.pop(name, None)


def _float64_forward(node: Any, x: torch.Tensor) -> torch.Tensor:
    """What `node` gives for `x` computed in float64 on a copy here (the node is untouched)."""
    import copy

    with torch.no_grad():
        return copy.deepcopy(node).double().forward(x.double(), None)


@pytest.mark.parametrize("mode, dtype", [("project", torch.float64), ("network", torch.bfloat16)])
def test_a_node_keeps_its_dtypes_on_its_worker_tensor_by_tensor(mode, dtype):
    worker = Worker.spawn(["--threads", "1"], mode=mode, send=[NODES])
    broker = Broker.embedded({"gpu": worker})
    try:
        torch.manual_seed(0)
        node = Normed(4).to(dtype)  # its count of batches (int64) stays int64
        sent = {k: v.detach().clone() for k, v in node.state_dict().items()}
        g = Graph.somatize(node.named("body").at("gpu"))
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = _float64_forward(node, x)
        y = g.forward(x, broker=broker)
        assert y.dtype == dtype
        # kernels in `dtype`: a linear of 4 terms and a batch norm of 6 rows, each rounded
        eps = torch.finfo(dtype).eps
        assert torch.allclose(y.double(), want, rtol=0, atol=32 * eps * float(want.abs().max()))
        got = broker.weights(g, "body")
        assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in sent.items()}
        assert torch.equal(got["lin.weight"], sent["lin.weight"])  # never rounded on the way
        assert int(got["norm.num_batches_tracked"]) == 1  # it ran in train mode there
    finally:
        broker.close()


def test_eval_and_train_reach_the_worker_on_the_next_forward(two):
    from somatize.torch import Split, Trainer, parameters

    torch.manual_seed(0)
    node = Normed(4)
    g = Graph.somatize(node.named("norm").at("a"))
    x = 3 * torch.randn(8, 4, generator=torch.Generator().manual_seed(2)) + 1
    g.forward(x, broker=two)  # train mode: batch statistics, and the running ones move
    learnt = two.weights(g, "norm")  # the copy here is brought up to the worker's
    assert int(learnt["norm.num_batches_tracked"]) == 1
    node.eval()
    y = g.forward(x, broker=two)
    want = _float64_forward(node, x)  # eval mode: the running statistics, row by row
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(y.double(), want, rtol=0, atol=32 * eps * float(want.abs().max()))
    assert torch.allclose(g.forward(x[:2], broker=two), y[:2], rtol=0, atol=32 * eps)
    still = two.weights(g, "norm")
    assert all(torch.equal(still[k], learnt[k]) for k in learnt)  # inference moved nothing
    node.train()
    g.forward(x, broker=two)
    moved = two.weights(g, "norm")
    assert int(moved["norm.num_batches_tracked"]) == 2
    assert not torch.equal(moved["norm.running_mean"], learnt["norm.running_mean"])
    # a trainer's step runs the node as it is here too: eval, then train again
    node.eval()
    g.forward(x, broker=two)
    node.train()
    trains = {"norm": Split(torch.optim.SGD, lr=0.1)}
    tg = Graph.somatize(node.named("norm").at("a") >> Lin(4, 2).named("head"))
    t = Trainer(
        tg,
        objective=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(tg, without=trains), lr=0.1),
        trains=trains,
        broker=two,
    )
    t.step((x, torch.zeros(8, 2)))
    assert int(t.export()["norm"]["norm.num_batches_tracked"]) == 3


def test_a_node_cast_here_after_it_was_sent_is_cast_on_its_worker_with_what_it_learnt(two):
    torch.manual_seed(0)
    node = Normed(4)
    g = Graph.somatize(node.named("norm").at("a"))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    assert g.forward(x, broker=two).dtype == torch.float32
    node.double()
    y = g.forward(x.double(), broker=two)
    assert y.dtype == torch.float64
    got = two.weights(g, "norm")
    assert got["lin.weight"].dtype == torch.float64
    # a trainer's step learnt there since its weights were read back: cast, not forgotten
    t = _split_trainer(Broker.embedded({"gpu": two.workers["a"]}))  # never closed: it stops "a"
    data = _batches(3)
    t.step(data[0])
    kept = t.export()["body"]
    t.step(data[1])  # learnt on the worker only
    for n in t.graph.nodes():
        t.graph.implementation(n).double()
    learnt = t.export()["body"]
    assert learnt["lin.weight"].dtype == torch.float64
    assert not torch.equal(learnt["lin.weight"], kept["lin.weight"].double())
    t.step(tuple(v.double() for v in data[2]))
    assert t.export()["body"]["lin.weight"].dtype == torch.float64


def test_modes_that_do_not_match_a_node_s_modules_are_refused_naming_it(two):
    node = Normed(4)
    g = Graph.somatize(node.named("norm").at("a"))
    x = torch.randn(3, 4)
    first = g.forward(x, broker=two)
    with pytest.raises(ValueError, match=r"a Normed here holds 3 module\(s\).*\[True\]"):
        two.request("a", {"op": "define", "modes": {two.key(node): [True]}})
    assert torch.equal(g.forward(x, broker=two), first)  # nothing changed there


def _audited(broker: Broker | None, body: Any, every: int = 1, micro: int = 1) -> tuple:
    """enc >> body >> head, body trained by a Split (on host "a" with a broker), audited every
    step with channels; answers the Trainer and the health facts it tells."""
    from somatize.torch import Audit, Split, Trainer, parameters

    g = Graph.somatize(
        Lin(4, 8).named("enc") >> (body.at("a") if broker else body) >> Lin(8, 2).named("head")
    )
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    heard: list[dict] = []
    t = Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
        broker=broker,
        auditing=Audit(every=1, snapshot=2, channels=True),
        watching=heard.append,
        every=every,
        micro=micro,
    )
    return t, heard


@pytest.mark.parametrize("every, micro", [(1, 1), (2, 2)])
def test_a_node_trained_on_a_worker_is_audited_there_as_it_is_here(two, every, micro):
    # it was judged from the copy here, which never moves: a healthy body read STALLED
    from somatize.health import seen_in, verdict

    runs = {}
    for broker in (None, two):
        torch.manual_seed(0)
        t, heard = _audited(broker, Lin(8, 8).named("body"), every, micro)
        t.fit(_batches(5))  # with every=2 the last group is closed by update()
        runs[broker is None] = [f for f in heard if f.get("fact") == "health"]
    here, there = runs[True], runs[False]
    assert len(there) == len(here) == 3 * 5
    key = lambda f: (f["step"], f["node"])  # noqa: E731
    for a, b in zip(sorted(here, key=key), sorted(there, key=key), strict=True):
        assert key(a) == key(b) and set(a) == set(b), (a, b)
        for k, v in a.items():
            if type(v) is float:  # float32 norms; an update's ratio from a difference
                assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-6), (key(a), k)
            else:
                assert b[k] == v, (key(a), k)
    body = seen_in(there)["body"]
    assert body["update_ratio"] > 0 and body["grad_norm"] > 0
    assert verdict(body) == []


def test_a_dead_node_on_a_worker_is_dead_to_the_audit(two):
    torch.manual_seed(0)
    body = Rectified(8, 8)
    with torch.no_grad():
        body.lin.bias.fill_(-50.0)  # no input reaches above it: every channel is dead
    t, heard = _audited(two, body.named("body"))
    t.fit(_batches(4))
    from somatize.health import seen_in, verdict

    body_seen = seen_in(heard)["body"]
    assert body_seen["dead_channels"] == 8
    assert "DEAD" in verdict(body_seen)
    t.close()  # training goes on, unaudited here and there
    told = len(heard)
    t.fit(_batches(2))
    assert not [f for f in heard[told:] if f.get("fact") == "health"]


def test_an_audit_by_hand_leaves_out_a_node_on_a_worker_and_says_so():
    # nothing measures it there: the copy here never runs nor moves, so it is not judged
    from somatize.torch import Audit

    g = Graph.somatize(Lin(4, 8).named("enc") >> Lin(8, 2).named("body").at("a"))
    said = r"leaves out node\(s\) 'body' \(host 'a'\): they run and learn on a worker"
    with pytest.warns(UserWarning, match=said):
        audit = Audit(every=1).watch(g)
    assert audit.places == ["enc"]
    audit.release()
    groups = {"body": {"x": range(0, 4), "y": range(4, 8)}}
    with pytest.raises(ValueError, match=r"\['body'\] run on a worker"):
        Audit(groups=groups).watch(g)


def test_a_trainer_refuses_a_cached_node_on_a_worker_as_graph_forward_does(two, tmp_path):
    # the Trainer sent such a node its values every step and cached nothing, saying nothing
    from somatize import Store
    from somatize.torch import Trainer, parameters

    g = Graph.somatize(Lin(4, 8).named("enc").at("a").frozen().cached() >> Lin(8, 2).named("head"))
    x, y = _batches(1)[0]
    with pytest.raises(ValueError) as by_graph:
        g.forward(x, broker=two, store=tmp_path)
    t = Trainer(
        g,
        objective=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        store=tmp_path,
        broker=two,
    )
    with pytest.raises(ValueError) as by_trainer:
        t.step((x, y))
    assert "not supported yet" in str(by_graph.value)
    assert str(by_trainer.value) == str(by_graph.value)  # the same refusal, in the same words
    assert "node 'enc' is .cached() and runs on host 'a'" in by_trainer.value.__notes__
    assert Store(tmp_path).bound() == []


class Unbox(Node):
    """Takes the value out of a `Box` (runs here, never sent)."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return x.x


def test_a_value_no_codec_writes_down_in_a_trainer_s_stage_is_no_codec_naming_its_node(two):
    from somatize.torch import Trainer, parameters

    what = "register it with somatize.codec\\(kind, type"

    def step(g: Graph, x: Any) -> None:
        opt = torch.optim.SGD(parameters(g), lr=0.1)
        t = Trainer(g, objective=torch.nn.functional.mse_loss, optimizer=opt, broker=two)
        t.step((x, torch.zeros(6, 2)))

    x = _batches(1)[0][0]
    # made on a worker: named by the node whose output it is (was "the answer to ...")
    g = Graph.somatize(
        Lin(4, 8).named("enc") >> Boxes().named("boxes").at("a") >> Unbox() >> Lin(8, 2)
    )
    with pytest.raises(NoCodec, match=f"Box in the output of node 'boxes';.*{what}") as caught:
        step(g, x)
    assert "host 'a'" in "\n".join(caught.value.__notes__)
    # sent to a worker: named by the node that made it and the node it was sent to
    g = Graph.somatize(
        Lin(4, 8).named("enc") >> Boxes().named("here") >> Plus(1).named("there").at("b")
    )
    sent = "Box in the output of node 'here', sent to node 'there' on host 'b';"
    with pytest.raises(NoCodec, match=f"{sent}.*{what}"):
        step(g, x)
    g = Graph.somatize(Plus(1).named("first").at("a") >> Unbox() >> Lin(4, 2).named("head"))
    with pytest.raises(NoCodec, match="Box in the graph's input, sent to node 'first' on host"):
        step(g, Box(x))
