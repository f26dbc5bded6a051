"""somatize.health: verdicts over numbers, one rule over time, and deliberately broken nets
diagnosed from the record alone."""

from __future__ import annotations

import json
import math
import time

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
    METRICS,
    NAN,
    NARROWING,
    OVERSTEPPING,
    SATURATED,
    STALLED,
    VANISHING,
    WINDOW,
    Flag,
    Thresholds,
    Verdicts,
    about,
    diagnose,
    family,
    numbers_of,
    seen,
    seen_in,
    verdict,
    where_of,
)
from somatize.record import Recorder
from somatize.store import Store
from somatize.torch import Audit, Trainer, parameters

# -- verdicts over numbers -----------------------------------------------------------------


def test_thresholds_defaults_and_refusals():
    t = Thresholds()
    assert (t.grad_low, t.grad_high, t.dead_eps, t.dead_frac) == (1e-7, 1e3, 1e-7, 0.95)
    assert (t.saturated_frac, t.update_low, t.update_high) == (0.5, 1e-6, 0.25)
    assert (t.dormant_tau, t.dormant_frac, t.leakage_cka) == (0.1, 0.5, 0.95)
    assert Thresholds(grad_high=10).grad_high == 10.0
    assert Thresholds(grad_high=10).grad_low == 1e-7
    with pytest.raises(TypeError, match="unknown threshold.*grad_hgih.*grad_high"):
        Thresholds(grad_hgih=3)
    with pytest.raises(TypeError, match="number"):
        Thresholds(grad_high="big")
    with pytest.raises(
        TypeError, match=r"thresholds is a Thresholds\(...\), not \{'grad_high': 10\}"
    ):
        verdict({"grad_norm": 1.0}, {"grad_high": 10})


@pytest.mark.parametrize(
    "numbers, flag",
    [
        ({"nan": True}, NAN),
        ({"grad_norm": float("nan")}, NAN),
        ({"inf": True}, INF),
        ({"grad_norm": 1e-9}, VANISHING),
        ({"grad_norm": 1e4}, EXPLODING),
        ({"zero_frac_max": 0.97}, DEAD),
        ({"sat_frac_max": 0.6}, SATURATED),
        ({"update_ratio": 1e-8}, STALLED),
        ({"update_ratio": 0.4}, OVERSTEPPING),
        ({"dead_channels": 5, "channels": 16}, DEAD_CHANNELS(5)),
        ({"ignored_channels": 10, "input_channels": 16}, IGNORED_CHANNELS(10)),
        ({"cka": 0.99}, LEAKAGE),
        ({"effective_rank": 1.5, "rank_room": 64}, NARROWING),
    ],
)
def test_each_flag_from_its_numbers(numbers, flag):
    assert verdict(numbers) == [flag]


def test_a_fact_is_judged_as_it_is_recorded_its_other_keys_ignored():
    fact = {"fact": "health", "node": "enc", "inside": None, "step": 3, "zero_frac_max": 0.99}
    assert verdict(fact) == [DEAD]
    assert verdict({"fact": "health", "node": "enc", "inside": "l", "step": 1.5}) == []


def test_healthy_numbers_raise_nothing_and_thresholds_move_the_line():
    healthy = {
        "grad_norm": 0.3,
        "param_norm": 4.0,
        "update_ratio": 1e-3,
        "zero_frac_max": 0.5,
        "sat_frac_max": 0.1,
        "nan": False,
        "inf": False,
        "dead_channels": 1,
        "dormant_channels": 1,
        "channels": 16,
        "ignored_channels": 2,
        "input_channels": 16,
        "cka": 0.3,
        "effective_rank": 20.0,
        "rank_room": 32,
    }
    assert verdict(healthy) == []
    assert verdict(healthy, Thresholds(grad_high=0.1)) == [EXPLODING]
    assert verdict({"zero_frac_max": 0.5}, Thresholds(dead_frac=0.4)) == [DEAD]
    assert verdict({"dead_channels": 1, "channels": 16}, Thresholds(dead_channel_frac=0.05)) == [
        DEAD_CHANNELS(1)
    ]
    with pytest.raises(TypeError):
        verdict([1, 2])


