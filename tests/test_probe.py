"""probe: per-place numbers at initialisation, keyed like the audit, checked by hand on a
layer of known gain, on the example as it is given (nothing tiled); deterministic and
side-effect free."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from models.zoo import BasicBlock, gpt2
from torch import nn
from torch.utils.checkpoint import checkpoint

from somatize import Graph, Node, Opaque
from somatize.record import Recorder, records
from somatize.store import Store
from somatize.torch.inside.probe import probe

NAMES = {"signal_gain", "jacobian_gain", "jacobian_spread", "zero_frac_max", "sat_frac_max"}


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


def test_keys_and_numbers_by_hand_on_the_example_as_given():
    g = _graph()
    x = torch.randn(6, 4, dtype=torch.float64).float()
    got = probe(g, x)
    assert list(got) == [
        "double",
        "double.l",
        "double.r",
        "body",
        "body.net",
        "body.net.0",
        "body.net.1",
        "body.net.2",
        "body.net.3",
    ]
    assert got["body.net"] == got["body.net.3"]  # a block: the last box that ran in it
    eps = torch.finfo(torch.float32).eps
    lin = got["double.l"]
    assert lin["signal_gain"] == pytest.approx(2.0, rel=8 * eps)
    assert lin["jacobian_gain"] == pytest.approx(2.0, rel=8 * eps)
    assert lin["jacobian_spread"] == pytest.approx(0.0, abs=8 * eps)
    relu = got["double.r"]
    assert relu["zero_frac_max"] == float((x <= 0).double().mean())  # six rows, not tiled
    assert relu["sat_frac_max"] == 0.0
    x64 = x.double()
    want = float((2 * x64).clamp(min=0).pow(2).mean().sqrt() / x64.pow(2).mean().sqrt())
    assert got["double"]["signal_gain"] == pytest.approx(want, rel=16 * eps)
    for numbers in got.values():
        assert set(numbers) >= {"signal_gain", "zero_frac_max", "sat_frac_max", "nan", "inf"}
        assert type(numbers["nan"]) is bool and numbers["nan"] is False
        assert type(numbers["zero_frac_max"]) is float


def test_no_side_effects_and_the_same_answer_twice():
    g = _graph()
    x = torch.randn(6, 4)
    mods = [g.implementation("double"), g.implementation("body").net]
    mods[1][0].weight.requires_grad_(False)
    mods[1][0].bias.grad = torch.ones(8)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in mods]
    grads = [p.grad for m in mods for p in m.parameters()]
    asks = [p.requires_grad for m in mods for p in m.parameters()]
    rng = torch.get_rng_state()
    first = probe(g, x)
    assert probe(g, x) == first
    for m, b in zip(mods, before, strict=True):
        assert all(torch.equal(b[k], v) for k, v in m.state_dict().items())
        assert m.training
    assert [p.grad for m in mods for p in m.parameters()] == grads
    assert [p.requires_grad for m in mods for p in m.parameters()] == asks
    torch.save(mods, io.BytesIO())  # whole: a hook probe had left on them would not pickle
    assert mods[0].r.inplace
    assert torch.equal(rng, torch.get_rng_state())
    assert "forward" not in vars(mods[0])
    assert x.grad is None and not x.requires_grad


def test_saturation_is_seen_at_init():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Sigmoid())
    with torch.no_grad():
        net[0].weight.mul_(50)
    got = probe(net, torch.randn(8, 4))
    assert got["sequential.1"]["sat_frac_max"] > 0.5
    assert got["sequential.0"]["sat_frac_max"] == 0.0  # a linear layer does not saturate


def test_a_dead_layer_is_flagged_dead_and_the_layer_after_it_not_overflowing():
    from somatize.health import verdict

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        net[0].bias.fill_(-100.0)  # every unit of the ReLU dead at init
    got = probe(net, torch.randn(8, 4))
    assert [str(f) for f in verdict(got["sequential.1"])] == ["DEAD"]
    # the next layer is given zeros: no gain against them, and nothing overflowed
    assert "signal_gain" not in got["sequential.2"]
    assert not any(str(f) in ("INF", "NAN") for f in verdict(got["sequential.2"]))


def test_depth_and_most_choose_the_places():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
    x = torch.randn(5, 2, 8)
    assert set(probe(enc, x)) == {
        "transformerencoder",
        "transformerencoder.layers",  # the block: its last box's numbers
        "transformerencoder.layers.0",
        "transformerencoder.layers.1",
    }
    opened = probe(enc, x, depth=1)
    assert "transformerencoder.layers.0.linear1" in opened
    boxes = [k for k in opened if k.count(".") == 3]  # every layer's boxes, as they ran
    assert len(boxes) > 6
    # past most=3: the blocks as architecture closes them, and the first and last boxes
    blocks = ["transformerencoder.layers", *(f"transformerencoder.layers.{k}" for k in (0, 1))]
    assert set(probe(enc, x, depth=1, most=3)) == {
        "transformerencoder",
        *blocks,
        *boxes[:2],
        boxes[-1],
    }


def test_the_places_past_most_leave_the_others_as_they_were():
    torch.manual_seed(0)
    relu = nn.ReLU()  # one module called at two places
    net = nn.Sequential(nn.Linear(4, 8), relu, nn.Linear(8, 8), relu, nn.Linear(8, 3), nn.Tanh())
    x = torch.randn(6, 4)
    every = probe(net, x)
    # the net and its six boxes, as architecture draws them: the ReLU's second call is its own
    assert list(every)[2:5] == ["sequential.1", "sequential.2", "sequential.1#2"]
    assert len(every) == 7
    node, *boxes = every
    for most in (1, 2, 3, 4, 5):  # the first half and the last half, the first one more if odd
        some = probe(net, x, most=most)
        kept = boxes[: (most + 1) // 2] + boxes[len(boxes) - most // 2 :]
        assert list(some) == [node, *kept]
        assert all(some[where] == every[where] for where in some)


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_a_llama_past_most_boxes_is_probed_at_its_first_and_its_last_its_head_among_them():
    from models import more

    from somatize.torch import architecture

    case = more.llama()
    every = probe(case.model, case.example, most=400)
    node = next(iter(every))
    boxes = [k for k in every if not any(o.startswith(k + ".") for o in every)]  # no blocks
    assert len(boxes) > 48  # two layers of about 25 boxes, the norm and the head
    some = probe(case.model, case.example)  # most=48
    kept = [k for k in some if k in boxes]
    assert kept[:24] == boxes[:24] and kept[-24:] == boxes[-24:]
    assert kept[-2:] == ["llamaforcausallm.model.norm", "llamaforcausallm.lm_head"]
    assert "llamaforcausallm.model.embed_tokens" in some
    assert all(some[where] == every[where] for where in some)  # as if none were left out
    # and every box the figure draws at most=48 (a layer's attention closed, its MLP open),
    # folded ×2: the box or its copy
    drawn = architecture(case.model, case.example)[node].layers
    for la in (la for la in drawn if not la.made_of):
        assert any(f"{node}.{p}" in some for p in [la.path, *la.repeats]), la.path


class Masked(nn.Module):
    """Takes its input by keywords, as transformers' models do: a mask of another length
    than the batch is used as it is."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask[..., None]
        return self.out(h.sum(1) / attention_mask.sum(1, keepdim=True))


