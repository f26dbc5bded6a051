"""Audit: health facts per place and step, driven by a hand loop and by the Trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node
from somatize.health import LEAKAGE, verdict
from somatize.torch import Trainer, parameters
from somatize.torch.audit.audit import Audit


class Layer(Node, nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.l = nn.Linear(i, o)
        self.r = nn.ReLU(inplace=True)

    def forward(self, x, ctx):
        return self.r(self.l(x))


class Head(Node):
    """A plain node holding a module."""

    def __init__(self, i):
        self.fc = nn.Linear(i, 3)

    def forward(self, x, ctx):
        return self.fc(x)


def _graph():
    torch.manual_seed(0)
    return Graph.somatize(Layer(4, 8) >> Layer(8, 8) >> Head(8))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)


def _loop(g, audit, steps, lr=0.1, tell=True):
    """`steps` hand-made steps; `params[k]`: the first node's weights as step k found them
    (and, last, as the loop left them). `tell`: say `moved()` after each optimizer step."""
    x, y = _data()
    opt = torch.optim.SGD(parameters(g), lr=lr)
    facts, params = [], []
    first = g.implementation(g.nodes()[0])
    for _ in range(steps):
        opt.zero_grad()
        params.append([p.detach().clone() for p in first.parameters()])
        F.cross_entropy(g.forward(x), y).backward()
        facts.append(audit.observed(g))
        opt.step()
        if tell:
            audit.moved()
    params.append([p.detach().clone() for p in first.parameters()])
    return facts, params


def _ratio(before, after):
    """‖after − before‖ / ‖before‖ over a node's weights, by hand."""
    diff = torch.cat([(a - b).flatten() for a, b in zip(after, before, strict=True)]).norm()
    return float(diff / torch.cat([b.flatten() for b in before]).norm())


def test_one_fact_per_place_with_typed_numbers_and_a_hand_checked_update_ratio():
    g = _graph()
    audit = Audit().watch(g)
    facts, params = _loop(g, audit, 3)
    audit.release()
    assert [[f["where"] for f in step] for step in facts] == [["layer", "layer_2", "head"]] * 3
    step2 = {f["where"]: f for f in facts[2]}
    n = step2["layer"]["numbers"]
    assert step2["layer"]["step"] == 2 and step2["layer"]["fact"] == "health"
    for key in ("grad_norm", "param_norm", "update_ratio", "act_mean", "zero", "saturated"):
        assert type(n[key]) is float, key
    assert type(n["nan"]) is bool and type(n["inf"]) is bool
    # the update this step's gradient made, over the weights the step ran with
    assert n["update_ratio"] == pytest.approx(_ratio(params[2], params[3]), rel=1e-5)
    assert n["param_norm"] == pytest.approx(
        float(torch.cat([p.flatten() for p in params[2]]).norm()), rel=1e-5
    )
    first = {f["where"]: f for f in facts[0]}["layer"]["numbers"]
    assert first["update_ratio"] == pytest.approx(_ratio(params[0], params[1]), rel=1e-5)
    assert 0.0 < n["zero"] < 1.0  # in-place ReLU measured without complaint
    assert "grad_norm" in step2["head"]["numbers"]


def test_without_moved_the_update_is_taken_when_the_next_measured_step_begins():
    g = _graph()
    audit = Audit(every=2).watch(g)
    facts, params = _loop(g, audit, 5, tell=False)
    audit.release()
    # step 0's facts waited: the weights had moved (twice) when step 2 began, and that was
    # taken as step 0's update; the last measured step never saw its update
    layer = [{f["where"]: f["numbers"] for f in step}.get("layer") for step in facts]
    assert layer[0]["update_ratio"] == pytest.approx(_ratio(params[0], params[2]), rel=1e-5)
    assert layer[2]["update_ratio"] == pytest.approx(_ratio(params[2], params[4]), rel=1e-5)
    assert "update_ratio" not in layer[4]
    assert layer[1] is None and layer[3] is None


def test_every_measures_one_step_in_n_and_keeps_the_update_ratio():
    g = _graph()
    audit = Audit(every=3).watch(g)
    facts, _ = _loop(g, audit, 7)
    audit.release()
    assert [bool(f) for f in facts] == [True, False, False, True, False, False, True]
    assert "update_ratio" in facts[3][0]["numbers"]
    assert audit.step == 7


def test_a_tap_that_is_not_live_keeps_its_wrappers_and_tells_nothing():
    from somatize.torch._modules import Tap

    g = _graph()
    x, _ = _data()
    heard = []
    tap = Tap(g, lambda node, input, ctx, out: heard.append((node, out.shape))).on()
    try:
        out = g.forward(x)
        told = list(heard)
        assert [n for n, _ in told] == g.nodes() and told[-1][1] == (32, 3)
        tap.live = False
        heard.clear()
        assert torch.equal(g.forward(x), out)  # the wrapped nodes still run
        assert heard == []
        tap.live = True
        g.forward(x)
        assert heard == told
    finally:
        tap.off()
    g.forward(x)
    assert heard == told  # unwrapped: nothing more


