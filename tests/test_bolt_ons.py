"""What researchers bolt onto a model, through every tool, against the same done in plain
torch (float64, same seeds): pruning (`torch.nn.utils.prune`), an EMA of the weights
(`swa_utils.AveragedModel`, `update_bn`), `channels_last`, autocast inside a node and a
`GradScaler`, deferred init on the meta device, and spectral and weight norm
(`parametrizations`) in a discriminator. Each tool either gives the plain loop's numbers or
refuses, naming the node and what to do."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.utils.prune as prune
from models import zoo
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

from somatize import Graph, Node
from somatize.torch import Audit, Trainer, architecture, parameters, probe

F64 = torch.float64
EPS = torch.finfo(F64).eps
CL = torch.channels_last


def rel(n):
    """A float64 result's relative tolerance, from the number of terms rounded into it."""
    return 64 * EPS * math.sqrt(n)


def same(got, want):
    """Tensors equal to a float64 reference within what rounding of their size accounts for."""
    assert got.shape == want.shape
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    assert torch.allclose(got, want, rtol=0, atol=rel(want.numel()) * scale), (got, want)


def same_state(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        same(got[key].double(), value.double())


def by_hand(model, data, objective, optimizer, after=None):
    """The plain torch loop: the losses, step by step."""
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = objective(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if after is not None:
            after()
    return losses


def images(n=3, size=(20, 12), seed=3, memory_format=torch.contiguous_format):
    """Batches for zoo.resnet, in float64: non-square, so height, width and channels differ."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(2, 3, *size, dtype=F64, generator=gen).to(memory_format=memory_format)
        out.append((x, torch.randint(0, 5, (2,), generator=gen)))
    return out


# -- pruning --------------------------------------------------------------------------------
def pruned_resnet(how=prune.l1_unstructured, **kw):
    """transformers' ResNet at a small config, float64, every convolution and its classifier
    pruned as a researcher prunes: `weight` becomes `weight_orig` times a `weight_mask`."""
    model = zoo.resnet().model.double()
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            how(module, "weight", amount=0.5, **kw)
    return model


def pruned_layers(model):
    return [m for m in model.modules() if prune.is_pruned(m) and hasattr(m, "weight_mask")]


def test_a_pruned_resnet_trains_as_by_hand_keeps_its_mask_and_the_audit_weighs_what_it_trains():
    data = images(1) * 3
    ref = pruned_resnet()
    want = by_hand(
        ref, data, zoo.class_loss, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    )

    model = pruned_resnet()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = Graph.somatize(Node.of(model).named("net"))
    facts = []
    opt = torch.optim.SGD(parameters(g), lr=0.1, momentum=0.9)
    t = Trainer(g, objective=zoo.class_loss, optimizer=opt, auditing=Audit(), watching=facts.append)
    first = []  # the weights the first update left
    opt.register_step_post_hook(
        lambda *_: (
            first or first.append({n: p.detach().clone() for n, p in model.named_parameters()})
        )
    )
    got = t.fit(data).history
    assert got == pytest.approx(want, rel=rel(10))
    assert want[0] - want[-1] > 0.05  # it learnt
    same_state(model.state_dict(), ref.state_dict())

    x = data[0][0]
    with torch.no_grad():
        model.eval(), ref.eval()
        same(g.forward(x).logits, ref(x).logits)
    for layer in pruned_layers(model):  # the mask is still what runs, and nothing moved under it
        mask, name = layer.weight_mask, [n for n, m in model.named_modules() if m is layer][0]
        assert 0 < int(mask.sum()) < mask.numel()
        assert torch.equal(layer.weight, layer.weight_orig * mask)  # (torch's, each forward)
        off = mask == 0
        assert torch.equal(layer.weight_orig[off], start[f"{name}.weight_orig"][off])

    # the audit weighs the weights the optimizer holds (weight_orig, bias), as the step found them
    health = [f for f in facts if f["fact"] == "health" and f["node"] == "net"]
    assert [f["step"] for f in health] == [0, 1, 2]
    assert all(math.isfinite(v) for f in health for v in f.values() if isinstance(v, float))
    n = sum(p.numel() for p in start.values())
    norm = math.sqrt(sum(float((p * p).sum()) for p in start.values()))
    assert health[0]["param_norm"] == pytest.approx(norm, rel=rel(n))
    moved = math.sqrt(sum(float(((p - start[k]) ** 2).sum()) for k, p in first[0].items()))
    assert health[0]["update_ratio"] == pytest.approx(moved / norm, rel=rel(n) * norm / moved)


def test_a_pruned_net_is_drawn_and_counted_as_the_net_it_prunes():
    x = images(1)[0][0]
    plain = Graph.somatize(Node.of(zoo.resnet().model.double()).named("net"))
    pruned = Graph.somatize(Node.of(pruned_resnet()).named("net"))
    drawn = architecture(pruned, x, depth=1)
    want = architecture(plain, x, depth=1)
    held = sum(p.numel() for p in pruned.implementation("net").held.parameters())
    assert drawn["net"].params == want["net"].params == held  # weight_orig counted, masks not
    assert pruned.figure(inside=drawn).svg() == plain.figure(inside=want).svg()
    looked = probe(pruned, x)
    assert looked.keys() == probe(plain, x).keys()
    assert all(math.isfinite(v) for n in looked.values() for v in n.values() if type(v) is float)


def trainer(model, node="net"):
    g = Graph.somatize(Node.of(model).named(node))
    return g, Trainer(g, objective=zoo.class_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1))


def test_a_pruned_export_loads_its_masks_into_a_twin_pruned_otherwise():
    data = images(2)
    g, t = trainer(pruned_resnet())
    t.fit(data)
    twin = pruned_resnet(prune.random_unstructured)  # another mask
    g2, t2 = trainer(twin)
    assert not all(
        torch.equal(a.weight_mask, b.weight_mask)
        for a, b in zip(
            pruned_layers(twin), pruned_layers(g.implementation("net").held), strict=True
        )
    )
    t2.load(t.export())
    same_state(twin.state_dict(), g.implementation("net").held.state_dict())
    x = data[0][0]
    with torch.no_grad():
        twin.eval(), g.implementation("net").held.eval()
        same(g2.forward(x).logits, g.forward(x).logits)  # the mask loaded is the one that runs


def test_plain_and_pruned_weights_load_into_each_other_after_saying_how():
    data = images(2)
    g, t = trainer(pruned_resnet())
    t.fit(data)
    pruned_export = t.export()
    for layer in pruned_layers(g.implementation("net").held):
        prune.remove(layer, "weight")  # the pruning made permanent: plain weights, zeros in them
    plain_export = t.export()
    key = "resnet.embedder.embedder.convolution.weight"
    assert key in plain_export["net"] and f"{key}_orig" not in plain_export["net"]

    twin = pruned_resnet(prune.random_unstructured)
    g2, t2 = trainer(twin)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    with pytest.raises(ValueError, match=r"node 'net'.*pruned.*prune\.remove") as refused:
        t2.load(plain_export)
    assert key in str(refused.value)
    same_state(twin.state_dict(), before)  # refused whole
    for layer in pruned_layers(twin):
        prune.remove(layer, "weight")
    t2.load(plain_export)

    bare = zoo.resnet().model.double()
    g3, t3 = trainer(bare)
    with pytest.raises(ValueError, match=r"node 'net'.*pruned.*prune\.identity"):
        t3.load(pruned_export)
    for module in bare.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            prune.identity(module, "weight")
    t3.load(pruned_export)
    x = data[0][0]
    with torch.no_grad():
        for model in (bare, twin, g.implementation("net").held):
            model.eval()
        same(g3.forward(x).logits, g.forward(x).logits)
        same(g2.forward(x).logits, g.forward(x).logits)


# -- an EMA of the weights ------------------------------------------------------------------
def body_head():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()).double()
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)).double()
    return body, head


def test_an_ema_of_a_graphs_weights_is_kept_evaluated_swapped_in_and_out_as_by_hand():
    data = images(4, size=(10, 6))
    ce = nn.functional.cross_entropy
    body, head = body_head()
    ref = nn.Sequential(body, head)
    ema_ref = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    want = by_hand(ref, data, ce, opt, after=lambda: ema_ref.update_parameters(ref))
    update_bn([x for x, _ in data], ema_ref)

    body, head = body_head()
    g = Graph.somatize(Node.of(body).named("body") >> Node.of(head).named("head"))
    held = nn.ModuleDict({"body": body, "head": head})  # the graph's modules, by node
    ema = AveragedModel(held, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    t = Trainer(g, objective=ce, optimizer=torch.optim.SGD(parameters(g), lr=0.2))
    got = []
    for batch in data[:2]:
        got.append(t.step(batch))
        ema.update_parameters(held)
    # half way, an evaluation with the EMA's weights swapped in, and the training's back
    kept = t.export()
    t.load({nid: ema.module[nid].state_dict() for nid in ("body", "head")})
    body.eval(), head.eval()
    with torch.no_grad():
        g.forward(data[0][0])
    t.load(kept)  # and the next step puts the nodes back in train mode
    for batch in data[2:]:
        got.append(t.step(batch))
        ema.update_parameters(held)
    assert got == pytest.approx(want, rel=rel(10))
    update_bn([x for x, _ in data], nn.Sequential(ema.module["body"], ema.module["head"]))
    same_state(ema.module["body"].state_dict(), ema_ref.module[0].state_dict())
    same_state(ema.module["head"].state_dict(), ema_ref.module[1].state_dict())

    # the EMA as a graph of its own, evaluated; and its weights kept as a run's export
    seen = Graph.somatize(
        Node.of(ema.module["body"]).named("body") >> Node.of(ema.module["head"]).named("head")
    )
    ema.eval(), ema_ref.eval()
    x = data[1][0]
    with torch.no_grad():
        same(seen.forward(x), ema_ref(x))
        t.load({nid: ema.module[nid].state_dict() for nid in ("body", "head")})
        body.eval(), head.eval()
        same(g.forward(x), ema_ref(x))
    exported = t.export()
    same_state(exported["body"], ema_ref.module[0].state_dict())
    # the AveragedModel itself as the node: its keys are its wrapper's, said so when loaded
    wrapper = Graph.somatize(Node.of(AveragedModel(body)).named("body") >> Node.of(head))
    wrapped = Trainer(wrapper, objective=ce, optimizer=torch.optim.SGD(parameters(wrapper), lr=0))
    with pytest.raises(ValueError, match=r"node 'body'.*start with 'module\.'.*ema\.module"):
        t.load({"body": wrapped.export()["body"]})


# -- channels_last ---------------------------------------------------------------------------
def resnet_with_two_dead_channels(memory_format):
    """zoo.resnet, float64, in this memory format; its stem's normalisation shifts channels 1
    and 2 far below zero, so the ReLU after it never lets them through (8 channels over a
    5 x 3 map: an axis read wrong gives another count)."""
    model = zoo.resnet().model.double().to(memory_format=memory_format)
    with torch.no_grad():
        model.resnet.embedder.embedder.normalization.bias[1:3] = -100.0
    return model


def audited_fit(memory_format):
    model = resnet_with_two_dead_channels(memory_format)
    g = Graph.somatize(Node.of(model).named("net"))
    facts = []
    audit = Audit(channels=True, inside=["net.resnet.embedder"])
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    t = Trainer(g, objective=zoo.class_loss, optimizer=opt, auditing=audit, watching=facts.append)
    data = images(3, memory_format=memory_format)
    history = t.fit(data).history
    t.close()
    return model, g, history, [f for f in facts if f["fact"] == "health"]


def test_a_channels_last_resnet_trains_is_audited_on_its_channels_and_looks_as_contiguous():
    model, g, got, facts = audited_fit(CL)
    assert model.resnet.embedder.embedder.convolution.weight.is_contiguous(memory_format=CL)
    ref = resnet_with_two_dead_channels(CL)
    data = images(3, memory_format=CL)
    want = by_hand(ref, data, zoo.class_loss, torch.optim.SGD(ref.parameters(), lr=0.1))
    assert got == pytest.approx(want, rel=rel(10))
    same_state(model.state_dict(), ref.state_dict())

    stem = [f for f in facts if f["inside"] == "resnet.embedder"]
    assert [(f["channels"], f["dead_channels"]) for f in stem] == [(8, 2)] * 3
    _, plain, _, plain_facts = audited_fit(torch.contiguous_format)
    tol = rel(data[0][0].numel())  # float64 through other kernels, over one batch's numbers
    for a, b in zip(facts, plain_facts, strict=True):  # the same numbers, whatever the layout
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float):
                assert value == pytest.approx(b[key], rel=tol, abs=tol), key
            else:
                assert value == b[key], key

    x = data[0][0]
    drawn, want_drawn = architecture(g, x, depth=1), architecture(plain, x.contiguous(), depth=1)
    assert g.figure(inside=drawn).svg() == plain.figure(inside=want_drawn).svg()
    looked, plain_looked = probe(g, x, depth=1), probe(plain, x.contiguous(), depth=1)
    assert looked.keys() == plain_looked.keys()
    for where, numbers in looked.items():
        for key, value in numbers.items():
            if type(value) is float:
                assert value == pytest.approx(plain_looked[where][key], rel=tol, abs=tol)


# -- autocast inside a node, and a GradScaler ------------------------------------------------
class HalfBody(Node, nn.Module):
    """A node that runs its body under bfloat16 autocast, as a researcher writes one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3))

    def forward(self, x, ctx=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.net(x).float()  # the rest of the net runs in float32


def half_net():
    torch.manual_seed(1)
    return HalfBody(), nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def bf16_loss(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def test_autocast_inside_a_node_trains_audits_and_probes_as_by_hand():
    data = [(x.float(), y) for x, y in images(1, size=(10, 6))] * 3
    ref = nn.Sequential(*half_net())
    want = by_hand(ref, data, bf16_loss, torch.optim.SGD(ref.parameters(), lr=0.5))

    body, head = half_net()
    g = Graph.somatize(body.named("body") >> Node.of(head).named("head"))
    facts = []
    opt = torch.optim.SGD(parameters(g), lr=0.5)
    t = Trainer(g, objective=bf16_loss, optimizer=opt, auditing=True, watching=facts.append)
    got = t.fit(data).history
    bf16 = 2.0**-8
    assert want[0] - want[-1] > 10 * bf16
    assert got == pytest.approx(want, rel=4 * bf16)
    health = [f for f in facts if f["fact"] == "health"]
    assert {f["node"] for f in health} == {"body", "head"}
    assert all(math.isfinite(v) for f in health for v in f.values() if isinstance(v, float))
    looked = probe(g, data[0][0])
    assert {"body", "head"} <= looked.keys()


class Casting(Node, nn.Module):
    """A layer and a ReLU, under bfloat16 autocast of its own when `inner`."""

    def __init__(self, i: int, o: int, inner: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(i, o), nn.ReLU())
        self.inner = inner

    def forward(self, x, ctx=None):
        if not self.inner:
            return self.net(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.net(x)


def audited_under_autocast(inner):
    """Two nodes trained on one batch, under autocast in each node, or around the fit."""
    torch.manual_seed(0)
    g = Graph.somatize(Casting(6, 32, inner).named("a") >> Casting(32, 32, inner).named("b"))

    def objective(out, y):
        with torch.autocast("cpu", enabled=False):
            return nn.functional.mse_loss(out.float(), y)

    facts = []
    audit = Audit(channels=True, snapshot=1)  # the ranks every step
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    t = Trainer(g, objective=objective, optimizer=opt, auditing=audit, watching=facts.append)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 6, generator=gen), torch.randn(64, 32, generator=gen))] * 2
    if inner:
        return t.fit(data).history, [f for f in facts if f["fact"] == "health"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return t.fit(data).history, [f for f in facts if f["fact"] == "health"]


def test_an_audit_under_autocast_around_fit_measures_as_under_autocast_in_each_node():
    # the same forward and backward either way; the audit measures in the dtype of what it
    # measures, not in autocast's (its ranks' matrix products were taken in bfloat16)
    want_losses, want = audited_under_autocast(inner=True)
    losses, got = audited_under_autocast(inner=False)
    assert losses == want_losses
    tol = 64 * torch.finfo(torch.float32).eps * math.sqrt(64 * 32)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float):
                assert value == pytest.approx(b[key], rel=tol, abs=tol), (a["node"], key)
            else:
                assert value == b[key], key