def test_a_dict_of_keywords_and_a_mask_are_measured_as_given():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = probe(Masked(), {"input_ids": ids, "attention_mask": mask})
    assert list(got) == ["masked", "masked.emb", "masked.mul", "masked.div", "masked.out"]
    emb = got["masked.emb"]
    assert "signal_gain" not in emb  # its input holds no floating tensor
    assert got["masked.out"]["jacobian_gain"] > 0 and "jacobian_spread" in got["masked.out"]


def test_a_sequence_first_rnn_is_not_tiled_along_time():
    torch.manual_seed(0)
    rnn = nn.GRU(3, 5)
    x = torch.randn(7, 2, 3)  # seven steps of two sequences
    got = probe(rnn, x)
    assert set(got) == {"gru"}
    with torch.no_grad():
        out, _ = rnn(x)
    zero = float((out.abs() <= 1e-7).double().mean())
    assert got["gru"]["zero_frac_max"] == zero
    assert got["gru"]["signal_gain"] > 0


def test_one_sample_says_the_spread_is_left_out():
    g = _graph()
    g.implementation("body").net[1].eval()  # batch norm on one sample: its running stats
    with pytest.warns(UserWarning, match="jacobian_spread") as told:
        got = probe(g, torch.randn(1, 4))
    assert [w.filename for w in told] == [__file__]  # said at the user's call
    assert "jacobian_gain" in got["double.l"] and "jacobian_spread" not in got["double.l"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe(g, torch.randn(3, 4))


def test_an_opaque_example_gives_the_same_answer():
    g = _graph()
    x = torch.randn(6, 4)
    assert probe(g, Opaque(x)) == probe(g, x)
    m = Masked()
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    given = {"input_ids": ids, "attention_mask": mask}
    wrapped = {"input_ids": Opaque(ids), "attention_mask": Opaque(mask)}
    assert probe(m, wrapped) == probe(m, given)


def test_watching_hears_ran_finished_and_flat_health_facts(tmp_path):
    g = _graph()
    heard = []
    got = probe(g, torch.randn(6, 4), watching=heard.append)
    kinds = [f["fact"] for f in heard]
    assert kinds[:3] == ["ran", "ran", "finished"]
    health = [f for f in heard if f["fact"] == "health"]
    assert kinds[3:] == ["health"] * len(health)
    assert [(f["node"], f["inside"]) for f in health][:3] == [
        ("double", None),
        ("double", "l"),
        ("double", "r"),
    ]
    for f in health:
        where = f["node"] + ("." + f["inside"] if f["inside"] else "")
        assert f["step"] == 0
        numbers = {k: v for k, v in f.items() if k not in ("fact", "node", "inside", "step")}
        # a block answered with its last box's numbers says which box instead (body.net: Tanh)
        assert numbers == got[where] or got[numbers["repeats"]] == got[where]
    assert [f.get("repeats") for f in health].count("body.net.3") == 1
    store = Store(tmp_path / "s")
    probe(g, torch.randn(6, 4), watching=Recorder(store, run="init"))
    ((_, record),) = list(records(store, "init"))
    assert [f["fact"] for f in record].count("health") == len(got)
    with pytest.raises(ValueError, match="probes"):
        probe(g, torch.randn(6, 4), probes=0)
    with pytest.raises(TypeError, match="watching"):
        probe(g, torch.randn(6, 4), watching=3)


def test_an_empty_example_is_refused_naming_its_shape():
    with pytest.raises(ValueError, match=r"empty tensor \(shape \(0, 4\)\)"):
        probe(Graph.somatize(Double()), torch.randn(0, 4))


class MarksItsInput(nn.Module):
    """As transformers' Wav2Vec2 feature encoder does in train mode: `requires_grad = True` on
    a view of its input, which torch refuses once the input asks for its gradient."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3)

    def forward(self, x):
        h = x[:, None]
        if self.training:
            h.requires_grad = True
        return self.conv(h)


def test_a_forward_that_refuses_a_differentiable_input_is_told_what_probe_did():
    net = MarksItsInput()
    x = torch.randn(2, 16)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="leaf") as caught:
        probe(net, x)
    notes = getattr(caught.value, "__notes__", [])
    assert any("asking for their gradient" in n and "model.eval()" in n for n in notes)
    after = list(net.parameters())
    assert net.training and all(torch.equal(a, p) for a, p in zip(before, after, strict=True))
    assert all(p.grad is None for p in net.parameters())
    assert not x.requires_grad
    net.eval()  # what the note says to do
    got = probe(net, x)
    assert set(got) == {"marksitsinput", "marksitsinput.conv"}
    assert got["marksitsinput.conv"]["jacobian_gain"] > 0


def test_a_node_is_given_no_gain_against_a_float_mask_its_output_is_not_computed_from():
    # the README's own model: the float attention_mask is the one floating tensor it is given
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    bert = BertModel(config)
    tokens = {"input_ids": torch.randint(0, 100, (2, 16)), "attention_mask": torch.ones(2, 16)}
    got = probe(bert, tokens)
    assert "signal_gain" not in got["bertmodel"] and "jacobian_gain" not in got["bertmodel"]
    dense = got["bertmodel.encoder.layer.0.intermediate.dense"]
    assert dense["signal_gain"] > 0 and dense["jacobian_gain"] > 0  # inside, gains as before


class Functional(nn.Module):
    """A layer called twice, functions between: y = cat(2·relu(2x), x), then y += 1."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(2 * torch.eye(4))

    def forward(self, x):
        y = torch.cat([self.lin(torch.relu(self.lin(x))), x], 1)
        y += 1  # in place: measured against y as the cat made it
        return y


def test_every_box_architecture_draws_is_probed_an_in_place_one_on_what_it_read():
    from somatize.torch import architecture

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    got = probe(Functional(), x)
    drawn = [f"functional.{la.path}" for la in architecture(Functional(), x)["functional"].layers]
    assert drawn == [
        "functional.lin",
        "functional.relu",
        "functional.lin#2",
        "functional.cat",
        "functional.add",
    ]
    assert list(got) == ["functional", *drawn]
    eps = torch.finfo(torch.float32).eps
    assert got["functional.lin#2"]["jacobian_gain"] == pytest.approx(2.0, rel=8 * eps)
    assert got["functional.lin#2"]["signal_gain"] == pytest.approx(2.0, rel=8 * eps)
    assert got["functional.relu"]["zero_frac_max"] == float((x <= 0).double().mean())
    x64 = x.double()
    cat = torch.cat([4 * x64.clamp(min=0), x64], 1)
    want = float(cat.pow(2).mean().sqrt() / (4 * x64.clamp(min=0)).pow(2).mean().sqrt())
    assert got["functional.cat"]["signal_gain"] == pytest.approx(want, rel=16 * eps)
    rms = cat.pow(2).mean().sqrt()
    add = got["functional.add"]  # y += 1: against y as it was read, the identity's gain
    assert add["signal_gain"] == pytest.approx(
        float((cat + 1).pow(2).mean().sqrt() / rms), rel=16 * eps
    )
    assert add["jacobian_gain"] == pytest.approx(1.0, rel=8 * eps)
    assert add["jacobian_spread"] == pytest.approx(0.0, abs=8 * eps)


class Scale(nn.Module):
    """x times a weight per feature, element by element (so 0·inf is NaN on every CPU)."""

    def __init__(self, *w: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))

    def forward(self, x):
        return x * self.w


