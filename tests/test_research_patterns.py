"""Networks a researcher writes by hand: a U-Net (skips joined by `cat`), a Siamese net, a VAE
(noise in the forward, a KL term over two outputs), a GAN (two Trainers in turn), a GNN layer
(`index_add_` over the batch's edge list), checkpointing inside a node, tied weights across two
nodes; each through forward, `fit` against the loop by hand in plain torch (float64, same
seeds), `Audit`, the figure, `probe`, a `Store` (outputs, weights) and `.cached()`."""

from __future__ import annotations

import copy
import math
import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from somatize import Graph, Node, Store
from somatize.health import Verdicts
from somatize.torch import Audit, Trainer, architecture, parameters, probe

F64 = torch.float64
# float64, the same operations in the same order: only a reduction summed in another order
# could differ, by a few eps per term; a missed or doubled update moves weights by ~lr (1e-2)
TOL = {"rtol": 1e4 * torch.finfo(F64).eps, "atol": 1e4 * torch.finfo(F64).eps}
STEPS = 3


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


class Case(NamedTuple):
    """A pattern: its graph, the modules it is made of, the same forward written by hand."""

    g: Graph
    mods: nn.ModuleDict
    by_hand: Any  # (mods, x) -> what g.forward(x) gives
    data: list
    objective: Any
    edges: set  # (from, to) node ids the figure must draw
    layers: set  # boxes the figure opened with architecture must hold
    weighted: set  # the nodes that hold weights


