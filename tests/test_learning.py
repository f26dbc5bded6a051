"""The Learning hole: envelopes, the group a Learning keeps, Split, and a technique of one's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from somatize import Graph, Node
from somatize.torch import (
    Enters,
    Envelope,
    Learning,
    NoGradient,
    OutOfStep,
    Split,
    Synthetic,
    Trainer,
    envelope,
    gradient,
    parameters,
)

mse = nn.functional.mse_loss
SGD = torch.optim.SGD


class Layer(Node, nn.Module):
    def __init__(self, i: int, o: int) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(i, o, dtype=torch.float64)

    def forward(self, x, ctx):
        return self.lin(x)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(4, 3, dtype=torch.float64, generator=gen),
        torch.randn(4, 2, dtype=torch.float64, generator=gen),
    )


def chain():
    torch.manual_seed(0)
    return Graph.somatize(
        Layer(3, 3).named("a") >> Layer(3, 3).named("enc") >> Layer(3, 2).named("head")
    )


def test_an_envelope_carries_a_gradient_and_whether_it_closes():
    t = torch.ones(2)
    e = envelope(t, closing=True)
    assert isinstance(e, Envelope) and e.closing and gradient(e) is t
    assert envelope(t).closing is False
    assert gradient({"x": envelope(t), "y": envelope(2 * t), "z": envelope(None)}).tolist() == [
        3,
        3,
    ]
    assert gradient(envelope(None)) is None
    assert gradient(t) is None and gradient({"x": t}) is None and gradient({}) is None
    assert gradient(envelope(t.double()), device="cpu").dtype == torch.float64


def test_a_learning_refuses_what_cannot_work():
    with pytest.raises(TypeError, match="factory"):
        Split("sgd")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="every"):
            Split(SGD, every=bad)
    learning = Split(SGD, lr=0.1).of(Layer(2, 2))
    with pytest.raises(ValueError, match="one node"):
        learning.of(Layer(2, 2))
    with pytest.raises(ValueError, match="no node"):
        Split(SGD).training()

    class Nothing(Learning):
        pass

    with pytest.raises(NotImplementedError, match="learn"):
        Nothing(SGD).learn(None, None)


def test_its_own_every_wins_and_the_optimizer_is_built_where_it_is_first_needed():
    assert Split(SGD).accumulating(3).every == 3
    assert Split(SGD, every=2).accumulating(3).every == 2
    layer = Layer(2, 2)
    learning = Split(SGD, lr=0.5).of(layer)
    opt = learning.optimizer
    assert isinstance(opt, SGD) and opt.param_groups[0]["lr"] == 0.5
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in layer.parameters()}
    assert learning.optimizer is opt
    enters, itself = learning.beside()
    assert isinstance(enters, Enters) and itself is learning and learning.beside()[0] is enters


def test_learn_without_an_activation_is_out_of_step():
    learning = Split(SGD, lr=0.1).of(Layer(2, 2))
    with pytest.raises(OutOfStep, match="a step apart"):
        learning.learn(torch.ones(1, 2, dtype=torch.float64), None)
    assert issubclass(OutOfStep, ValueError)
    with pytest.raises(OutOfStep):
        learning.waiting()


def test_the_two_positions_by_hand_give_dl_dinput():
    layer = Layer(3, 2)
    learning = Split(SGD, lr=0.0).of(layer)
    enters, after = learning.beside()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    given = enters.forward(x, None)
    assert given is not x and given.is_leaf and given.requires_grad
    out = after.forward(layer.forward(given, None), None)
    assert learning.waiting() is out
    signal = torch.ones(5, 2, dtype=torch.float64)
    back = after.forward(envelope(signal, closing=True), None)
    assert isinstance(back, Envelope) and back.closing
    assert torch.allclose(back.gradient, signal @ layer.lin.weight)
    assert torch.allclose(layer.lin.weight.grad, signal.T @ x.detach())
    assert learning.held is None and learning.given is None  # dropped after each learn


def test_split_with_its_own_every_steps_on_its_own_count():
    for micro in (1, 2):
        g = chain()
        trains = {"enc": Split(SGD, lr=0.1, every=2)}
        t = Trainer(
            g,
            objective=mse,
            optimizer=SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
            micro=micro,
        )
        w = g.implementation("enc").lin.weight
        seen = [w.clone()]
        for k in range(4):
            t.step(batch(k))
            seen.append(w.clone())
        moved = [not seen[k + 1].equal(seen[k]) for k in range(4)]
        assert moved == [False, True, False, True], micro


class Stop(Learning):
    """A technique that trains nothing and owes nothing upstream: the cut is on purpose."""

    def learn(self, signal, ctx):
        self.done()
        return None


def test_a_technique_that_gives_nothing_back_starves_upstream_and_says_so():
    g = chain()
    trains = {"enc": Stop(SGD)}
    t = Trainer(
        g, objective=mse, optimizer=SGD(parameters(g, without=trains), lr=0.1), trains=trains
    )
    with pytest.raises(NoGradient, match=r"'a'.*a\.lin\.weight"):
        t.step(batch())

    # Said on purpose: what is before the cut is frozen, and the rest trains.
    g = Graph.somatize(
        Layer(3, 3).named("a").frozen() >> Layer(3, 3).named("enc") >> Layer(3, 2).named("head")
    )
    trains = {"enc": Stop(SGD)}
    t = Trainer(
        g, objective=mse, optimizer=SGD(parameters(g, without=trains), lr=0.1), trains=trains
    )
    before = g.implementation("head").lin.weight.clone()
    t.step(batch())
    assert not g.implementation("head").lin.weight.equal(before)


def test_a_refused_load_leaves_a_synthetic_without_the_guesser_it_would_have_built():
    def synthetic():
        g = chain()
        trains = {"enc": Synthetic(SGD, lr=0.1)}
        opt = SGD(parameters(g, without=trains), lr=0.1)
        return Trainer(g, objective=mse, optimizer=opt, trains=trains)

    trained = synthetic()
    trained.fit([batch(0), batch(1)])
    saved = trained.export()
    assert "learning/guesser.weight" in saved["enc"]
    wrong = {**saved, "head": {"lin.weight": torch.zeros(1, dtype=torch.float64)}}

    def keys(t):
        return {n: sorted(s) for n, s in t.export().items()}

    t = synthetic()  # fresh: its guesser is built at the first output, or by a load
    before = keys(t)
    assert "learning/guesser.weight" not in before["enc"]
    with pytest.raises(ValueError, match=r"strict=True.*leave out node 'a'"):
        t.load({"enc": saved["enc"]}, strict=True)
    assert keys(t) == before  # no guesser built by the refused call
    with pytest.raises(ValueError, match=r"node 'head', 'lin.weight'.*shape"):
        t.load(wrong)
    assert keys(t) == before
    t.load(saved, strict=True)
    assert torch.equal(
        t.export()["enc"]["learning/guesser.weight"], saved["enc"]["learning/guesser.weight"]
    )
    with pytest.raises(ValueError, match="shape"):
        t.load(wrong)  # a guesser loaded before the refusal is kept, as it was
    assert torch.equal(
        t.export()["enc"]["learning/guesser.weight"], saved["enc"]["learning/guesser.weight"]
    )
    assert t.step(batch(2)) > 0


def test_strict_counts_the_keys_of_the_guesser_a_load_would_build():
    g = chain()
    trains = {"enc": Synthetic(SGD, lr=0.1)}
    t = Trainer(
        g, objective=mse, optimizer=SGD(parameters(g, without=trains), lr=0.1), trains=trains
    )
    weight = torch.full((3, 3), 0.5, dtype=torch.float64)
    before = t.export()  # no guesser yet: built at the first output, or by a load
    weights = {**before, "enc": {**before["enc"], "learning/guesser.weight": weight}}
    with pytest.raises(ValueError, match=r"strict=True.*'enc': learning/guesser\.bias"):
        t.load(weights, strict=True)  # the guesser it builds holds a bias, left out
    assert sorted(t.export()["enc"]) == sorted(before["enc"])  # none built
    t.load(weights)  # a subset: the bias is the one a guesser is built with
    got = t.export()["enc"]
    assert torch.equal(got["learning/guesser.weight"], weight)
    assert torch.equal(got["learning/guesser.bias"], torch.zeros(3, dtype=torch.float64))
    assert t.step(batch(2)) > 0
