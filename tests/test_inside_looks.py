"""A look leaves what it looks at as it was, and names the layer a single-layer node reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from somatize import Graph, Node
from somatize.torch import architecture, probe, proxies


class Renormed(nn.Module):
    """An embedding that renormalises the rows it looks up, in place, in any forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4, max_norm=0.5)
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            self.embed.weight.mul_(10)  # every row far past max_norm

    renormed = ("embed.weight",)

    def forward(self, x):
        return self.fc(self.embed(x)).mean(1)


def test_a_node_that_is_one_layer_is_said_to_read_the_layer_that_made_what_it_reads():
    body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))
    g = Graph.somatize(Node.of(body).named("body") >> Node.of(nn.Linear(5, 2)).named("out"))
    inside = architecture(g, torch.randn(2, 4))
    assert inside["body"].read_by == {"out": ["2"]}
    assert inside["out"].read_by == {}


@pytest.mark.parametrize(
    "net, look",
    [(Renormed, look) for look in ("architecture", "probe", "proxies")],
)
def test_a_look_leaves_weights_a_forward_renormalises_in_place_as_they_were(net, look):
    net = net()
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    if look == "architecture":
        architecture(net, x)
    elif look == "probe":
        probe(net, x)
    else:
        proxies(net, x, target=torch.tensor([0, 1]), objective=nn.functional.cross_entropy)
    for k, v in net.state_dict().items():
        assert torch.equal(before[k], v), k
    net(x)  # the same forward outside a look does renormalise: the test reads what it must
    for k in net.renormed:
        assert not torch.equal(before[k], net.state_dict()[k]), k