def test_an_audit_hears_the_nodes_only_on_measured_steps():
    g = _graph()
    audit = Audit(every=3).watch(g)
    seen = []
    saw = audit._saw
    audit._saw = lambda place, out: (seen.append((audit.step, place.where)), saw(place, out))
    _loop(g, audit, 4)
    audit.release()
    assert sorted({s for s, _ in seen}) == [0, 3]
    assert [w for s, w in seen if s == 3] == g.nodes()


def test_snapshots_come_every_snapshot_steps_whatever_every_is():
    g = _graph()
    audit = Audit(every=7, snapshot=20).watch(g)
    facts, _ = _loop(g, audit, 50)
    audit.release()
    ranked = [k for k, f in enumerate(facts) if f and "effective_rank" in f[0]["numbers"]]
    # the first measured step of each 20: 0, then 21 (not 140, the first both divide), 42
    assert ranked == [0, 21, 42]
    assert all("update_stable_rank" in facts[k][0]["numbers"] for k in ranked)
    measured = [k for k, f in enumerate(facts) if f]
    assert measured == list(range(0, 50, 7))
    assert not any("effective_rank" in facts[k][0]["numbers"] for k in measured if k not in ranked)


def test_inside_channels_and_snapshot():
    g = _graph()
    audit = Audit(inside=True, channels=True, snapshot=2).watch(g)
    facts, _ = _loop(g, audit, 3)
    audit.release()
    where = [f["where"] for f in facts[0]]
    assert where == [
        "layer",
        "layer.l",
        "layer.r",
        "layer_2",
        "layer_2.l",
        "layer_2.r",
        "head",
        "head.fc",
    ]
    first = {f["where"]: f["numbers"] for f in facts[0]}
    assert first["layer.r"]["channels"] == 8 and type(first["layer.r"]["dead_channels"]) is int
    assert "effective_rank" in first["layer.r"] and first["layer.r"]["rank_room"] == 8
    assert "effective_rank" not in {f["where"]: f["numbers"] for f in facts[1]}["layer.r"]
    assert "update_stable_rank" in {f["where"]: f["numbers"] for f in facts[2]}["layer"]
    assert "grad_norm" not in first["layer.r"]  # no parameters there


def test_dead_channels_over_the_window():
    g = _graph()
    with torch.no_grad():
        g.implementation("layer").l.bias[:3] = -100.0
    audit = Audit(channels=True, inside=["layer.r"]).watch(g)
    facts, _ = _loop(g, audit, 2, lr=0.0)
    audit.release()
    n = {f["where"]: f["numbers"] for f in facts[1]}["layer.r"]
    assert n["dead_channels"] == 3 and n["channels"] == 8
    assert "DEAD_CHANNELS(3)" in verdict(n)


def test_groups_that_carry_the_same_thing_leak():
    class Copy(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, ctx):
            h = self.l(x)
            return torch.cat([h, 2 * h, torch.randn_like(h)], 1)

    torch.manual_seed(0)
    g = Graph.somatize(Copy() >> Head(12))
    audit = Audit(groups={"copy": {"a": range(0, 4), "b": range(4, 8)}}).watch(g)
    facts, _ = _loop(g, audit, 1)
    audit.release()
    cka = facts[0][0]["numbers"]["cka"]
    assert cka == pytest.approx(1.0, abs=1e-6) and LEAKAGE in verdict(facts[0][0]["numbers"])
    with pytest.raises(ValueError, match="groups.*nowhere"):
        Audit(groups={"nowhere": {"a": [0], "b": [1]}}).watch(g)
    with pytest.raises(ValueError, match="two channel groups"):
        Audit(groups={"copy": {"a": [0]}})


def test_release_takes_every_hook_off_and_refusals():
    g = _graph()
    audit = Audit(inside=True).watch(g)
    with pytest.raises(RuntimeError, match="release"):
        audit.watch(g)
    audit.release()
    node = g.implementation("layer")
    assert "forward" not in vars(node)
    assert not node.l._forward_hooks and not node.r._forward_hooks
    with pytest.raises(RuntimeError, match="watch"):
        audit.observed(g)
    again = Audit().watch(g)
    facts, _ = _loop(g, again, 1)
    again.release()
    assert len(facts[0]) == 3
    with pytest.raises(ValueError, match="every"):
        Audit(every=0)
    with pytest.raises(ValueError, match="not in this graph"):
        Audit(inside=["layer.nope"]).watch(g)


def _trainer(g, audit, heard, every=1, trains=None):
    """A Trainer of `g` by SGD, audited by `audit`, telling `heard` everything; the nodes in
    `trains` trained by their own Learning instead."""
    return Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g, without=trains or ()), lr=0.1),
        trains=trains,
        auditing=audit,
        watching=heard.append,
        every=every,
    )


