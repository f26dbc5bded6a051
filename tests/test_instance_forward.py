"""A node whose `forward` is replaced on the instance is read as the graph runs it, by every
look that calls it through the modules it holds (architecture here; the Audit in test_audit)."""

from __future__ import annotations

import torch
from torch import nn

from somatize import Graph, Node
from somatize.torch import architecture


class Two(Node):
    """A plain node holding two layers; its class's forward runs both."""

    def __init__(self):
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x, ctx):
        return self.b(self.a(x))


def test_architecture_reads_a_plain_node_by_the_forward_its_instance_has():
    torch.manual_seed(0)
    two = Two()
    two.forward = lambda x, ctx: two.b(x)  # `a` set aside on this instance
    g = Graph.somatize(two.named("two"))
    inside = architecture(g, torch.randn(5, 4))["two"]
    assert [(layer.path, layer.shape) for layer in inside.layers] == [("b", [5, 3])]