def test_a_flag_names_a_cause_and_leaves_out_what_it_explains_at_that_place():
    # dead units pass no gradient back: not also VANISHING and STALLED, nor DEAD_CHANNELS
    dead = {"zero_frac_max": 1.0, "grad_norm": 1e-9, "update_ratio": 0.0, "param_norm": 3.0}
    assert verdict({**dead, "dead_channels": 32, "channels": 32}) == [DEAD]
    assert verdict({"sat_frac_max": 0.9, "grad_norm": 1e-9, "update_ratio": 0.0}) == [SATURATED]
    # weights whose gradient is exactly zero got none: the place that cut them off is flagged
    assert verdict({"grad_norm": 0.0, "update_ratio": 0.0, "param_norm": 3.0}) == []
    # a stall under an ordinary step for its gradient (‖Δθ‖/‖∇θ‖ = 0.1) is the gradient's
    small = {"grad_norm": 1e-5, "param_norm": 3.0, "update_ratio": 1e-5 * 0.1 / 3.0}
    assert verdict(small) == [VANISHING]
    # under a step that is itself small (1e-7 per unit of gradient) it is the optimizer's
    slow = {"grad_norm": 0.1, "param_norm": 3.0, "update_ratio": 0.1 * 1e-7 / 3.0}
    assert verdict(slow) == [STALLED]
    assert verdict({"grad_norm": 1e4, "update_ratio": 0.9}) == [EXPLODING]
    # a NaN makes every other number moot; one that came from elsewhere raises nothing here
    assert verdict({"nan": True, "zero_frac_max": 1.0, "grad_norm": float("nan")}) == [NAN]
    assert verdict({"nan": True, "inf": True, "inherited": True, "zero_frac_max": 1.0}) == []
    # an output that does not vary at all (rank 0) is not one that narrows
    assert verdict({"effective_rank": 0.0, "rank_room": 32}) == []
    # narrowing is a fall from where the place started; narrow from its first look, it is not
    fell = {"effective_rank": 1.2, "rank_room": 32, "rank_share_start": 0.4}
    assert verdict(fell) == [NARROWING]
    assert verdict({**fell, "rank_share_start": 1.3 / 32}) == []
    lower = Thresholds(narrow_frac=0.03)  # (the start is judged by the same line)
    assert verdict({**fell, "effective_rank": 0.9, "rank_share_start": 1.3 / 32}, lower) == [
        NARROWING
    ]


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
    with pytest.raises(
        ValueError, match=r"DEAD_CHANNELS takes a count, e.g. DEAD_CHANNELS\(3\), not 'x'"
    ):
        Flag("DEAD_CHANNELS(x)")
    for bad in (5, None):
        with pytest.raises(TypeError, match=f"a flag is a name such as 'DEAD'.*not {bad!r}"):
            about(bad)


# -- facts, and one rule over time -----------------------------------------------------------


def _fact(node, step, inside=None, **numbers):
    return {"fact": "health", "node": node, "inside": inside, "step": step, **numbers}


def test_where_and_numbers_of_a_flat_fact_and_of_one_in_the_earlier_layout():
    flat = _fact("enc", 4, inside="blocks.0", grad_norm=0.5, nan=False)
    assert where_of(flat) == "enc.blocks.0" and where_of(_fact("enc", 0)) == "enc"
    assert numbers_of(flat) == {"grad_norm": 0.5, "nan": False}
    old = {
        "fact": "health",
        "where": "enc.l",
        "step": 2,
        "numbers": {"zero": 0.97, "saturated": 0.1},
    }
    assert where_of(old) == "enc.l"
    assert numbers_of(old) == {"zero_frac_max": 0.97, "sat_frac_max": 0.1}
    assert seen_in([old]) == {"enc.l": {"zero_frac_max": 0.97, "sat_frac_max": 0.1}}
    with pytest.raises(ValueError, match="node"):
        where_of({"fact": "health", "step": 1})


def test_seen_in_summarises_each_metric_by_its_type():
    facts = [
        {"fact": "loss", "value": 1.0, "step": 0},
        _fact("a", 0, grad_norm=1.0, nan=False),
        _fact("a", 1, grad_norm=3.0, nan=True),
        _fact("a", 2, grad_norm=2.0, nan=False),
        _fact("a", 2, inside="l", dead_channels=4),
        _fact("a", 3, inside="l", dead_channels=1),
    ]
    got = seen_in(facts)
    assert got == {"a": {"grad_norm": 2.0, "nan": True}, "a.l": {"dead_channels": 1}}
    assert type(got["a"]["nan"]) is bool and type(got["a.l"]["dead_channels"]) is int
    assert seen_in(facts, last=1)["a"] == {"grad_norm": 2.0, "nan": False}


