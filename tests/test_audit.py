"""Audit: flat health facts per place and measured step, driven by a hand loop and by the
Trainer; every float checked against a float64 reference with a tolerance from dtype and size."""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node
from somatize.health import Thresholds, verdict
from somatize.node import Opaque
from somatize.torch import Audit, Split, Trainer, parameters

EPS32 = torch.finfo(torch.float32).eps


def rtol(n: int, k: float = 8.0, dtype: torch.dtype = torch.float32) -> float:
    """What float rounding can move a reduction over `n` values by, relatively."""
    return k * torch.finfo(dtype).eps * math.sqrt(max(n, 1))


class Layer(Node, nn.Module):
    def __init__(self, i, o, act="relu"):
        super().__init__()
        self.l = nn.Linear(i, o)
        self.r = {"relu": nn.ReLU(inplace=True), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[act]

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


def _data(n=32, d=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


def _by(facts, where):
    """The fact of one place (`node` or `node.inside`) among one step's facts."""
    found = [
        f
        for f in facts
        if (f["node"] if f["inside"] is None else f"{f['node']}.{f['inside']}") == where
    ]
    assert len(found) == 1, (where, found)
    return found[0]


def _loop(g, audit, steps, optimizer=None, tell=True):
    """`steps` hand-made steps; `params[k]`: every weight as step k found them (and, last, as
    the loop left them), in float64. `tell`: say `moved()` after each optimizer step."""
    x, y = _data()
    opt = optimizer(parameters(g)) if optimizer else torch.optim.SGD(parameters(g), lr=0.1)
    facts, params = [], []
    for _ in range(steps):
        opt.zero_grad()
        params.append({id(p): p.detach().double().clone() for p in parameters(g)})
        F.cross_entropy(g.forward(x), y).backward()
        facts.append(audit.observed(g))
        opt.step()
        if tell:
            audit.moved()
    params.append({id(p): p.detach().double().clone() for p in parameters(g)})
    return facts, params


def _weights(module):
    """Every weight of a module as it is now, in float64, by identity."""
    return {id(p): p.detach().double().clone() for p in module.parameters()}


def _split(g, heard, learning):
    """A Trainer of `g` by SGD, its `layer_2` trained by its own `learning`, audited."""
    trains = {"layer_2": learning}
    return Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
        trains=trains,
        auditing=Audit(),
        watching=heard.append,
    )


def _audited(g, heard, **kw):
    """A Trainer of `g` by SGD (lr 0.1) on cross entropy, audited every step, telling `heard`."""
    return Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        auditing=Audit(),
        watching=heard.append,
        **kw,
    )


def _fit(g, steps=3):
    """What an audited Trainer (SGD, lr 0.1) told over `steps` steps on `_data()`."""
    heard = []
    t = _audited(g, heard)
    x, y = _data()
    t.fit([(x, y)] * steps)
    t.close()
    return heard


def _ratio(module, before, after):
    """‖after − before‖ / ‖before‖ over a module's weights, in float64."""
    ps = list(module.parameters())
    diff = torch.cat([(after[id(p)] - before[id(p)]).flatten() for p in ps]).norm()
    return float(diff / torch.cat([before[id(p)].flatten() for p in ps]).norm())


def _size(module):
    return sum(p.numel() for p in module.parameters())


# -- the facts --------------------------------------------------------------------------------


def test_one_flat_fact_per_place_with_published_names_types_and_float64_checked_numbers():
    g = _graph()
    audit = Audit().watch(g)
    facts, params = _loop(g, audit, 3)
    audit.release()
    assert [[(f["node"], f["inside"]) for f in step] for step in facts] == [
        [("layer", None), ("layer_2", None), ("head", None)]
    ] * 3
    n = _by(facts[2], "layer")
    assert n["fact"] == "health" and n["step"] == 2 and "where" not in n and "numbers" not in n
    for key in (
        "grad_norm",
        "param_norm",
        "update_ratio",
        "act_abs_mean",
        "zero_frac_max",
        "sat_frac_max",
        "param_norm_slope",
    ):
        assert type(n[key]) is float, key
    assert type(n["nan"]) is bool and type(n["inf"]) is bool and n["nan"] is n["inf"] is False
    layer = g.implementation("layer")
    size = _size(layer)
    # the update this step's gradient made, over the weights the step ran with
    want = _ratio(layer, params[2], params[3])
    assert n["update_ratio"] == pytest.approx(want, rel=rtol(size))
    theta = torch.cat([params[2][id(p)].flatten() for p in layer.parameters()]).norm()
    assert n["param_norm"] == pytest.approx(float(theta), rel=rtol(size))
    # SGD without momentum: the update is lr·g, so ‖∇θ‖ is ‖Δθ‖ / lr
    delta = float(
        torch.cat(
            [(params[3][id(p)] - params[2][id(p)]).flatten() for p in layer.parameters()]
        ).norm()
    )
    assert n["grad_norm"] == pytest.approx(delta / 0.1, rel=rtol(size, 64))
    before = [
        float(torch.cat([s[id(p)].flatten() for p in layer.parameters()]).norm())
        for s in params[:3]
    ]
    # two float32 norms apart over two steps: each is good to rtol(size) of ‖θ‖
    slack = rtol(size) * before[2]
    assert n["param_norm_slope"] == pytest.approx((before[2] - before[0]) / 2, abs=slack)
    assert slack < abs(before[2] - before[0]) / 2  # (the check says something)
    assert 0.0 < n["zero_frac_max"] < 1.0  # in-place ReLU measured without complaint
    assert "grad_norm" in _by(facts[2], "head")
    # ‖∂L/∂output‖ is a snapshot step's (the first measured step of every 50)
    assert type(_by(facts[0], "layer")["out_grad_norm"]) is float
    assert "out_grad_norm" not in n


@pytest.mark.parametrize("inplace", [False, True])
def test_out_grad_norm_is_the_gradient_a_hook_on_the_output_hears(inplace):
    class Grab(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 8)
            self.grads = []

        def forward(self, x, ctx):
            h = self.l(x)
            h.register_hook(lambda g: self.grads.append(float(g.double().norm())))
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
    audit = Audit(snapshot=1).watch(g)
    facts, _ = _loop(g, audit, 4)
    audit.release()
    heard = [_by(step, "grab")["out_grad_norm"] for step in facts]
    assert heard == pytest.approx(grab.grads, rel=rtol(32 * 8))
    assert grab.grads[0] != pytest.approx(grab.grads[1])  # the steps differ: a real check


