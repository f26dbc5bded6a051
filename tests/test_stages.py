"""Stages: where a graph is cut, and that a part run elsewhere trains the same as here."""

from __future__ import annotations

import copy

import pytest
import torch
from _nodes import Layer
from torch import nn

from somatize import Broker, Graph, Node, Worker
from somatize.torch import Split, Trainer, envelope, parameters
from somatize.torch.training.stages import INPUT, LOSS, Stages

mse = nn.functional.mse_loss
SGD = torch.optim.SGD


class Add(Node):
    def forward(self, x, ctx):
        return sum(x.values())


def data(n=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(6, 4, dtype=torch.float64, generator=gen),
            torch.randn(6, 4, dtype=torch.float64, generator=gen),
        )
        for _ in range(n)
    ]


def residual(host=None):
    torch.manual_seed(0)
    mid = Layer(4, 4).named("mid")
    mid = mid.at(host) if host else mid
    return Graph.somatize(
        Layer(4, 4).named("src")
        >> (mid | Layer(4, 4).named("skip"))
        >> Add().named("join")
        >> Layer(4, 4, False).named("head")
    )


def test_a_stage_is_the_number_of_cuts_behind_a_node():
    g = residual()
    s = Stages(g, {"mid": Split(SGD)})
    assert [(p.stage, p.ids) for p in s.parts] == [
        (0, ("src", "skip")),
        (1, ("mid",)),
        (2, ("join", "head")),
    ]
    first, middle, last = s.parts
    assert first.entering == ((INPUT, "src"),)
    assert first.leaving == (("src", "mid"), ("skip", "join"))
    assert middle.learning is not None and middle.trained == "mid"
    assert last.last and last.leaving == (("head", LOSS),)
    assert last.sources == ("mid", "skip")
    assert Stages(g).whole and len(Stages(g).parts) == 1


def test_a_part_graph_holds_the_nodes_themselves_and_the_learning_stands_around_its_node():
    g = residual()
    learning = Split(SGD)
    mid = Stages(g, {"mid": learning}).parts[1]
    assert mid.graph.nodes() == ["mid"]
    assert mid.graph.implementation("mid") is g.implementation("mid")
    assert mid.learning is learning and mid.ctx.id == "mid/learning"
    learning.of(g.implementation("mid"))  # what the Trainer says
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    (out,) = mid.forward({"src": x}).values()
    # the position before leafed what the node was given; the one after kept what it made
    assert learning.given is not x and learning.given.is_leaf and learning.given.requires_grad
    assert torch.equal(learning.given, x) and learning.held is out and out.grad_fn is not None
    back = mid.backward({"mid": envelope(torch.ones_like(out), True)})
    assert set(back) == {"src"} and back["src"].closing
    assert back["src"].gradient.shape == x.shape and learning.held is None


@pytest.mark.parametrize("every", [1, 2])
def test_a_skip_edge_across_stages_trains_as_without_the_cut(every):
    g1, g2 = residual(), residual()
    t1 = Trainer(g1, objective=mse, optimizer=SGD(parameters(g1), lr=0.1), every=every)
    trains = {"mid": Split(SGD, lr=0.1)}
    t2 = Trainer(
        g2,
        objective=mse,
        optimizer=SGD(parameters(g2, without=trains), lr=0.1),
        trains=trains,
        every=every,
    )
    for b in data():
        assert t1.step(b) == pytest.approx(t2.step(b), abs=1e-12)
    for n, w in t1.export().items():
        for k, v in w.items():
            assert torch.allclose(v, t2.export()[n][k], atol=1e-12), (n, k)


def test_a_leaf_before_the_last_stage_gets_its_gradient_from_the_loss():
    def build():
        torch.manual_seed(0)
        return Graph.somatize(
            Layer(4, 4).named("src")
            >> (
                Layer(4, 4).named("mid") >> Layer(4, 2, False).named("far")
                | Layer(4, 2).named("near")
            )
        )

    def loss(out, y):
        return mse(out["far"], y) + mse(out["near"], y)

    g1, g2 = build(), build()
    t1 = Trainer(g1, objective=loss, optimizer=SGD(parameters(g1), lr=0.1))
    trains = {"mid": Split(SGD, lr=0.1)}
    t2 = Trainer(
        g2, objective=loss, optimizer=SGD(parameters(g2, without=trains), lr=0.1), trains=trains
    )
    for x, y in data():
        y = y[:, :2]
        assert t1.step((x, y)) == pytest.approx(t2.step((x, y)), abs=1e-12)
    for n, w in t1.export().items():
        for k, v in w.items():
            assert torch.allclose(v, t2.export()[n][k], atol=1e-12), (n, k)


