"""Greedy, Synthetic and ForwardForward: each rule against the same rule worked out by hand,
with every, micro, update(), export/load, an audit, and across a worker as in process."""

from __future__ import annotations

import math

import pytest
import torch
from _nodes import Layer
from torch import nn
from torch.nn.functional import mse_loss, softplus

from somatize import Broker, Graph, NoCodec, Node, Worker
from somatize.torch import (
    Audit,
    ForwardForward,
    Greedy,
    NoGradient,
    Split,
    Synthetic,
    Trainer,
    envelope,
    parameters,
)
from somatize.torch.training.synthetic import Guesser

SGD = torch.optim.SGD
F64 = torch.float64


def close(got, expected, n=None):
    """Equal to a float64 reference within what rounding of n terms can account for."""
    n = n or max(expected.numel(), 1)
    tol = 64 * torch.finfo(F64).eps * math.sqrt(n)
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    assert torch.allclose(got, expected, rtol=0, atol=tol * max(scale, 1.0)), (got, expected)


def positions(learning, node, x):
    """A step by hand through the Learning's two positions: what the node was given, and what
    the one after it hands on."""
    enters, after = learning.beside()
    given = enters.forward(x, None)
    return given, after.forward(node.forward(given, None), None)


def data(n=4, seed=1, rows=6, i=3, o=2, classes=None):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(rows, i, dtype=F64, generator=gen)
        if classes:
            y = torch.randint(0, classes, (rows,), generator=gen)
        else:
            y = torch.randn(rows, o, dtype=F64, generator=gen)
        out.append((x, y))
    return out


# -- each rule, by hand ---------------------------------------------------------------------


def test_greedy_steps_the_node_and_its_head_on_its_own_loss_and_gives_nothing_back():
    torch.manual_seed(0)
    node = Layer(3, 2, act=False)
    head = nn.Linear(2, 2, dtype=F64)
    W, b = node.lin.weight.detach().clone(), node.lin.bias.detach().clone()
    V, c = head.weight.detach().clone(), head.bias.detach().clone()
    ((x, y),) = data(1, rows=5)
    learning = Greedy(SGD, head=head, lr=0.1).of(node).tell(every=1, objective=mse_loss)
    learning.target = y
    _, out = positions(learning, node, x)
    h = x @ W.T + b
    assert not out.requires_grad  # handed on detached
    close(out, h)  # what the node computed (addmm rounds otherwise than x @ W.T + b)
    back = learning.forward(envelope(None, closing=True), None)
    assert back.gradient is None and back.closing

    o = h @ V.T + c
    do = 2 * (o - y) / o.numel()
    dh = do @ V
    close(head.weight.detach(), V - 0.1 * do.T @ h)
    close(head.bias.detach(), c - 0.1 * do.sum(0))
    close(node.lin.weight.detach(), W - 0.1 * dh.T @ x)
    close(node.lin.bias.detach(), b - 0.1 * dh.sum(0))
    assert learning.held is None and learning.target is None


def test_synthetic_moves_the_node_with_the_guess_before_the_true_gradient_arrives():
    torch.manual_seed(0)
    node = Layer(3, 2, act=False)
    learning = Synthetic(SGD, lr=0.1).of(node).tell(every=1)
    learning.guesser = Guesser(2, dtype=F64)  # as a load of one of that shape builds it
    with torch.no_grad():
        learning.guesser.weight.copy_(torch.randn(2, 2, dtype=F64))
        learning.guesser.bias.copy_(torch.randn(2, dtype=F64))
    W, b = node.lin.weight.detach().clone(), node.lin.bias.detach().clone()
    M, m = learning.guesser.weight.detach().clone(), learning.guesser.bias.detach().clone()
    ((x, true),) = data(1, rows=5)
    x.requires_grad_(True)  # something upstream asks for dL/d(input)
    _, out = positions(learning, node, x)
    h = x.detach() @ W.T + b
    guess = h @ M.T + m
    # the forward is over, no gradient has come back: the node has moved already
    close(node.lin.weight.detach(), W - 0.1 * guess.T @ x.detach())
    close(node.lin.bias.detach(), b - 0.1 * guess.sum(0))
    assert torch.equal(learning.guesser.weight.detach(), M)
    moved = node.lin.weight.detach().clone()

    back = learning.forward(envelope(true, closing=True), None)
    close(back.gradient, guess @ W)  # under the guess, through the weights the forward ran
    miss = guess - true
    close(learning.guesser.weight.detach(), M - 0.1 * miss.T @ h)
    close(learning.guesser.bias.detach(), m - 0.1 * miss.sum(0))
    assert torch.equal(node.lin.weight.detach(), moved)  # the true gradient teaches the guesser


