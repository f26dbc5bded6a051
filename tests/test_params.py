"""parameters and freeze, for both ways of being a torch node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from somatize import Graph, Node
from somatize.torch import freeze, named_parameters, parameters
from somatize.torch.training.params import state_of


class Is(Node, nn.Module):
    def __init__(self, i: int = 2, o: int = 2) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)
        self.norm = nn.BatchNorm1d(o)

    def forward(self, x, ctx):
        return self.norm(self.lin(x))


class Holds(Node):
    def __init__(self, shared: nn.Module | None = None) -> None:
        self.net = nn.Linear(2, 2)
        self.blocks = [nn.Linear(2, 2), shared or nn.Linear(2, 2)]

    def forward(self, x, ctx):
        return self.blocks[1](self.blocks[0](self.net(x)))


class Plain(Node):
    def forward(self, x, ctx):
        return x


def test_parameters_of_both_kinds_in_declaration_order_once_each():
    shared = nn.Linear(2, 2)
    a, b, c = Is(), Holds(shared), Holds(shared)
    g = Graph.somatize(Plain() >> a.named("a") >> b.named("b") >> c.named("c"))
    got = parameters(g)
    expected = list(a.parameters()) + [*b.net.parameters(), *b.blocks[0].parameters()]
    expected += list(shared.parameters()) + [*c.net.parameters(), *c.blocks[0].parameters()]
    assert [id(p) for p in got] == [id(p) for p in expected]
    assert [id(p) for p in parameters(g, without={"a": None, "c": None})] == [
        id(p) for p in [*b.net.parameters(), *b.blocks[0].parameters(), *shared.parameters()]
    ]


def test_frozen_nodes_and_parameters_that_ask_no_gradient_are_left_out():
    a, b = Is(), Is()
    b.lin.bias.requires_grad_(False)
    g = Graph.somatize(a.named("a").frozen() >> b.named("b"))
    got = {id(p) for p in parameters(g)}
    assert got == {id(b.lin.weight), id(b.norm.weight), id(b.norm.bias)}


def test_freeze_with_no_ids_obeys_what_was_declared():
    a, b = Is(), Holds()
    g = Graph.somatize(a.named("a").frozen() >> b.named("b"))
    assert a.training and all(p.requires_grad for p in a.parameters())
    freeze(g)
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    assert all(p.requires_grad for p in b.net.parameters())


def test_freeze_with_ids_declares_and_obeys_and_refuses_unknown_ids_first():
    a, b = Is(), Holds()
    g = Graph.somatize(a.named("a") >> b.named("b"))
    with pytest.raises(ValueError, match="nope"):
        freeze(g, "b", "nope")
    assert g.frozen() == {} and all(p.requires_grad for p in b.net.parameters())
    freeze(g, "b")
    assert set(g.frozen()) == {"b"} and g.frozen()["b"].startswith("sha256:")
    assert not any(p.requires_grad for m in (b.net, *b.blocks) for p in m.parameters())
    assert parameters(g) == list(a.parameters())
    g.forward(torch.zeros(3, 2))  # the plan is rebuilt with the new declaration


def test_state_of_reads_both_kinds_with_buffers():
    assert set(state_of(Is())) == {
        "lin.weight",
        "lin.bias",
        "norm.weight",
        "norm.bias",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    }
    assert set(state_of(Holds())) == {
        "net.weight",
        "net.bias",
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    }
    assert state_of(Plain()) == {}


def test_named_parameters_names_each_parameter_by_its_node_and_key_for_groups_by_name():
    shared = nn.Linear(2, 2)
    g = Graph.somatize(
        Is().named("a") >> Holds(shared).named("b") >> Holds(shared).named("c") >> Plain()
    )
    freeze(g, "a")
    named = named_parameters(g)
    assert [p for _, p in named] == parameters(g)  # the same, in the same order
    assert [n for n, _ in named] == [
        "b.net.weight",
        "b.net.bias",
        "b.blocks.0.weight",
        "b.blocks.0.bias",
        "b.blocks.1.weight",
        "b.blocks.1.bias",  # the module b and c share goes by its first
        "c.net.weight",
        "c.net.bias",
        "c.blocks.0.weight",
        "c.blocks.0.bias",
    ]
    assert [n for n, _ in named_parameters(g, without=["b"])][0] == "c.net.weight"
    decay = [p for n, p in named if not n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}], lr=1e-3)
    assert len(opt.param_groups[0]["params"]) == 5


def test_parameters_of_a_bare_module_as_the_trainer_takes_one():
    from somatize.torch import Trainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert parameters(model) == list(model.parameters())
    assert [n for n, _ in named_parameters(model)] == [
        "sequential.0.weight",
        "sequential.0.bias",
        "sequential.2.weight",
        "sequential.2.bias",
    ]
    before = model[0].weight.detach().clone()
    t = Trainer(
        model,
        objective=nn.functional.mse_loss,
        optimizer=torch.optim.SGD(parameters(model), lr=0.1),
    )
    t.step((torch.randn(5, 3), torch.randn(5, 2)))
    assert not torch.equal(model[0].weight.detach(), before)