def test_output_numbers_are_the_outputs_against_float64():
    class Keep(Node, nn.Module):
        """An activation of a linear layer; keeps a float64 copy of what it gave."""

        def __init__(self, i, o, act):
            super().__init__()
            self.l = nn.Linear(i, o)
            self.act = act
            self.gave = []

        def forward(self, x, ctx):
            out = self.act(self.l(x) * 4)
            self.gave.append(out.detach().double())
            return out

    torch.manual_seed(0)
    nodes = [Keep(4, 64, nn.ReLU()), Keep(64, 64, nn.Sigmoid()), Keep(64, 64, nn.Tanh())]
    g = Graph.somatize(
        nodes[0].named("relu") >> nodes[1].named("sigmoid") >> nodes[2].named("tanh") >> Head(64)
    )
    audit = Audit(window=3).watch(g)
    facts, _ = _loop(g, audit, 5)
    audit.release()
    for name, node in zip(("relu", "sigmoid", "tanh"), nodes, strict=True):
        zeros, saturated = [], []
        for k, step in enumerate(facts):
            a = node.gave[k]
            n = _by(step, name)
            assert n["act_abs_mean"] == pytest.approx(float(a.abs().mean()), rel=rtol(a.numel()))
            zeros.append(float((a.abs() <= 1e-7).double().mean()))
            if name == "sigmoid":
                saturated.append(float(((a <= 0.01) | (a >= 0.99)).double().mean()))
            elif name == "tanh":
                saturated.append(float((a.abs() >= 0.99).double().mean()))
            else:
                saturated.append(0.0)
            # the largest share over the last `window` (3) measured steps
            assert n["zero_frac_max"] == pytest.approx(max(zeros[-3:]), abs=1e-12), (name, k)
            assert n["sat_frac_max"] == pytest.approx(max(saturated[-3:]), abs=1e-12), (name, k)
        telling = zeros if name == "relu" else saturated  # a check that could fail
        assert 0 < min(telling) and max(telling) < 1 and len(set(telling)) > 1, name


def test_every_optimizer_is_measured_the_same_way_against_the_weights_themselves():
    makers = [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.1, foreach=False, maximize=True),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.RMSprop(p, lr=0.01),
    ]
    for make in makers:
        g = _graph()
        audit = Audit().watch(g)
        facts, params = _loop(g, audit, 3, optimizer=make)
        audit.release()
        for k in range(3):
            for node in ("layer", "layer_2"):
                module = g.implementation(node)
                want = _ratio(module, params[k], params[k + 1])
                got = _by(facts[k], node)["update_ratio"]
                assert got == pytest.approx(want, rel=rtol(_size(module))), (make, k, node)
                assert got > 0


def test_a_step_hook_and_a_scheduler_change_nothing_in_how_the_update_is_taken():
    g = _graph()
    opt = torch.optim.SGD(parameters(g), lr=0.1, momentum=0.9)
    opt.register_step_post_hook(lambda *a: None)
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    heard, weights = [], []
    layer = g.implementation("layer")
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=opt,
        auditing=Audit(),
        watching=[heard.append, lambda f: lr.step() if f["fact"] == "updated" else None],
    )
    x, y = _data()
    for _ in range(5):
        weights.append(_weights(layer))
        t.step((x, y))
    weights.append(_weights(layer))
    t.close()
    ratios = [
        f["update_ratio"] for f in heard if f.get("fact") == "health" and f["node"] == "layer"
    ]
    want = [_ratio(layer, weights[k], weights[k + 1]) for k in range(5)]
    assert ratios == pytest.approx(want, rel=rtol(_size(layer)))


def test_every_measures_one_step_in_n_and_snapshots_come_every_snapshot_steps_whatever_every_is():
    g = _graph()
    audit = Audit(every=7, snapshot=20).watch(g)
    facts, _ = _loop(g, audit, 50)
    audit.release()
    assert [k for k, f in enumerate(facts) if f] == list(range(0, 50, 7))
    assert audit.step == 50
    ranked = [k for k, f in enumerate(facts) if f and "effective_rank" in f[0]]
    # the first measured step of each 20: 0, then 21 (not 140, the first both divide), 42
    assert ranked == [0, 21, 42]
    assert all("update_stable_rank" in facts[k][0] for k in ranked)
    assert all("update_ratio" in f[0] for f in facts if f)


def test_without_moved_no_update_ratio_and_the_copy_waits():
    g = _graph()
    audit = Audit().watch(g)
    facts, _ = _loop(g, audit, 2, tell=False)
    assert all("update_ratio" not in f for step in facts for f in step)
    assert all("grad_norm" in f for f in facts[1] if f["node"] != "head" or True)
    audit.release()


def test_under_accumulation_each_measured_step_gets_its_groups_update_told_at_the_close():
    g = _graph()
    heard = []
    t = _audited(g, heard, every=3)
    layer = g.implementation("layer")
    x, y = _data()
    before = _weights(layer)
    for _ in range(3):
        t.step((x, y))
    after = _weights(layer)
    t.close()
    kinds = [(f["fact"], f.get("step")) for f in heard if f["fact"] in ("loss", "updated")]
    assert kinds == [("loss", 0), ("loss", 1), ("loss", 2), ("updated", 2)]
    order = [f["fact"] for f in heard if f["fact"] in ("loss", "health", "updated")]
    assert order[:3] == ["loss"] * 3 and order[-1] == "updated"  # told together, at the close
    ratios = [f["update_ratio"] for f in heard if f["fact"] == "health" and f["node"] == "layer"]
    want = _ratio(layer, before, after)
    assert want > 0 and ratios == pytest.approx([want] * 3, rel=rtol(_size(layer)))


def test_under_accumulation_grad_norm_is_what_the_group_has_accumulated_so_far():
    x, y = _data()
    batches = [(x, y), (x.flip(0), y), (2 * x, y.flip(0))]
    reference = _graph()  # the same weights, in float64: each step's gradient by hand
    for p in parameters(reference):
        p.data = p.data.double()
    grads = []
    for bx, by in batches:
        for p in parameters(reference):
            p.grad = None
        F.cross_entropy(reference.forward(bx.double()), by).backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in reference.implementation("layer").l.parameters()])
        )
    g = _graph()
    heard = []
    t = _audited(g, heard, every=3)
    for batch in batches:
        t.step(batch)
    t.close()
    said = [f["grad_norm"] for f in heard if f["fact"] == "health" and f["node"] == "layer"]
    want = [float((sum(grads[: k + 1]) / 3).norm()) for k in range(3)]  # the Trainer's 1/every
    assert said == pytest.approx(want, rel=rtol(_size(g.implementation("layer"))))


def test_a_node_trained_inside_backward_by_its_own_split_is_seen_to_move():
    g = _graph()
    heard = []
    t = _split(g, heard, Split(torch.optim.SGD, lr=0.1))
    body = g.implementation("layer_2")
    x, y = _data()
    for _ in range(3):
        before = _weights(body)
        t.step((x, y))
        after = _weights(body)
    t.close()
    last = [f for f in heard if f["fact"] == "health" and f["node"] == "layer_2"][-1]
    # its weights move inside backward, before `observed`: θ was copied in the forward
    assert last["update_ratio"] == pytest.approx(_ratio(body, before, after), rel=rtol(_size(body)))
    assert last["update_ratio"] > 0


def test_a_node_updated_every_other_step_by_its_own_split_is_not_stalled_between():
    from somatize.health import STALLED, seen_in, verdict

    g = _graph()
    heard = []
    t = _split(g, heard, Split(torch.optim.SGD, every=2, lr=0.1))  # its own, not the Trainer's
    body = g.implementation("layer_2")
    x, y = _data()
    moved = []
    for _ in range(7):
        before = _weights(body)
        t.step((x, y))
        moved.append(_ratio(body, before, _weights(body)))
    t.close()
    told = [f for f in heard if f["fact"] == "health" and f["node"] == "layer_2"]
    assert [m > 0 for m in moved] == [False, True, False, True, False, True, False]
    # the first step: nothing has moved it yet and it reads 0 (a node nobody trains stays
    # there, and is STALLED); after that a step that leaves it for its own update says
    # nothing, and one that updates it says by how much
    assert told[0]["update_ratio"] == 0.0
    for k in (1, 3, 5):
        assert told[k]["update_ratio"] == pytest.approx(moved[k], rel=rtol(_size(body)))
    for k in (2, 4, 6):
        assert "update_ratio" not in told[k] and "grad_norm" in told[k]
    assert STALLED not in verdict(seen_in(heard)["layer_2"])
    assert all("update_ratio" in f for f in heard if f["fact"] == "health" and f["node"] == "layer")