class Score(Node, nn.Module):
    """One number per example: an output of shape (batch,)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(3, 1, dtype=F64)

    def forward(self, x, ctx):
        return self.lin(x).squeeze(-1)


def test_synthetic_guesses_the_gradient_of_one_number_per_example():
    torch.manual_seed(0)
    node = Score()
    learning = Synthetic(SGD, lr=0.1).of(node).tell(every=1)
    learning.guesser = Guesser(1, dtype=F64)
    with torch.no_grad():
        learning.guesser.weight.fill_(0.5)
        learning.guesser.bias.fill_(-0.25)
    W, b = node.lin.weight.detach().clone(), node.lin.bias.detach().clone()
    ((x, true),) = data(1, rows=5, o=1)
    true = true.squeeze(-1)
    x.requires_grad_(True)
    _, out = positions(learning, node, x)
    h = (x.detach() @ W.T + b).squeeze(-1)
    guess = 0.5 * h - 0.25
    assert out.shape == (5,)
    close(node.lin.weight.detach(), W - 0.1 * guess[None] @ x.detach())
    close(node.lin.bias.detach(), b - 0.1 * guess.sum(0, keepdim=True))

    back = learning.forward(envelope(true, closing=True), None)
    close(back.gradient, guess[:, None] @ W)
    miss = guess - true
    close(learning.guesser.weight.detach(), torch.tensor([[0.5]], dtype=F64) - 0.1 * miss @ h)
    close(learning.guesser.bias.detach(), torch.tensor([-0.25], dtype=F64) - 0.1 * miss.sum(0))


def test_a_synthetic_guesser_is_built_from_the_first_output_and_moves_nothing_at_first():
    torch.manual_seed(0)
    node = Layer(3, 4)
    learning = Synthetic(SGD, lr=0.1).of(node).tell(every=1)
    assert learning.guesser is None
    before = node.lin.weight.detach().clone()
    ((x, _),) = data(1, rows=5)
    positions(learning, node, x)
    assert learning.guesser.weight.shape == (4, 4) and learning.guesser.weight.dtype == F64
    assert torch.equal(node.lin.weight.detach(), before)  # a guess of zero
    learning.forward(envelope(torch.ones(5, 4, dtype=F64), closing=True), None)
    assert learning.guesser.weight.abs().sum() > 0  # and it learnt


def test_forward_forward_scores_its_goodness_against_blends_of_two_classes():
    torch.manual_seed(0)
    node = Layer(3, 4)  # tanh
    W, b = node.lin.weight.detach().clone(), node.lin.bias.detach().clone()
    x = torch.randn(4, 3, dtype=F64)
    y = torch.tensor([0, 0, 1, 2])
    theta = 0.5
    learning = ForwardForward(SGD, lr=0.1, threshold=theta).of(node).tell(every=1)
    learning.target = y
    _, out = positions(learning, node, x)
    assert not out.requires_grad
    assert learning.forward(envelope(None, closing=True), None).gradient is None

    # the nearest row after each whose class differs: rows 0 and 1 go with row 2, 2 with 3,
    # 3 (going round) with 0
    negative = 0.5 * (x + x[torch.tensor([2, 2, 3, 0])])
    rows, features = 4, 4

    def dz(inputs, sign):
        a = torch.tanh(inputs @ W.T + b)
        g = a.pow(2).mean(1)
        # d/dG of softplus(sign * (G - theta)), averaged over the 2 * rows terms
        dg = sign * torch.sigmoid(sign * (g - theta)) / (2 * rows)
        return (dg[:, None] * 2 * a / features) * (1 - a.pow(2))

    zp, zn = dz(x, -1.0), dz(negative, 1.0)
    close(node.lin.weight.detach(), W - 0.1 * (zp.T @ x + zn.T @ negative))
    close(node.lin.bias.detach(), b - 0.1 * (zp.sum(0) + zn.sum(0)))
    loss = softplus(
        torch.cat(
            [
                theta - torch.tanh(x @ W.T + b).pow(2).mean(1),
                torch.tanh(negative @ W.T + b).pow(2).mean(1) - theta,
            ]
        )
    ).mean()
    assert 0 < loss < 2  # the rule above is the loss's gradient, and the loss is a number


class Pair(Node, nn.Module):
    """A layer whose output is a dict of two tensors: no technique's one tensor."""

    def __init__(self):
        nn.Module.__init__(self)
        self.lin = nn.Linear(3, 2, dtype=F64)

    def forward(self, x, ctx):
        return {"a": self.lin(x), "b": x}


