"""Placement: tensors moved to a node's device on arrival, modules moved when built."""

from __future__ import annotations

import warnings

import pytest
import torch
from _nodes import Lin
from torch import nn

import somatize.torch  # noqa: F401
from somatize import Graph, Node


class Where(Node):
    def forward(self, input, ctx):
        return input


class Holder(Node):
    def __init__(self) -> None:
        self.net = nn.Sequential(nn.Linear(2, 2))

    def forward(self, input, ctx):
        return self.net(input)


def test_tensors_inside_containers_are_moved_to_the_node_device():
    x = {"a": [torch.ones(2)], "b": (torch.zeros(1), 3)}
    out = Graph.somatize(Where().on("meta")).forward(x)
    assert out["a"][0].device.type == "meta" and out["b"][0].device.type == "meta"
    assert out["b"][1] == 3 and isinstance(out["b"], tuple)


def test_module_nodes_are_moved_when_the_graph_is_built_both_ways():
    a, b = Lin(), Holder()
    with pytest.warns(UserWarning) as said:
        Graph.somatize(a.on("meta") >> b.on("meta"))
    assert [str(w.message).split(" placed")[0] for w in said] == ["a Lin", "a Holder"]
    assert all(".on('meta') loses its weights' values" in str(w.message) for w in said)
    assert a.lin.weight.device.type == "meta"
    assert b.net[0].weight.device.type == "meta"
    with warnings.catch_warnings():  # already there: nothing is lost, nothing said
        warnings.simplefilter("error")
        Graph.somatize(a.on("meta") >> b.on("meta"))


def test_autograd_history_crosses_edges():
    a = Lin()
    x = torch.randn(3, 2, requires_grad=True)
    y = Graph.somatize(Where() >> a >> Where()).forward(x)
    y.sum().backward()
    assert x.grad is not None and a.lin.weight.grad is not None


def test_hooks_on_a_node_that_is_a_module_fire():
    a = Lin()
    seen = []
    a.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    Graph.somatize(Where() >> a).forward(torch.ones(4, 2))
    assert seen == [torch.Size([4, 2])]


def test_a_device_this_machine_lacks_is_refused_naming_the_node_and_leaving_the_graph_as_it_was():
    g = Graph()
    g.node(Where())
    # no CUDA: a ValueError naming the node; CUDA without a 64th GPU: torch's own error, with
    # a note naming the node
    with pytest.raises(Exception) as info:
        g.node("far", Lin().on("cuda:63"))
    said = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "'far'" in said and "'cuda:63'" in said and ".on(" in said
    assert g.nodes() == ["where"] and g.devices() == {}
    if not torch.backends.mps.is_available():  # a module as it is: named by its class
        with pytest.raises(ValueError, match=r"'linear': a Linear is placed \.on\('mps'\)"):
            g.node(Node.of(nn.Linear(2, 2)).on("mps"))
        assert g.nodes() == ["where"]


def test_a_node_that_fails_on_its_device_is_named_with_the_device():
    class Strict(Node):
        def forward(self, input, ctx):
            raise ValueError(f"no kernel for {input.device}")

    with pytest.raises(ValueError, match="meta") as info:
        Graph.somatize(Where() >> Strict().on("meta")).forward(torch.ones(2))
    assert "while running node 'strict' (Strict), placed .on('meta')" in info.value.__notes__
