"""proxies: each checked against its formula computed by hand on a network of a few weights;
deterministic; and the network left exactly as it was."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from somatize import Graph, Node
from somatize.torch import ProxyLeftOut
from somatize.torch.inside.proxies import EVERY, proxies, proxy


def _scalar_net(w1=0.7, w2=-1.3):
    """y = w2 · relu(w1 · x): two weights."""
    net = nn.Sequential(nn.Linear(1, 1, bias=False), nn.ReLU(), nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        net[0].weight.fill_(w1)
        net[2].weight.fill_(w2)
    return net


X = torch.tensor([[0.5], [1.0], [2.0]])
T = torch.tensor([[1.0], [0.0], [-1.0]])


def mse(out, target):
    return ((out - target) ** 2).mean()


def _hand(w1=0.7, w2=-1.3):
    """Loss, gradient and Hessian of L = mean((w1 w2 x − t)²) for x > 0, by hand."""
    x, t = X.double().flatten().numpy(), T.double().flatten().numpy()
    y = w1 * w2 * x
    r = y - t
    g = np.array([np.mean(2 * r * w2 * x), np.mean(2 * r * w1 * x)])
    h12 = np.mean(2 * x * (2 * w1 * w2 * x - t))
    h = np.array([[np.mean(2 * w2**2 * x**2), h12], [h12, np.mean(2 * w1**2 * x**2)]])
    return x, t, y, r, g, h


def test_synflow_by_hand():
    net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[0.5, -1.0], [2.0, 0.25]]))
        net[2].weight.copy_(torch.tensor([[-3.0, 0.5]]))
    a1 = np.abs(net[0].weight.detach().double().numpy())
    a2 = np.abs(net[2].weight.detach().double().numpy())
    batch = 3
    r = batch * (a2 @ a1 @ np.ones(2)).item()  # R = Σ output on ones, all-positive path
    # Σ θ ∂R/∂θ for a network homogeneous of degree 2 in its weights is 2R (Euler)
    assert proxy(net, torch.randn(batch, 2), "synflow") == pytest.approx(math.log(2 * r))


class _Float32(nn.Module):
    """Casts to float32, as a timestep embedding written with `.float()` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


class _NaN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.nan


def test_synflow_is_taken_in_float32_where_the_net_will_not_run_in_float64():
    net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[0.5, -1.0], [2.0, 0.25]]))
        net[2].weight.copy_(torch.tensor([[-3.0, 0.5]]))
    cast = nn.Sequential(net[0], _Float32(), net[1], net[2])  # float64 meets float32 and fails
    x = torch.randn(3, 2)
    eps = torch.finfo(torch.float32).eps
    assert proxy(cast, x, "synflow") == pytest.approx(proxy(net, x, "synflow"), rel=16 * eps)
    assert net[0].weight.dtype == torch.float32 and net[0].weight[0, 1] == -1.0
    broken = nn.Sequential(nn.Linear(2, 2), _NaN())
    told = r"synflow runs the net on an input of ones.* node 'sequential' gave nan"
    with pytest.warns(UserWarning, match=told):
        got = proxies(broken, x)
    assert "synflow" not in got


def test_synflow_turns_batch_norm_off():
    net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.BatchNorm1d(2), nn.Linear(2, 1, bias=False))
    bare = nn.Sequential(net[0], nn.Identity(), net[2])
    x = torch.randn(4, 2)
    assert proxy(net, x, "synflow") == pytest.approx(proxy(bare, x, "synflow"))


def test_snip_grasp_grad_norm_by_hand():
    net = _scalar_net()
    w = np.array([0.7, -1.3])
    _, _, _, _, g, h = _hand()
    kw = dict(target=T, objective=mse)
    assert proxy(net, X, "snip", **kw) == pytest.approx(math.log(np.abs(w * g).sum()), rel=1e-5)
    assert proxy(net, X, "grad_norm", **kw) == pytest.approx(math.log(np.linalg.norm(g)), rel=1e-5)
    assert proxy(net, X, "grasp", **kw) == pytest.approx(-(w @ (h @ g)), rel=1e-4)