def test_forward_forward_scores_one_number_per_example_and_refuses_what_is_no_tensor():
    torch.manual_seed(0)
    node = Score()  # no activation: the goodness of a row is the square of its one number
    W, b = node.lin.weight.detach().clone(), node.lin.bias.detach().clone()
    x = torch.randn(4, 3, dtype=F64)
    theta = 0.5
    learning = ForwardForward(SGD, lr=0.1, threshold=theta).of(node).tell(every=1)
    learning.target = torch.tensor([0, 0, 1, 2])
    _, out = positions(learning, node, x)
    assert out.shape == (4,)
    learning.forward(envelope(None, closing=True), None)
    negative = 0.5 * (x + x[torch.tensor([2, 2, 3, 0])])

    def dz(inputs, sign):
        a = inputs @ W.T + b
        g = a.pow(2).mean(1)
        return (sign * torch.sigmoid(sign * (g - theta)) / 8)[:, None] * 2 * a

    zp, zn = dz(x, -1.0), dz(negative, 1.0)
    close(node.lin.weight.detach(), W - 0.1 * (zp.T @ x + zn.T @ negative))
    close(node.lin.bias.detach(), b - 0.1 * (zp.sum(0) + zn.sum(0)))

    class Pick(Node, nn.Module):
        def __init__(self):
            nn.Module.__init__(self)
            self.lin = nn.Linear(2, 2, dtype=F64)

        def forward(self, x, ctx):
            return self.lin(x["a"])

    g = Graph.somatize(Pair().named("pair") >> Pick().named("out"))
    trains = {"pair": ForwardForward(SGD, lr=0.1)}
    t = Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g, without=trains)), trains=trains)
    before = g.implementation("pair").lin.weight.detach().clone()
    with pytest.raises(TypeError, match="goodness of what node 'pair' produces.*produced dict"):
        t.step(data(1)[0])
    assert torch.equal(g.implementation("pair").lin.weight.detach(), before)


def test_what_each_technique_refuses():
    with pytest.raises(TypeError, match="nn.Module"):
        Greedy(SGD, head="linear")
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="threshold"):
            ForwardForward(SGD, threshold=bad)
    with pytest.raises(ValueError, match="objective"):
        learning = Greedy(SGD, head=nn.Linear(2, 2, dtype=F64)).of(Layer(3, 2)).tell(every=1)
        positions(learning, learning.node, torch.ones(2, 3, dtype=F64))
        learning.forward(envelope(None, True), None)

    torch.manual_seed(0)
    g = Graph.somatize(Pair().named("pair") >> Layer(2, 2).named("head"))
    trains = {"pair": Synthetic(SGD, lr=0.1)}
    t = Trainer(
        g,
        objective=lambda out, y: mse_loss(out, y),
        optimizer=SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
    )
    with pytest.raises(TypeError, match="'pair' produced dict"):
        t.step(data(1)[0])
    g = Graph.somatize(Layer(3, 2).named("a") >> Layer(2, 2).named("head"))
    trains = {"a": ForwardForward(SGD, lr=0.1)}
    t = Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g, without=trains)), trains=trains)
    with pytest.raises(TypeError, match="at least two rows"):
        t.step(data(1, rows=1)[0])


# -- in a Trainer ---------------------------------------------------------------------------