def test_the_trainer_drives_it():
    g = _graph()
    heard = []
    t = _trainer(g, Audit(every=2), heard)
    x, y = _data()
    t.fit([(x, y)] * 4)
    health = [f for f in heard if f["fact"] == "health"]
    assert sorted({f["step"] for f in health}) == [0, 2]
    assert {f["where"] for f in health} == {"layer", "layer_2", "head"}
    assert "update_ratio" in health[-1]["numbers"]


def test_snapshot_numbers_against_float64_and_a_full_svd():
    import numpy as np

    from somatize.torch.audit._measures import effective_ranks, spectra, stable_of, stable_rank

    gen = torch.Generator().manual_seed(0)

    def by_svd_rank(f):
        f = f.double() - f.double().mean(0, keepdim=True)
        s = torch.linalg.svdvals(f)
        p = s / s.sum()
        p = p[p > 0]
        return float(torch.exp(-(p * p.log()).sum()))

    def by_svd_stable(d):
        s = torch.linalg.svdvals(d.reshape(d.shape[0], -1).double())
        return float((s**2).sum() / s[0] ** 2)

    full = torch.relu(torch.randn(64, 256, generator=gen))
    thin = torch.randn(64, 10, generator=gen)
    collapsed = torch.randn(64, 1, generator=gen) @ torch.randn(1, 256, generator=gen)
    ranks = [float(r) for r in effective_ranks([full, thin, full * 2, collapsed])]
    assert ranks[0] == pytest.approx(by_svd_rank(full), rel=1e-4)
    assert ranks[1] == pytest.approx(by_svd_rank(thin), rel=1e-4)
    assert ranks[2] == pytest.approx(ranks[0], rel=1e-5)  # batched with `full`: same answer
    assert ranks[3] == pytest.approx(1.0, abs=1e-3)  # collapsed reads collapsed, not noise
    assert float(effective_ranks([torch.ones(8, 4)])[0]) == 0.0
    for d in (
        torch.randn(256, 64, generator=gen) @ torch.randn(64, 256, generator=gen),  # Lanczos
        torch.randn(256, 64, generator=gen),  # exact, from the 64×64 Gram matrix
        torch.randn(32, 16, 3, 3, generator=gen),  # a conv kernel, flattened
    ):
        assert float(stable_rank(d)) == pytest.approx(by_svd_stable(d), rel=2e-3)
    assert float(stable_rank(torch.zeros(128, 128))) == 0.0
    # an update with one dominant direction (as real ones have) is settled by power steps,
    # within the 1e-3 their residual bound promises; a flat spectrum is not, and goes to Lanczos
    from somatize.torch.audit._measures import _power

    u, v = torch.randn(256, 1, generator=gen), torch.randn(1, 256, generator=gen)
    dominant = u @ v + torch.randn(256, 256, generator=gen)  # stable rank ≈ 2
    assert float(stable_rank(dominant)) == pytest.approx(by_svd_stable(dominant), rel=1e-3)
    x = dominant.numpy()
    top = float(torch.linalg.svdvals(dominant.double())[0] ** 2)
    assert _power(x, lambda *shape: np.zeros(shape, np.float32)) == pytest.approx(top, rel=1e-3)
    flat = torch.randn(256, 256, generator=gen).numpy()
    assert _power(flat, lambda *shape: np.zeros(shape, np.float32)) is None
    # taken together (Gram matrices of one size share an eigendecomposition): the same numbers
    updates = [torch.randn(256, 64, generator=gen), torch.randn(10, 256, generator=gen)]
    updates.append(torch.randn(128, 64, generator=gen) @ torch.randn(64, 128, generator=gen))
    both, tops = spectra([full, thin], updates)
    stable = [stable_of(float(d.norm()), top) for d, top in zip(updates, tops, strict=True)]
    assert [float(r) for r in both] == pytest.approx(ranks[:2], rel=1e-5)
    assert [float(s) for s in stable] == pytest.approx(
        [by_svd_stable(d) for d in updates], rel=2e-3
    )
    # the Lanczos other devices take, in torch, run here on the CPU: the numpy one's answer
    from somatize.torch.audit._measures import _lanczos

    for d in (dominant, updates[2]):
        in_torch = _lanczos(d, d.new_zeros, torch.linalg, 12)
        x = d.numpy()
        in_numpy = _lanczos(x, lambda *shape: np.zeros(shape, np.float32), np.linalg, 12)
        assert in_torch == pytest.approx(in_numpy, rel=1e-4)
        top = float(torch.linalg.svdvals(d.double())[0] ** 2)
        assert in_torch == pytest.approx(top, rel=1e-3)