def test_a_frozen_node_is_watched_for_what_it_gives_not_for_weights():
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8).frozen() >> Layer(8, 8) >> Head(8))
    heard = _fit(g)
    health = [f for f in heard if f["fact"] == "health"]
    frozen = [f for f in health if f["node"] == "layer"]
    assert len(frozen) == 3 and all("act_abs_mean" in f for f in frozen)
    assert not any(k in f for f in frozen for k in ("grad_norm", "param_norm", "update_ratio"))
    assert all(f["update_ratio"] > 0 for f in health if f["node"] == "layer_2")


def test_weights_given_new_memory_or_another_dtype_between_steps_are_measured_as_they_are():
    g = _graph()
    layer = g.implementation("layer")
    for impl in (g.implementation(n) for n in g.nodes()):
        (impl if isinstance(impl, nn.Module) else impl.fc).to(torch.bfloat16)
    audit = Audit(snapshot=1).watch(g)
    x, y = _data()
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    for k in range(3):
        if k == 1:  # as a load that swaps tensors would
            with torch.no_grad():
                layer.l.weight.data = layer.l.weight.data.clone()
        opt.zero_grad()
        before = _weights(layer)
        F.cross_entropy(g.forward(x.to(torch.bfloat16)).float(), y).backward()
        grads = torch.cat([p.grad.double().flatten() for p in layer.parameters()])
        n = _by(audit.observed(g), "layer")
        opt.step()
        audit.moved()
        after = _weights(layer)
        # bfloat16 weights: norms accumulated in float32 over bfloat16 values
        tol = rtol(_size(layer), dtype=torch.bfloat16)
        assert n["grad_norm"] == pytest.approx(float(grads.norm()), rel=tol)
        assert n["update_ratio"] == pytest.approx(_ratio(layer, before, after), rel=tol)
        assert type(n["update_stable_rank"]) is float and n["update_stable_rank"] >= 1.0
    audit.release()


