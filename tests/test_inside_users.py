"""inside, as a researcher comparing candidates before training uses it: every look leaves a
model that changes itself in its forward as it was, and a model that cannot be read is
named (its node, its candidate)."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import zoo
from torch import nn

from somatize import Graph, Node
from somatize.figures import compare
from somatize.torch import ProxyLeftOut, architecture, probe, proxies, proxy, traced


class Counting(nn.Module):
    """A forward that counts its calls and keeps a running mean of its output in buffers,
    updated in place, and scales its output by the count: what it gives depends on them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
        y = self.lin(x) * self.calls
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * y.mean(0))
        return y + torch.rand(()) * 0  # draws from the global generator, as a noise would


def _behaviour(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a copy of `model` gives on `x`, its parameters' gradients, and the buffers after:
    a copy, so that asking changes nothing."""
    twin = copy.deepcopy(model)
    out = twin(x)
    out.square().sum().backward()
    return (out.detach(), *(p.grad for p in twin.parameters()), *twin.buffers())


@pytest.mark.parametrize(
    "look",
    [
        lambda m, x: architecture(m, x),
        lambda m, x: architecture(m),
        lambda m, x: traced(m),
        lambda m, x: Graph.somatize(m).figure(inside=architecture(m, x)),
        lambda m, x: probe(m, x),
        lambda m, x: proxies(m, x, target=torch.tensor([0, 1, 2, 0, 1]), objective=F.cross_entropy),
    ],
    ids=["architecture", "architecture-without-example", "traced", "figure", "probe", "proxies"],
)
def test_a_forward_updating_its_buffers_is_left_as_it_was_by_every_look(look):
    torch.manual_seed(0)
    model, x = Counting(), torch.randn(5, 4)
    before = _behaviour(model, x)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProxyLeftOut)
        look(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    after = _behaviour(model, x)
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)


class Wrong(nn.Module):
    """A layer that expects 5 features where it is given 4."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_proxy_left_out_because_the_net_does_not_run_names_the_node():
    g = Graph.somatize(Node.of(nn.Linear(4, 4)).named("first") >> Node.of(Wrong()).named("second"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert proxies(g, torch.randn(5, 4)) == {}
    left = [w.message for w in said if isinstance(w.message, ProxyLeftOut)]
    assert {w.proxy for w in left} >= {"synflow", "zen", "jacob_cov"}
    for w in left:
        if w.proxy != "naswot":  # (no activation module: said so before anything runs)
            assert "shapes cannot be multiplied" in w.why
            assert "'second'" in w.why, w.why


def test_compare_names_the_candidate_that_cannot_run():
    # two bare modules are both node 'sequential': only the candidate's name tells them apart
    good = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    broken = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="candidate 'broken'") as raised:
            compare({"good": good, "broken": broken}, torch.randn(5, 4))
    assert "shapes cannot be multiplied" in str(raised.value)
    assert any("'sequential'" in n for n in raised.value.__notes__)


def test_probe_takes_an_example_made_under_inference_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    with torch.inference_mode():  # as a data pipeline run without autograd gives it
        frozen = x.clone()
    assert probe(model, frozen) == probe(model, x)


def test_probe_of_a_node_that_does_not_run_names_it_and_gives_no_unrelated_advice():
    g = Graph.somatize(Node.of(nn.Linear(4, 4)).named("first") >> Node.of(Wrong()).named("second"))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as raised:
        probe(g, torch.randn(5, 4))
    notes = raised.value.__notes__
    assert any("'second'" in n for n in notes)
    assert not any("model.eval()" in n for n in notes), notes  # not what is wrong here


def test_naswot_is_not_taken_on_a_mixture_of_experts_whose_activation_sees_token_rows():
    # transformers' Mixtral runs its experts grouped: one activation call on every (token,
    # expert) pair, 2 samples x 8 tokens x top-2 rows, the same count in every layer. Scored
    # so, naswot's kernel is over those rows, not the samples, and no candidate compares.
    moe, gpt2 = zoo.mixtral(), zoo.gpt2()
    with pytest.raises(ValueError, match=r"2 rows .*experts\.act_fn' saw 32"):
        proxy(moe.model, moe.example, "naswot")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = compare({"moe": moe.model, "gpt2": gpt2.model}, gpt2.example)
    assert math.isnan(df.loc["moe", "proxy:naswot"]) and math.isfinite(
        df.loc["gpt2", "proxy:naswot"]
    )
    assert "experts" in df.attrs["left_out"]["moe"]["proxy:naswot"]


def test_a_loss_proxy_says_when_the_objective_is_what_failed():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="batch_size") as raised:  # a target of 2 rows, not 5
        proxy(model, x, "snip", target=torch.tensor([0, 1]), objective=F.cross_entropy)
    assert any("objective(output, target)" in n for n in raised.value.__notes__)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = proxies(model, x, target=torch.tensor([0, 1]), objective=F.cross_entropy)
    assert "synflow" in got and "snip" not in got
    why = {w.message.proxy: w.message.why for w in said if isinstance(w.message, ProxyLeftOut)}
    assert set(why) == {"snip", "grasp", "grad_norm", "fisher"}
    assert all("objective(output, target)" in w for w in why.values()), why
    with pytest.raises(ValueError, match=r"gave a tuple, not a scalar tensor") as raised:
        proxy(model, x, "snip", target=torch.zeros(5), objective=lambda out, t: (out, t))
    assert "tensor(" not in str(raised.value)  # what it gave is named, not printed
    per_sample = lambda out, t: F.cross_entropy(out, t, reduction="none")  # noqa: E731
    with pytest.raises(ValueError, match=r"gave a \(5,\) tensor, not a scalar tensor"):
        proxy(model, x, "snip", target=torch.tensor([0, 1, 2, 0, 1]), objective=per_sample)


class Attending(nn.Module):
    """Self-attention over padded sequences; a sequence that is all padding (every key
    masked) comes out NaN, as torch's attention gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.out(self.act(self.att(h, h, h, key_padding_mask=pad)[0]).mean(1))


def test_a_proxy_the_nets_nan_makes_nan_is_left_out_saying_so_not_scored():
    torch.manual_seed(0)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0] = True  # the first sequence is all padding
    example, target = (torch.randn(3, 5, 8), pad), torch.tensor([0, 1, 2])
    assert probe(Attending(), example)["attending"]["nan"]  # what probe says of it
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = proxies(Attending(), example, target=target, objective=F.cross_entropy)
    assert all(math.isfinite(v) for k, v in got.items() if k != "naswot"), got
    assert "naswot" in got  # (its codes read "> 0": a NaN is a unit off, a score all the same)
    why = {w.message.proxy: w.message.why for w in said if isinstance(w.message, ProxyLeftOut)}
    assert {"zen", "snip", "grad_norm"} <= set(why)  # not -inf, the worst score, nor nan
    assert all("nan" in w for w in why.values()), why


class _Sampled(Node):
    """A VAE's sampling step as research code writes it: a plain `Node`, no module, drawing
    its noise from the global generator, and counting its calls (state a second run of its
    Python would move)."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        mu, logvar = x
        return mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)


