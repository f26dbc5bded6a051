"""Code written for the published somatize 1.0.1, as its reference page writes it, runs here
unchanged and gets what the page documents; each section is one area's scripts."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.optim import SGD, Adam

from somatize import Graph, Node, Opaque, Recorder, Store

# -- audit --

PUBLISHED_NAMES = ("act_abs_mean", "zero_frac_max", "sat_frac_max", "grad_norm", "param_norm")


class AuditEncoder(Node, nn.Module):
    """As the published page declares a node, handing its value on in an `Opaque`."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU())
        self.skip = nn.Identity()

    def forward(self, input, ctx):
        return Opaque(self.skip(self.net(input)))


class AuditHead(Node, nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 3)

    def forward(self, input, ctx):
        return self.fc(input)


def _audit_data(steps: int = 24):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
        for _ in range(steps)
    ]


def test_audit_as_the_page_writes_it_gives_flat_facts_with_the_published_names(tmp_path):
    from somatize.health import diagnose, seen
    from somatize.torch import Audit, Trainer, parameters

    torch.manual_seed(0)
    g = Graph.somatize(AuditEncoder().named("encoder") >> AuditHead())
    store = Store(tmp_path / "store")
    facts = []
    with Recorder(store, run="r") as recorder:
        t = Trainer(
            g,
            objective=cross_entropy,
            optimizer=Adam(parameters(g), lr=1e-3),
            auditing=Audit(every=10, channels=True),
            watching=[recorder, facts.append],
        )
        t.fit(_audit_data())
        t.close()
    health = [f for f in facts if f["fact"] == "health"]
    assert sorted({f["step"] for f in health}) == [0, 10, 20]
    for f in health:  # flat: node, inside, the numbers beside them, each of its own type
        assert f["inside"] is None and "numbers" not in f
        for name in PUBLISHED_NAMES:
            assert type(f[name]) is float and math.isfinite(f[name]), name
        assert type(f["nan"]) is bool and type(f["inf"]) is bool
        assert type(f["update_ratio"]) is float and f["update_ratio"] > 0
    # the encoder's output crossed its edge in an Opaque: measured as the tensor inside it
    encoder = [f for f in health if f["node"] == "encoder"]
    assert all(f["channels"] == 16 and 0.0 < f["zero_frac_max"] < 1.0 for f in encoder)
    assert "param_norm_slope" in encoder[-1]
    assert set(seen(store, run="r")) == {"encoder", "audithead"}
    assert diagnose(store, run="r") == {}


def test_audit_by_hand_with_groups_as_the_page_declares_them():
    from somatize.torch import Audit, parameters

    torch.manual_seed(0)
    g = Graph.somatize(AuditEncoder(128).named("encoder") >> AuditHead(128))
    audit = Audit(groups={"encoder": {"audio": range(0, 64), "text": range(64, 128)}})
    audit.watch(g)
    opt = SGD(parameters(g), lr=0.1)
    x, y = _audit_data(1)[0]
    opt.zero_grad()
    cross_entropy(g.forward(x), y).backward()
    facts = audit.observed(g)
    opt.step()
    audit.release()
    assert [f["node"] for f in facts] == ["encoder", "audithead"]
    assert 0.0 <= facts[0]["cka"] <= 1.0 and "cka" not in facts[1]


def test_audit_inside_watches_what_the_published_package_watches():
    from somatize.torch import Audit

    torch.manual_seed(0)
    g = Graph.somatize(AuditEncoder().named("encoder") >> AuditHead())
    audit = Audit(inside=True).watch(g)
    # the Identity that only passes its input on is not a place of its own
    assert audit.places == [
        "encoder",
        "encoder.net.0",
        "encoder.net.1",
        "audithead",
        "audithead.fc",
    ]
    audit.release()