class Mixed(Node, nn.Module):
    """Two layers in two dtypes: float64, then float32."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8).double()
        self.b = nn.Linear(8, 3)

    def forward(self, x, ctx):
        return self.b(torch.tanh(self.a(x.double())).float())


def test_weights_of_two_dtypes_in_one_place_and_a_weight_given_another_shape_are_measured():
    torch.manual_seed(0)
    g = Graph.somatize(Mixed())
    net = g.implementation("mixed")
    audit = Audit().watch(g)
    x, y = _data()
    for k in range(3):
        if k == 2:  # a layer made wider between steps: its weights are copied as they are now
            with torch.no_grad():
                net.b.weight.data = torch.randn(5, 8) / 3
                net.b.bias.data = torch.zeros(5)
        opt = torch.optim.SGD(parameters(g), lr=0.1)
        opt.zero_grad()
        before = _weights(net)
        F.cross_entropy(g.forward(x), y).backward()
        n = _by(audit.observed(g), "mixed")
        opt.step()
        audit.moved()
        after = _weights(net)
        tol = rtol(_size(net))  # the float32 layer's rounding bounds the place's
        theta = torch.cat([w.flatten() for w in before.values()]).norm()
        assert n["param_norm"] == pytest.approx(float(theta), rel=tol)
        assert n["update_ratio"] == pytest.approx(_ratio(net, before, after), rel=tol)
    audit.release()


class Embed(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(50, 8, sparse=True)

    def forward(self, x, ctx):
        return self.e(x).mean(1)


def test_a_sparse_gradient_is_audited_by_its_values():
    torch.manual_seed(0)
    g = Graph.somatize(Embed() >> Head(8))
    table = g.implementation("embed").e.weight
    heard = []
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.5),
        auditing=Audit(snapshot=2),
        watching=heard.append,
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50, (16, 4), generator=gen), torch.randint(0, 3, (16,), generator=gen)
    for step in range(3):
        before = table.detach().double().clone()
        t.step((x, y))
        grad = table.grad
        assert grad.layout is torch.sparse_coo  # what the embedding gave, untouched
        n = [
            f for f in heard if f["fact"] == "health" and f["node"] == "embed" and f["step"] == step
        ][0]
        assert n["grad_norm"] == pytest.approx(
            float(grad.to_dense().double().norm()), rel=rtol(400)
        )
        delta = table.detach().double() - before
        assert n["update_ratio"] == pytest.approx(
            float(delta.norm() / before.norm()), rel=rtol(400)
        )
        if step % 2 == 0:
            s = torch.linalg.svdvals(delta)
            assert n["update_stable_rank"] == pytest.approx(
                float((s**2).sum() / s[0] ** 2), rel=rtol(400, 64)
            )
    t.close()


# -- snapshots ----------------------------------------------------------------------------------


def _entropy_rank(rows):
    x = rows.double() - rows.double().mean(0, keepdim=True)
    s = torch.linalg.svdvals(x)
    s = s[s > float(rows.double().norm()) * max(x.shape) * EPS32]
    p = s / s.sum()
    return float(torch.exp(-(p * p.log()).sum()))


def _stable(d):
    s = torch.linalg.svdvals(d.reshape(d.shape[0], -1).double())
    return float((s**2).sum() / s[0] ** 2)


def test_snapshot_numbers_against_float64_singular_values():
    class Gave(Node, nn.Module):
        def __init__(self, i, o, collapse=False):
            super().__init__()
            self.l = nn.Linear(i, o)
            self.collapse = collapse
            self.gave = None

        def forward(self, x, ctx):
            h = torch.relu(self.l(x))
            if self.collapse:  # every sample on one line: rank one
                h = h[:, :1] * torch.linspace(1, 2, h.shape[1])
            self.gave = h.detach().clone()
            return h

    torch.manual_seed(0)
    wide, thin, flat = Gave(16, 256), Gave(256, 96), Gave(96, 32, collapse=True)
    g = Graph.somatize(wide.named("wide") >> thin.named("thin") >> flat.named("flat") >> Head(32))
    audit = Audit(snapshot=1).watch(g)
    x, y = (
        torch.randn(64, 16, generator=torch.Generator().manual_seed(0)),
        torch.randint(0, 3, (64,)),
    )
    opt = torch.optim.SGD(parameters(g), lr=0.1, momentum=0.9)
    for _ in range(3):  # momentum: updates that are not rank one
        opt.zero_grad()
        before = {
            n: g.implementation(n).l.weight.detach().double().clone() for n in ("wide", "thin")
        }
        F.cross_entropy(g.forward(x), y).backward()
        facts = audit.observed(g)
        opt.step()
        audit.moved()
    audit.release()
    for name, node in (("wide", wide), ("thin", thin)):
        n = _by(facts, name)
        rows = node.gave
        assert n["rank_room"] == min(rows.shape)
        assert n["effective_rank"] == pytest.approx(_entropy_rank(rows), rel=rtol(rows.numel(), 16))
        d = g.implementation(name).l.weight.detach().double() - before[name]
        # exactly (matrix_norm) for a smaller side up to 64, by svd_lowrank past it, whose
        # error on σ_max the power steps bound well under this for an update with a gap
        tol = rtol(d.numel(), 16) if min(d.shape) <= 64 else 1e-3
        assert n["update_stable_rank"] == pytest.approx(_stable(d), rel=tol), name
    assert _by(facts, "flat")["effective_rank"] == pytest.approx(1.0, abs=1e-3)


def test_the_audit_changes_nothing_in_the_training_it_watches():
    class Drop(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 128)
            self.d = nn.Dropout(0.3)

        def forward(self, x, ctx):
            return self.d(torch.relu(self.l(x)))

    def run(auditing):
        torch.manual_seed(0)
        g = Graph.somatize(Drop() >> Layer(128, 96) >> Head(96))
        t = Trainer(
            g,
            objective=F.cross_entropy,
            optimizer=torch.optim.Adam(parameters(g), lr=0.01),
            auditing=auditing,
        )
        x, y = _data()
        torch.manual_seed(1)  # the dropout masks, drawn from the global generator
        result = t.fit([(x, y)] * 4)
        t.close()
        return result.history, [p.detach().clone() for p in parameters(g)]

    plain = run(None)
    audited = run(Audit(snapshot=1, channels=True, inside=True))  # svd_lowrank on the 96×128
    assert plain[0] == audited[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], audited[1], strict=True))


# -- what is watched ------------------------------------------------------------------------------


def test_inside_watches_modules_and_never_an_identity_that_only_passes_its_input_on():
    class Wrap(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 8)
            self.skip = nn.Identity()
            self.r = nn.ReLU()

        def forward(self, x, ctx):
            return self.r(self.skip(self.l(x)))

    torch.manual_seed(0)
    g = Graph.somatize(Wrap() >> Head(8))
    audit = Audit(inside=True).watch(g)
    assert audit.places == ["wrap", "wrap.l", "wrap.r", "head", "head.fc"]
    assert audit.left_out == []
    facts, _ = _loop(g, audit, 1)
    audit.release()
    assert [(f["node"], f["inside"]) for f in facts[0]] == [
        ("wrap", None),
        ("wrap", "l"),
        ("wrap", "r"),
        ("head", None),
        ("head", "fc"),
    ]
    assert "grad_norm" not in _by(facts[0], "wrap.r")  # no weights there
    # the node's output is its last layer's: one output, the same numbers, two facts
    for key in ("act_abs_mean", "zero_frac_max", "out_grad_norm"):
        assert _by(facts[0], "head")[key] == _by(facts[0], "head.fc")[key]


def test_a_bare_module_is_audited_as_a_graph_of_one_node():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Identity(), nn.Linear(8, 3))
    heard = []
    t = Trainer(
        model,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        auditing=Audit(inside=True),
        watching=heard.append,
    )
    x, y = _data()
    before = _weights(model)
    t.step((x, y))
    t.close()
    health = [f for f in heard if f["fact"] == "health"]
    assert [(f["node"], f["inside"]) for f in health] == [
        ("sequential", None),
        ("sequential", "0"),
        ("sequential", "1"),
        ("sequential", "3"),
    ]
    whole = _by(health, "sequential")
    assert whole["update_ratio"] == pytest.approx(
        _ratio(model, before, _weights(model)), rel=rtol(_size(model))
    )


class Block(nn.Module):
    """A ResNet basic block, its ReLU called twice (as torchvision's is)."""

    def __init__(self, i, o, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(i, o, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(o)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(o, o, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(o)
        self.downsample = (
            nn.Sequential(nn.Conv2d(i, o, 1, stride, bias=False), nn.BatchNorm2d(o))
            if stride != 1 or i != o
            else None
        )

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(Node, nn.Module):
    """ResNet-18's module tree (narrow): a stem, four stages of two blocks, a pool, fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(2)
        widths = [(4, 4, 1), (4, 8, 2), (8, 8, 2), (8, 16, 2)]
        for k, (i, o, s) in enumerate(widths, start=1):
            setattr(self, f"layer{k}", nn.Sequential(Block(i, o, s), Block(o, o)))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 3)

    def forward(self, x, ctx):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for k in range(1, 5):
            x = getattr(self, f"layer{k}")(x)
        return self.fc(self.avgpool(x).flatten(1))


def test_inside_past_most_covers_the_whole_net_coarsest_first_and_says_what_it_left_out():
    torch.manual_seed(0)
    net = ResNet18()
    g = Graph.somatize(net.named("resnet"))
    with pytest.warns(UserWarning, match=r"most=32.*left_out") as told:
        audit = Audit(inside=True).watch(g)
    inner = [p for p in audit.places if p != "resnet"]
    assert len(inner) == 32
    assert {"resnet.layer4.0", "resnet.layer4.1", "resnet.fc", "resnet.layer1.0.conv1"} <= set(
        inner
    )
    # every weight of the net is in exactly one watched place inside it: a cut, no gaps
    held = {}
    for where in inner:
        module = net.get_submodule(where.split(".", 1)[1])
        for p in module.parameters():
            held[id(p)] = held.get(id(p), 0) + 1
    assert held == {id(p): 1 for p in net.parameters()}
    # what a finer watch would add is listed, and counted in the warning
    assert (
        "resnet.layer4.0.conv1" in audit.left_out and "resnet.layer1.0.conv1" not in audit.left_out
    )
    assert str(len(audit.left_out)) in str(told[0].message)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    F.cross_entropy(g.forward(x), torch.tensor([0, 1, 2, 0])).backward()
    facts = audit.observed(g)
    audit.release()
    assert {f"{f['node']}.{f['inside']}" for f in facts if f["inside"]} == set(inner)
    assert (
        _by(facts, "resnet.layer4.1")["grad_norm"] > 0 and _by(facts, "resnet.fc")["grad_norm"] > 0
    )
    # more room: each leaf on its own, nothing left out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wide = Audit(inside=True, most=100).watch(g)
    assert wide.left_out == [] and "resnet.layer4.1.conv2" in wide.places
    wide.release()


def test_inside_by_depth_and_by_name_and_refusals():
    torch.manual_seed(0)
    g = Graph.somatize(ResNet18().named("resnet"))
    one = Audit(inside=1).watch(g)
    assert one.places[:3] == ["resnet", "resnet.conv1", "resnet.bn1"] and len(one.places) == 11
    one.release()
    with pytest.warns(UserWarning, match="6 more"):
        two = Audit(inside=2, most=12).watch(g)
    assert "resnet.fc" in two.places and "resnet.layer4.1" not in two.places  # coarsest first
    assert "resnet.layer4.1" in two.left_out
    two.release()
    named = Audit(inside=["resnet.layer4.1.conv2", "resnet.fc"]).watch(g)
    assert named.places == ["resnet", "resnet.layer4.1.conv2", "resnet.fc"]
    named.release()
    with pytest.raises(ValueError, match="not in this graph"):
        Audit(inside=["resnet.nope"]).watch(g)
    with pytest.raises(ValueError, match=r"\['layer4.1.conv2'\].*say \['resnet.layer4.1.conv2'\]"):
        Audit(inside=["layer4.1.conv2"]).watch(g)  # without its node: the place is suggested
    for bad in ({"every": 0}, {"snapshot": 1.5}, {"window": True}, {"most": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Audit(**bad)


def test_inside_given_as_a_generator_names_places_in_every_node():
    names = ["layer.l", "layer_2.l", "head.fc"]
    audit = Audit(inside=(w for w in names)).watch(_graph())  # an iterable read once
    assert audit.places == ["layer", "layer.l", "layer_2", "layer_2.l", "head", "head.fc"]
    audit.release()
    with pytest.raises(ValueError, match="nope"):
        Audit(inside=(w for w in ["layer.l", "layer_2.nope"])).watch(_graph())
    with pytest.raises(ValueError, match=r"inside=.*a list of places, not 1.5"):
        Audit(inside=1.5)


def test_a_node_that_returns_opaque_gets_the_numbers_a_bare_tensor_gets():
    class Wrapped(Node, nn.Module):
        def __init__(self, opaque):
            super().__init__()
            self.l = nn.Linear(4, 8)
            self.opaque = opaque

        def forward(self, x, ctx):
            h = torch.relu(self.l(x))
            return Opaque(h) if self.opaque else h

    def facts(opaque):
        torch.manual_seed(0)
        g = Graph.somatize(Wrapped(opaque).named("enc") >> Head(8))
        audit = Audit(snapshot=1, channels=True).watch(g)
        got, _ = _loop(g, audit, 2)
        audit.release()
        return [_by(step, "enc") for step in got]

    bare, wrapped = facts(False), facts(True)
    assert "act_abs_mean" in bare[0] and "out_grad_norm" in bare[0]
    assert wrapped == bare


def test_an_evaluation_between_steps_is_not_heard_and_nothing_of_it_is_kept():
    def run(evaluate):
        g = _graph()
        audit = Audit().watch(g)
        x, y = _data()
        opt = torch.optim.SGD(parameters(g), lr=0.1)
        kept = []
        facts = []
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(g.forward(x), y).backward()
            facts.append(audit.observed(g))
            opt.step()
            audit.moved()
            if evaluate:
                with torch.no_grad():
                    for _ in range(5):
                        other = torch.randn(256, 4) * 100
                        kept.append(weakref.ref(other))
                        g.forward(other)
                        del other
        audit.release()
        return facts, kept

    plain, _ = run(False)
    evaluated, kept = run(True)
    assert evaluated == plain  # the same numbers: the evaluations were not heard
    assert all(ref() is None for ref in kept)  # and nothing of them is held


def test_release_takes_every_hook_off_and_a_second_watch_is_refused():
    g = _graph()
    audit = Audit(inside=True, channels=True).watch(g)
    with pytest.raises(RuntimeError, match="release"):
        audit.watch(g)
    _loop(g, audit, 1)  # hooks on, heard, and on again for the next step
    audit.release()
    assert "forward" not in vars(g.implementation("layer"))
    with pytest.raises(RuntimeError, match="watch"):
        audit.observed(g)
    gone = weakref.ref(audit)
    del audit
    gc.collect()
    assert gone() is None  # a hook left on a module or a node of g would hold it alive
    again = Audit().watch(g)
    facts, _ = _loop(g, again, 1)
    again.release()
    assert len(facts[0]) == 3


def test_a_dropped_audited_trainer_frees_the_weights_at_once_without_the_collector():
    def trainer():
        g = _graph()
        t = Trainer(
            g,
            objective=F.cross_entropy,
            optimizer=torch.optim.SGD(parameters(g), lr=0.1),
            auditing=Audit(every=1, snapshot=1, channels=True, inside=True),
        )
        x, y = _data(16)
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


# -- channels and groups --------------------------------------------------------------------------


def test_dead_channels_over_the_window_and_input_channels_a_node_ignores():
    class Masked(Node, nn.Module):
        """A linear layer that reads only its first `keep` input channels."""

        def __init__(self, i, o, keep):
            super().__init__()
            self.l = nn.Linear(i, o)
            self.register_buffer("mask", (torch.arange(i) < keep).float())

        def forward(self, x, ctx):
            return torch.relu(F.linear(x, self.l.weight * self.mask, self.l.bias))

    torch.manual_seed(0)
    first = Layer(4, 16)
    with torch.no_grad():
        first.l.bias[:3] = -100.0  # three channels that never come on
    g = Graph.somatize(first.named("first") >> Masked(16, 8, keep=4).named("masked") >> Head(8))
    audit = Audit(channels=True).watch(g)
    facts, _ = _loop(g, audit, 2, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    audit.release()
    n = _by(facts[1], "first")
    assert n["channels"] == 16 and n["dead_channels"] == 3 and type(n["dormant_channels"]) is int
    m = _by(facts[1], "masked")
    # the gradient reaching channels 4..15 of its input is exactly 0: those 12 are ignored
    assert m["input_channels"] == 16 and m["ignored_channels"] == 12
    assert "input_channels" not in n  # its input is the data: no gradient reaches it


class InPlaceNet(nn.Module):
    """A stem and torchvision's basic block as they are written: each ReLU in place (the
    block's called twice), the block's input added in place to what its bn2 gave."""

    def __init__(self, inplace):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=inplace)
        self.block = nn.ModuleDict(
            {
                "conv1": nn.Conv2d(8, 8, 3, padding=1, bias=False),
                "bn1": nn.BatchNorm2d(8),
                "relu": nn.ReLU(inplace=inplace),
                "conv2": nn.Conv2d(8, 8, 3, padding=1, bias=False),
                "bn2": nn.BatchNorm2d(8),
            }
        )
        self.fc = nn.Linear(8, 3)
        self.inplace = inplace
        with torch.no_grad():
            self.bn1.bias[:3] = -50.0  # three channels the stem's ReLU never lets through

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        b = self.block
        out = b["relu"](b["bn1"](b["conv1"](x)))
        out = b["bn2"](b["conv2"](out))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.fc(b["relu"](out).mean((2, 3)))


def test_outputs_written_over_in_place_after_a_place_gave_them_are_measured_as_given():
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # 128 rows
    y = torch.tensor([0, 2])
    told = {}
    for inplace in (True, False):
        torch.manual_seed(0)
        model = InPlaceNet(inplace)
        # what each module gave, per call, copied in float64 as it gave it
        gave = {n: [] for n, m in model.named_modules() if n and not isinstance(m, nn.ModuleDict)}
        for name, calls in gave.items():
            model.get_submodule(name).register_forward_hook(
                lambda m, i, o, calls=calls: calls.append(o.detach().double())
            )
        heard = []
        t = Trainer(
            model,
            objective=F.cross_entropy,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            auditing=Audit(inside=True, channels=True, snapshot=1, most=64),
            watching=heard.append,
        )
        t.step((x, y))
        t.close()
        told[inplace] = {f["inside"]: f for f in heard if f["fact"] == "health"}
    assert set(told[True]) == {None, *gave}
    for where, outs in gave.items():
        n = told[True][where]
        a = torch.cat([o.flatten() for o in outs])
        assert n["act_abs_mean"] == pytest.approx(float(a.abs().mean()), rel=rtol(a.numel()))
        assert n["zero_frac_max"] == pytest.approx(float((a.abs() <= 1e-7).double().mean()))
        views = [o.movedim(1, -1).reshape(-1, o.shape[1]) for o in outs]  # (samples, channels)
        channel = torch.stack([v.abs().mean(0) for v in views]).mean(0)
        assert n["dead_channels"] == int((channel <= 1e-7).sum()), where
        rows = views[0]  # the first call's, every row (128 at most)
        assert n["effective_rank"] == pytest.approx(_entropy_rank(rows), rel=rtol(128 * 8, 16))
        # and written over in place or not, every number is the same
        for key, value in told[False][where].items():
            same = pytest.approx(value, rel=rtol(a.numel())) if type(value) is float else value
            assert n[key] == same, (where, key)
    # the gradient reaching the stem ReLU's three dead input channels is 0: it ignores them
    assert told[True]["relu"]["dead_channels"] == told[True]["relu"]["ignored_channels"] == 3


class Gives(Node, nn.Module):
    """A linear layer whose first three output channels never come on; keeps the gradient of
    what it gave, heard by a hook put on it as it gave it."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 8)
        self.grads = []
        with torch.no_grad():
            self.l.bias[:3] = -100.0

    def forward(self, x, ctx):
        h = self.l(x)
        h.register_hook(lambda g: self.grads.append(g.detach().double()))
        return h


class EatsModule(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, ctx):
        return self.fc(x.relu_())


class EatsPlain(Node):
    def __init__(self):
        self.fc = nn.Linear(8, 8)

    def forward(self, x, ctx):
        return self.fc(x.relu_())


def _clip(x):
    return x.relu_()


@pytest.mark.parametrize(
    "eats",
    [
        EatsModule,
        EatsPlain,
        lambda: Node.of(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))),
        lambda: Node.of(_clip),
    ],
    ids=["module", "plain", "wrapped", "function"],
)
def test_a_node_that_writes_over_its_input_hears_the_gradient_of_the_input_as_given(eats):
    torch.manual_seed(0)
    gives = Gives()
    g = Graph.somatize(gives.named("gives") >> eats().named("eats") >> Head(8))
    audit = Audit(channels=True).watch(g)
    facts, _ = _loop(g, audit, 3)
    audit.release()
    tau = Thresholds().dormant_tau
    said = []
    for grad in gives.grads:  # (samples, channels): each channel's mean |∂L/∂input|
        channel = grad.abs().mean(0)
        said.append(int((channel <= tau * channel.mean()).sum()) if channel.mean() > 0 else 0)
    # the three channels the ReLU shuts get no gradient as given (written over, they would)
    assert len(said) == 3 and all(k >= 3 for k in said)
    for step, k in zip(facts, said, strict=True):
        n = _by(step, "eats")
        assert n["input_channels"] == 8 and n["ignored_channels"] == k


def test_a_module_standing_as_two_nodes_is_heard_as_each_node():
    """Weights tied across nodes (`Node.of` the same module twice): each node's numbers are of
    its own output, not of every call of the module they share."""
    torch.manual_seed(0)
    tied = nn.Linear(4, 4)
    a, b = Node.of(tied).named("a"), Node.of(tied).named("b")
    g = Graph.somatize(a >> Node.of(nn.ReLU()).named("relu") >> b >> Head(4))
    x, _ = _data()
    with torch.no_grad():  # what each gives, in float64
        w, bias = tied.weight.double(), tied.bias.double()
        gave_a = F.linear(x.double(), w, bias)
        gave_b = F.linear(gave_a.relu(), w, bias)
    audit = Audit(channels=True).watch(g)
    facts, _ = _loop(g, audit, 1)
    audit.release()
    for node, gave in (("a", gave_a), ("b", gave_b)):
        n = _by(facts[0], node)
        assert n["act_abs_mean"] == pytest.approx(float(gave.abs().mean()), rel=rtol(gave.numel()))
    assert float(gave_a.abs().mean()) != pytest.approx(float(gave_b.abs().mean()))


class Plain(Node):
    """A plain node holding a module, its forward replaced on one instance."""

    def __init__(self, i):
        self.fc = nn.Linear(i, 3)

    def forward(self, x, ctx):
        return self.fc(x)


def _doubled(node):
    """`node` whose forward, replaced on the instance, gives twice what its class's gives."""
    own = node.forward
    node.forward = lambda x, ctx: 2 * own(x, ctx)
    return node


@pytest.mark.parametrize(
    "make",
    [lambda: Layer(8, 3), lambda: Plain(8), lambda: Node.of(nn.Linear(8, 3))],
    ids=["module", "plain", "wrapped"],
)
def test_a_node_whose_forward_is_replaced_on_the_instance_runs_it_while_watched(make):
    """The audit calls a node as the engine would: its instance's forward, not its class's."""
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8) >> _doubled(make()).named("doubled"))
    x, y = _data()
    with torch.no_grad():
        want = g.forward(x)
    audit = Audit().watch(g)
    got = g.forward(x)
    F.cross_entropy(got, y).backward()
    heard = _by(audit.observed(g), "doubled")["act_abs_mean"]
    audit.release()
    torch.testing.assert_close(got.detach(), want)
    assert heard == pytest.approx(float(want.abs().mean()), rel=rtol(want.numel()))