def test_nan_and_inf_in_an_output_are_told_apart():
    class Poison(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.what = 0.0

        def forward(self, x, ctx):
            h = self.l(x)
            c = torch.full_like(h[:, :1], self.what)
            return torch.cat([h, c, -c], 1)

    torch.manual_seed(0)
    poison = Poison()
    g = Graph.somatize(poison >> Head(6))
    audit = Audit().watch(g)
    got = {}
    for what in (0.0, float("inf"), float("nan")):
        poison.what = what
        with torch.no_grad():
            g.forward(_data()[0])
        n = {f["where"]: f["numbers"] for f in audit.observed(g)}["poison"]
        got[what if what == what else "nan"] = (n["nan"], n["inf"])
        assert type(n["nan"]) is bool and type(n["inf"]) is bool
    audit.release()
    # inf and −inf in one output: Σa is nan, Σ|a| is inf — it is an inf, not a nan
    assert got == {
        0.0: (False, False),
        float("inf"): (False, True),
        "nan": (True, False),
    }


class Kept(Node, nn.Module):
    """Linear, then an activation; keeps a copy of what it gave. `poke`: a value written into
    its output's first row after it is given."""

    def __init__(self, i, o, act):
        super().__init__()
        self.l = nn.Linear(i, o)
        self.act = act
        self.gave = None

    def forward(self, x, ctx):
        out = self.act(self.l(x) * 4)
        self.gave = out.detach().clone()
        return out


def _by_hand(out, saturates=None):
    """act_mean, zero and saturated of one output, as the forward's torch ops take them."""
    a = out.double()
    zero = float((a.abs() <= 1e-7).double().mean())
    if saturates == "sigmoid":
        sat = float(((a <= 0.01) | (a >= 0.99)).double().mean())
    elif saturates == "tanh":
        sat = float((a.abs() >= 0.99).double().mean())
    else:
        sat = 0.0
    return float(a.mean()), zero, sat


def test_sums_taken_when_observed_are_those_the_forward_would_take():
    torch.manual_seed(0)
    nodes = [Kept(4, 8, nn.ReLU()), Kept(8, 8, nn.Sigmoid()), Kept(8, 8, nn.Tanh())]
    names = ["relu", "sigmoid", "tanh"]
    g = Graph.somatize(
        nodes[0].named("relu") >> nodes[1].named("sigmoid") >> nodes[2].named("tanh") >> Head(8)
    )
    audit = Audit(window=1).watch(g)
    x, y = _data()
    opt = torch.optim.SGD(parameters(g), lr=0.5)
    for step in range(4):
        opt.zero_grad()
        F.cross_entropy(g.forward(x * (step + 1)), y).backward()
        n = {f["where"]: f["numbers"] for f in audit.observed(g)}
        opt.step()
        audit.moved()
        for node, name, sat in zip(nodes, names, (None, "sigmoid", "tanh"), strict=True):
            mean, zero, saturated = _by_hand(node.gave, sat)
            got = n[name]
            assert got["act_mean"] == pytest.approx(mean, rel=1e-5, abs=1e-7), (step, name)
            assert got["zero"] == pytest.approx(zero, abs=1e-9), (step, name)
            assert got["saturated"] == pytest.approx(saturated, abs=1e-9), (step, name)
            assert type(got["zero"]) is float and got["nan"] is False and got["inf"] is False
        # after the first step, every one of them is known to stay as given: taken when observed
        assert [audit._places[k].later for k in names] == [True, True, True]
    assert 0 < n["relu"]["zero"] < 1 and 0 < n["sigmoid"]["saturated"] < 1
    audit.release()


def test_an_output_written_over_only_later_loses_that_steps_sums_then_is_taken_at_once():
    class Poke(Node):
        """Adds one to what it is given, in place when `inplace`."""

        def __init__(self):
            self.inplace = False

        def forward(self, x, ctx):
            return x.add_(1.0) if self.inplace else x + 1.0

    torch.manual_seed(0)
    first, poke = Kept(4, 8, nn.Identity()), Poke()
    g = Graph.somatize(first.named("first") >> poke.named("poke") >> Head(8))
    audit = Audit(window=1).watch(g)
    x, y = _data()
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    told = []
    for step in range(4):
        poke.inplace = step >= 2
        opt.zero_grad()
        F.cross_entropy(g.forward(x), y).backward()
        told.append({f["where"]: f["numbers"] for f in audit.observed(g)}["first"])
        opt.step()
        audit.moved()
        if step != 2:
            mean, zero, _ = _by_hand(first.gave)
            assert told[-1]["act_mean"] == pytest.approx(mean, rel=1e-5), step
    # step 2: its output was written over after the audit saw it, where the audit had learnt
    # it would not be: that step's sums are gone (not wrong); from then on taken at once
    assert "act_mean" not in told[2] and "zero" not in told[2]
    assert "grad_norm" in told[2] and "param_norm" in told[2]
    assert audit._places["first"].later is False
    assert "act_mean" in told[3]
    audit.release()


@pytest.mark.parametrize("inplace", [False, True])
def test_out_grad_norm_is_the_outputs_gradient_even_when_the_next_node_writes_over_it(inplace):
    class Grab(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 8)
            self.grads = []

        def forward(self, x, ctx):
            h = self.l(x)
            h.register_hook(lambda g: self.grads.append(float(g.norm())))
            return h

    class Bump(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x, ctx):
            return self.fc(x.relu_() if inplace else torch.relu(x))

    torch.manual_seed(0)
    grab = Grab()
    g = Graph.somatize(grab >> Bump())
    audit = Audit(snapshot=1).watch(g)  # ∂L/∂output is a snapshot step's number
    facts, _ = _loop(g, audit, 4)
    audit.release()
    heard = [{f["where"]: f["numbers"] for f in step}["grab"]["out_grad_norm"] for step in facts]
    assert heard == pytest.approx(grab.grads, rel=1e-6)
    assert grab.grads[0] != pytest.approx(grab.grads[1])  # the steps differ: a real check


def test_out_grad_norm_comes_with_the_snapshot_and_other_steps_keep_no_output_gradient():
    class Keep(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 8)

        def forward(self, x, ctx):
            self.last = self.l(x)
            return self.last

    class Out(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x, ctx):
            return self.fc(torch.relu(x))

    torch.manual_seed(0)
    keep = Keep()
    g = Graph.somatize(keep >> Out())
    audit = Audit(every=2, snapshot=4).watch(g)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    x, y = _data()
    for i in range(9):  # measured 0, 2, 4, 6, 8; snapshots 0, 4, 8
        opt.zero_grad()
        F.cross_entropy(g.forward(x), y).backward()
        # only a snapshot step keeps ∂L/∂output past backward
        assert keep.last.retains_grad == (i % 4 == 0), i
        n = {f["where"]: f["numbers"] for f in audit.observed(g)}
        opt.step()
        audit.moved()
        if i % 2:
            assert n == {}
            continue
        assert "grad_norm" in n["keep"] and "act_mean" in n["keep"]
        has = ["out_grad_norm" in v for v in n.values()]
        assert all(has) if i % 4 == 0 else not any(has), i
        assert ("effective_rank" in n["keep"]) == (i % 4 == 0)
    audit.release()


def test_a_place_and_its_last_layer_share_one_output_but_not_one_written_over():
    g = _graph()
    audit = Audit(inside=True, channels=True, snapshot=1).watch(g)
    facts, _ = _loop(g, audit, 2)
    audit.release()
    x, y = _data()
    with torch.no_grad():
        logits = _graph().forward(x)  # the same start: step 0's output by hand
    by_hand = (torch.softmax(logits, 1) - F.one_hot(y, 3)).div(len(y)).norm()
    for step in facts:
        n = {f["where"]: f["numbers"] for f in step}
        # the node's output is its last layer's: the same numbers, each place its own fact
        for key in ("act_mean", "zero", "out_grad_norm", "channels", "effective_rank"):
            assert n["head"][key] == n["head.fc"][key], key
        assert n["head"].get("update_stable_rank") == n["head.fc"].get("update_stable_rank")
        # layer.r wrote over layer.l's output in place: layer.l keeps what it saw before that
        assert n["layer.l"]["zero"] == 0.0 < n["layer.r"]["zero"] == n["layer"]["zero"]
        assert n["layer.l"]["act_mean"] != n["layer"]["act_mean"]
    first = {f["where"]: f["numbers"] for f in facts[0]}
    assert first["head"]["out_grad_norm"] == pytest.approx(float(by_hand), rel=1e-5)
    assert "update_stable_rank" in {f["where"]: f["numbers"] for f in facts[1]}["head"]


def test_under_accumulation_each_measured_step_gets_its_groups_update_told_at_the_close():
    g = _graph()
    heard = []
    t = _trainer(g, Audit(every=1), heard, every=3)
    first = g.implementation("layer")
    x, y = _data()
    before = [p.detach().clone() for p in first.parameters()]
    for _ in range(3):
        t.step((x, y))
    after = [p.detach().clone() for p in first.parameters()]
    heard = [f for f in heard if f["fact"] in ("loss", "health", "updated")]
    kinds = [(f["fact"], f.get("step")) for f in heard if f["fact"] != "health"]
    assert kinds == [("loss", 0), ("loss", 1), ("loss", 2), ("updated", 2)]
    # the three steps' facts are told together, after the third loss and before `updated`
    order = [f["fact"] for f in heard]
    assert order[:3] == ["loss"] * 3 and order[-1] == "updated"
    assert sorted({f["step"] for f in heard if f["fact"] == "health"}) == [0, 1, 2]
    ratios = [f["numbers"]["update_ratio"] for f in heard if f.get("where") == "layer"]
    assert len(ratios) == 3 and ratios[0] > 0  # not the 0 of a step where nothing moved
    assert ratios == pytest.approx([_ratio(before, after)] * 3, rel=1e-5)
    t.close()


def test_weights_given_new_memory_between_steps_are_copied_afresh():
    g = _graph()
    audit = Audit().watch(g)
    first = g.implementation("layer")
    x, y = _data()
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    ratios = []
    for k in range(3):
        if k == 1:  # as `.to(device)` or a load that swaps tensors would
            with torch.no_grad():
                first.l.weight.data = first.l.weight.data.clone()
        opt.zero_grad()
        before = [p.detach().clone() for p in first.parameters()]
        F.cross_entropy(g.forward(x), y).backward()
        n = {f["where"]: f["numbers"] for f in audit.observed(g)}["layer"]
        opt.step()
        audit.moved()
        after = [p.detach().clone() for p in first.parameters()]
        assert n["update_ratio"] == pytest.approx(_ratio(before, after), rel=1e-5)
        ratios.append(n["update_ratio"])
    audit.release()
    assert len(set(ratios)) == 3


def test_weights_numpy_cannot_view_take_torchs_way():
    # bfloat16 has no numpy view: the norms and the update go through torch, as on a GPU
    g = _graph()
    for node in g.nodes():
        impl = g.implementation(node)
        (impl if isinstance(impl, nn.Module) else impl.fc).to(torch.bfloat16)
    first = g.implementation("layer")
    audit = Audit(snapshot=1).watch(g)
    x, y = _data()
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        before = [p.detach().double() for p in first.parameters()]
        F.cross_entropy(g.forward(x.to(torch.bfloat16)).float(), y).backward()
        grads = [p.grad.double() for p in first.parameters()]
        n = {f["where"]: f["numbers"] for f in audit.observed(g)}["layer"]
        opt.step()
        audit.moved()
        after = [p.detach().double() for p in first.parameters()]
        flat = torch.cat([b.flatten() for b in before])
        assert n["param_norm"] == pytest.approx(float(flat.norm()), rel=1e-2)
        assert n["grad_norm"] == pytest.approx(
            float(torch.cat([q.flatten() for q in grads]).norm()), rel=1e-2
        )
        assert n["update_ratio"] == pytest.approx(_ratio(before, after), rel=1e-2)
        assert n["update_ratio"] > 0 and type(n["update_stable_rank"]) is float
    audit.release()


def test_a_node_trained_inside_backward_by_its_own_split_is_seen_to_move():
    from somatize.torch import Split

    g = _graph()
    heard = []
    trains = {"layer_2": Split(torch.optim.SGD, lr=0.1)}
    t = _trainer(g, Audit(every=1), heard, trains=trains)
    body = g.implementation("layer_2")
    x, y = _data()
    for _ in range(3):
        before = [p.detach().clone() for p in body.parameters()]
        t.step((x, y))
        after = [p.detach().clone() for p in body.parameters()]
    assert t.audit._prev is not None  # weights the Trainer's SGD does not hold: θ is copied
    t.close()
    last = [f["numbers"] for f in heard if f.get("where") == "layer_2"][-1]
    # its weights move inside backward, before `observed`: the copy is taken in the forward
    assert last["update_ratio"] > 0
    assert last["update_ratio"] == pytest.approx(_ratio(before, after), rel=1e-5)


def test_a_node_updated_every_other_step_by_its_own_split_is_not_stalled_between():
    from somatize.health import STALLED, seen_in, verdict
    from somatize.torch import Split

    g = _graph()
    heard = []
    trains = {"layer_2": Split(torch.optim.SGD, every=2, lr=0.1)}  # its own, not the Trainer's
    t = _trainer(g, Audit(every=1), heard, trains=trains)
    body = g.implementation("layer_2")
    x, y = _data()
    moved = []
    for _ in range(7):
        before = [p.detach().clone() for p in body.parameters()]
        t.step((x, y))
        moved.append(_ratio(before, [p.detach().clone() for p in body.parameters()]))
    t.close()
    told = [f["numbers"] for f in heard if f.get("where") == "layer_2"]
    assert [m > 0 for m in moved] == [False, True, False, True, False, True, False]
    # the first step: nothing has moved it yet, and it reads 0 (a node nobody trains would
    # stay there, and be STALLED); after that a step that leaves it for its own update says
    # nothing, and one that updates it says by how much
    assert told[0]["update_ratio"] == 0.0
    for k in (1, 3, 5):
        assert told[k]["update_ratio"] == pytest.approx(moved[k], rel=1e-5)
    for k in (2, 4, 6):
        assert "update_ratio" not in told[k] and "grad_norm" in told[k]
    assert STALLED not in verdict(seen_in(heard)["layer_2"])
    # the rest of the graph, moved by the Trainer's optimizer every step, has a ratio each step
    assert all("update_ratio" in f["numbers"] for f in heard if f.get("where") == "layer")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("saturates", [None, "sigmoid", "tanh"])
def test_later_sums_in_pieces_and_either_precision(dtype, saturates):
    from somatize.torch.audit import _measures

    rng = np.random.default_rng(0)
    n = 2 * _measures._CHUNK + 12345  # three pieces against the ones vector
    v = rng.standard_normal(n).astype(dtype)
    v[::7] = 0.0
    v[1::11] = 5e-8  # under ε: zero too
    v[2::13] = 0.995
    v[3::17] = np.nan
    into = [None] * 4
    _measures.later_sums(v, saturates, into, 1)
    finite = np.nan_to_num(v.astype(np.float64), nan=0.0)
    assert into[0] is None
    assert math.isnan(into[1])  # a NaN in the output makes Σa NaN (the caller then looks)
    if saturates is None:
        zero_at = 2
    else:
        zero_at = 3
        sat = (v <= 0.01) | (v >= 0.99) if saturates == "sigmoid" else np.abs(v) >= 0.99
        assert into[2] == float(np.count_nonzero(sat))
    assert into[zero_at] == float(np.count_nonzero(np.abs(v) <= 1e-7))
    v[3::17] = 0.0
    _measures.later_sums(v, saturates, into, 1)
    # a float32 BLAS dot in three pieces: within a few ulps of Σ|a| of the exact sum
    assert into[1] == pytest.approx(float(finite.sum()), abs=1e-6 * float(np.abs(finite).sum()))


def test_a_dropped_audited_trainer_frees_the_weights_at_once_without_the_collector():
    import gc
    import weakref

    def trainer():
        g = _graph()
        t = Trainer(
            g,
            objective=F.cross_entropy,
            optimizer=torch.optim.SGD(parameters(g), lr=0.1),
            auditing=Audit(every=1, snapshot=1),
        )
        x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        t.fit([(x, y)] * 3)
        return t, weakref.ref(parameters(g)[0])

    t, weight = trainer()
    assert weight() is not None
    was = gc.isenabled()
    gc.disable()
    try:
        del t  # the Trainer's finalizer releases the audit's hooks; nothing else is a cycle
        assert weight() is None
    finally:
        if was:
            gc.enable()


def test_weights_or_an_update_that_are_not_finite_give_a_ratio_to_report_and_no_warning():
    import warnings

    for poisoned, lr in ((True, 0.1), (False, 1e38)):
        g = _graph()
        first = g.implementation(g.nodes()[0]).l
        with torch.no_grad():
            first.weight.mul_(1e18)  # grads of ≈ 1e36: an lr of 1e38 overflows the update
            if poisoned:
                first.weight[0, 0] = float("inf")
        audit = Audit(every=1).watch(g)
        optimizer = torch.optim.SGD(parameters(g), lr=lr)
        x, y = _data()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.cross_entropy(g.forward(x), y).backward()
            facts = audit.observed(g)
            optimizer.step()
            audit.moved()
        audit.release()
        ratio = {f["where"]: f["numbers"] for f in facts}[g.nodes()[0]]["update_ratio"]
        assert not math.isfinite(ratio), (poisoned, ratio)


def test_snapshot_numbers_of_something_that_blew_up_are_no_number_and_stop_nothing():
    import warnings

    from somatize.torch.audit._measures import effective_ranks, stable_rank

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for bad in (float("inf"), float("nan")):
            for shape in ((256, 256), (256, 64)):  # power steps and Lanczos; the exact Gram
                d = torch.randn(*shape)
                d[3, 5] = bad
                assert stable_rank(d) == 0.0  # σ_max² is NaN: read as no update, as documented
            f = torch.relu(torch.randn(64, 256))
            f[0, 0] = bad
            blew, fine = effective_ranks([f, torch.relu(torch.randn(64, 256))])
            assert blew == 0.0 and fine > 30  # the other one of the batch is still taken


def _sgd_run(make_optimizer, steps=12, hook=False, scheduler=False):
    """A Trainer of `_graph()` by `make_optimizer(params)`, audited every step with a snapshot
    every fourth; its health numbers by (place, step), and whether the audit held a copy of θ
    after each update. `hook`: a step hook that does nothing (the audit then copies θ).
    `scheduler`: a StepLR stepped after each update."""
    g = _graph()
    heard, copied, held = [], [], []
    opt = make_optimizer(parameters(g))
    if hook:
        opt.register_step_post_hook(lambda *a: None)
    watching = [
        heard.append,
        lambda f: copied.append(held[0]._prev is not None) if f["fact"] == "updated" else None,
    ]
    if scheduler:
        lr = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        watching.append(lambda f: lr.step() if f["fact"] == "updated" else None)
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=opt,
        auditing=Audit(every=1, snapshot=4),
        watching=watching,
    )
    held.append(t.audit)
    x, y = _data()
    t.fit([(x, y)] * steps)
    numbers = {(f["where"], f["step"]): f["numbers"] for f in heard if f["fact"] == "health"}
    return numbers, copied


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, foreach=False, maximize=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, dampening=0.1),
    ],
    ids=["plain", "single-tensor, maximize", "momentum, weight decay, dampening"],
)
@pytest.mark.parametrize("scheduler", [False, True], ids=["", "StepLR"])
def test_an_sgd_steps_update_is_read_from_the_step_as_a_copy_would_measure_it(make, scheduler):
    read, held = _sgd_run(make, scheduler=scheduler)
    assert held == [False] * 12  # no copy of θ was ever made
    copied, held = _sgd_run(make, hook=True, scheduler=scheduler)
    assert held == [True] * 12  # with a step hook, θ is copied
    assert read.keys() == copied.keys() and len(read) == 36
    for key, n in read.items():
        assert n["update_ratio"] == pytest.approx(copied[key]["update_ratio"], rel=1e-4), key
        assert n["update_ratio"] > 0
        assert ("update_stable_rank" in n) == (key[1] % 4 == 0)
        if "update_stable_rank" in n:
            assert n["update_stable_rank"] == pytest.approx(
                copied[key]["update_stable_rank"], rel=1e-4
            )


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, fused=True),  # leaves the version counters be
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-3),  # decay outside any buffer
    ],
    ids=["Adam", "fused", "Nesterov", "decay without momentum"],
)
def test_any_other_step_has_its_update_measured_on_a_copy_of_the_weights(make):
    numbers, held = _sgd_run(make, steps=3)
    assert held == [True] * 3
    assert len(numbers) == 9 and all(n["update_ratio"] > 0 for n in numbers.values())