def _stepped(opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """One step of the loop written by hand."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def mlp(*sizes: int) -> nn.Sequential:
    """Linear layers in float64 with a tanh between each two."""
    layers = [nn.Linear(i, o, dtype=F64) for i, o in zip(sizes, sizes[1:], strict=False)]
    return nn.Sequential(*[m for lin in layers for m in (lin, nn.Tanh())][:-1])


# -- 1. U-Net: skips joined by torch.cat in nodes taking two inputs --------------------------
class Down(Node, nn.Module):
    """A conv and a ReLU, after a 2x2 max pool unless `pool=False`."""

    def __init__(self, i: int, o: int, pool: bool = True) -> None:
        nn.Module.__init__(self)
        self.conv, self.pool = nn.Conv2d(i, o, 3, padding=1, dtype=F64), pool

    def forward(self, x: Any, ctx: Any) -> Any:
        return torch.relu(self.conv(F.max_pool2d(x, 2) if self.pool else x))


class Up(Node, nn.Module):
    """Upsamples node `deep`'s output, joins node `shallow`'s to it by `cat`, conv and ReLU."""

    def __init__(self, i: int, skip: int, o: int, deep: str, shallow: str) -> None:
        nn.Module.__init__(self)
        self.conv = nn.Conv2d(i + skip, o, 3, padding=1, dtype=F64)
        self.deep, self.shallow = deep, shallow

    def forward(self, x: Any, ctx: Any) -> Any:
        up = F.interpolate(x[self.deep], scale_factor=2)
        return torch.relu(self.conv(torch.cat([up, x[self.shallow]], 1)))


def unet() -> Case:
    torch.manual_seed(0)
    d1, d2, mid = Down(1, 4, pool=False), Down(4, 8), Down(8, 8)
    u2, u1, head = Up(8, 8, 8, "mid", "d2"), Up(8, 4, 4, "u2", "d1"), nn.Conv2d(4, 1, 1, dtype=F64)
    g = Graph.somatize(
        d1.named("d1") >> d2.named("d2") >> mid.named("mid") >> u2.named("u2")
        >> u1.named("u1") >> Node.of(head).named("head")
    )  # fmt: skip
    g.edge("d2", "u2")
    g.edge("d1", "u1")
    mods = nn.ModuleDict({"d1": d1, "d2": d2, "mid": mid, "u2": u2, "u1": u1, "head": head})

    def by_hand(m, x):
        a = m["d1"](x, None)
        b = m["d2"](a, None)
        c = m["u2"]({"mid": m["mid"](b, None), "d2": b}, None)
        return m["head"](m["u1"]({"u2": c, "d1": a}, None))

    data = [(_rand(2, 1, 8, 8, seed=k), _rand(2, 1, 8, 8, seed=10 + k)) for k in range(STEPS)]
    edges = {("d1", "d2"), ("d2", "u2"), ("d1", "u1"), ("u1", "head")}
    return Case(g, mods, by_hand, data, F.mse_loss, edges, {"l:u2:cat", "l:u1:cat"}, set(mods))


# -- 2. Siamese: one encoder module standing as two nodes, one per view; or one node ----------
class Distance(Node):
    """How far apart the two views' codes are, one number per pair."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return (x["left"] - x["right"]).pow(2).sum(1).add(1e-9).sqrt()


def contrastive(d: torch.Tensor, same: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Hadsell et al.'s loss: pull pairs alike together, push others past the margin."""
    return (same * d.pow(2) + (1 - same) * F.relu(margin - d).pow(2)).mean()


def siamese() -> Case:
    torch.manual_seed(1)
    enc = mlp(6, 8, 3)
    views = [Node.of(lambda p, k=k: p[k]).named(f"view{k}") for k in (0, 1)]
    g = Graph.somatize(
        ((views[0] >> Node.of(enc).named("left")) | (views[1] >> Node.of(enc).named("right")))
        >> Distance().named("distance")
    )

    def by_hand(m, x):
        return (m["enc"](x[0]) - m["enc"](x[1])).pow(2).sum(1).add(1e-9).sqrt()

    same = torch.tensor([1.0, 0, 1, 0], dtype=F64)
    data = [((_rand(4, 6, seed=k), _rand(4, 6, seed=20 + k)), same) for k in range(STEPS)]
    edges = {("view0", "left"), ("view1", "right"), ("left", "distance"), ("right", "distance")}
    layers, weighted = {"l:left:0", "l:right:2"}, {"left", "right"}
    return Case(g, nn.ModuleDict({"enc": enc}), by_hand, data, contrastive, edges, layers, weighted)


class Twin(Node, nn.Module):
    """The other Siamese way: one node calling its encoder on both views."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.enc = mlp(6, 8, 3)

    def forward(self, x: Any, ctx: Any) -> Any:
        return (self.enc(x[0]) - self.enc(x[1])).pow(2).sum(1).add(1e-9).sqrt()


def twin() -> Case:
    torch.manual_seed(1)
    g, data = Graph.somatize((node := Twin()).named("twin")), siamese().data
    return Case(g, nn.ModuleDict({"twin": node}), lambda m, x: m["twin"](x, None), data,
                contrastive, set(), {"l:twin:enc.0", "l:twin:enc.0#2"}, {"twin"})  # fmt: skip


# -- 3. VAE: reparameterised noise in the forward, a KL term over two outputs -----------------
class Encoder(Node, nn.Module):
    """The posterior's mean and log-variance."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.body = mlp(6, 8, 4)

    def forward(self, x: Any, ctx: Any) -> Any:
        return self.body(x).chunk(2, dim=1)


class Sample(Node):
    """z = mu + sigma * noise, the noise drawn anew at every forward."""

    def forward(self, x: Any, ctx: Any) -> Any:
        return x[0] + torch.exp(0.5 * x[1]) * torch.randn_like(x[0])


def elbo(out: Any, x: torch.Tensor) -> torch.Tensor:
    """Reconstruction error plus the KL divergence of the posterior from N(0, 1)."""
    m, lv = out["mu"], out["logvar"]
    kl = -0.5 * (1 + lv - m.pow(2) - lv.exp()).sum(1).mean()
    return F.mse_loss(out["decoder"], x, reduction="sum") / len(x) + kl


def vae() -> Case:
    torch.manual_seed(2)
    enc, dec = Encoder(), mlp(2, 8, 6)
    mu, logvar = Node.of(lambda s: s[0]).named("mu"), Node.of(lambda s: s[1]).named("logvar")
    g = Graph.somatize(
        enc.named("encoder")
        >> ((Sample().named("sample") >> Node.of(dec).named("decoder")) | mu | logvar)
    )

    def by_hand(m, x):
        mean, lv = m["enc"](x, None)
        z = mean + torch.exp(0.5 * lv) * torch.randn_like(mean)
        return {"decoder": m["dec"](z), "mu": mean, "logvar": lv}

    data = [(x := _rand(4, 6, seed=k), x) for k in range(STEPS)]
    edges = {("encoder", "sample"), ("sample", "decoder"), ("encoder", "mu"), ("encoder", "logvar")}
    mods, layers = nn.ModuleDict({"enc": enc, "dec": dec}), {"l:encoder:body.2", "l:decoder:0"}
    return Case(g, mods, by_hand, data, elbo, edges, layers, {"encoder", "decoder"})


# -- 5. GNN: a message-passing layer written with index_add_ over the batch's edge list -------
class Conv(Node, nn.Module):
    """h_i' = relu(W_self h_i + sum over edges j -> i of W_msg h_j); the edges go on with h
    unless it is the `last` layer."""

    def __init__(self, i: int, o: int, last: bool = False) -> None:
        nn.Module.__init__(self)
        self.own, self.msg = nn.Linear(i, o, dtype=F64), nn.Linear(i, o, bias=False, dtype=F64)
        self.last = last

    def forward(self, x: Any, ctx: Any) -> Any:
        h, (src, dst) = x["h"], x["edges"]
        got = torch.zeros(len(h), self.msg.out_features, dtype=h.dtype)
        h = torch.relu(self.own(h) + got.index_add_(0, dst, self.msg(h)[src]))
        return h if self.last else {"h": h, "edges": x["edges"]}


def gnn() -> Case:
    torch.manual_seed(3)
    c1, c2, out = Conv(5, 8), Conv(8, 8, last=True), nn.Linear(8, 3, dtype=F64)
    g = Graph.somatize(c1.named("conv1") >> c2.named("conv2") >> Node.of(out).named("readout"))
    mods = nn.ModuleDict({"c1": c1, "c2": c2, "out": out})

    def by_hand(m, x):
        return m["out"](m["c2"](m["c1"](x, None), None))

    def batch(k):
        gen = torch.Generator().manual_seed(30 + k)
        edges = torch.randint(0, 7, (2, 12), generator=gen)
        return {"h": _rand(7, 5, seed=k), "edges": edges}, torch.randint(0, 3, (7,), generator=gen)

    data, edges = [batch(k) for k in range(STEPS)], {("conv1", "conv2"), ("conv2", "readout")}
    layers, weighted = {"l:conv1:index_add", "l:conv2:msg"}, {"conv1", "conv2", "readout"}
    return Case(g, mods, by_hand, data, F.cross_entropy, edges, layers, weighted)


# -- 6. gradient checkpointing inside a node --------------------------------------------------
class Checkpointed(Node, nn.Module):
    """An MLP block under torch's non-reentrant checkpoint: activations made again in backward."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.body = mlp(6, 16, 6)

    def forward(self, x: Any, ctx: Any) -> Any:
        return x + checkpoint(self.body, x, use_reentrant=False)


def checkpointed() -> Case:
    torch.manual_seed(4)
    block, head = Checkpointed(), nn.Linear(6, 2, dtype=F64)
    g = Graph.somatize(block.named("block") >> Node.of(head).named("head"))
    mods = nn.ModuleDict({"block": block, "head": head})

    def by_hand(m, x):  # no checkpoint: the same numbers, activations kept
        return m["head"](x + m["block"].body(x))

    data = [(_rand(4, 6, seed=k), _rand(4, 2, seed=40 + k)) for k in range(STEPS)]
    return Case(
        g, mods, by_hand, data, F.mse_loss, {("block", "head")}, {"l:block:body.0"}, set(mods)
    )


# -- 7. an embedding and an output layer sharing one Parameter, in two nodes -----------------
class Embed(Node, nn.Module):
    """Token ids to vectors."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.table = nn.Embedding(11, 6, dtype=F64)

    def forward(self, x: Any, ctx: Any) -> Any:
        return torch.tanh(self.table(x))


def lm(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every token."""
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def tied() -> Case:
    torch.manual_seed(5)
    emb = Embed()
    body, out = nn.Linear(6, 6, dtype=F64), nn.Linear(6, 11, bias=False, dtype=F64)
    out.weight = emb.table.weight  # one Parameter, held by two nodes
    g = Graph.somatize(
        emb.named("embed") >> Node.of(body).named("body") >> Node.of(out).named("logits")
    )
    mods = nn.ModuleDict({"emb": emb, "body": body, "out": out})

    def by_hand(m, x):
        return m["out"](m["body"](m["emb"](x, None)))

    gen = torch.Generator().manual_seed(50)
    data = [(ids := torch.randint(0, 11, (3, 5), generator=gen), ids) for _ in range(STEPS)]
    edges, layers = {("embed", "body"), ("body", "logits")}, {"l:embed:table", "l:logits:"}
    return Case(g, mods, by_hand, data, lm, edges, layers, {"embed", "body", "logits"})


CASES = {f.__name__: f for f in (unet, siamese, twin, vae, gnn, checkpointed, tied)}


def _fit(c: Case, **kw: Any) -> tuple[Trainer, list]:
    """A Trainer's fit over the case's data, Adam at 1e-2, seeded; and what it told."""
    facts: list = []
    opt = torch.optim.Adam(parameters(c.g), lr=1e-2)
    t = Trainer(c.g, objective=c.objective, optimizer=opt, watching=facts.append, **kw)
    torch.manual_seed(9)
    t.fit(c.data)
    return t, facts


@pytest.mark.parametrize("name", CASES)
def test_a_fit_is_the_loop_written_by_hand(name):
    c = CASES[name]()
    hand = copy.deepcopy(c.mods)
    torch.manual_seed(9)
    y = c.g.forward(c.data[0][0])
    torch.manual_seed(9)
    torch.testing.assert_close(y, c.by_hand(c.mods, c.data[0][0]), **TOL)
    result = _fit(c)[0].result
    opt = torch.optim.Adam(hand.parameters(), lr=1e-2)  # a shared weight is held once
    torch.manual_seed(9)
    losses = [_stepped(opt, c.objective(c.by_hand(hand, x), y)) for x, y in c.data]
    torch.testing.assert_close(result.history, losses, **TOL)
    torch.testing.assert_close(c.mods.state_dict(), hand.state_dict(), **TOL)


@pytest.mark.parametrize("name", CASES)
def test_an_audit_hears_every_node_with_weights_at_every_step_and_changes_nothing(name):
    c, plain = CASES[name](), CASES[name]()
    t, facts = _fit(c, auditing=Audit())
    health = [f for f in facts if f["fact"] == "health"]
    heard = {(f["node"], f["step"]) for f in health}
    assert heard >= {(n, s) for n in c.weighted for s in range(STEPS)}
    assert {s for _, s in heard} == set(range(STEPS))
    assert [f["step"] for f in facts if f["fact"] == "updated"] == list(range(STEPS))
    for f in health:
        numbers = [v for v in f.values() if isinstance(v, float)]
        assert numbers and all(math.isfinite(v) for v in numbers), f
        assert not f["nan"] and not f["inf"], f
        if f["node"] in c.weighted:
            assert f["grad_norm"] > 0 and f["update_ratio"] > 0, f
    assert t.result.history == _fit(plain)[0].result.history  # the same run, bit for bit


@pytest.mark.parametrize("name", CASES)
def test_the_figure_draws_the_nodes_the_skips_and_the_layers(name):
    c = CASES[name]()
    svg = c.g.figure().svg()
    drawn = set(re.findall(r'data-from="n:([^"]+)" data-to="n:([^"]+)"', svg))
    assert drawn == set(c.g.edges()) and drawn >= c.edges
    skips = set(re.findall(r'smz-skip"[^>]*data-from="n:([^"]+)" data-to="n:([^"]+)"', svg))
    assert skips == ({("d2", "u2"), ("d1", "u1")} if name == "unet" else set())  # drawn as skips
    assert set(re.findall(r'data-id="n:([^"]+)"', svg)) == set(c.g.nodes())
    opened = c.g.figure(inside=architecture(c.g, c.data[0][0])).svg()
    assert set(re.findall(r'data-id="(l:[^"]+)"', opened)) >= c.layers


# checkpointed: probe's backward raises torch's CheckpointError, left to somatize/torch/inside
@pytest.mark.parametrize("name", [n for n in CASES if n != "checkpointed"])
def test_probe_measures_each_node_and_leaves_the_net_as_it_was(name):
    c = CASES[name]()
    before, rng = copy.deepcopy(c.mods.state_dict()), torch.get_rng_state()
    found = probe(c.g, c.data[0][0])
    for n in c.weighted:  # a gain is against a float input: the embedding's ids have none
        gains = [found[n]["signal_gain"]] if n != "embed" else []
        assert all(math.isfinite(v) and v > 0 for v in [*gains, found[n]["param_norm"]]), n
    torch.testing.assert_close(c.mods.state_dict(), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in c.mods.parameters())


@pytest.mark.parametrize("name", CASES)
def test_a_store_keeps_the_outputs_and_the_trained_weights(name, tmp_path):
    c = CASES[name]()
    fresh_g, fresh = copy.deepcopy((c.g, c.mods))
    t, _ = _fit(c)
    x = c.data[0][0]
    torch.manual_seed(9)
    y = c.g.forward(x)
    store = Store(tmp_path)
    store.keep(f"{name}/out", y)
    torch.testing.assert_close(store.recall(f"{name}/out"), y, rtol=0, atol=0)
    store.keep(f"{name}/weights", t.export())
    again = Trainer(fresh_g, objective=c.objective, optimizer=torch.optim.Adam(parameters(fresh_g)))
    again.load(store.recall(f"{name}/weights"), strict=True)
    torch.testing.assert_close(fresh.state_dict(), c.mods.state_dict(), rtol=0, atol=0)
    torch.manual_seed(9)
    torch.testing.assert_close(fresh_g.forward(x), y, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "front"), [("unet", "d1"), ("gnn", "conv1")])
def test_a_frozen_front_cached_runs_once_per_batch_over_epochs(name, front, tmp_path):
    c, plain = CASES[name](), CASES[name]()
    for case in (c, plain):
        case.g.declare(front, frozen=True)
    c.g.declare(front, cached=True)
    ran: list = []
    c.g.implementation(front).register_forward_hook(lambda *a: ran.append(1))
    t, u = (Trainer(k.g, objective=c.objective, optimizer=torch.optim.Adam(parameters(k.g), lr=1e-2),
                    store=tmp_path) for k in (c, plain))  # fmt: skip
    assert t.fit(c.data, epochs=2).history == u.fit(plain.data, epochs=2).history
    assert len(ran) == STEPS  # the second epoch's front came from the store


def _bce(logits: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.squeeze(1), real)


def _fooled(logits: torch.Tensor, _: Any) -> torch.Tensor:
    """The generator's loss: the discriminator calling its samples real."""
    return _bce(logits, torch.ones(len(logits), dtype=logits.dtype))


def test_a_gan_trains_by_two_trainers_alternating_as_by_hand():
    torch.manual_seed(6)
    gen, disc = mlp(2, 8, 3), mlp(3, 8, 1)
    hand_gen, hand_disc = copy.deepcopy((gen, disc))
    g = Graph.somatize(Node.of(gen).named("gen") >> Node.of(disc).named("disc"))
    d = Graph.somatize(Node.of(disc).named("disc"))  # the same module: the discriminator's step
    both = [torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())]
    with pytest.raises(TypeError, match=r"not a list of 2.*one Trainer each.*stepped in turn"):
        Trainer(g, objective=_fooled, optimizer=both)  # (Lightning's two optimizers)
    heard: dict = {"gen": [], "disc": []}  # each Trainer's facts
    t_gen = Trainer(g, objective=_fooled, optimizer=torch.optim.Adam(parameters(g, without=["disc"]), lr=1e-2),
                    auditing=Audit(inside=True), watching=heard["gen"].append)  # fmt: skip
    t_disc = Trainer(d, objective=_bce, optimizer=torch.optim.Adam(parameters(d), lr=1e-2),
                     auditing=Audit(), watching=heard["disc"].append)  # fmt: skip
    opt_gen = torch.optim.Adam(hand_gen.parameters(), lr=1e-2)
    opt_disc = torch.optim.Adam(hand_disc.parameters(), lr=1e-2)
    labels, first = torch.tensor([1.0] * 4 + [0.0] * 4, dtype=F64), []
    for k in range(STEPS):
        z, real = _rand(4, 2, seed=k), _rand(4, 3, seed=60 + k)
        lost = [t_disc.step((torch.cat([real, gen(z).detach()]), labels))]
        first.append(disc[0](gen(z)).abs().mean().item())  # the first layer's, on the samples
        lost.append(t_gen.step((z, None)))
        fake = hand_gen(z).detach()
        by_hand = _stepped(opt_disc, _bce(hand_disc(torch.cat([real, fake])), labels))
        fooled = _stepped(opt_gen, _fooled(hand_disc(hand_gen(z)), None))
        torch.testing.assert_close(lost, [by_hand, fooled], **TOL)
    torch.testing.assert_close(gen.state_dict(), hand_gen.state_dict(), **TOL)
    torch.testing.assert_close(disc.state_dict(), hand_disc.state_dict(), **TOL)
    # each Trainer's audit hears its own nodes at its own steps; the generator's Trainer does
    # not train the discriminator, so it gives it no update ratio (a 0 would read STALLED)
    said = {(run, f["node"], f["step"], f.get("update_ratio", 0) > 0)
            for run, facts in heard.items() for f in facts if f["fact"] == "health"
            and f["inside"] is None}  # fmt: skip
    assert said == {(run, n, s, moved) for s in range(STEPS) for run, n, moved in
                    [("gen", "gen", True), ("gen", "disc", False), ("disc", "disc", True)]}  # fmt: skip
    # the generator's audit hears the discriminator's layers in its own steps only, not in
    # the discriminator's Trainer's, which runs the same module before its first
    at = [f for f in heard["gen"] if f.get("inside") == "0" and f["node"] == "disc"]
    torch.testing.assert_close([f["act_abs_mean"] for f in at], first, **TOL)
    for run, facts in heard.items():
        assert Verdicts().feed(facts).flags() == {}, run  # what diagnose would say
        for f in (f for f in facts if f["fact"] == "health" and "grad_norm" in f):  # weighed
            assert math.isfinite(f["grad_norm"]) and f["grad_norm"] > 0
            assert ("update_ratio" in f) == (f["node"] == run), f


def test_tied_weights_stay_tied_through_export_and_load_and_step_once():
    c = tied()
    assert sum(p is c.mods["emb"].table.weight for p in parameters(c.g)) == 1
    t, _ = _fit(c)
    w = t.export()
    assert torch.equal(w["embed"]["table.weight"], w["logits"]["weight"])
    fresh_g, fresh = copy.deepcopy((c.g, c.mods))
    again = Trainer(fresh_g, objective=c.objective, optimizer=torch.optim.Adam(parameters(fresh_g)))
    again.load({"embed": {"table.weight": w["embed"]["table.weight"]}})  # one key loads both
    assert fresh["out"].weight is fresh["emb"].table.weight
    torch.testing.assert_close(fresh.state_dict(), c.mods.state_dict(), rtol=0, atol=0)
    before = copy.deepcopy(fresh.state_dict())
    w["logits"]["weight"] = w["logits"]["weight"] + 1
    with pytest.raises(ValueError, match=r"(?s)'(embed|logits)'.*weight.*'(logits|embed)'"):
        again.load(w)
    torch.testing.assert_close(fresh.state_dict(), before, rtol=0, atol=0)  # nothing loaded


def test_an_encoder_frozen_at_one_node_and_trained_at_the_other_is_refused_saying_what_to_do():
    c = siamese()
    c.g.declare("left", frozen=True)
    with pytest.raises(ValueError) as e:
        Trainer(c.g, objective=c.objective, optimizer=torch.optim.Adam(parameters(c.g)))
    assert re.search(r"'left'.*'right'.*Freeze 'right' as well, or untie", str(e.value)), e.value


def test_an_edge_list_is_not_cut_into_micro_batches_and_the_refusal_says_what_to_do():
    c = gnn()
    t = Trainer(c.g, objective=c.objective, optimizer=torch.optim.Adam(parameters(c.g)), micro=7)
    before = copy.deepcopy(c.mods.state_dict())
    with pytest.raises(ValueError) as e:
        t.step(c.data[0])
    assert re.search(r"input\['edges'\] has shape \(2, 12\).*or micro=1", str(e.value)), e.value
    torch.testing.assert_close(c.mods.state_dict(), before, rtol=0, atol=0)