class Lin(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, ctx):
        return self.l(x)


class PlainLin(Node):
    def __init__(self):
        self.l = nn.Linear(8, 8)

    def forward(self, x, ctx):
        return self.l(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (n := Lin(), n.l),
        lambda: (n := PlainLin(), n.l),
        lambda: (Node.of(m := nn.Linear(8, 8)), m),
    ],
    ids=["module", "plain", "wrapped"],
)
def test_a_node_standing_twice_in_a_graph_is_heard_as_each(make):
    """The same node object at two ids (its weights used twice): each id's numbers are of its
    own output, not of every call of the node."""
    torch.manual_seed(0)
    first = nn.Linear(4, 8)
    node, linear = make()
    g = Graph.somatize(Node.of(first).named("first") >> node.named("a") >> node.named("b"))
    x, _ = _data()
    with torch.no_grad():  # what each gives, in float64
        w, bias = linear.weight.double(), linear.bias.double()
        gave_a = F.linear(F.linear(x.double(), first.weight.double(), first.bias.double()), w, bias)
        gave_b = F.linear(gave_a, w, bias)
    audit = Audit().watch(g)
    g.forward(x).square().mean().backward()
    facts = audit.observed(g)
    audit.release()
    for where, gave in (("a", gave_a), ("b", gave_b)):
        heard = _by(facts, where)["act_abs_mean"]
        assert heard == pytest.approx(float(gave.abs().mean()), rel=rtol(gave.numel()))
    assert float(gave_a.abs().mean()) != pytest.approx(float(gave_b.abs().mean()))