def test_a_nan_and_an_inf_are_told_apart_where_they_arise():
    inf = float("inf")
    net = nn.Sequential(Scale(inf, 1.0, 1.0), nn.ReLU(), Scale(0.0, inf, 1.0), Scale(1.0, 0.0, 1.0))
    got = probe(net, torch.rand(4, 3) + 0.5)  # positive: the inf goes through the ReLU
    said = {where: (numbers["nan"], numbers["inf"]) for where, numbers in got.items()}
    assert said == {
        "sequential": (True, False),  # what the last layer gave
        "sequential.0": (False, True),
        "sequential.1": (False, True),
        "sequential.2": (True, True),  # 0·inf is NaN, inf·x stays inf beside it
        "sequential.3": (True, False),  # inf·0 is NaN too
    }


class Same(Node):
    """Hands its input on as it is."""

    def forward(self, x, ctx):
        return x


def test_a_node_that_hands_its_input_on_has_gains_of_one():
    got = probe(Graph.somatize(Double() >> Same()), torch.randn(6, 4))
    same = got["same"]
    assert (same["signal_gain"], same["jacobian_gain"], same["jacobian_spread"]) == (1, 1, 0)
    assert got["double.l"]["signal_gain"] > 1  # (the place before it measured as ever)


class _Dec(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin
        self.skip = nn.Identity()

    def forward(self, x):
        return torch.sigmoid(self.lin(x)) + self.skip(x)


class Shared(nn.Module):
    """One Linear held in two blocks and called in each, an Identity handing its input on,
    and functions inside a block and after it."""

    def __init__(self):
        super().__init__()
        lin = nn.Linear(4, 4)
        self.enc = nn.Sequential(lin, nn.Tanh())
        self.dec = _Dec(lin)

    def forward(self, x):
        return self.dec(self.enc(x)) * 2


def test_a_module_held_in_two_blocks_is_probed_at_each_box_architecture_draws():
    from somatize.torch import architecture

    torch.manual_seed(0)
    net, x = Shared(), torch.randn(6, 4)
    inside = architecture(net, x)["shared"]
    boxes = [f"shared.{la.path}" for la in inside.layers if not la.made_of]
    assert boxes == [
        "shared.enc.0",
        "shared.enc.1",
        "shared.dec.lin",
        "shared.dec.sigmoid",
        "shared.dec.add",
        "shared.mul",
    ]
    got = probe(net, x)
    assert [k for k in got if k not in ("shared.enc", "shared.dec")] == ["shared", *boxes]
    assert got["shared.enc"] == got["shared.enc.1"]  # a block: the last box that ran in it
    # dec.lin is the Linear's second call, on what enc gave (not its first, on x)
    lin = net.dec.lin
    w, b = lin.weight.detach().double(), lin.bias.detach().double()
    h = torch.tanh(x.double() @ w.T + b)
    rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
    eps = torch.finfo(torch.float32).eps
    assert got["shared.dec.lin"]["signal_gain"] == pytest.approx(
        rms(h @ w.T + b) / rms(h), rel=64 * eps
    )
    assert got["shared.enc.0"]["signal_gain"] == pytest.approx(
        rms(x.double() @ w.T + b) / rms(x.double()), rel=64 * eps
    )


class TorchvisionBlock(BasicBlock):
    """torchvision's ResNet BasicBlock as it is written: one ReLU(inplace=True) called twice,
    and the input added in place (`out += identity`), where the zoo's block adds out of place."""

    def __init__(self, c: int = 4):
        super().__init__(c)

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out += identity
        out = self.relu(out)
        return out


def test_a_torchvision_resnet_block_colours_every_box_by_hand_in_float64():
    from somatize import Graph
    from somatize.torch import architecture

    torch.manual_seed(0)
    block, x = TorchvisionBlock(), torch.randn(3, 4, 6, 6)
    got = probe(block, x)
    boxes = ["conv1", "bn1", "relu", "conv2", "bn2", "add", "relu#2"]
    inside = architecture(block, x)
    assert [la.path for la in inside["torchvisionblock"].layers] == boxes
    assert list(got) == ["torchvisionblock", *(f"torchvisionblock.{b}" for b in boxes)]
    gains = {where: numbers["signal_gain"] for where, numbers in got.items()}
    Graph.somatize(block).figure(inside=inside, colour=gains)  # every box has its colour
    # by hand, in float64, on the same weights (batch norm on the batch's statistics)
    ref = TorchvisionBlock()
    ref.load_state_dict(block.state_dict())
    ref.double()
    x64 = x.double()
    with torch.no_grad():
        c1 = ref.conv1(x64)
        b1 = ref.bn1(c1)
        r1 = torch.relu(b1)
        c2 = ref.conv2(r1)
        b2 = ref.bn2(c2)
        s = b2 + x64
        r2 = torch.relu(s)
    pairs = {
        "conv1": (x64, c1),
        "bn1": (c1, b1),
        "relu": (b1, r1),
        "conv2": (r1, c2),
        "bn2": (c2, b2),
        "add": (b2, s),  # against what it read, before it was written over
        "relu#2": (s, r2),  # against the sum, not what bn2 gave
    }
    rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
    eps = torch.finfo(torch.float32).eps
    for box, (before, after) in pairs.items():
        numbers = got[f"torchvisionblock.{box}"]
        # float32 through at most five layers of 36-term sums, each normalised by batch norm
        assert numbers["signal_gain"] == pytest.approx(rms(after) / rms(before), rel=64 * eps)
    add, relu = got["torchvisionblock.add"], got["torchvisionblock.relu#2"]
    assert add["jacobian_gain"] == pytest.approx(1.0, rel=8 * eps)  # d(b2 + x)/d(b2) = I
    assert 0 < relu["jacobian_gain"] < 1  # a ReLU's Jacobian keeps part of the cotangent
    zeros = float((s <= 0).double().mean())
    assert relu["zero_frac_max"] == pytest.approx(zeros, abs=2 / s.numel())  # a tie may flip


class Twice(nn.Module):
    """Doubles what it is handed, in place, and hands it back."""

    def forward(self, x):
        return x.mul_(2)


class Rewrites(nn.Module):
    """A Linear, a module doubling its input in place, a dropout (in eval, it hands its
    input back as it is)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.twice = Twice()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.twice(self.lin(x).clone()))  # (the clone is no box)


def test_a_module_writing_over_its_input_or_handing_it_back_is_measured_on_what_it_read():
    torch.manual_seed(0)
    net = Rewrites().eval()
    got = probe(net, torch.randn(6, 4))
    assert list(got) == ["rewrites", "rewrites.lin", "rewrites.twice", "rewrites.drop"]
    eps = torch.finfo(torch.float32).eps
    for box, gain in (("twice", 2.0), ("drop", 1.0)):
        numbers = got[f"rewrites.{box}"]
        assert numbers["signal_gain"] == pytest.approx(gain, rel=8 * eps)
        assert numbers["jacobian_gain"] == pytest.approx(gain, rel=8 * eps)
        assert numbers["jacobian_spread"] == pytest.approx(0.0, abs=8 * eps)


def test_watching_hears_a_block_answered_with_its_last_box_say_it_repeats_the_box():
    from somatize.health import Verdicts

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with torch.no_grad():
        block[0].bias.fill_(-100.0)  # every unit below zero: the ReLU gives zeros
    g = Graph.somatize(Node.of(nn.Sequential(block, nn.Linear(8, 3))).named("net"))
    facts: list[dict] = []
    got = probe(g, torch.randn(6, 4), watching=facts.append)
    assert got["net.0"] == got["net.0.1"]  # the block answered with its last box's numbers
    health = {(f["node"], f["inside"]): f for f in facts if f["fact"] == "health"}
    assert len(health) == len(got)
    assert health[("net", "0")] == {
        "fact": "health",
        "node": "net",
        "inside": "0",
        "step": 0,
        "repeats": "net.0.1",
    }
    assert health[("net", "0.1")]["zero_frac_max"] == got["net.0.1"]["zero_frac_max"] == 1.0
    flagged = Verdicts(last=None).feed(facts).flags()
    assert [w for w, flags in flagged.items() if "DEAD" in flags] == ["net.0.1"], flagged
    # a block drawn closed (its box not answered) has the numbers
    closed: list[dict] = []
    got = probe(g, torch.randn(6, 4), most=2, watching=closed.append)
    assert "net.0" in got and "net.0.1" not in got
    (fact,) = [f for f in closed if f["fact"] == "health" and f["inside"] == "0"]
    assert "repeats" not in fact and fact["zero_frac_max"] == got["net.0"]["zero_frac_max"]


class Checkpointed(Node, nn.Module):
    """x + body(x), the body run under torch.utils.checkpoint (`reentrant` its variant), or
    plainly where `reentrant` is None."""

    def __init__(self, reentrant):
        nn.Module.__init__(self)
        self.reentrant = reentrant
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6)).double()

    def forward(self, x, ctx):
        if self.reentrant is None:
            return x + self.body(x)
        return x + checkpoint(self.body, x, use_reentrant=self.reentrant)


def _same_numbers(got, plain, dtype, size):
    """Each place's numbers equal, floats to `dtype`'s rounding over `size` values."""
    assert got.keys() == plain.keys()
    rel = 16 * torch.finfo(dtype).eps * size**0.5
    for where, numbers in plain.items():
        assert got[where] == pytest.approx(numbers, rel=rel, abs=rel), where


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_node_that_checkpoints_its_block_is_probed_as_without_checkpointing(reentrant):
    def graph(reentrant):
        torch.manual_seed(0)
        head = Node.of(nn.Linear(6, 2, dtype=torch.float64)).named("head")
        return Graph.somatize(Checkpointed(reentrant).named("block") >> head)

    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain = probe(graph(None), x)
    assert plain["block.body.0"]["jacobian_gain"] > 0
    g = graph(reentrant)
    if not reentrant:  # the recomputation in the backward saves what the forward saved
        _same_numbers(probe(g, x), plain, torch.float64, x.numel())
        return
    # torch.autograd.grad cannot pass a reentrant checkpoint: probe says where, and what to do
    before = [p.detach().clone() for p in g.implementation("block").parameters()]
    with pytest.raises(RuntimeError, match=r"node 'block' .*use_reentrant=False.* off"):
        probe(g, x)
    after = list(g.implementation("block").parameters())
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(after, before, strict=True))


def test_a_transformers_model_checkpointing_every_layer_in_train_mode_is_probed_as_without():
    case = gpt2()
    model = case.model.train()  # transformers checkpoints only in train mode (dropout on)
    plain = probe(model, case.example)
    size = case.example["input_ids"].numel() * model.config.vocab_size  # the logits
    for reentrant in (False, True):  # (both said in so many words)
        with warnings.catch_warnings():  # (newer releases call it activation_checkpointing_…)
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        if not reentrant:
            _same_numbers(probe(model, case.example), plain, torch.float32, size)
    with pytest.raises(RuntimeError, match=r"node 'gpt2lmheadmodel' .*use_reentrant=False"):
        probe(model, case.example)