def first(kind=None, seed=0):
    """The technique on the first node `a`, a head after it trained by the Trainer."""
    torch.manual_seed(seed)
    return Graph.somatize(Layer(3, 4).named("a") >> Layer(4, 2, False).named("head"))


def middle(seed=0):
    torch.manual_seed(seed)
    return Graph.somatize(
        Layer(3, 4).named("front") >> Layer(4, 4).named("mid") >> Layer(4, 2, False).named("head")
    )


def technique(kind, **kw):
    if kind == "greedy":
        torch.manual_seed(7)
        return Greedy(SGD, head=nn.Linear(4, 2, dtype=F64), lr=0.1, **kw)
    if kind == "synthetic":
        return Synthetic(SGD, lr=0.1, **kw)
    if kind == "ff":
        return ForwardForward(SGD, lr=0.1, threshold=0.5, **kw)
    return Split(SGD, lr=0.1, **kw)


def trainer(kind, g=None, *, objective=mse_loss, broker=None, **kw):
    nid = "mid" if kind == "synthetic" else "a"
    if g is None:
        g = middle() if kind == "synthetic" else first(kind)
    trains = {nid: technique(kind)}
    opt = SGD(parameters(g, without=trains), lr=0.1)
    return Trainer(g, objective=objective, optimizer=opt, trains=trains, broker=broker, **kw)


def objective_of(kind):
    return nn.functional.cross_entropy if kind == "ff" else mse_loss


def batches_of(kind, n=4, rows=6):
    return data(n, rows=rows, classes=2) if kind == "ff" else data(n, rows=rows)


def same(w1, w2, tol=1e-12):
    assert w1.keys() == w2.keys()
    for n in w1:
        assert w1[n].keys() == w2[n].keys(), n
        for k in w1[n]:
            assert torch.allclose(w1[n][k], w2[n][k], atol=tol, rtol=0), (n, k)


def joined(a, b):
    return torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])


@pytest.mark.parametrize("kind", ["greedy", "synthetic"])
def test_every_and_micro_give_one_step_on_the_joined_batch(kind):
    data4 = batches_of(kind)
    t1 = trainer(kind, every=2)
    t2 = trainer(kind, micro=2)
    t3 = trainer(kind)
    for k in range(0, 4, 2):
        t1.step(data4[k])
        t1.step(data4[k + 1])
        both = joined(data4[k], data4[k + 1])
        t2.step(both)
        t3.step(both)
    same(t1.export(), t3.export())
    same(t2.export(), t3.export())
    trained = "mid" if kind == "synthetic" else "a"
    fresh = trainer(kind).export()[trained]
    assert not t3.export()[trained]["lin.weight"].equal(fresh["lin.weight"])


def test_forward_forward_cut_in_micro_pieces_is_every_over_those_pieces():
    # its negatives are made within what it is handed, so micro=2 on a joined batch is
    # every=2 on its halves (not one step on the whole, whose rows would pair across halves)
    data4 = batches_of("ff")
    pieces = trainer("ff", objective=objective_of("ff"), every=2)
    micro = trainer("ff", objective=objective_of("ff"), micro=2)
    for k in range(0, 4, 2):
        pieces.step(data4[k])
        pieces.step(data4[k + 1])
        micro.step(joined(data4[k], data4[k + 1]))
    same(pieces.export(), micro.export())
    fresh = trainer("ff", objective=objective_of("ff")).export()["a"]
    assert not micro.export()["a"]["lin.weight"].equal(fresh["lin.weight"])


