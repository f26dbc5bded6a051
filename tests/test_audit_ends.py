"""The audit after a step that did not end as planned: interrupted while it measured, or a
forward refused by hand; and where weights a block holds itself (DINOv2's tokens) are measured."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import newer
from torch import nn
from torch.overrides import TorchFunctionMode

from somatize import Graph, Node
from somatize.torch import Audit, Trainer, parameters, probe


def rtol(n: int, k: float = 8.0) -> float:
    """What float32 rounding can move a reduction over `n` values by, relatively."""
    return k * torch.finfo(torch.float32).eps * math.sqrt(n)


class Layer(Node, nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.l = nn.Linear(i, o)

    def forward(self, x, ctx):
        return torch.relu(self.l(x))


class Narrow(Node, nn.Module):
    """Its input's first `keep` channels: a place whose width the test sets."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def forward(self, x, ctx):
        return x[:, : self.keep]


class Interrupt(TorchFunctionMode):
    """Ctrl-C at the first norm taken (none in a forward, backward or SGD: the audit's own)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.linalg.vector_norm:
            raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("where", ["while the audit measures", "in a watcher told the loss"])
def test_a_ctrl_c_leaves_the_audits_step_the_trainers(where):
    """Interrupted after the step counted (its loss told): while the audit measured it, or
    in a watcher, before the audit measured it."""
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8) >> Layer(8, 3))
    heard = []

    def watcher(fact):
        heard.append(fact)
        losses = [f for f in heard if f["fact"] == "loss"]
        if where.startswith("in a watcher") and fact["fact"] == "loss" and len(losses) == 1:
            raise KeyboardInterrupt

    t = Trainer(
        g,
        objective=F.cross_entropy,
        optimizer=torch.optim.SGD(parameters(g), lr=0.1),
        auditing=Audit(),
        watching=watcher,
    )
    x, y = _data()
    with Interrupt() if where.startswith("while") else contextlib.nullcontext():
        with pytest.raises(KeyboardInterrupt):
            t.step((x, y))
    assert t.steps == 1 == t.audit.step  # the step counted (its loss told), the audit with it
    t.fit([(x, y)] * 2)
    t.close()
    assert [f["step"] for f in heard if f["fact"] == "loss"] == [0, 1, 2]
    health = [(f["step"], f["node"]) for f in heard if f["fact"] == "health"]
    assert sorted(health) == sorted((s, n) for s in (1, 2) for n in g.nodes())


def test_a_ctrl_c_in_observed_by_hand_still_moves_the_audits_step_on():
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8) >> Layer(8, 3))
    audit = Audit().watch(g)
    x, y = _data()
    F.cross_entropy(g.forward(x), y).backward()
    with Interrupt(), pytest.raises(KeyboardInterrupt):
        audit.observed()
    assert audit.step == 1
    F.cross_entropy(g.forward(x), y).backward()
    assert {f["step"] for f in audit.observed()} == {1}
    audit.release()


def test_a_probe_run_by_a_watcher_in_the_middle_of_a_step_is_not_heard_by_its_audit():
    """A watcher told the loss (after the backward, before the audit measures) that probes the
    graph: the step's facts are those of the same run without it."""
    runs = []
    for probing in (False, True):
        torch.manual_seed(0)
        g = Graph.somatize(Layer(4, 8) >> Layer(8, 3))
        x, y = _data()
        facts = []

        def watcher(fact, g=g, x=x, probing=probing, facts=facts):
            facts.append(fact)
            if probing and fact["fact"] == "loss":
                probe(g, x)

        t = Trainer(
            g,
            objective=F.cross_entropy,
            optimizer=torch.optim.SGD(parameters(g), lr=0.1),
            auditing=Audit(),
            watching=watcher,
        )
        t.fit([(x, y)] * 2)
        t.close()
        runs.append([f for f in facts if f["fact"] == "health"])
    assert runs[0] and runs[1] == runs[0]


def test_a_forward_refused_for_its_groups_by_hand_leaves_nothing_for_the_next_step():
    torch.manual_seed(0)
    g = Graph.somatize(Layer(4, 8).named("first") >> Narrow(6).named("narrow"))
    audit = Audit(groups={"narrow": {"a": range(0, 4), "b": range(4, 8)}}).watch(g)
    x, _ = _data()
    with pytest.raises(ValueError, match=r"groups\['narrow'\] names channel 7.*6 channels"):
        g.forward(3 * x)  # `first` heard it before `narrow` was refused
    g.implementation("narrow").keep = 8
    g.forward(x).pow(2).mean().backward()
    facts = {f["node"]: f for f in audit.observed()}
    audit.release()
    lin = g.implementation("first").l
    with torch.no_grad():
        want = torch.relu(x.double() @ lin.weight.double().T + lin.bias.double()).mean()
    assert facts["first"]["step"] == 0
    assert facts["first"]["act_abs_mean"] == pytest.approx(float(want), rel=rtol(32 * 8))
    assert audit.step == 1


def test_weights_a_block_holds_itself_are_measured_in_the_nearest_watched_place_holding_them():
    """DINOv2's embeddings hold cls_token, mask_token and position_embeddings themselves: at
    inside=True the embeddings are opened into their layers, so the node's place measures them;
    at inside=2 the embeddings are a place, which does."""
    case = newer.dinov2()
    g = Graph.somatize(case.model)
    (node,) = g.nodes()
    emb = case.model.dinov2.embeddings
    own = [emb.cls_token, emb.mask_token, emb.position_embeddings]
    with torch.no_grad():  # a size of their own, that no tolerance hides
        for q in own:
            q.fill_(1.0)
    for inside, where, holder in ((True, None, case.model), (2, "dinov2.embeddings", emb)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            audit = Audit(inside=inside, most=400).watch(g)
        assert (f"{node}.dinov2.embeddings" in audit.places) == (where is not None)
        weights = list(holder.parameters())
        want = math.sqrt(sum(float(q.detach().double().pow(2).sum()) for q in weights))
        without = math.sqrt(want**2 - sum(float(q.detach().double().pow(2).sum()) for q in own))
        case.objective(g.forward(case.example), case.target).backward()
        (fact,) = [f for f in audit.observed() if f["inside"] == where]
        audit.release()
        assert fact["param_norm"] == pytest.approx(want, rel=rtol(sum(q.numel() for q in weights)))
        assert fact["param_norm"] > 1.5 * without  # theirs counted