def test_a_1d_convs_channels_are_dim_1_after_its_norm_activation_and_pool_a_sequences_last():
    """(N, C, L) out of a Conv1d keeps its channels on dim 1 through the BatchNorm1d, the ReLU
    and the pool after it, each its own place; a sequence's (N, T, D) keeps them last."""

    class Audio(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 8, 3, padding=1)
            self.bn = nn.BatchNorm1d(8)
            self.act = nn.ReLU()
            self.pool = nn.AdaptiveAvgPool1d(5)

        def forward(self, x, ctx):
            return self.pool(self.act(self.bn(self.conv(x))))

    class Sequence(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 6)
            self.r = nn.ReLU()
            self.head = nn.Linear(6, 3)

        def forward(self, x, ctx):  # (N, 8, 5) → 5 steps of 8 features
            return self.head(self.r(self.l(x.transpose(1, 2))).mean(1))

    torch.manual_seed(0)
    audio, sequence = Audio(), Sequence()
    with torch.no_grad():  # 3 channels the norm makes -1, which the ReLU kills; 2 features too
        audio.bn.weight[:3], audio.bn.bias[:3] = 0.0, -1.0
        sequence.l.bias[:2], sequence.l.bias[2:] = -100.0, 100.0
    g = Graph.somatize(audio.named("audio") >> sequence.named("seq"))
    last = _second_step(g)
    for where in ("audio", "audio.conv", "audio.bn", "audio.act", "audio.pool"):
        assert _by(last, where)["channels"] == 8, where  # not the 20 (or 5) positions
    for where in ("audio", "audio.act", "audio.pool"):
        n = _by(last, where)
        assert n["dead_channels"] == 3 and "DEAD_CHANNELS(3)" in verdict(n), where
    bn = _by(last, "audio.bn")  # a weight of 0 passes no gradient back to its channel
    assert bn["input_channels"] == 8 and bn["ignored_channels"] == 3
    assert _by(last, "audio.act")["input_channels"] == 8
    r = _by(last, "seq.r")
    assert r["channels"] == 6 and r["dead_channels"] == 2 and r["input_channels"] == 6