class _Attention(nn.Module):
    """One head of self-attention, through torch's fused kernel or written out."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (batch, 1 head, seq, 4)
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v)
        return torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v


def test_grasp_is_taken_through_fused_attention_as_through_attention_written_out():
    torch.manual_seed(0)
    fused, plain = _Attention(fused=True), _Attention(fused=False)
    plain.load_state_dict(fused.state_dict())
    x, y = torch.randn(2, 5, 4), torch.randn(2, 1, 5, 4)
    kw = dict(target=y, objective=mse)
    got = proxy(fused, x, "grasp", **kw)  # raises where it cannot be taken
    eps = torch.finfo(torch.float32).eps  # two orders of summation of one float32 formula
    assert got == pytest.approx(proxy(plain, x, "grasp", **kw), rel=64 * eps)


def test_fisher_by_hand():
    net = _scalar_net()
    x, t, y, r, g, h = _hand()
    n = len(x)
    a1, a2 = 0.7 * x, y  # outputs of the two learned layers
    g2 = 2 * r / n  # ∂L/∂a2
    g1 = g2 * -1.3  # ∂L/∂a1 through relu (a1 > 0) and w2
    fisher = 0.5 * np.mean((a1 * g1) ** 2) + 0.5 * np.mean((a2 * g2) ** 2)
    got = proxy(net, X, "fisher", target=T, objective=mse)
    assert got == pytest.approx(math.log(fisher), rel=1e-5)


def test_naswot_by_hand():
    w1 = torch.tensor([[1.0, -1.0], [0.5, 2.0], [-1.0, -0.5]])
    net = nn.Sequential(nn.Linear(2, 3, bias=False), nn.ReLU(), nn.Linear(3, 1, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(w1)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 1.0], [1.0, 1.0]])
    c = ((x @ w1.T) > 0).double().numpy()
    k = c @ c.T + (1 - c) @ (1 - c).T
    assert proxy(net, x, "naswot") == pytest.approx(np.linalg.slogdet(k)[1])


def test_jacob_cov_by_hand():
    w1 = np.array([[1.0, -1.0], [0.5, 2.0], [-1.0, -0.5]])
    w2 = np.array([0.3, -0.7, 1.1])
    net = nn.Sequential(nn.Linear(2, 3, bias=False), nn.ReLU(), nn.Linear(3, 1, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor(w1))
        net[2].weight.copy_(torch.tensor(w2).reshape(1, 3))
    x = np.array([[1.0, 0.2], [0.1, 1.0], [-1.0, 1.0], [1.0, 1.5]])
    # d(Σ y)/dx_b = W1ᵀ diag(relu'(W1 x_b)) w2
    j = np.stack([w1.T @ ((w1 @ xb > 0) * w2) for xb in x])
    v = np.linalg.eigvalsh(np.corrcoef(j))
    want = -np.sum(np.log(v + 1e-5) + 1 / (v + 1e-5))
    got = proxy(net, torch.tensor(x, dtype=torch.float32), "jacob_cov")
    assert got == pytest.approx(want, rel=1e-3)


def test_zen_by_hand():
    w = torch.tensor([[1.0, -2.0], [0.5, 0.5]])
    net = nn.Sequential(nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(w)
    example = torch.zeros(5, 2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, generator=gen)
    eps = torch.randn(5, 2, generator=gen)
    # linear: f(x) − f(x + αε) = −α W ε
    want = math.log(float((0.01 * (eps @ w.T)).abs().sum(1).mean()))
    assert proxy(net, example, "zen") == pytest.approx(want, rel=1e-4)
    bn = nn.Sequential(net[0], nn.BatchNorm1d(2))
    h = x @ w.T
    var = float(h.var(0, unbiased=False).mean())
    hb = F.batch_norm(h, None, None, training=True)
    hm = F.batch_norm((x + 0.01 * eps) @ w.T, None, None, training=True)
    want = math.log(float((hb - hm).abs().sum(1).mean())) + 0.5 * math.log(var)
    assert proxy(bn, example, "zen") == pytest.approx(want, rel=1e-3)


# -- the contract ------------------------------------------------------------------------


class Net(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(inplace=True),
            nn.Dropout(0.3),
            nn.Flatten(),
        )

    def forward(self, x, ctx):
        return self.body(x)


class Head(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x, ctx):
        return self.fc(x)


def _graph():
    torch.manual_seed(0)
    return Graph.somatize(Net() >> Head())


def _state(g):
    mods = [g.implementation(n) for n in g.nodes()]
    return (
        [(k, v.clone(), v.dtype) for m in mods for k, v in m.state_dict(keep_vars=True).items()],
        [[(s.training, getattr(s, "inplace", None)) for s in m.modules()] for m in mods],
        [p.grad for m in mods for p in m.parameters()],
        [(p.data_ptr(), p.requires_grad) for m in mods for p in m.parameters()],
        torch.get_rng_state(),
    )


def _same(a, b):
    assert len(a[0]) == len(b[0])
    for (k1, v1, d1), (k2, v2, d2) in zip(a[0], b[0], strict=True):
        assert k1 == k2 and d1 == d2 and torch.equal(v1, v2), k1
    assert a[1] == b[1]
    assert all(x is y for x, y in zip(a[2], b[2], strict=True))
    assert a[3] == b[3]
    assert torch.equal(a[4], b[4])


def test_every_proxy_leaves_the_net_as_it_was_and_answers_the_same_twice():
    g = _graph()
    g.implementation("head").fc.weight.grad = torch.ones(3, 144)
    g.implementation("net").body[0].weight.requires_grad_(False)
    x = torch.randn(8, 1, 6, 6)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    before = _state(g)
    first = proxies(g, x, target=y, objective=F.cross_entropy)
    _same(before, _state(g))
    assert list(first) == list(EVERY)
    assert all(isinstance(v, float) and math.isfinite(v) for v in first.values())
    assert proxies(g, x, target=y, objective=F.cross_entropy) == first
    g.implementation("net").eval()
    before = _state(g)
    proxies(g, x, target=y, objective=F.cross_entropy)
    _same(before, _state(g))


def test_loss_proxies_are_absent_without_a_loss_and_refused_alone():
    g = _graph()
    x = torch.randn(4, 1, 6, 6)
    got = proxies(g, x)
    assert set(got) == {"synflow", "zen", "naswot", "jacob_cov"}
    for name in ("snip", "grasp", "grad_norm", "fisher"):
        with pytest.raises(ValueError, match=f"{name} reads a loss"):
            proxy(g, x, name)
    with pytest.raises(ValueError, match="unknown proxy 'synflo'.*synflow"):
        proxy(g, x, "synflo")


def test_a_graph_and_its_module_score_the_same():
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))

    class Whole(Node):
        def __init__(self):
            self.net = net

        def forward(self, x, ctx):
            return self.net(x)

    x = torch.randn(6, 3)
    assert proxies(Graph.somatize(Whole()), x) == proxies(net, x)


def test_a_proxy_the_graph_cannot_give_is_absent_and_a_warning_says_why():
    net = nn.Sequential(nn.Linear(3, 2))
    with pytest.warns(UserWarning) as said:
        got = proxies(net, torch.randn(1, 3))
    assert "naswot" not in got and "jacob_cov" not in got and "synflow" in got
    text = [str(w.message) for w in said]
    assert any("naswot" in t and "activation" in t for t in text)
    assert any("jacob_cov" in t and "fewer than two" in t for t in text)
    with pytest.raises(ValueError, match="activation") as refused:
        proxy(net, torch.randn(4, 3), "naswot")
    # the proxy is named under the error, on every Python the project runs on (3.10 has no
    # add_note: the same __notes__ list, printed under the traceback by later versions)
    assert "while taking the proxy 'naswot'" in refused.value.__notes__


class _Tagger(nn.Module):
    """An LSTM fed a PackedSequence, as sequence models with padded batches are."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, packed):
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True)
        return self.out(h[:, 0])