def test_an_int_past_a_floats_range_is_judged_as_an_infinity_is():
    for huge, inf in ((10**400, math.inf), (-(10**400), -math.inf)):
        assert verdict({"grad_norm": huge}) == verdict({"grad_norm": inf}) == [INF]
        assert verdict({"param_norm": 1.0, "grad_norm": huge, "inherited": True}) == []
        assert verdict({"dead_channels": huge, "channels": 8}) == [INF]
    # summarised by the type of its latest value: an int as a count (that value, INF), a
    # float as a measure (the median of the finite values, 10**400 left out as an inf is)
    grads = [1.0, 10**400, 2.0, 3.0]
    states = [v.add(_fact("a", k, grad_norm=g)) for v in [Verdicts()] for k, g in enumerate(grads)]
    assert states == [[], [INF], [], []]
    assert seen_in([_fact("a", k, grad_norm=g) for k, g in enumerate(grads)]) == {
        "a": {"grad_norm": 2.0}
    }


def test_numpy_numbers_are_judged_as_python_numbers_are():
    import numpy as np

    for grad in (3e4, math.inf, math.nan, 0.5):  # each held exactly enough in float16
        for kind in (np.float32, np.float64, np.float16):
            assert verdict({"grad_norm": kind(grad)}) == verdict({"grad_norm": float(grad)})
    assert verdict({"dead_channels": np.int64(8), "channels": 8}) == verdict(
        {"dead_channels": 8, "channels": 8}
    )
    assert verdict({"grad_norm": True}) == verdict({})  # a bool is no measure


def test_a_live_audit_judging_an_int_past_a_floats_range_keeps_sending():
    from somatize.figures import LiveAudit

    class Kept(LiveAudit):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.sent = []

        def send(self, content, buffers=None):
            self.sent.append(content)

    audit = Kept(interval=0.05)
    audit(_fact("enc", 0, grad_norm=10**400))
    audit(_fact("enc", 1, grad_norm=0.5))
    audit.sync()  # judged and sent in this thread: it raised here as in the sender's
    assert audit.frame()["flags"].tolist() == [["INF"], []]
    steps = [s for c in audit.sent for r in c["runs"] for p in r["places"] for s in p["steps"]]
    assert steps == [0, 1]
    audit(_fact("enc", 3, grad_norm=10**400))
    audit(_fact("enc", 4, grad_norm=10**400))
    deadline = time.monotonic() + 10  # the sender thread judges and sends them on its own
    while time.monotonic() < deadline and len(steps) < 4:
        time.sleep(0.05)
        steps = [s for c in audit.sent for r in c["runs"] for p in r["places"] for s in p["steps"]]
    assert steps == [0, 1, 3, 4]
    assert audit.frame()["flags"].tolist() == [["INF"], [], ["INF"], ["INF"]]