@pytest.mark.parametrize("kind", ["greedy", "synthetic", "ff"])
def test_a_group_moves_the_node_only_where_it_closes_and_update_applies_a_half_open_one(kind):
    nid = "mid" if kind == "synthetic" else "a"
    t = trainer(kind, objective=objective_of(kind), every=3)
    batches = batches_of(kind, 7)
    for b in batches[:3]:  # one group first: a Synthetic's first guesses are zero
        t.step(b)
    seen = [t.export()[nid]["lin.weight"]]
    for b in batches[3:]:
        t.step(b)
        seen.append(t.export()[nid]["lin.weight"])
    moved = [not seen[k + 1].equal(seen[k]) for k in range(4)]
    assert moved == [False, False, True, False]
    assert t.update() is True and not t.export()[nid]["lin.weight"].equal(seen[-1])
    assert t.update() is False

    with_own = {nid: technique(kind, every=2)}
    g = middle() if kind == "synthetic" else first(kind)
    t = Trainer(
        g,
        objective=objective_of(kind),
        optimizer=SGD(parameters(g, without=with_own), lr=0.1),
        trains=with_own,
    )
    for b in batches[:2]:
        t.step(b)
    seen = [t.export()[nid]["lin.weight"]]
    for b in batches[2:6]:
        t.step(b)
        seen.append(t.export()[nid]["lin.weight"])
    assert [not seen[k + 1].equal(seen[k]) for k in range(4)] == [False, True, False, True]


def still(kind, *, every=1, own=None, objective=None):
    """The technique with an `every` of its own (`own`) or the Trainer's, everything else held
    still (the Trainer's optimizer at lr=0): only what the technique moves moves."""
    g = middle() if kind == "synthetic" else first(kind)
    trains = {"mid" if kind == "synthetic" else "a": technique(kind, every=own)}
    opt = SGD(parameters(g, without=trains), lr=0.0)
    objective = objective or objective_of(kind)
    return Trainer(g, objective=objective, optimizer=opt, trains=trains, every=every)


def exported_close(got, expected):
    assert got.keys() == expected.keys()
    for n in expected:
        assert got[n].keys() == expected[n].keys(), n
        for k in expected[n]:
            close(got[n][k], expected[n][k], n=expected[n][k].numel() * 6)


@pytest.mark.parametrize("kind", ["split", "greedy", "synthetic", "ff"])
def test_a_group_of_its_own_is_a_mean_as_the_trainers_is(kind):
    # every=2 of its own, under a Trainer stepping every batch: two steps are one on the two
    # batches joined (ForwardForward pairs rows within what it is handed, so for it the same
    # two steps under Trainer(every=2)); two groups, so a Synthetic moves with a taught guess
    batches = batches_of(kind)
    own = still(kind, own=2)
    for b in batches:
        own.step(b)
    if kind == "ff":
        reference = still(kind, every=2)
        for b in batches:
            reference.step(b)
    else:
        reference = still(kind)
        for k in range(0, 4, 2):
            reference.step(joined(batches[k], batches[k + 1]))
    nid = "mid" if kind == "synthetic" else "a"
    fresh = still(kind).export()[nid]["lin.weight"]
    assert not reference.export()[nid]["lin.weight"].equal(fresh)  # it moved
    exported_close(own.export(), reference.export())


@pytest.mark.parametrize("kind", ["split", "greedy", "synthetic", "ff"])
def test_update_applies_a_group_of_its_own_left_open(kind):
    # under Trainer(every=1) only the technique's own group is open: update() applies it as
    # it applies the Trainer's (what accumulated over the group's every), and says so
    batches = batches_of(kind, 3)
    own, outer = still(kind, own=2), still(kind, every=2)
    nid = "mid" if kind == "synthetic" else "a"
    for t in (own, outer):
        for b in batches:  # a group, then one step of the next (a Synthetic's guess taught)
            t.step(b)
    before = own.export()[nid]["lin.weight"]
    assert own.update() is True and outer.update() is True
    assert not own.export()[nid]["lin.weight"].equal(before)
    exported_close(own.export(), outer.export())
    assert own.update() is False

    fitted = still(kind, own=2)  # an epoch of 3 batches ends with its group applied
    fitted.fit(batches)
    exported_close(fitted.export(), own.export())


def test_a_node_before_one_that_gives_nothing_back_is_a_cut():
    g = middle()
    trains = {"mid": Greedy(SGD, head=nn.Linear(4, 2, dtype=F64), lr=0.1)}
    t = Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g, without=trains)), trains=trains)
    with pytest.raises(NoGradient, match=r"front\.lin\.weight"):
        t.step(data(1)[0])
    g = middle()
    trains = {
        "front": Greedy(SGD, head=nn.Linear(4, 2, dtype=F64), lr=0.1),
        "mid": Greedy(SGD, head=nn.Linear(4, 2, dtype=F64), lr=0.1),
    }
    t = Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g, without=trains)), trains=trains)
    for b in data(2):
        t.step(b)  # greedy all the way down: every node learns


