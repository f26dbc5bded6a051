"""probe: per-place numbers at initialisation, keyed like the audit, checked by hand on a
layer of known gain; deterministic and side-effect free."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from somatize import Graph, Node
from somatize.health import SATURATED, seen, verdict
from somatize.record import Recorder
from somatize.store import Store
from somatize.torch.inside.probe import probe


class Double(Node, nn.Module):
    """y = 2x, then ReLU: gain 2 on the linear layer, jacobian gain exactly 2."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4, bias=False)
        self.r = nn.ReLU(inplace=True)
        with torch.no_grad():
            self.l.weight.copy_(2 * torch.eye(4))

    def forward(self, x, ctx):
        return self.r(self.l(x))


class Body(Node):
    def __init__(self):
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Tanh())

    def forward(self, x, ctx):
        return self.net(x)


def _graph():
    torch.manual_seed(0)
    return Graph.somatize(Double() >> Body())


def test_keys_and_numbers_by_hand():
    g = _graph()
    x = torch.randn(6, 4)
    got = probe(g, x)
    assert list(got) == [
        "double",
        "double.l",
        "double.r",
        "body",
        "body.net.0",
        "body.net.1",
        "body.net.2",
        "body.net.3",
    ]
    lin = got["double.l"]
    assert lin["gain"] == pytest.approx(2.0)
    assert lin["jacobian_gain"] == pytest.approx(2.0)
    assert lin["jacobian_spread"] == pytest.approx(0.0, abs=1e-6)
    relu = got["double.r"]
    # the tiled input: 24 rows cycling the 6 of x
    tiled = x.repeat(4, 1)
    assert relu["zero"] == pytest.approx(float((2 * tiled <= 0).float().mean()))
    assert relu["saturated"] == 0.0
    assert got["double"]["gain"] == pytest.approx(
        float((2 * tiled).clamp(min=0).pow(2).mean().sqrt() / tiled.pow(2).mean().sqrt())
    )
    for numbers in got.values():
        assert type(numbers["nan"]) is bool and numbers["nan"] is False
        assert type(numbers["zero"]) is float
    assert verdict(got["double.l"]) == []


def test_no_side_effects_and_the_same_answer_twice():
    g = _graph()
    x = torch.randn(6, 4)
    mods = [g.implementation("double"), g.implementation("body").net]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in mods]
    rng = torch.get_rng_state()
    first = probe(g, x)
    assert probe(g, x) == first
    for m, b in zip(mods, before, strict=True):
        assert all(torch.equal(b[k], v) for k, v in m.state_dict().items())
        assert all(p.grad is None for p in m.parameters())
        assert m.training
    assert mods[0].r.inplace
    assert torch.equal(rng, torch.get_rng_state())
    assert "forward" not in vars(mods[0])


def test_saturation_is_seen_at_init():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Sigmoid())
    with torch.no_grad():
        net[0].weight.mul_(50)
    got = probe(net, torch.randn(8, 4))
    assert SATURATED in verdict(got["sequential.1"])
    assert got["sequential.1"]["saturated"] > 0.5


def test_depth_and_most_choose_the_places():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
    x = torch.randn(5, 2, 8)
    assert set(probe(enc, x)) == {
        "transformerencoder",
        "transformerencoder.layers.0",
        "transformerencoder.layers.1",
    }
    opened = probe(enc, x, depth=1)
    assert "transformerencoder.layers.0.linear1" in opened
    assert len(probe(enc, x, depth=1, most=3)) == 4


def test_watching_records_what_seen_reads_back(tmp_path):
    g = _graph()
    heard = []
    got = probe(g, torch.randn(6, 4), watching=heard.append)
    assert [f["where"] for f in heard] == list(got)
    assert all(f["fact"] == "health" and f["step"] == 0 for f in heard)
    store = Store(tmp_path / "s")
    probe(g, torch.randn(6, 4), watching=Recorder(store, run="init"))
    back = seen(store, run="init")
    assert set(back) == set(got)
    assert back["double.l"]["gain"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="probes"):
        probe(g, torch.randn(6, 4), probes=0)
