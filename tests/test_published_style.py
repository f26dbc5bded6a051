"""Code written the published way (somatize 1.0.1: `Opaque` for every tensor crossing an edge
and given as an input, the spec's signatures), asserting what the published package documents,
and beside it the places where this one does better."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

from somatize import Graph, Node, Opaque

# -- training --


class Encoder(Node, nn.Module):
    """Written the published way: what it produces crosses the edge in an Opaque."""

    def __init__(self, i: int = 8, o: int = 16) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, input, ctx):
        return Opaque(torch.relu(self.lin(input)))


class Head(Node, nn.Module):
    def __init__(self, i: int = 16, o: int = 4) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o)

    def forward(self, input, ctx):
        return Opaque(self.lin(input))


class Tokenizer(Node):
    """A node with nothing to train."""

    def forward(self, input, ctx):
        return Opaque(input)


def _net(seed: int = 0) -> Graph:
    torch.manual_seed(seed)
    return Graph.somatize(Encoder().named("encoder") >> Head().named("head"))


def _data(n: int = 3, rows: int = 8):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 8, generator=gen), torch.randint(0, 4, (rows,), generator=gen))
        for _ in range(n)
    ]


def test_training_on_opaque_batches_takes_the_steps_of_the_bare_batches():
    from somatize.torch import Trainer, parameters

    g1, g2 = _net(), _net()
    t1 = Trainer(g1, objective=cross_entropy, optimizer=torch.optim.Adam(parameters(g1), lr=1e-3))
    t2 = Trainer(g2, objective=cross_entropy, optimizer=torch.optim.Adam(parameters(g2), lr=1e-3))
    for x, y in _data():
        assert t1.step((Opaque(x), Opaque(y))) == t2.step((x, y))
    for node, weights in t1.export().items():
        for key, value in weights.items():
            assert torch.equal(value, t2.export()[node][key]), (node, key)


def test_a_result_prints_as_one_line_with_its_steps_and_first_and_last_loss():
    from somatize.torch import Result, Trainer, parameters

    g = _net()
    t = Trainer(g, objective=cross_entropy, optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
    result = t.fit(_data(), epochs=4)
    assert isinstance(result, Result) and len(result.history) == 12
    line = repr(result)
    assert "\n" not in line and "12 steps" in line
    assert f"{result.history[0]:.3g}" in line and f"{result.history[-1]:.3g}" in line
    assert result.loss == result.history[-1]


def test_a_bad_watching_or_auditing_can_be_caught_as_a_value_error():
    from somatize.torch import Trainer, parameters

    g = _net()
    for bad in ({"watching": 42}, {"auditing": "yes"}):
        with pytest.raises(ValueError):
            Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD(parameters(g)), **bad)


def test_a_trainer_over_nothing_to_train_and_trains_on_a_node_without_parameters_are_refused():
    from somatize.torch import Split, Trainer, parameters

    g = Graph.somatize(Tokenizer().named("tok"))
    with pytest.raises(ValueError, match="nothing to train"):
        Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))]))
    torch.manual_seed(0)
    g = Graph.somatize(Tokenizer().named("tok") >> Encoder().named("encoder") >> Head())
    trains = {"tok": Split(torch.optim.SGD, lr=0.1)}
    with pytest.raises(ValueError, match="'tok'"):
        Trainer(
            g,
            objective=cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
        )


def test_micro_pieces_of_an_input_and_a_target_of_other_lengths_are_refused():
    from somatize.torch import Trainer, parameters

    g = _net()
    t = Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD(parameters(g)), micro=2)
    x, _ = _data(1)[0]
    with pytest.raises(ValueError, match="differ"):
        t.step((Opaque(x), Opaque(torch.zeros(4, dtype=torch.long))))


def test_an_optimizer_over_a_subset_trains_that_subset_and_the_rest_stays_as_in_torch():
    from somatize.torch import Trainer

    g = _net()
    head = g.implementation("head")
    encoder_before = g.implementation("encoder").lin.weight.detach().clone()
    t = Trainer(g, objective=cross_entropy, optimizer=torch.optim.SGD(head.parameters(), lr=0.1))
    head_before = head.lin.weight.detach().clone()
    t.fit(_data())
    assert torch.equal(g.implementation("encoder").lin.weight, encoder_before)
    assert not torch.equal(head.lin.weight, head_before)


def test_no_gradient_names_the_parameters_of_a_cut_and_how_to_say_it_is_on_purpose():
    from somatize.torch import Greedy, NoGradient, Trainer, parameters

    torch.manual_seed(0)
    g = Graph.somatize(Encoder().named("front") >> Encoder(16, 16).named("body") >> Head())
    trains = {"body": Greedy(torch.optim.SGD, head=nn.Linear(16, 4), lr=0.1)}
    t = Trainer(
        g,
        objective=cross_entropy,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
    )
    with pytest.raises(NoGradient, match=r"front\.lin\.weight.*without=\['front'\]"):
        t.step(_data(1)[0])


def test_the_learning_hole_a_technique_writes_learn_and_nothing_else():
    """The spec: "A technique writes learn(signal, ctx) and nothing else"; here a hand-written
    Split, stepped where the group closes."""
    from somatize.torch import Learning, Split, Trainer, parameters

    class Mine(Learning):
        def learn(self, signal, ctx):
            if signal is not None:
                torch.autograd.backward([self.waiting()], [signal])
            if self.closes():
                self.optimizer.step()
                self.optimizer.zero_grad()
            given = self.done()
            return given.grad if given is not None and given.requires_grad else None

    results = []
    for technique in (Mine, Split):
        torch.manual_seed(0)
        g = Graph.somatize(Encoder().named("front") >> Encoder(16, 16).named("body") >> Head())
        trains = {"body": technique(torch.optim.SGD, lr=0.1)}
        t = Trainer(
            g,
            objective=cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
        )
        results.append(t.fit(_data()).history)
    assert results[0] == pytest.approx(results[1], abs=1e-6)


def test_better_the_same_hole_answered_four_ways():
    """Split, Greedy, Synthetic and ForwardForward each train the node they are given."""
    from somatize.torch import ForwardForward, Greedy, Split, Synthetic, Trainer, parameters

    SGD = torch.optim.SGD
    for trains in (
        {"body": Split(SGD, lr=0.1)},
        {"body": Synthetic(SGD, lr=0.1)},
        {"front": Greedy(SGD, head=nn.Linear(16, 4), lr=0.1)},
        {"front": ForwardForward(SGD, lr=0.1)},
    ):
        torch.manual_seed(0)
        g = Graph.somatize(Encoder().named("front") >> Encoder(16, 16).named("body") >> Head())
        (nid,) = trains
        before = g.implementation(nid).lin.weight.detach().clone()
        t = Trainer(
            g,
            objective=cross_entropy,
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
        )
        t.fit(_data(4), epochs=2)
        assert not torch.equal(g.implementation(nid).lin.weight, before), trains