def test_what_crosses_a_cut_is_counted_forward_and_back():
    rows = 6
    activation = rows * 4 * 8  # float64
    expected = {
        "split": (activation, activation),  # the activation out, its gradient back
        "greedy": (activation + rows * 2 * 8, 0),  # and its target; nothing comes back
        "synthetic": (2 * activation, 2 * activation),  # both cuts of the middle node
    }
    for kind, (forward, back) in expected.items():
        heard = []
        t = trainer(kind, watching=heard.append)
        t.step(data(1, rows=rows)[0])
        (fact,) = [f for f in heard if f["fact"] == "crossed"]
        assert (fact["forward"], fact["backward"], fact["step"]) == (forward, back, 0), kind
    heard = []
    g = first("split")
    Trainer(g, objective=mse_loss, optimizer=SGD(parameters(g)), watching=heard.append).step(
        data(1)[0]
    )
    assert not [f for f in heard if f["fact"] == "crossed"]  # no cut, nothing crosses


@pytest.mark.parametrize("kind", ["greedy", "synthetic", "ff"])
def test_export_carries_what_it_brought_and_load_takes_it_back(kind):
    nid = "mid" if kind == "synthetic" else "a"
    objective = objective_of(kind)
    t1 = trainer(kind, objective=objective)
    batches = batches_of(kind, 6)
    for b in batches[:3]:
        t1.step(b)
    exported = t1.export()
    brought = {k for k in exported[nid] if k.startswith("learning/")}
    assert (
        brought
        == {
            "greedy": {"learning/head.weight", "learning/head.bias"},
            "synthetic": {"learning/guesser.weight", "learning/guesser.bias"},
            "ff": set(),
        }[kind]
    )
    t2 = trainer(kind, objective=objective)  # fresh: a Synthetic has no guesser yet
    t2.load(exported)
    same(t2.export(), exported, tol=0)
    for b in batches[3:]:
        t1.step(b)
        t2.step(b)
    same(t2.export(), t1.export())

    if brought:
        key = sorted(brought)[0]
        before = t2.export()
        plain = first(kind) if kind != "synthetic" else middle()
        t3 = Trainer(plain, objective=objective, optimizer=SGD(parameters(plain)))
        with pytest.raises(ValueError, match="nothing trains"):
            t3.load(exported)
        wrong = {**exported, nid: {**exported[nid], key: torch.zeros(7, dtype=F64)}}
        with pytest.raises(ValueError, match="shape"):
            t2.load(wrong)
        same(t2.export(), before, tol=0)  # refused whole


def test_what_one_technique_brought_is_refused_by_another_naming_the_keys():
    t = trainer("synthetic")  # it trains "mid", and brings a guesser
    t.step(data(1)[0])
    exported = t.export()
    g = middle()
    trains = {"mid": Split(SGD, lr=0.1)}
    split = Trainer(
        g, objective=mse_loss, optimizer=SGD(parameters(g, without=trains)), trains=trains
    )
    before = split.export()
    with pytest.raises(ValueError) as refused:
        split.load(exported)
    said = str(refused.value)
    assert "'learning/guesser.weight'" in said and "Split" in said and "''" not in said
    assert "node 'mid'" in said
    same(split.export(), before, tol=0)

    bad = {"mid": {**exported["mid"], "learning/guesser.bias": torch.zeros(7, dtype=F64)}}
    with pytest.raises(ValueError, match=r"Synthetic training node 'mid'.*guesser\.bias"):
        trainer("synthetic").load(bad)