def _second_step(g: Graph) -> list[dict]:
    """The health facts of the second step of a channel audit of `g` (inside too), on a batch
    of 16 two-channel sequences of 20, at a learning rate of 0."""
    heard = []
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.0),
        auditing=Audit(channels=True, inside=True),
        watching=heard.append,
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 2, 20, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    t.fit([(x, y)] * 2)
    t.close()
    return [f for f in heard if f.get("fact") == "health" and f["step"] == 1]


def test_channels_are_where_each_layer_puts_them_a_1d_pool_after_a_transpose_included():
    """The same rule as a figure's axes (tests/test_figures.py runs this net): a 1-d pool
    holds its channels on dim 1 whatever came before it, here the features of a Linear."""

    class Head(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(60, 3)

        def forward(self, x, ctx):
            return self.l(x.flatten(1))

    from _nodes import Listen

    torch.manual_seed(0)
    g = Graph.somatize(Node.of(Listen()).named("listen") >> Head().named("head"))
    last = _second_step(g)
    for where, channels in {"conv": 8, "lrn": 8, "act": 8, "lin": 6, "pool": 6}.items():
        assert _by(last, f"listen.{where}")["channels"] == channels, where  # not 20 or 10


def test_groups_that_carry_the_same_thing_leak_and_refusals():
    class Copy(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, ctx):
            h = self.l(x)
            return torch.cat([h, 2 * h, torch.randn_like(h)], 1)

    torch.manual_seed(0)
    g = Graph.somatize(Copy() >> Head(12))
    audit = Audit(groups={"copy": {"a": range(0, 4), "b": range(4, 8), "c": range(8, 12)}}).watch(g)
    facts, _ = _loop(g, audit, 1)
    audit.release()
    assert _by(facts[0], "copy")["cka"] == pytest.approx(1.0, abs=rtol(32 * 8, 64))
    with pytest.raises(ValueError, match="groups.*nowhere"):
        Audit(groups={"nowhere": {"a": [0], "b": [1]}}).watch(g)
    with pytest.raises(ValueError, match="two channel groups"):
        Audit(groups={"copy": {"a": [0]}})
    with pytest.raises(ValueError, match=r"'a' and 'b' share channels \[4, 5\]"):
        Audit(groups={"copy": {"a": range(0, 6), "b": range(4, 8)}})  # a partition: apart
    wide = Audit(groups={"copy": {"a": [0], "b": [40]}}).watch(g)
    with pytest.raises(ValueError, match="channel 40.*12 channels"):
        _loop(g, wide, 1)
    wide.release()


def test_groups_past_a_place_s_width_are_refused_before_the_step_counts():
    """The width shows only in a forward: there the step is refused, before a Trainer counts
    it or tells its loss, and again each step; a right Audit after it measures from step 0."""

    class Wide(Node, nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 8)

        def forward(self, x, ctx):
            return torch.tanh(self.l(x))

    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 4) >> Wide().named("wide") >> Head(8))
    x, y = _data()
    before = _weights(g.implementation("wide"))
    heard = []
    wrong = {"wide": {"a": range(0, 4), "b": range(4, 9)}}  # channel 8 of 0..7
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        auditing=Audit(groups=wrong),
        watching=heard.append,
    )
    for _ in range(2):
        with pytest.raises(ValueError, match=r"groups\['wide'\] names channel 8.*8 channels"):
            t.step((x, y))
        assert t.steps == 0  # not counted, no loss nor health told
        assert not [f for f in heard if f["fact"] in ("loss", "health")]
    after = _weights(g.implementation("wide"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    t.close()
    with torch.no_grad():  # step 0's output of `wide`, in float64, centred

        def linear(lin, v):
            return v @ lin.weight.double().T + lin.bias.double()

        first = g.implementation(g.nodes()[0]).l
        h = torch.tanh(linear(g.implementation("wide").l, torch.relu(linear(first, x.double()))))
        h = h - h.mean(0)
    a, b = h[:, :4], h[:, 4:]
    want = float((b.T @ a).pow(2).sum() / ((a.T @ a).norm() * (b.T @ b).norm()))
    right = Audit(groups={"wide": {"a": range(0, 4), "b": range(4, 8)}})
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        auditing=right,
        watching=heard.append,
    )
    t.fit([(x, y)] * 2)
    t.close()
    health = [f for f in heard if f["fact"] == "health"]
    assert [f["step"] for f in heard if f["fact"] == "loss"] == [0, 1]
    assert sorted({f["step"] for f in health}) == [0, 1]
    assert _by([f for f in health if f["step"] == 0], "wide")["cka"] == pytest.approx(
        want, rel=rtol(32 * 8, 64)
    )
    for step in (0, 1):
        facts = [f for f in health if f["step"] == step]
        assert {f["node"] for f in facts} == set(g.nodes())
        assert _by(facts, "wide")["update_ratio"] > 0


# -- what is not a number ----------------------------------------------------------------------


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
        g.forward(_data()[0])  # (a forward under no_grad is an evaluation, and not heard)
        n = _by(audit.observed(g), "poison")
        got["nan" if what != what else what] = (n["nan"], n["inf"], n.get("inherited"))
    audit.release()
    # inf and −inf in one output: an inf, not a nan; both arose here (the input was finite)
    assert got == {
        0.0: (False, False, None),
        float("inf"): (False, True, False),
        "nan": (True, False, False),
    }


def test_a_nan_is_pinned_to_the_place_it_arose_after_it_has_spread_everywhere():
    class Log(Node):
        def forward(self, x, ctx):
            return torch.log(x - 0.5)  # NaN wherever x < 0.5

    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8).named("a") >> Log().named("log") >> Head(8).named("b"))
    heard = _fit(g)
    last = {f["node"]: f for f in heard if f.get("fact") == "health" and f["step"] == 2}
    assert all(f["nan"] for f in last.values())  # everything is NaN by now
    assert {k: f["inherited"] for k, f in last.items()} == {"a": True, "log": False, "b": True}