class Scaled:
    """What a user hands a Trainer to train with a GradScaler: the optimizer, stepped and
    skipped as the scaler says (the objective gives the scaled loss)."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch < 2.3: no CPU scaler")
def test_a_grad_scaler_under_float16_autocast_steps_and_skips_as_by_hand():
    # a first scale so large that the first steps' gradients overflow: skipped, then backed off
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-16)

    case = zoo.resnet()
    data = [(case.example, case.target)] * 4
    ref, ref_scaler = case.model, scaler()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    want, scales = [], []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = case.objective(ref(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(opt)
        ref_scaler.update()
        want.append(loss.item())
        scales.append(ref_scaler.get_scale())
    assert scales[0] < 2.0**40 and want[0] == want[1] and want[-1] < want[0]  # skipped, then not

    model, by = zoo.resnet().model, scaler()
    g = Graph.somatize(Node.of(model).named("net"))
    seen = []
    t = Trainer(
        g,
        objective=lambda out, y: by.scale(case.objective(out, y)),
        optimizer=Scaled(torch.optim.SGD(parameters(g), lr=0.2), by),
        watching=lambda fact: fact["fact"] == "updated" and seen.append(by.get_scale()),
    )
    with torch.autocast("cpu", dtype=torch.float16):
        got = t.fit(data).history
    assert seen == scales
    # the history holds the loss as scaled (by the scale of that step, before its update)
    before = [2.0**40, *scales[:-1]]
    assert [v / s for v, s in zip(got, before, strict=True)] == pytest.approx(want, rel=2.0**-10)
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


# -- deferred init on the meta device ---------------------------------------------------------
def bert_on_meta():
    from transformers import BertConfig, BertModel

    off = dict.fromkeys(("hidden_dropout_prob", "attention_probs_dropout_prob"), 0.0)
    with torch.device("meta"):
        return BertModel(BertConfig(**zoo.TEXT, **off))


def test_a_bert_built_on_meta_is_refused_until_it_holds_values_then_trains_as_by_hand():
    case = zoo.bert(dropout=0.0)
    ref = case.model.double()
    data = [(case.example, case.target.double())] * 2
    model = bert_on_meta()
    g = Graph.somatize(Node.of(model).named("bert") >> Node.of(nn.Identity()).named("out"))
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    with pytest.raises(ValueError, match=r"node 'bert' holds .* on the meta device.*to_empty"):
        Trainer(g, objective=case.objective, optimizer=opt)
    # loaded as the reference holds it: a state_dict leaves out BERT's non-persistent buffers
    model.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"node 'bert' holds embeddings\.position_ids"):
        Trainer(g, objective=case.objective, optimizer=opt)
    model.embeddings.position_ids = ref.embeddings.position_ids.clone()
    model.embeddings.token_type_ids = ref.embeddings.token_type_ids.clone()
    with pytest.raises(ValueError, match="optimizer holds parameters on the meta device"):
        Trainer(g, objective=case.objective, optimizer=opt)  # built over the meta ones
    t = Trainer(g, objective=case.objective, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    got = t.fit(data).history
    hand = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = by_hand(lambda x: ref(**x), data, case.objective, hand)
    assert got == pytest.approx(want, rel=rel(case.target.numel()))
    same_state(t.export()["bert"], ref.state_dict())


def test_a_net_built_on_meta_then_emptied_and_reset_trains_and_exports_real_weights():
    def net():
        return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 2))

    torch.manual_seed(4)
    ref = net().double()
    with torch.device("meta"):
        model = net()
    g = Graph.somatize(Node.of(model).named("net"))
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    for module in model.modules():  # in the order its constructor reset them
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model.double()
    same_state(model.state_dict(), ref.state_dict())
    gen = torch.Generator().manual_seed(2)
    data = [
        (torch.randn(5, 6, dtype=F64, generator=gen), torch.randn(5, 2, dtype=F64, generator=gen))
    ] * 3
    mse = nn.functional.mse_loss
    want = by_hand(ref, data, mse, torch.optim.Adam(ref.parameters(), lr=1e-2))
    t = Trainer(g, objective=mse, optimizer=torch.optim.Adam(parameters(g), lr=1e-2))
    assert t.fit(data).history == pytest.approx(want, rel=rel(10))
    assert all(not v.is_meta for v in t.export()["net"].values())
    same_state(t.export()["net"], ref.state_dict())


# -- spectral and weight norm -----------------------------------------------------------------
def discriminator(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        spectral_norm(nn.Conv2d(3, 8, 3, stride=2, padding=1)),
        nn.LeakyReLU(0.2),
        weight_norm(nn.Conv2d(8, 8, 3, stride=2, padding=1)),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        spectral_norm(nn.Linear(8 * 5 * 3, 1)),
    ).double()


def test_a_spectrally_normed_discriminator_trains_as_by_hand_and_its_export_loads():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 20, 12, dtype=F64, generator=gen)
    y = torch.tensor([[1.0], [0.0], [1.0], [0.0]], dtype=F64)
    data = [(x, y)] * 3
    bce = nn.functional.binary_cross_entropy_with_logits
    ref = discriminator()
    want = by_hand(ref, data, bce, torch.optim.Adam(ref.parameters(), lr=2e-3, betas=(0.0, 0.9)))

    model = discriminator()
    g = Graph.somatize(Node.of(model).named("disc"))
    opt = torch.optim.Adam(parameters(g), lr=2e-3, betas=(0.0, 0.9))
    t = Trainer(g, objective=bce, optimizer=opt, auditing=True)
    assert t.fit(data).history == pytest.approx(want, rel=rel(10))
    assert want[-1] < want[0]
    same_state(model.state_dict(), ref.state_dict())  # the power iteration's u and v too

    twin = discriminator(seed=9)
    g2 = Graph.somatize(Node.of(twin).named("disc"))
    t2 = Trainer(g2, objective=bce, optimizer=torch.optim.SGD(parameters(g2), lr=0.1))
    t2.load(t.export())
    same_state(twin.state_dict(), model.state_dict())
    model.eval(), twin.eval()
    with torch.no_grad():
        same(g2.forward(x), g.forward(x))

    plain = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.LeakyReLU(0.2),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        nn.Linear(8 * 5 * 3, 1),
    ).double()
    g3 = Graph.somatize(Node.of(plain).named("disc"))
    t3 = Trainer(g3, objective=bce, optimizer=torch.optim.SGD(parameters(g3), lr=0.1))
    with pytest.raises(ValueError, match=r"node 'disc'.*parametrize the node's layer the same way"):
        t3.load(t.export())
    with pytest.raises(ValueError, match=r"node 'disc'.*0\.weight is parametrized"):
        t2.load(t3.export())
