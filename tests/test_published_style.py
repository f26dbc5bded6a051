"""Code written for the published somatize 1.0.1, as its reference page writes it, runs here
unchanged and gets what the page documents; each section is one area's scripts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node, Opaque

# -- inside --


class Encoder(Node, nn.Module):
    """As the published page declares a node: a module whose forward takes (input, ctx)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, input, ctx):
        return Opaque(self.net(input))  # the published way: every value crossing an edge


class Head(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, input, ctx):
        return self.fc(torch.flatten(input, 1))


def _published_graph():
    torch.manual_seed(0)
    return Graph.somatize(Encoder() >> Head())


def test_inside_the_reference_pages_figure_line_runs():
    from somatize.torch import architecture

    g = _published_graph()
    x = Opaque(torch.randn(4, 1, 6, 6))
    fig = g.figure(inside=architecture(g, x))  # "g.figure(inside=architecture(g, x))"
    assert set(fig.inside) == {"encoder", "head"}
    inside = architecture(g, x)
    assert [x.path for x in inside["encoder"].layers] == ["net", "net.0", "net.1", "net.2"]
    assert inside["head"].layer("fc").shape == [4, 3]


def test_inside_kind_of_by_role_and_a_transformer_layer_is_attention():
    from somatize.torch import kind_of

    class FancyNorm(nn.Module):
        pass

    assert kind_of(nn.TransformerEncoderLayer(8, 2)) == "attention"
    assert kind_of(nn.TransformerDecoderLayer(8, 2)) == "attention"
    assert kind_of(FancyNorm()) == "norm"  # "a class ... that ends in Norm is a normalisation"
    assert kind_of(nn.Conv2d(1, 1, 1)) == "conv"


def test_inside_traced_answers_an_inside_or_none():
    from somatize.torch import Inside, traced

    enc = nn.TransformerEncoderLayer(8, 2, 16)
    assert traced(enc) is None  # "a module that needs a forward answers None"
    got = traced(enc, Opaque(torch.randn(5, 2, 8)))
    assert isinstance(got, Inside) and got.how == "traced"
    assert got.to_json() == traced(enc, torch.randn(5, 2, 8)).to_json()


def test_inside_probe_in_the_published_layout_opaque_or_not():
    from somatize.torch import probe

    g = _published_graph()
    x = torch.randn(4, 1, 6, 6)
    heard = []
    got = probe(g, Opaque(x), depth=0, most=48, probes=24, watching=heard.append)
    assert got == probe(g, x)
    for where, numbers in got.items():
        assert where in ("encoder", "head") or where.split(".")[0] in ("encoder", "head")
        assert {"signal_gain", "zero_frac_max", "sat_frac_max", "nan", "inf"} <= set(numbers)
    assert {"jacobian_gain", "jacobian_spread"} <= set(got["head.fc"])
    kinds = [f["fact"] for f in heard]
    assert "ran" in kinds and "finished" in kinds and "health" in kinds
    health = [f for f in heard if f["fact"] == "health"]
    assert all({"node", "inside", "step"} <= set(f) and f["step"] == 0 for f in health)
    assert {(f["node"], f["inside"]) for f in health} >= {("encoder", None), ("head", "fc")}


def test_inside_proxies_as_the_page_writes_them_opaque_or_not():
    from somatize.torch import EVERY, proxies, proxy

    g = _published_graph()
    x, y = torch.randn(8, 1, 6, 6), torch.arange(8) % 3
    scores = proxies(g, Opaque(x), target=Opaque(y), objective=F.cross_entropy)
    assert scores == proxies(g, x, target=y, objective=F.cross_entropy)
    assert list(scores) == list(EVERY)
    assert all(isinstance(v, float) and math.isfinite(v) for v in scores.values())
    # "without a target and an objective the three that read a loss are not in the answer"
    assert set(proxies(g, Opaque(x))) == {"synflow", "zen", "naswot", "jacob_cov"}
    assert proxy(g, Opaque(x), "synflow") == scores["synflow"]


def test_inside_better_a_model_as_it_is_in_every_tool():
    """**better:** any nn.Module as it is: Graph.somatize(model), Node.of, and every tool."""
    from somatize.figures import compare
    from somatize.torch import Trainer, architecture, probe, proxies

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.arange(6) % 2
    g = Graph.somatize(model)
    assert g.nodes() == ["sequential"]
    assert architecture(model, x)["sequential"].params == 58
    assert set(probe(model, x)) == {"sequential", "sequential.0", "sequential.1", "sequential.2"}
    assert "synflow" in proxies(model, x)
    assert list(compare({"mlp": model}, x).index) == ["mlp"]
    from somatize.figures import graph_figure

    fig = graph_figure(model, inside=architecture(model, x))
    assert [n["id"] for n in fig.plan["nodes"]] == ["sequential"] and fig.inside["sequential"]
    t = Trainer(
        model, objective=F.cross_entropy, optimizer=torch.optim.SGD(model.parameters(), 0.1)
    )
    assert math.isfinite(t.step((x, y)))
    chained = Graph.somatize(Node.of(model[:2]) >> Node.of(model[2]).named("head"))
    assert chained.nodes() == ["sequential", "head"]
    assert torch.equal(chained.forward(x), model(x))