def test_weights_or_an_update_that_are_not_finite_or_only_huge_are_told_apart_and_warn_nothing():
    for poisoned, lr in ((True, 0.1), (False, 1e38)):
        g = _graph()
        first = g.implementation("layer").l
        with torch.no_grad():
            first.weight.mul_(1e18)  # an lr of 1e38 makes an update of ≈ 1e36 a weight
            if poisoned:
                first.weight[0, 0] = float("inf")
        audit = Audit(snapshot=1).watch(g)
        optimizer = torch.optim.SGD(parameters(g), lr=lr)
        x, y = _data()
        layer = g.implementation("layer")
        before = _weights(layer)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.cross_entropy(g.forward(x), y).backward()
            facts = audit.observed(g)
            optimizer.step()
            audit.moved()
        audit.release()
        after = _weights(layer)
        n = _by(facts, "layer")
        if poisoned:  # an inf in the weights: NaN gradients, a NaN update, and no rank
            assert n["inf"] and n["nan"] and math.isnan(n["update_ratio"])
            assert n["update_stable_rank"] == 0.0 and verdict(n) == ["NAN", "INF"]
        else:  # values whose squares overflow float32 are large, not infinite
            assert not n["inf"] and not n["nan"]
            want = _ratio(layer, before, after)
            assert math.isfinite(want) and n["update_ratio"] == pytest.approx(want, rel=rtol(40))
            assert verdict(n) == ["OVERSTEPPING"]


def test_a_lazy_module_not_made_yet_is_refused_until_it_has_run_once():
    torch.manual_seed(0)
    g = Graph.somatize(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.LazyLinear(4)))
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    audit = Audit(inside=True)
    with pytest.raises(ValueError, match=r"node .sequential. \(Sequential\) holds 2\.weight"):
        audit.watch(g)
    assert audit.places == []  # refused before anything was hooked: it can still watch
    g.forward(x)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    t = Trainer(g, objective=F.cross_entropy, optimizer=opt, auditing=audit)
    t.fit([(x, y)] * 2)
    assert {"sequential", "sequential.2"} <= set(audit.places)


def test_a_compiled_module_is_refused_before_anything_is_hooked():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
    refused = Audit(inside=True, channels=True)
    with pytest.raises(ValueError, match=r"compiled module .*give it the module that was"):
        refused.watch(Graph.somatize(torch.compile(net)))
    assert refused.places == []
    gone = weakref.ref(refused)
    del refused
    gc.collect()
    assert gone() is None  # a hook it had put on net's modules would hold it alive
    audit = Audit(inside=True).watch(Graph.somatize(net))  # the module that was compiled
    assert "sequential.2" in audit.places


def test_what_an_audit_leaves_out_is_warned_at_the_line_that_made_the_trainer():
    net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(8)])
    g = Graph.somatize(Node.of(net).named("net"))
    with pytest.warns(UserWarning, match="most=2") as told:
        Trainer(
            g,
            objective=F.mse_loss,
            auditing=Audit(inside=True, most=2),
            optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        )
    assert [w.filename for w in told] == [__file__]  # not the Trainer's line that watched


class DottedHeads(Node):
    """A plain node holding its layers in a dict whose keys hold dots ("v1.0") or are nested
    names a ModuleDict would refuse as they stand."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.heads = {"v1.0": nn.Linear(4, 3), "v2": nn.Linear(4, 3), 7: nn.Linear(4, 3)}

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:  # noqa: ANN001
        return sum(head(x) for head in self.heads.values())


def test_a_plain_node_holding_layers_under_dotted_keys_is_audited_and_drawn():
    g = Graph.somatize(DottedHeads())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    node = g.nodes()[0]
    head = g.implementation(node).heads["v1.0"]
    with torch.no_grad():  # the first step's activity, of the weights it ran with, in float64
        want = nn.functional.linear(x.double(), head.weight.double(), head.bias.double())
    audit = Audit(every=1, channels=True, inside=True)
    facts: list[dict] = []
    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        auditing=audit,
        watching=facts.append,
    )
    t.fit([(x, y)] * 2)
    heard = {(f["node"], f["inside"]) for f in facts if f.get("fact") == "health"}
    assert heard == {(node, None), (node, "heads.v1.0"), (node, "heads.v2"), (node, "heads.7")}
    first = next(f for f in facts if f.get("inside") == "heads.v1.0")
    assert first["act_abs_mean"] == pytest.approx(want.abs().mean().item(), rel=1e-5)


def test_a_plain_node_whose_dict_keys_collide_once_split_at_dots_is_refused_by_name():
    node = DottedHeads()
    node.heads["v1"] = nn.Linear(4, 3)  # "heads.v1" and "heads.v1.0": one path inside another
    g = Graph.somatize(node)
    with pytest.raises(ValueError, match=r"DottedHeads holds a module as 'heads\.v1"):
        Audit().watch(g)
    assert g(torch.randn(2, 4)).shape == (2, 3)  # the refused audit left the graph as it was


class Typed(Node):
    """A plain node holding a layer under a name nn.Module keeps for itself (`type`)."""

    def __init__(self) -> None:
        self.type = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:  # noqa: ANN001
        return self.type(x)


def test_a_plain_node_holding_a_layer_as_type_is_refused_naming_it_and_what_to_do():
    from somatize.torch import architecture

    g = Graph.somatize(Typed())
    x = torch.randn(2, 4)
    for look in (lambda: Audit().watch(g), lambda: architecture(g, x)):
        with pytest.raises(ValueError, match=r"Typed holds a module as 'type'.*Typed\(Node, nn"):
            look()
    assert g(x).shape == (2, 3)


def test_a_model_that_gives_its_loss_first_is_measured_on_what_it_makes_not_on_the_loss():
    # transformers' models given labels answer (loss, logits, ...): the loss is one number
    # about the batch, not an activation; the node's numbers are of its logits
    from models import zoo

    model = zoo.gpt2().model
    for m in model.modules():  # no dropout: the audited step's logits are the hook's
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    logits = []
    model.register_forward_hook(lambda m, args, out: logits.append(out.logits.detach()))
    ids = torch.randint(1, zoo.VOCAB, (2, zoo.SEQ), generator=torch.Generator().manual_seed(0))
    heard = []
    t = Trainer(
        Graph.somatize(Node.of(model).named("lm")),
        objective=lambda out, _: out.loss,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        auditing=Audit(),
        watching=heard.append,
    )
    t.step(({"input_ids": ids, "labels": ids}, None))
    t.close()
    fact = _by([f for f in heard if f["fact"] == "health"], "lm")
    (seen,) = logits
    want = float(seen.double().abs().mean())
    assert fact["act_abs_mean"] == pytest.approx(want, rel=rtol(seen.numel()))