def test_a_packed_sequence_is_perturbed_as_itself():

    torch.manual_seed(0)
    packed = nn.utils.rnn.pack_padded_sequence(
        torch.randn(3, 5, 4), torch.tensor([5, 3, 2]), batch_first=True
    )
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        got = proxies(_Tagger(), packed)
    # each perturbed input is a PackedSequence again, so the proxies that perturb it are taken
    assert {"synflow", "zen", "jacob_cov"} <= set(got)
    assert all(math.isfinite(v) for v in got.values())
    assert [str(w.message).split(" could")[0] for w in heard] == ["proxies: naswot"]


def test_zen_is_left_out_where_the_output_does_not_move_with_a_float_mask():
    # the README's own model: a float attention_mask is the example's one floating tensor
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    )
    tokens = {"input_ids": torch.randint(0, 100, (2, 16)), "attention_mask": torch.ones(2, 16)}
    with pytest.warns(UserWarning) as said:
        got = proxies(bert, tokens)
    for of in ("zen", "jacob_cov"):  # each left out, saying why
        assert any(
            f"{of} could not be taken" in str(w.message) and "(attention_mask)" in str(w.message)
            for w in said
        )
    left = {w.message.proxy: w.message.why for w in said if w.category is ProxyLeftOut}
    assert {"zen", "jacob_cov"} <= set(left) and "attention_mask" in left["zen"]
    with warnings.catch_warnings():  # what was left out can be silenced alone
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", ProxyLeftOut)
        assert proxies(bert, tokens) == pytest.approx(got, rel=1e-5)
    assert "zen" not in got and {"synflow", "naswot"} <= set(got)
    assert all(math.isfinite(v) for v in got.values())
    with pytest.raises(ValueError, match="output did not move"):
        proxy(bert, tokens, "zen")