@pytest.mark.parametrize("every", [1, 3])
def test_a_part_on_a_worker_trains_as_one_trained_here(every):
    g1, g2 = residual(), residual(host="far")
    t1 = Trainer(g1, objective=mse, optimizer=SGD(parameters(g1), lr=0.1), every=every)
    trains = {"mid": Split(SGD, lr=0.1)}
    broker = Broker.embedded({"far": Worker.spawn(["--threads", "1"], send=["_nodes"])})
    try:
        t2 = Trainer(
            g2,
            objective=mse,
            optimizer=SGD(parameters(g2, without=trains), lr=0.1),
            trains=trains,
            every=every,
            broker=broker,
        )
        here = g2.implementation("mid").lin.weight.clone()
        for b in data(4):
            assert t1.step(b) == pytest.approx(t2.step(b), abs=1e-12)
        t1.update(), t2.update()
        assert g2.implementation("mid").lin.weight.equal(here)  # the copy here never learnt
        exported = t2.export()["mid"]["lin.weight"]  # asked of where it learnt
        assert torch.allclose(exported, g1.implementation("mid").lin.weight, atol=1e-12)
        for n in ("src", "skip", "head"):
            assert torch.allclose(
                g1.implementation(n).lin.weight, g2.implementation(n).lin.weight, atol=1e-12
            )
    finally:
        broker.close()


class Boxed(Node):
    """Gives its input back inside a mapping that is not a dict (as a BatchEncoding is)."""

    def forward(self, x, ctx):
        from collections import UserDict

        return UserDict({"h": x})


class Unboxing(Layer):
    """A layer that reads its input out of the mapping it is given."""

    def forward(self, box, ctx):
        return super().forward(box["h"], ctx)


def test_a_mapping_that_is_not_a_dict_carries_its_gradient_back_across_a_cut():
    def made():
        torch.manual_seed(0)
        return Graph.somatize(
            Layer(4, 4).named("src")
            >> Boxed()
            >> Unboxing(4, 4).named("mid")
            >> Layer(4, 4, False).named("head")
        )

    g1, g2 = made(), made()
    t1 = Trainer(g1, objective=mse, optimizer=SGD(parameters(g1), lr=0.1))
    trains = {"mid": Split(SGD, lr=0.1)}  # the mapping crosses the cut before mid
    t2 = Trainer(
        g2, objective=mse, optimizer=SGD(parameters(g2, without=trains), lr=0.1), trains=trains
    )
    for b in data():
        assert t1.step(b) == pytest.approx(t2.step(b), abs=1e-12)
    for n, w in t1.export().items():
        for k, v in w.items():
            assert torch.allclose(v, t2.export()[n][k], atol=1e-12), (n, k)


class Embed(nn.Module):
    """GPT-2's token and position embeddings, as a user cuts them out of the model."""

    def __init__(self, wte, wpe):
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))


class Blocks(nn.Module):
    """GPT-2's blocks and final norm."""

    def __init__(self, h, ln_f):
        super().__init__()
        self.h, self.ln_f = h, ln_f

    def forward(self, x):
        for block in self.h:
            out = block(x)
            x = out[0] if isinstance(out, tuple) else out
        return self.ln_f(x)


def _gpt2():
    """A transformers GPT-2 (small config, random init, float64, no dropout), its LM head's
    weight the embedding's (tied)."""
    from models import zoo

    m = zoo.gpt2().model.double()
    for module in m.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return m


def _gpt2_in_three(host=None):
    """`_gpt2()` cut in three: embeddings and blocks here, the LM head at `host`."""
    m = _gpt2()
    tr = m.transformer
    head = Node.of(m.lm_head).named("head")
    return m, Graph.somatize(
        Node.of(Embed(tr.wte, tr.wpe)).named("emb")
        >> Node.of(Blocks(tr.h, tr.ln_f)).named("blocks")
        >> (head.at(host) if host else head)
    )


def _token_loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tokens(n=3):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(1, 96, (2, 8), generator=gen),) * 2 for _ in range(n)]