def test_weights_moved_by_more_than_the_sgd_step_give_no_ratio_that_step_then_a_copy():
    g = _graph()
    heard = []
    first = g.implementation("layer")
    meddle = {"step": 1}

    def objective(out, y):
        loss = F.cross_entropy(out, y)
        if meddle["step"] == 0:
            with torch.no_grad():  # moved between the forward and the SGD step
                first.l.weight.mul_(1.01)
        meddle["step"] -= 1
        return loss

    t = Trainer(
        g,
        objective=objective,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        auditing=Audit(every=1),
        watching=heard.append,
    )
    x, y = _data()
    befores, afters = [], []
    for _ in range(4):
        befores.append([p.detach().clone() for p in first.parameters()])
        t.step((x, y))
        afters.append([p.detach().clone() for p in first.parameters()])
    layer = {f["step"]: f["numbers"] for f in heard if f.get("where") == "layer"}
    assert "update_ratio" in layer[0] and t.audit._prev is not None  # read at 0; copied after 1
    assert "update_ratio" not in layer[1] and "grad_norm" in layer[1]
    for k in (0, 2, 3):
        assert layer[k]["update_ratio"] == pytest.approx(_ratio(befores[k], afters[k]), rel=1e-4)


class Embed(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(50, 8, sparse=True)

    def forward(self, x, ctx):
        return self.e(x).mean(1)


@pytest.mark.parametrize("hook", [False, True], ids=["read from the step", "copied"])
def test_a_sparse_gradient_is_audited_by_its_values(hook):
    torch.manual_seed(0)
    g = Graph.somatize(Embed() >> Head(8))
    table = g.implementation("embed").e.weight
    opt = torch.optim.SGD(parameters(g), lr=0.5)
    if hook:
        opt.register_step_post_hook(lambda *a: None)
    heard = []
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=opt,
        auditing=Audit(every=1, snapshot=2),
        watching=heard.append,
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50, (16, 4), generator=gen), torch.randint(0, 3, (16,), generator=gen)
    for step in range(3):
        before = table.detach().clone()
        t.step((x, y))
        grad = table.grad
        assert grad.layout is torch.sparse_coo  # what the embedding gave, untouched by the audit
        n = [f["numbers"] for f in heard if f.get("where") == "embed" and f["step"] == step][0]
        assert n["grad_norm"] == pytest.approx(float(grad.to_dense().norm()), rel=1e-5)
        delta = table.detach() - before
        assert n["update_ratio"] == pytest.approx(float(delta.norm() / before.norm()), rel=1e-4)
        if step % 2 == 0:
            s = torch.linalg.svdvals(delta.double())
            assert n["update_stable_rank"] == pytest.approx(
                float((s**2).sum() / s[0] ** 2), rel=1e-3
            )


def test_past_a_frozen_node_the_sgd_steps_update_is_still_read_from_the_step():
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8).frozen() >> Layer(8, 8) >> Head(8))
    heard = []
    t = _trainer(g, Audit(every=1), heard)
    body = g.implementation("layer_2")
    x, y = _data()
    for step in range(3):
        before = [p.detach().clone() for p in body.parameters()]
        t.step((x, y))
        assert t.audit._prev is None  # the frozen weights are not watched: nothing to copy
        n = [f["numbers"] for f in heard if f.get("where") == "layer_2" and f["step"] == step]
        after = [p.detach() for p in body.parameters()]
        assert n[0]["update_ratio"] == pytest.approx(_ratio(before, after), rel=1e-4)
    frozen = [f["numbers"] for f in heard if f.get("where") == "layer"]
    assert frozen and not any("update_ratio" in n for n in frozen)