def test_a_net_of_dead_units_scores_worst_on_zen_and_jacob_cov_rather_than_being_left_out():
    # every ReLU of the first layer dead: the output is computed from the input and does not
    # move with it. That is the worst score there is, not a score that cannot be taken
    def net(bias):
        torch.manual_seed(0)
        m = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
        with torch.no_grad():
            m[0].bias.fill_(bias)
        return m

    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    healthy, dead = proxies(net(0.0), x), proxies(net(-100.0), x)
    assert {"zen", "jacob_cov"} <= set(dead)
    assert dead["zen"] == -math.inf < healthy["zen"]
    assert math.isfinite(dead["jacob_cov"]) and dead["jacob_cov"] < healthy["jacob_cov"]


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    features: torch.Tensor


class _Fields(nn.Module):
    """Gives back a dataclass, as many hand-written models do."""

    def __init__(self, dataclass=True):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)
        self.dataclass = dataclass

    def forward(self, x):
        f = self.body(x)
        return _Out(self.head(f), f) if self.dataclass else {"logits": self.head(f), "features": f}


def test_a_dataclass_output_is_scored_and_probed_as_the_same_dict_is():
    from somatize.torch import probe

    torch.manual_seed(0)
    net, x = _Fields(), torch.randn(5, 4)
    as_dict = _Fields(dataclass=False)
    as_dict.load_state_dict(net.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out
        got = proxies(net, x)
    assert got == proxies(as_dict, x) and set(got) == {"synflow", "zen", "naswot", "jacob_cov"}
    gains = probe(net, x)["_fields"]
    assert gains["jacobian_gain"] == probe(as_dict, x)["_fields"]["jacobian_gain"] > 0


class _Standardise(nn.Module):
    def forward(self, x):
        return (x - x.mean()) / x.std()


def test_synflow_says_which_node_gave_a_nan_on_its_input_of_ones():
    g = Graph.somatize(Node.of(_Standardise()).named("norm") >> Node.of(nn.Linear(4, 2)))
    with pytest.warns(UserWarning) as said:
        got = proxies(g, torch.randn(3, 4))
    assert "synflow" not in got and "zen" in got
    text = " ".join(str(w.message) for w in said if "synflow" in str(w.message))
    assert "input of ones" in text and "node 'norm' gave nan" in text and "_NotHere" not in text


class _Routed(nn.Module):
    """Each sample goes to one of two experts: an expert sees only some of the rows."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))

    def forward(self, x):
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            rows = torch.where((x[:, 0] > 0) == bool(j))[0]
            out = out.index_add(0, rows, ex(x[rows]))
        return out


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def test_naswot_says_why_it_cannot_be_taken_and_what_to_do():
    x = torch.tensor([[1.0, 0, 0, 0], [-1, 0, 0, 0], [2, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"3 rows and '_routed.experts.0.1' saw 1 .* lined up"):
        proxy(_Routed(), x, "naswot")
    with pytest.raises(ValueError, match=r"activation called as a function \(F.relu"):
        proxy(_Functional(), x, "naswot")
