"""Code written for the published somatize 1.0.1 runs here unchanged.

Each test is a script written the published way, asserting what the published package
documents; where this project does better that is asserted beside it. Each area keeps a
section of its own below.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss
from torch.optim import SGD, Adam

from somatize import Broker, Graph, Node, Opaque, Worker
from somatize.torch import Split, Trainer, parameters

# -- remote --


class Front(Node, nn.Module):
    """Four features to eight."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(4, 8)

    def forward(self, input, ctx):
        return torch.relu(self.lin(input))


class Middle(Node, nn.Module):
    """Eight to eight: the part that lives on another machine."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(8, 8)

    def forward(self, input, ctx):
        return torch.relu(self.lin(input))


class Back(Node, nn.Module):
    """Eight to two."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(8, 2)

    def forward(self, input, ctx):
        return self.lin(input)


def _split_run(broker):
    """Three epochs of Front >> Middle >> Back with the middle trained by Split (on the
    broker's host "gpu" when there is a broker), the inputs given as Opaques."""
    torch.manual_seed(0)
    middle = Middle().named("middle")
    g = Graph.somatize(Front() >> (middle.at("gpu") if broker else middle) >> Back())
    trains = {"middle": Split(SGD, lr=0.1)}
    t = Trainer(
        g,
        objective=mse_loss,
        optimizer=Adam(parameters(g, without=trains), lr=1e-2),
        trains=trains,
        broker=broker,
    )
    gen = torch.Generator().manual_seed(3)
    data = [
        (Opaque(torch.randn(8, 4, generator=gen)), torch.randn(8, 2, generator=gen))
        for _ in range(4)
    ]
    return t, t.fit(data, epochs=3).history


def test_a_worker_spawned_from_its_whole_command_line_trains_the_middle_as_code_travels():
    worker = Worker.spawn(
        [sys.executable, "-m", "somatize.worker"], mode="network", send=[__name__]
    )
    broker = Broker.embedded({"gpu": worker})
    try:
        there_trainer, there = _split_run(broker)
        _, here = _split_run(None)
        # the same float32 arithmetic on both sides of the wire, step for step
        assert there == pytest.approx(here, rel=1e-5)
        assert sum(there[-4:]) < sum(there[:4])  # the last epoch below the first
        exported = there_trainer.export()["middle"]["lin.weight"]
        assert exported.shape == (8, 8)
    finally:
        broker.close()
    assert worker.process.poll() is not None  # closing the broker stopped what it spawned


def test_a_generic_worker_in_project_mode_imports_the_code_and_names_travel():
    from _remote_nodes import Lin, Plus

    worker = Worker.generic(mode="project", send=["_remote_nodes"], python=sys.executable)
    broker = Broker.embedded({"gpu": worker})
    try:
        torch.manual_seed(0)
        g = Graph.somatize(Plus(1.0) >> Lin(4, 3).at("gpu"))
        x = torch.randn(2, 4)
        y = g.forward(Opaque(x), broker=broker)
        with torch.no_grad():
            want = g.implementation("lin").lin(x + 1.0)
        eps = torch.finfo(torch.float32).eps
        assert torch.allclose(y, want, rtol=0, atol=16 * eps * 2)
        with pytest.raises(PermissionError, match="--import test_published_style"):
            Graph.somatize(Middle().at("gpu")).forward(torch.randn(1, 8), broker=broker)
    finally:
        broker.close()


def test_a_worker_at_an_address_takes_the_same_keywords():
    token = secrets.token_hex(16)
    env = {**os.environ, "SOMATIZE_TOKEN": token, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0",
         "--import", "_remote_nodes"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        address = process.stdout.readline().split()[3]
        from _remote_nodes import Plus

        at = Worker.at(address, mode="project", send=["_remote_nodes"], token=token)
        with Broker.embedded({"gpu": at}) as broker:
            assert Graph.somatize(Plus(2.0).at("gpu")).forward(1.0, broker=broker) == 3.0
        network = Worker.at(address, mode="network", send=[__name__], token=token)
        with Broker.embedded({"gpu": network}) as broker:  # code only to a worker that takes it
            with pytest.raises(PermissionError, match="--accept-code"):
                Graph.somatize(Middle().at("gpu")).forward(torch.randn(1, 8), broker=broker)
        nobody = Worker.at(address, token="not its token")
        with Broker.embedded({"gpu": nobody}) as broker:  # better: no token, nothing runs
            with pytest.raises(PermissionError, match="token does not match"):
                Graph.somatize(Plus(2.0).at("gpu")).forward(1.0, broker=broker)
    finally:
        process.kill()
        process.wait()


def test_a_worker_that_exits_at_once_is_reported_with_its_exit_code_and_what_it_printed():
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2.*unrecognized arguments"):
        Worker.spawn([sys.executable, "-m", "somatize.worker", "--no-such-flag"], mode="network")
    assert time.monotonic() - began < 30


def test_load_takes_a_subset_of_a_nodes_keys_cast_to_its_dtype_all_or_nothing():
    torch.manual_seed(0)
    g = Graph.somatize(Front() >> Back())
    t = Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g), lr=0.1))
    before = t.export()
    # as load_state_dict(strict=False) takes it: some keys, cast to the node's dtype
    t.load({"back": {"lin.bias": torch.zeros(2, dtype=torch.float64)}})
    after = t.export()
    assert after["back"]["lin.bias"].dtype == torch.float32
    assert torch.equal(after["back"]["lin.bias"], torch.zeros(2))
    assert torch.equal(after["back"]["lin.weight"], before["back"]["lin.weight"])
    # but all or nothing: one bad tensor anywhere and nothing is loaded
    with pytest.raises(ValueError, match="nothing was loaded"):
        t.load({"front": {"lin.bias": torch.ones(8)}, "back": {"lin.nope": torch.ones(2)}})
    assert torch.equal(t.export()["front"]["lin.bias"], before["front"]["lin.bias"])


def test_load_refuses_weights_for_a_node_that_has_none_like_an_unknown_node():
    class Scale(Node):
        def forward(self, input, ctx):
            return input * 2

    torch.manual_seed(0)
    g = Graph.somatize(Front() >> Scale() >> Back())
    t = Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g), lr=0.1))
    for nid in ("scale", "nowhere"):
        with pytest.raises(ValueError, match=f"{nid!r}.*nothing was loaded"):
            t.load({nid: {"w": torch.zeros(1)}})
