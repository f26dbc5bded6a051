"""somatize.health: verdicts over numbers, and deliberately broken nets diagnosed from the
record alone."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node
from somatize.health import (
    DEAD,
    DEAD_CHANNELS,
    EXPLODING,
    FAMILIES,
    IGNORED_CHANNELS,
    INF,
    LEAKAGE,
    NAN,
    NARROWING,
    OVERSTEPPING,
    SATURATED,
    STALLED,
    VANISHING,
    Flag,
    Thresholds,
    about,
    diagnose,
    family,
    seen,
    seen_in,
    verdict,
)
from somatize.record import Recorder
from somatize.store import Store
from somatize.torch import Audit, Trainer, parameters

# -- verdicts over numbers -----------------------------------------------------------------


def test_thresholds_defaults_and_refusals():
    t = Thresholds()
    assert (t.grad_low, t.grad_high, t.dead_eps, t.dead_frac) == (1e-7, 1e3, 1e-7, 0.95)
    assert (t.saturated_frac, t.update_low, t.update_high) == (0.5, 1e-4, 1e-2)
    assert (t.dormant_tau, t.dormant_frac, t.leakage_cka) == (0.1, 0.5, 0.95)
    assert Thresholds(grad_high=10).grad_high == 10.0
    assert Thresholds(grad_high=10).grad_low == 1e-7
    with pytest.raises(TypeError, match="unknown threshold.*grad_hgih.*grad_high"):
        Thresholds(grad_hgih=3)
    with pytest.raises(TypeError, match="number"):
        Thresholds(grad_high="big")


@pytest.mark.parametrize(
    "numbers, flag",
    [
        ({"nan": True}, NAN),
        ({"grad_norm": float("nan")}, NAN),
        ({"inf": True}, INF),
        ({"grad_norm": 1e-9}, VANISHING),
        ({"grad_norm": 1e4}, EXPLODING),
        ({"zero": 0.97}, DEAD),
        ({"saturated": 0.6}, SATURATED),
        ({"update_ratio": 1e-6}, STALLED),
        ({"update_ratio": 0.2}, OVERSTEPPING),
        ({"dead_channels": 3, "channels": 16}, DEAD_CHANNELS(3)),
        ({"dormant_channels": 10, "channels": 16}, IGNORED_CHANNELS(10)),
        ({"cka": 0.99}, LEAKAGE),
        ({"effective_rank": 1.0, "rank_room": 64}, NARROWING),
    ],
)
def test_each_flag_from_its_numbers(numbers, flag):
    assert verdict(numbers) == [flag]


def test_healthy_numbers_raise_nothing_and_thresholds_move_the_line():
    healthy = {
        "grad_norm": 0.3,
        "param_norm": 4.0,
        "update_ratio": 1e-3,
        "zero": 0.5,
        "saturated": 0.1,
        "nan": False,
        "inf": False,
        "dead_channels": 0,
        "dormant_channels": 1,
        "channels": 16,
        "cka": 0.3,
        "effective_rank": 20.0,
        "rank_room": 32,
    }
    assert verdict(healthy) == []
    assert verdict(healthy, Thresholds(grad_high=0.1)) == [EXPLODING]
    assert verdict({"zero": 0.5}, Thresholds(dead_frac=0.4)) == [DEAD]
    with pytest.raises(TypeError):
        verdict([1, 2])


def test_flags_are_strings_with_a_family_and_advice():
    assert DEAD_CHANNELS(3) == "DEAD_CHANNELS(3)" and DEAD_CHANNELS(3).n == 3
    assert DEAD_CHANNELS(3).name == "DEAD_CHANNELS"
    assert Flag("IGNORED_CHANNELS(5)") == IGNORED_CHANNELS(5)
    assert json.loads(json.dumps([DEAD, DEAD_CHANNELS(2)])) == ["DEAD", "DEAD_CHANNELS(2)"]
    families = {
        "numeric": [NAN, INF],
        "signal": [VANISHING, EXPLODING],
        "activation": [DEAD, SATURATED],
        "step": [STALLED, OVERSTEPPING],
        "capacity": [DEAD_CHANNELS(1), IGNORED_CHANNELS(1), LEAKAGE, NARROWING],
    }
    assert tuple(families) == FAMILIES
    for fam, flags in families.items():
        for f in flags:
            assert family(f) == fam
            assert family(str(f)) == fam
            text = about(f)
            assert text.endswith(".") and len(text) > 40
    with pytest.raises(ValueError, match="unknown flag"):
        about("SLEEPY")
    with pytest.raises(ValueError, match="takes a count"):
        Flag("DEAD_CHANNELS")
    with pytest.raises(ValueError, match="takes no count"):
        Flag("DEAD", 2)


def test_seen_in_summarises_each_metric_by_its_type():
    facts = [
        {"fact": "loss", "value": 1.0, "step": 0},
        {"fact": "health", "where": "a", "step": 0, "numbers": {"grad_norm": 1.0, "nan": False}},
        {"fact": "health", "where": "a", "step": 1, "numbers": {"grad_norm": 3.0, "nan": True}},
        {"fact": "health", "where": "a", "step": 2, "numbers": {"grad_norm": 2.0, "nan": False}},
        {"fact": "health", "where": "a.l", "step": 2, "numbers": {"dead_channels": 4}},
        {"fact": "health", "where": "a.l", "step": 3, "numbers": {"dead_channels": 1}},
    ]
    got = seen_in(facts)
    assert got == {"a": {"grad_norm": 2.0, "nan": True}, "a.l": {"dead_channels": 1}}
    assert type(got["a"]["nan"]) is bool and type(got["a.l"]["dead_channels"]) is int
    assert seen_in(facts, last=1)["a"] == {"grad_norm": 2.0, "nan": False}


# -- broken nets, trained and diagnosed from the record alone ------------------------------


class Layer(Node, nn.Module):
    def __init__(self, i: int, o: int, act: str = "relu", bias: float | None = None, scale=1.0):
        super().__init__()
        self.l = nn.Linear(i, o)
        self.a = {"relu": nn.ReLU(inplace=True), "sigmoid": nn.Sigmoid(), "none": nn.Identity()}[
            act
        ]
        with torch.no_grad():
            self.l.weight.mul_(scale)
            if bias is not None:
                self.l.bias.fill_(bias)

    def forward(self, x, ctx):
        return self.a(self.l(x))


def _data(n=128, d=8, classes=3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    teacher = torch.randn(d, classes, generator=g)
    return x, (x @ teacher).argmax(1)


def _train(layers, tmp_path, *, steps=25, opt=torch.optim.SGD, lr=0.02, audit=None, objective=None):
    torch.manual_seed(0)
    expr = layers[0].named("l0")
    for i, layer in enumerate(layers[1:], start=1):
        expr = expr >> layer.named(f"l{i}")
    g = Graph.somatize(expr)
    store = Store(tmp_path / "store")
    with Recorder(store, run="r") as rec:
        t = Trainer(
            g,
            objective=objective or F.cross_entropy,
            optimizer=opt(parameters(g), lr=lr),
            auditing=audit or True,
            watching=rec,
        )
        x, y = _data()
        t.fit([(x, y)] * steps)
        t.audit.release()
    return store


def _healthy():
    torch.manual_seed(0)
    return [Layer(8, 32), Layer(32, 32), Layer(32, 3, "none")]


def test_a_healthy_net_gets_no_flag(tmp_path):
    store = _train(_healthy(), tmp_path)
    numbers = seen(store, run="r")
    assert diagnose(store, run="r") == {}, numbers
    assert set(numbers) == {"l0", "l1", "l2"}
    assert numbers["l0"]["grad_norm"] > 0 and 0 < numbers["l0"]["update_ratio"] < 1e-2


def test_dead_relus_are_dead_on_their_node(tmp_path):
    layers = _healthy()
    layers[1] = Layer(32, 32, bias=-20.0)
    found = diagnose(_train(layers, tmp_path), run="r")
    assert DEAD in found["l1"]
    assert DEAD not in found.get("l0", []) and DEAD not in found.get("l2", [])


def _deep(scale):
    torch.manual_seed(0)
    layers = [Layer(8, 32, scale=scale)] + [Layer(32, 32, scale=scale) for _ in range(5)]
    return layers + [Layer(32, 3, "none", scale=scale)]


def test_exploding_init_explodes_and_the_same_net_scaled_right_does_not(tmp_path):
    def square(out, y):
        return out.pow(2).mean()

    store = _train(_deep(6.0), tmp_path / "big", steps=4, lr=1e-9, objective=square)
    assert EXPLODING in diagnose(store, run="r")["l0"]
    store = _train(_deep(1.0), tmp_path / "fine", steps=4, lr=1e-9, objective=square)
    assert not any(EXPLODING in f for f in diagnose(store, run="r").values())


def test_a_sigmoid_stack_vanishes_at_the_bottom_only(tmp_path):
    torch.manual_seed(0)
    layers = [Layer(8, 16, "sigmoid")] + [Layer(16, 16, "sigmoid") for _ in range(14)]
    layers.append(Layer(16, 3, "none"))
    found = diagnose(_train(layers, tmp_path, steps=5), run="r")
    assert VANISHING in found["l0"]
    assert VANISHING not in found.get("l15", [])


def test_a_learning_rate_that_oversteps(tmp_path):
    store = _train(_healthy(), tmp_path, steps=10, opt=torch.optim.Adam, lr=0.5)
    found = diagnose(store, run="r")
    for node in ("l0", "l1", "l2"):
        assert OVERSTEPPING in found[node]


def test_seen_refuses_an_unknown_run_and_a_bad_window(tmp_path):
    store = _train(_healthy(), tmp_path, steps=2)
    with pytest.raises(LookupError, match="nope"):
        seen(store, run="nope")
    with pytest.raises(ValueError, match="last"):
        seen(store, run="r", last=0)
    assert all(not math.isnan(v) for n in seen(store, run="r", last=1).values() for v in n.values())


def test_audit_choice_reaches_the_record(tmp_path):
    store = _train(_healthy(), tmp_path, steps=6, audit=Audit(every=3, channels=True))
    steps = [
        f["step"]
        for _, rec in __import__("somatize.record", fromlist=["records"]).records(store, "r")
        for f in rec
        if f["fact"] == "health" and f["where"] == "l0"
    ]
    assert steps == [0, 3]
    assert seen(store, run="r")["l1"]["channels"] == 32