class _Posterior(Node, nn.Module):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(6, 4)

    def forward(self, x, ctx):
        return self.lin(x).chunk(2, dim=1)


def test_a_vaes_sampling_node_that_is_no_module_is_drawn_as_what_it_computes():
    """The sampling node holds no module; read in the graph's one run, it shows what it
    computes: the noise it draws (fed by nothing: the data gives it a shape, no values), the
    exp of half the log-variance, their product and the sum with the mean, each 4 batch · 2
    dim. Its forward runs once, and the global generator is left where it was: the next draw
    is the one it would have been without the look."""
    torch.manual_seed(0)
    sample = _Sampled()
    g = Graph.somatize(_Posterior().named("posterior") >> sample.named("sample"))
    x = torch.randn(4, 6)
    state = torch.get_rng_state()
    inside = architecture(g, x)
    assert sample.calls == 1
    assert torch.equal(torch.get_rng_state(), state)
    drawn = inside["sample"]
    assert [la.path for la in drawn.layers] == ["mul", "exp", "randn_like", "mul_1", "add"]
    assert set(drawn.edges) == {
        ("mul", "exp"),
        ("exp", "mul_1"),
        ("randn_like", "mul_1"),
        ("mul_1", "add"),
    }
    assert drawn.inputs == ["mul", "add"] and drawn.outputs == ["add"]
    assert inside["posterior"].read_by == {"sample": ["lin"]}
    svg = g.figure(inside=inside).svg()
    for box in ("randn_like", "exp", "mul_1", "add"):
        group = re.search(rf'data-id="l:sample:{box}".*?</g>', svg, re.S)
        assert group and ">4 batch · 2 dim<" in group.group(0), box
    assert "sample" not in architecture(g)  # no example: nothing reads it (fx would run it)
    assert sample.calls == 1



@pytest.mark.parametrize("name", ["vit", "bert"])
def test_a_model_built_on_meta_is_drawn_from_a_real_example_as_the_real_one_is(name):
    """A model too big to hold is built under torch.device("meta") and looked at before any
    weight is loaded: drawn from the example a user has (on the CPU: ViT's image, BERT's
    input_ids), it is what the same model with values gives. A forward that reads a value of
    the example (BERT making its mask from attention_mask) cannot run on meta, and the error
    says what to give instead."""
    case = getattr(zoo, name)()
    with torch.device("meta"):
        ghost = type(case.model)(case.model.config)
    x = {"input_ids": case.example["input_ids"]} if name == "bert" else case.example
    want = architecture(Graph.somatize(case.model), x)
    got = architecture(Graph.somatize(ghost), x)
    assert [i.to_json() for i in got.values()] == [i.to_json() for i in want.values()]
    assert all(q.is_meta for q in ghost.parameters())  # drawn without ever holding values
    if name == "bert":
        with pytest.raises(RuntimeError) as info:
            architecture(Graph.somatize(ghost), case.example)
        assert any("input_ids without an attention_mask" in n for n in info.value.__notes__)


def test_a_net_partly_on_meta_is_refused_naming_what_has_no_values():
    with torch.device("meta"):
        late = nn.Linear(8, 2)
    g = Graph.somatize(Node.of(nn.Sequential(nn.Linear(3, 8), late)).named("half"))
    with pytest.raises(RuntimeError) as info:
        architecture(g, torch.randn(2, 3))
    said = " ".join(info.value.__notes__)
    assert "'half' 1.weight, 1.bias" in said and "to_empty" in said and "Tensor.item" not in said