def test_verdicts_as_facts_arrive_are_the_rule_diagnose_reads_a_run_by():
    # a place that is healthy, dies for longer than half the window, then comes back
    zero = [0.4] * 5 + [0.99] * (WINDOW // 2 + 3) + [0.4] * (WINDOW + 1)
    facts = [_fact("enc", k, zero_frac_max=z, grad_norm=0.1) for k, z in enumerate(zero)]
    v = Verdicts()
    states = [v.add(f) for f in facts]
    assert v.add({"fact": "loss", "value": 1.0}) is None
    onset = states.index([DEAD])
    # flagged once most of its last WINDOW steps are dead, and no longer once most are not
    assert 5 < onset <= 5 + WINDOW // 2 + 1 and states[4] == []
    assert states[-1] == [] and v.flags() == {}
    # the state at each step is verdict over seen_in of the facts up to it
    for k in (onset - 1, onset, len(facts) - 1):
        assert states[k] == verdict(seen_in(facts[: k + 1], last=WINDOW)["enc"])
    with pytest.raises(ValueError, match="last"):
        Verdicts(last=0)


# -- broken nets, trained and diagnosed from the record alone ---------------------------------


class Layer(Node, nn.Module):
    def __init__(self, i: int, o: int, act: str = "relu", bias: float | None = None, scale=1.0):
        super().__init__()
        self.l = nn.Linear(i, o)
        acts = {"relu": nn.ReLU(inplace=True), "sigmoid": nn.Sigmoid(), "none": nn.Identity()}
        self.a = acts[act]
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


def _train(layers, tmp_path, *, steps=25, opt=torch.optim.Adam, lr=3e-3, audit=None, watch=None):
    torch.manual_seed(0)
    expr = layers[0].named("l0")
    for i, layer in enumerate(layers[1:], start=1):
        expr = expr >> layer.named(f"l{i}")
    g = Graph.somatize(expr)
    store = Store(tmp_path / "store")
    with Recorder(store, run="r") as rec:
        t = Trainer(
            g,
            objective=F.cross_entropy,
            optimizer=opt(parameters(g), lr=lr),
            auditing=audit or True,
            watching=[rec] + ([watch] if watch else []),
        )
        x, y = _data()
        t.fit([(x, y)] * steps)
        t.close()
    return store


def _healthy():
    torch.manual_seed(0)
    return [Layer(8, 32), Layer(32, 32), Layer(32, 3, "none")]


def test_a_healthy_net_gets_no_flag_at_any_step_and_its_numbers_are_recorded(tmp_path):
    heard = []
    store = _train(_healthy(), tmp_path, watch=heard.append)
    numbers = seen(store, run="r")
    assert diagnose(store, run="r") == {}, numbers
    v = Verdicts()
    assert all(not v.add(f) for f in heard if f["fact"] == "health")  # clean at every step
    assert set(numbers) == {"l0", "l1", "l2"}
    assert numbers["l0"]["grad_norm"] > 0 and 0 < numbers["l0"]["update_ratio"] < 0.25


def test_dead_relus_read_dead_on_their_node_and_nothing_upstream(tmp_path):
    layers = _healthy()
    layers[1] = Layer(32, 32, bias=-20.0)
    found = diagnose(_train(layers, tmp_path), run="r")
    # l0 gets no gradient through the dead l1: that is l1's doing, said once, where it is
    assert found == {"l1": [DEAD]}


def test_a_nan_is_flagged_where_it_arose_only(tmp_path):
    class Log(Node):
        def forward(self, x, ctx):
            return torch.log(x - 0.5)

    layers = [Layer(8, 32), Log(), Layer(32, 3, "none")]
    found = diagnose(_train(layers, tmp_path, steps=5), run="r")
    assert found == {"l1": [NAN]}


def test_a_sigmoid_stack_vanishes_at_the_bottom_only(tmp_path):
    torch.manual_seed(0)
    layers = [Layer(8, 16, "sigmoid")] + [Layer(16, 16, "sigmoid") for _ in range(14)]
    layers.append(Layer(16, 3, "none"))
    found = diagnose(_train(layers, tmp_path, steps=5, opt=torch.optim.SGD, lr=0.1), run="r")
    assert found["l0"] == [VANISHING]
    assert not found.get("l15") and not found.get("l14")
    assert {f for flags in found.values() for f in flags} == {VANISHING}


def test_a_tiny_learning_rate_stalls_every_node(tmp_path):
    found = diagnose(_train(_healthy(), tmp_path, steps=5, opt=torch.optim.SGD, lr=1e-8), run="r")
    assert found == {"l0": [STALLED], "l1": [STALLED], "l2": [STALLED]}


def test_seen_refuses_an_unknown_run_and_a_bad_window(tmp_path):
    store = _train(_healthy(), tmp_path, steps=2)
    with pytest.raises(LookupError, match="nope"):
        seen(store, run="nope")
    with pytest.raises(ValueError, match="last"):
        seen(store, run="r", last=0)
    assert all(not math.isnan(v) for n in seen(store, run="r", last=1).values() for v in n.values())


def test_every_number_a_fact_carries_is_explained_in_one_sentence(tmp_path):
    heard = []
    audit = Audit(
        snapshot=2, channels=True, inside=True, groups={"l1": {"a": range(16), "b": range(16, 32)}}
    )
    _train(_healthy(), tmp_path, steps=3, audit=audit, watch=heard.append)
    keys = {k for f in heard if f["fact"] == "health" for k in numbers_of(f)}
    assert {"update_stable_rank", "rank_room", "cka", "ignored_channels", "out_grad_norm"} <= keys
    assert keys <= set(METRICS), keys - set(METRICS)
    for name, text in METRICS.items():
        assert text.endswith(".") and text.count(". ") == 0, name  # one sentence each


def test_audit_choice_reaches_the_record(tmp_path):
    from somatize.record import records

    store = _train(_healthy(), tmp_path, steps=6, audit=Audit(every=3, channels=True))
    facts = [f for _, rec in records(store, "r") for f in rec if f["fact"] == "health"]
    assert [f["step"] for f in facts if where_of(f) == "l0"] == [0, 3]
    assert all(set(f) >= {"fact", "node", "inside", "step", "grad_norm", "nan"} for f in facts)
    assert seen(store, run="r")["l1"]["channels"] == 32