def _steps_as_torch(t, reference):
    """Three steps of `t` beside plain SGD on `reference` (float64): the same losses."""
    by_hand = SGD(reference.parameters(), lr=0.1)
    for ids, y in _tokens():
        by_hand.zero_grad()
        loss = _token_loss(reference(input_ids=ids).logits, y)
        loss.backward()
        by_hand.step()
        assert t.step((ids, y)) == pytest.approx(loss.item(), rel=1e-12)


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_tied_weights_across_a_cut_are_refused_naming_both_and_untied_they_train_as_torch():
    broker = Broker.embedded({"far": Worker.spawn(["--threads", "1"], mode="network")})
    try:
        for host, where in ((None, "'head' here, by Split"), ("far", "on host 'far'")):
            m, g = _gpt2_in_three(host)
            before = {k: v.clone() for k, v in m.state_dict().items()}
            trains = {"head": Split(SGD, lr=0.1)}
            opt = SGD(parameters(g, without=trains), lr=0.1)
            with pytest.raises(ValueError, match=r"'emb' \(wte.weight\) and node 'head' \(weight"):
                Trainer(g, objective=_token_loss, optimizer=opt, trains=trains, broker=broker)
            with pytest.raises(ValueError, match=f"tied weights.*{where}.*nn.Parameter"):
                Trainer(g, objective=_token_loss, optimizer=opt, trains=trains, broker=broker)
            assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
        # untied as the error says, the cut trains as plain torch in one process does
        m, g = _gpt2_in_three("far")
        m.lm_head.weight = nn.Parameter(m.lm_head.weight.detach().clone())
        reference = copy.deepcopy(m)
        trains = {"head": Split(SGD, lr=0.1)}
        t = Trainer(
            g,
            objective=_token_loss,
            optimizer=SGD(parameters(g, without=trains), lr=0.1),
            trains=trains,
            broker=broker,
        )
        _steps_as_torch(t, reference)
        learnt = t.export()["head"]["weight"]
        assert torch.allclose(learnt, reference.lm_head.weight, rtol=0, atol=1e-12)
    finally:
        broker.close()


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_tied_weights_on_one_side_of_the_cuts_train_as_torch_with_the_blocks_on_a_worker():
    m = _gpt2()
    reference = copy.deepcopy(m)
    tr = m.transformer
    g = Graph.somatize(  # embedding and head here (one weight), the blocks on a worker
        Node.of(Embed(tr.wte, tr.wpe)).named("emb")
        >> Node.of(Blocks(tr.h, tr.ln_f)).named("blocks").at("far")
        >> Node.of(m.lm_head).named("head")
    )
    with Broker.embedded({"far": Worker.spawn(["--threads", "1"], mode="network")}) as broker:
        trains = {"blocks": Split(SGD, lr=0.1)}
        opt = SGD(parameters(g, without=trains), lr=0.1)
        t = Trainer(g, objective=_token_loss, optimizer=opt, trains=trains, broker=broker)
        _steps_as_torch(t, reference)
        t.export()
    assert m.lm_head.weight is tr.wte.weight  # still one weight, moved once per step
    assert torch.allclose(tr.wte.weight, reference.transformer.wte.weight, rtol=0, atol=1e-12)


def test_a_trainer_refused_for_tied_weights_across_a_cut_changed_nothing_before_it_refused():
    # the tie check runs with the other checks: a frozen node is not yet settled, no Learning
    # is bound, so the same graph and trains, untied, build a Trainer as if nothing happened
    torch.manual_seed(0)
    stem, body, head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    head.weight = stem.weight  # tied, and head is trained by Split: a cut between them
    g = Graph.somatize(
        Node.of(stem).named("stem") >> Node.of(body).named("body").frozen() >> Node.of(head)
    )
    trains = {"linear": Split(torch.optim.SGD, lr=0.1)}
    opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
    with pytest.raises(ValueError, match=r"'stem' \(weight\) and node 'linear' \(weight\)"):
        Trainer(g, objective=nn.functional.mse_loss, optimizer=opt, trains=trains)
    assert body.training and all(p.requires_grad for p in body.parameters())  # not settled
    # the first of the pair trained by Split: the tie is what is said, not what the optimizer
    # holds (parameters(g, without=) credits a tied weight to the first node holding it)
    first = {"stem": Split(torch.optim.SGD, lr=0.1)}
    opt_first = torch.optim.SGD(parameters(g, without=first), lr=0.1)
    with pytest.raises(ValueError, match=r"'stem' \(weight\) and node 'linear'.*tied"):
        Trainer(g, objective=nn.functional.mse_loss, optimizer=opt_first, trains=first)
    head.weight = nn.Parameter(stem.weight.detach().clone())
    opt = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
    t = Trainer(g, objective=nn.functional.mse_loss, optimizer=opt, trains=trains)
    assert not body.training and not any(p.requires_grad for p in body.parameters())
    x = torch.randn(3, 4)
    assert t.step((x, x)) > 0


class _LastHidden(Node, nn.Module):
    """An LM head read off a transformers output's `last_hidden_state`."""

    def __init__(self, head: nn.Module) -> None:
        nn.Module.__init__(self)
        self.head = head

    def forward(self, out, ctx):
        return self.head(out.last_hidden_state)


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_crossed_counts_a_llama_cache_that_crosses_a_cut_with_the_states():
    # the body's output carries its DynamicCache across the cut beside the hidden states: the
    # bytes said are every tensor that crossed, the cache's keys and values included
    from models import more

    case = more.llama()
    m = case.model
    g = Graph.somatize(Node.of(m.model).named("body") >> _LastHidden(m.lm_head).named("head"))
    heard = []
    trains = {"body": Split(SGD, lr=0.1)}
    t = Trainer(
        g,
        objective=lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()),
        optimizer=SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
        watching=heard.append,
    )
    with torch.no_grad():
        out = m.model(**case.example)
    cache = out.past_key_values
    assert len(cache.layers) == 2  # two layers, each with its keys and values
    states = out.last_hidden_state.nbytes
    forward = states + sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    t.step((case.example, case.target))
    (fact,) = [f for f in heard if f["fact"] == "crossed"]
    assert (fact["forward"], fact["backward"]) == (forward, states)  # no gradient of a cache