@pytest.mark.parametrize("kind", ["greedy", "synthetic", "ff"])
def test_an_audit_sees_the_node_a_technique_trains_like_any_other(kind):
    heard = []
    t = trainer(kind, objective=objective_of(kind), auditing=Audit(every=1), watching=heard.append)
    for b in batches_of(kind, 3):
        t.step(b)
    t.close()
    health = [f for f in heard if f["fact"] == "health"]

    def where(f):
        return f.get("where") or f["node"]

    def numbers(f):
        return f.get("numbers", f)

    nid = "mid" if kind == "synthetic" else "a"
    assert {where(f) for f in health} == set(t.graph.nodes())
    mine = [numbers(f) for f in health if where(f) == nid]
    assert len(mine) == 3 and all(n["grad_norm"] >= 0 for n in mine)
    assert mine[-1]["grad_norm"] > 0  # (a Synthetic's first guess is zero)
    assert mine[-1].get("update_ratio", 1) > 0


# -- across a worker, as in process ---------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    """A worker that imports what it runs, and one started to accept code as well: Greedy's
    head is a module, which travels as code; the others travel by name, as Split does."""
    brokers = {
        "project": Broker.embedded({"far": Worker.spawn(["--threads", "1"], send=["_nodes"])}),
        "code": Broker.embedded({"far": Worker.spawn(["--threads", "1"], mode="network")}),
    }
    yield brokers
    for broker in brokers.values():
        broker.close()


@pytest.mark.parametrize("kind", ["greedy", "synthetic", "ff"])
def test_a_technique_on_a_worker_trains_to_the_weights_it_trains_to_here(kind, workers):
    far = workers["code" if kind == "greedy" else "project"]
    objective = objective_of(kind)
    nid = "mid" if kind == "synthetic" else "a"

    def build(host=None):
        torch.manual_seed(0)
        if kind == "synthetic":
            mid = Layer(4, 4).named("mid")
            return Graph.somatize(
                Layer(3, 4).named("front")
                >> (mid.at(host) if host else mid)
                >> Layer(4, 2, False).named("head")
            )
        a = Layer(3, 4).named("a")
        return Graph.somatize((a.at(host) if host else a) >> Layer(4, 2, False).named("head"))

    if kind == "greedy":  # its head is code: a worker that does not take code is not sent it
        refused = trainer(kind, build("far"), objective=objective, broker=workers["project"])
        with pytest.raises(NoCodec, match="a/learning.*--accept-code"):
            refused.step(batches_of(kind, 1)[0])
    here = trainer(kind, build(), objective=objective, every=2, micro=2)
    there = trainer(kind, build("far"), objective=objective, every=2, micro=2, broker=far)
    batches = batches_of(kind, 10)
    for b in batches:
        assert here.step(b) == pytest.approx(there.step(b), abs=1e-6)
    here.update(), there.update()
    same(there.export(), here.export(), tol=1e-6)  # what the worker learnt, asked of it
    kept = there.graph.implementation(nid).lin.weight
    # export brought the copy here up to what the worker learnt (what a restart re-sends)
    assert torch.allclose(kept, here.graph.implementation(nid).lin.weight, atol=1e-6)

    # loaded there, as here: both go on from the same weights
    other = trainer(kind, objective=objective)
    other.step(batches[-1])
    start = other.export()
    here.load(start)
    there.load(start)
    same(there.export(), start, tol=0)
    for b in batches[:4]:
        here.step(b)
        there.step(b)
    same(there.export(), here.export(), tol=1e-6)


@pytest.mark.parametrize("kind", ["split", "synthetic"])
def test_a_group_of_its_own_on_a_worker_is_the_mean_it_is_here(kind, workers):
    # what a worker is told carries the Trainer's every beside the technique's own
    nid = "mid" if kind == "synthetic" else "a"

    def run(host=None):
        torch.manual_seed(0)
        if kind == "synthetic":
            mid = Layer(4, 4).named("mid")
            g = Graph.somatize(
                Layer(3, 4).named("front")
                >> (mid.at(host) if host else mid)
                >> Layer(4, 2, False).named("head")
            )
        else:
            a = Layer(3, 4).named("a")
            g = Graph.somatize((a.at(host) if host else a) >> Layer(4, 2, False).named("head"))
        trains = {nid: technique(kind, every=2)}
        t = Trainer(
            g,
            objective=mse_loss,
            optimizer=SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
            broker=workers["project"] if host else None,
        )
        for b in batches_of(kind, 5):
            t.step(b)
        assert t.update() is True
        return t.export()

    exported_close(run("far"), run())
