"""inside: kind_of by role, traced (fx, else a hooked forward), architecture on what really
reaches each node, ×N folding, depth, most."""

from __future__ import annotations

import gc
import io
import json
import operator
import weakref

import pytest
import torch
from _nodes import Tied, loops
from torch import nn

from somatize import Graph, Node, Opaque
from somatize.torch.inside.architecture import Inside, architecture, kind_of, traced


class MyRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale / x.pow(2).mean(-1, keepdim=True).sqrt()


class Scaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1)
        self.b1 = nn.BatchNorm2d(c)
        self.r = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(c, c, 3, padding=1)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.b2(self.c2(self.r(self.b1(self.c1(x))))) + x)


class CNN(nn.Module):
    def __init__(self, c=4, n=3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(n)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


@pytest.mark.parametrize(
    "what, kind",
    [
        (nn.Conv2d(1, 1, 1), "conv"),
        (nn.ConvTranspose1d(1, 1, 1), "conv"),
        (nn.Linear(1, 1), "learned"),
        (nn.Embedding(3, 2), "learned"),
        (Scaler(), "learned"),
        (nn.LSTM(2, 2), "recurrent"),
        (nn.GRUCell(2, 2), "recurrent"),
        (nn.MultiheadAttention(4, 2), "attention"),
        (nn.BatchNorm2d(2), "norm"),
        (nn.LayerNorm(2), "norm"),
        (MyRMSNorm(2), "norm"),
        (nn.ReLU(), "activation"),
        (nn.GELU(), "activation"),
        (nn.Softmax(-1), "activation"),
        (nn.Dropout(), "regular"),
        (nn.MaxPool2d(2), "shaping"),
        (nn.ZeroPad2d(1), "shaping"),
        (nn.Flatten(), "shaping"),
        (nn.Upsample(scale_factor=2), "shaping"),
        (nn.Sequential(), "block"),
        (Block(2), "block"),
        (nn.TransformerEncoderLayer(4, 2), "attention"),
        (nn.TransformerDecoderLayer(4, 2), "attention"),
        (nn.Module(), "other"),
        (torch.relu, "activation"),
        (torch.flatten, "shaping"),
        (operator.add, "other"),
        (nn.BatchNorm1d, "norm"),
    ],
)
def test_kind_of_by_role(what, kind):
    assert kind_of(what) == kind


def test_kind_of_a_subclass_with_a_new_name_keeps_its_role():
    class Rectifier(nn.ReLU):
        pass

    class FancyGroupNorm(nn.Module):
        pass

    assert kind_of(Rectifier()) == "activation"
    assert kind_of(FancyGroupNorm()) == "norm"


def test_traced_residual_cnn_symbolically_folded_with_shapes():
    inside = traced(CNN(), torch.randn(2, 3, 8, 8))
    assert isinstance(inside, Inside) and inside.how == "symbolic" and inside.why is None
    block = inside.layer("blocks.0")
    assert block.kind == "block" and block.times == 3
    assert block.repeats == ["blocks.1", "blocks.2"]
    conv = inside.layer("blocks.0.c1")
    assert conv.kind == "conv" and conv.shape == [2, 4, 8, 8] and conv.block == "blocks.0"
    # ×3 is said once, by the block: the conv inside it is one conv of each copy
    assert conv.times == 1 and conv.params == 4 * 4 * 9 + 4
    assert "blocks.1.c1" in conv.repeats
    assert inside.layer("fc").shape == [2, 10]
    assert inside.layer("flatten").kind == "shaping"
    # the residual edge, from before the blocks to the add inside the first one
    assert ("stem", "blocks.0.add") in inside.edges
    assert ("blocks.0.b2", "blocks.0.add") in inside.edges
    assert all(not p.startswith("blocks.1") for p in (x.path for x in inside.layers))
    data = inside.to_json()
    assert json.loads(json.dumps(data)) == data
    assert set(data["layers"][0]) >= {"path", "kind", "label", "shape", "params", "block"}


class BranchyCNN(CNN):
    def forward(self, x):  # fx cannot follow a branch on the data: read by a real forward
        return super().forward(x if x.sum() > -1e9 else -x)


@pytest.mark.parametrize("net, how", [(CNN, "symbolic"), (BranchyCNN, "traced")])
def test_architecture_keeps_no_block_output_it_does_not_read(net, how):
    # a block's output is let go once the next block has used it, not held for the shapes
    model, block_out, alive = net(), [], []
    model.blocks[0].register_forward_hook(lambda m, a, out: block_out.append(weakref.ref(out)))

    def check(m, args):
        gc.collect()
        alive.append(block_out[-1]() is not None)

    model.fc.register_forward_pre_hook(check)
    inside = traced(model, torch.randn(2, 3, 8, 8))
    assert inside.how == how and inside.layer("blocks.0.c1").shape == [2, 4, 8, 8]
    assert alive and not any(alive)


def test_traced_without_an_example_is_symbolic_without_shapes():
    inside = traced(CNN())
    assert inside.how == "symbolic"
    assert all(x.shape is None for x in inside.layers)
    assert inside.layer("blocks.0").times == 3


def test_traced_transformer_layer_falls_back_deterministically():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 8)
    first = traced(nn.TransformerEncoderLayer(8, 2, 16), x)
    assert first.how == "traced" and first.why
    again = traced(nn.TransformerEncoderLayer(8, 2, 16), x)
    assert first.to_json() == again.to_json()
    paths = [x.path for x in first.layers]
    assert paths[:3] == ["self_attn", "dropout1", "add"]
    assert first.layer("linear1").shape == [5, 2, 16]
    assert ("norm1", "linear1") in first.edges
    assert traced(nn.TransformerEncoderLayer(8, 2, 16)) is None


def test_a_plain_function_is_not_traced():
    assert traced(torch.relu, torch.randn(3)) is None
    assert traced(lambda x: x) is None


def test_depth_opens_a_composite_torch_ships():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 4, enable_nested_tensor=False)
    x = torch.randn(5, 2, 8)
    closed = traced(enc, x)
    layer = closed.layer("layers.0")
    assert layer.times == 4 and not layer.made_of
    opened = traced(enc, x, depth=1)
    assert opened.layer("layers.0").times == 4
    assert opened.layer("layers.0.self_attn").kind == "attention"
    assert opened.layer("layers.0.linear1").times == 1
    assert "layers.3.linear1" in opened.layer("layers.0.linear1").repeats


def test_traced_leaves_the_module_as_it_was():
    net = CNN()
    other = nn.Sequential(nn.Dropout(0.5), nn.TransformerEncoderLayer(8, 2, 16))
    x, y = torch.randn(2, 3, 8, 8), torch.randn(3, 2, 8)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    traced(net, x)
    traced(other, y)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert net.training and net.blocks[0].r.inplace


def test_most_closes_the_deepest_blocks_first_then_cuts():
    net = nn.Sequential(
        *[nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(6)]
    )
    for i, part in enumerate(net):  # different blocks: nothing folds
        part[0] = nn.Linear(4, 4, bias=i % 2 == 0)
    inside = traced(net, torch.randn(1, 4), most=8)
    assert len(inside.layers) <= 8
    assert all(x.path.count(".") == 0 for x in inside.layers)
    assert inside.hidden == 0 and len(inside.layers) == 6
    cut = traced(
        nn.Sequential(*[nn.Linear(4, 4, bias=i % 2 == 0) for i in range(10)]), None, most=4
    )
    assert len(cut.layers) == 4 and cut.hidden == 6


class Enc(Node, nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 8)
        self.r = nn.ReLU()

    def forward(self, x, ctx):
        return self.r(self.l(x))


class Branch(Node, nn.Module):
    def __init__(self, o):
        super().__init__()
        self.l = nn.Linear(8, o)

    def forward(self, x, ctx):
        return self.l(x)


class Join(Node):
    def __init__(self):
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x, ctx):
        return self.head(self.net(torch.cat([x["branch"], x["branch_2"]], 1)))


class Tokens(Node):
    def forward(self, x, ctx):
        return x * 1.0


def _graph():
    return Graph.somatize(Tokens() >> Enc() >> (Branch(2) | Branch(3)) >> Join())


def test_architecture_traces_each_node_on_what_reaches_it():
    g = _graph()
    got = architecture(g, torch.randn(7, 4))
    assert list(got) == ["tokens", "enc", "branch", "branch_2", "join"]
    assert [x.path for x in got["tokens"].layers] == ["mul"]  # no module: what it computes
    assert got["enc"].layer("l").shape == [7, 8]
    assert got["branch_2"].layer("l").shape == [7, 3]
    join = got["join"]
    # a plain node is read as one module made of what it holds, its own torch.cat included
    assert [x.path for x in join.layers] == ["cat", "net", "net.0", "net.1", "head"]
    assert ("cat", "net.0") in join.edges
    assert join.layer("net.0").shape == [7, 6] and join.layer("net.0").block == "net"
    assert join.layer("head").shape == [7, 2] and join.layer("head").kind == "learned"
    assert ("net.1", "head") in join.edges
    assert "forward" not in vars(g.implementation("enc"))
    assert g.forward(torch.randn(2, 4)).shape == (2, 2)


def test_architecture_without_an_example_answers_symbolically():
    got = architecture(_graph())
    assert got["enc"].how == "symbolic" and got["enc"].layer("l").shape is None
    assert [x.path for x in got["join"].layers] == ["cat", "net", "net.0", "net.1", "head"]


def test_architecture_of_a_bare_module_is_keyed_by_its_class():
    got = architecture(CNN(), torch.randn(1, 3, 8, 8))
    assert list(got) == ["cnn"] and got["cnn"].layer("blocks.0").times == 3


# -- following the data, on a real forward and through fx ----------------------------------


class Pooled(nn.Module):
    """A head fed through indexing, a transpose and a reshape; `branchy` adds control flow
    on a value, which fx cannot follow, so the real forward has to read it."""

    def __init__(self, branchy: bool):
        super().__init__()
        self.branchy = branchy
        self.embed = nn.Linear(4, 8)
        self.mix = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.act(self.mix(self.embed(x)))  # (batch, seq, 8)
        if self.branchy and bool(h.sum() > -1e9):
            h = h * 1.0
        h = h.transpose(1, 2).reshape(h.shape[0], 8, -1).transpose(1, 2)
        return self.head(h[:, 0])


@pytest.mark.parametrize("branchy, how", [(False, "symbolic"), (True, "traced")])
def test_edges_follow_the_data_through_indexing_views_and_reshapes(branchy, how):
    inside = traced(Pooled(branchy), torch.randn(2, 5, 4))
    assert inside.how == how
    assert ("act", "head") in inside.edges or ("mul", "head") in inside.edges
    assert ("embed", "mix") in inside.edges and ("mix", "act") in inside.edges
    labels = [x.label for x in inside.layers]
    assert "transpose" not in labels and "reshape" not in labels and "getitem" not in labels
    assert "gt" not in labels and "sum" not in labels  # bookkeeping on the data is not drawn


class Twice(nn.Module):
    """One ReLU called twice, as torchvision's ResNet block does."""

    def __init__(self, branchy: bool = False):
        super().__init__()
        self.branchy = branchy
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.relu(self.conv(x))
        if self.branchy and bool(out.mean() > 1e9):  # never true; fx cannot know it
            out = out * 0
        return self.relu(out + x)


@pytest.mark.parametrize("branchy", [False, True])
def test_a_module_called_twice_is_a_box_per_call_and_nothingloops(branchy):
    inside = traced(Twice(branchy), torch.randn(1, 2, 4, 4))
    assert inside.how == ("traced" if branchy else "symbolic")
    paths = [x.path for x in inside.layers]
    assert "relu" in paths and "relu#2" in paths
    assert inside.layer("relu#2").label == "ReLU" and inside.layer("relu#2").params == 0
    assert ("conv", "relu") in inside.edges and ("add", "relu#2") in inside.edges
    assert not loops(inside.edges)
    assert "mean" not in paths  # a number read for a decision is not a layer of the net


class Looped(nn.Module):
    """One residual block called three times (ALBERT runs its one layer so)."""

    def __init__(self, branchy: bool = False):
        super().__init__()
        self.branchy = branchy
        self.inp = nn.Linear(4, 8)
        self.block = Residual()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        times = 3 if not self.branchy or bool(x.sum() > -1e9) else 2  # fx cannot know it
        for _ in range(times):
            x = self.block(x)
        return self.out(x)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(self.act(self.a(x)))


@pytest.mark.parametrize("branchy, how", [(False, "symbolic"), (True, "traced")])
def test_a_block_called_three_times_is_a_box_per_call_open_or_closed(branchy, how):
    net = Looped(branchy)
    x = torch.randn(2, 4)
    opened = traced(net, x)
    assert opened.how == how
    if how == "symbolic":
        assert opened.why is None  # fx follows a block called again (keys `block@1`)
    paths = [layer.path for layer in opened.layers]
    assert {"block.a", "block.a#2", "block.a#3", "block.add_2"} <= set(paths)
    assert not loops(opened.edges)
    closed = traced(net, x, most=5)  # too many layers: the block is closed, a box per call
    assert [layer.path for layer in closed.layers] == ["inp", "block", "block#2", "block#3", "out"]
    assert closed.edges == [
        ("inp", "block"),
        ("block", "block#2"),
        ("block#2", "block#3"),
        ("block#3", "out"),
    ]
    assert closed.layer("block#3").label == "Residual" and closed.layer("block#3").shape == [2, 8]
    counted = sum(closed.layer(p).params for p in ("inp", "block", "out"))
    assert closed.params == sum(p.numel() for p in net.parameters()) == counted


def test_a_tied_weight_is_counted_once():
    net = Tied()
    inside = traced(net, torch.tensor([[1, 2, 3]]))
    assert inside.params == 11 * 4 + 4 * 4 + 4 == sum(p.numel() for p in net.parameters())
    assert inside.layer("lm_head").params == inside.layer("wte").params == 44
    assert architecture(net, torch.tensor([[1, 2]]))["tied"].params == inside.params
    assert inside.to_json()["params"] == inside.params


class Masks(nn.Module):
    """What transformers do with masks and caches: comparisons, a triangle, a count, an
    assert, and a cache filled by concatenating onto an empty tensor."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        keep = mask.gt(0) & mask.eq(mask)
        n = keep.sum()
        torch._assert(n >= 0, "a count")
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1]), diagonal=1)
        cache = torch.cat([torch.zeros(x.shape[0], 0, 4), self.proj(x)], dim=1)
        scores = cache @ cache.transpose(1, 2) - 1e4 * causal
        return (scores.softmax(-1) * keep[:, None, :]) @ x


def test_bookkeeping_is_not_drawn_and_the_data_still_flows():
    inside = traced(
        Masks(), {"x": torch.randn(2, 3, 4), "mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    )
    labels = [x.label for x in inside.layers]
    for op in ("gt", "eq", "and", "sum", "triu", "assert", "ones", "zeros", "cat", "transpose"):
        assert op not in labels, op
    assert labels[0].startswith("Linear")
    assert ("proj", "matmul") in inside.edges and ("softmax", "mul") in inside.edges


class Conv1D(nn.Module):
    """GPT-2's: a linear layer with its weight transposed, named for a convolution."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class Kernel(nn.Module):
    """A convolution of its own, with a name that says nothing."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 2, 3, 3))

    def forward(self, x):
        return torch.conv2d(x, self.w, padding=1)


class SqueezeExcitation(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Conv2d(2, 2, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc(self.pool(x)))


class BertPooler(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.activation = nn.Tanh()

    def forward(self, h):
        return self.activation(self.dense(h[:, 0]))


class Layer(nn.Module):
    """A transformer layer of somebody's own: attention among its parts."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.ff = nn.Linear(4, 4)


class ConvNeXtBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(2, 2, 7, padding=3, groups=2)
        self.norm = nn.LayerNorm(2)


@pytest.mark.parametrize(
    "module, kind",
    [
        (Conv1D(3, 4), "learned"),
        (Kernel(), "conv"),
        (SqueezeExcitation(), "block"),
        (BertPooler(), "block"),
        (ConvNeXtBlock(), "block"),
        (Layer(), "attention"),
        (nn.TransformerDecoderLayer(4, 2), "attention"),
    ],
)
def test_kind_by_what_a_module_computes_with_not_its_name(module, kind):
    assert kind_of(module) == kind


class Drop(nn.Module):
    """A residual block whose branch is dropped with probability p (stochastic depth)."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Drop(0.1), Drop(0.1))

    def forward(self, x):
        return self.blocks(x)


def test_blocks_that_differ_in_a_setting_are_not_folded_together():
    same = traced(nn.Sequential(Drop(0.1), Drop(0.1), Drop(0.1)), torch.randn(2, 4))
    assert same.layer("0").times == 3
    rising = traced(nn.Sequential(Drop(0.0), Drop(0.05), Drop(0.1)), torch.randn(2, 4))
    assert [x.times for x in rising.layers if x.block is None] == [1, 1, 1]


def test_nested_folds_say_their_own_count_once_per_level():
    inside = traced(nn.Sequential(Stage(), Stage(), Stage()), torch.randn(2, 4))
    assert inside.layer("0").times == 3
    assert inside.layer("0.blocks.0").times == 2
    assert inside.layer("0.blocks.0.lin").times == 1
    assert inside.params == 3 * 2 * (16 + 4)


def test_an_identity_only_hands_its_input_on():
    net = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.ReLU())
    inside = traced(net, torch.randn(2, 4))
    assert [x.path for x in inside.layers] == ["0", "2"]
    assert inside.edges == [("0", "2")]


def test_an_opaque_example_gives_the_same_answer():
    net, x = CNN(), torch.randn(2, 3, 8, 8)
    assert traced(net, Opaque(x)).to_json() == traced(net, x).to_json()
    assert architecture(net, Opaque(x))["cnn"].to_json() == architecture(net, x)["cnn"].to_json()
    kw = {"x": torch.randn(2, 3, 4), "mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    wrapped = {k: Opaque(v) for k, v in kw.items()}
    assert traced(Masks(), wrapped).to_json() == traced(Masks(), kw).to_json()


def test_a_bare_module_holding_a_plain_module_and_the_graph_agree():
    net = Pooled(True)
    g = Graph.somatize(Node.of(net))
    assert architecture(g, torch.randn(2, 5, 4))["pooled"].to_json() == (
        architecture(net, torch.randn(2, 5, 4))["pooled"].to_json()
    )


def test_a_node_that_is_one_module_runs_once_and_has_the_shape_it_gave_in_the_run():
    class Scale(nn.Module):  # one layer: a weight, no modules; counts its forwards
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * self.w

    scale = Scale()
    g = Graph.somatize(Node.of(nn.Linear(3, 4)).named("lin") >> Node.of(scale).named("scale"))
    inside = architecture(g, torch.randn(2, 3))
    assert scale.calls == 1  # the graph's run, not a second one for the shape
    assert inside["scale"].layer("").shape == [2, 4] and inside["lin"].layer("").shape == [2, 4]


def test_traced_reads_a_node_that_is_a_module_as_the_graph_calls_it():
    inside = traced(Enc(), torch.randn(3, 4))
    assert [x.path for x in inside.layers] == ["l", "r"] and inside.layer("r").shape == [3, 8]


@pytest.mark.parametrize("look", ["architecture", "probe", "proxies"])
def test_a_lazy_module_not_made_yet_is_refused_and_left_as_it_was(look):
    from somatize.torch import probe, proxies

    fn = {"architecture": architecture, "probe": probe, "proxies": proxies}[look]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.LazyLinear(4))
    x = torch.randn(2, 3)
    with pytest.raises(
        ValueError,
        match=r"node .sequential. \(Sequential\) holds 2\.weight, 2\.bias not made yet.*run it once first",
    ):
        fn(net, x)
    # nothing was made: still a lazy module, which its own first forward then makes
    assert isinstance(net[2], nn.LazyLinear)
    assert net(x).shape == (2, 4)
    assert not isinstance(net[2], nn.LazyLinear)
    assert fn(net, x)  # once made, the look answers


@pytest.mark.parametrize("look", ["architecture", "probe", "proxies"])
@pytest.mark.parametrize("where", ["the net", "a block inside", "scripted"])
def test_a_compiled_module_is_refused_naming_the_fix_and_left_as_it_was(look, where):
    from somatize.torch import probe, proxies

    fn = {"architecture": architecture, "probe": probe, "proxies": proxies}[look]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 3)
    want = net(x)
    if where == "the net":
        given, said = torch.compile(net), "compiled module"
    elif where == "a block inside":
        given, said = nn.Sequential(torch.compile(net), nn.Tanh()), "compiled module"
    else:
        given, said = torch.jit.script(net), "TorchScript module"
    with pytest.raises(ValueError, match=said + r" .*give it the module that was"):
        fn(given, x)
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(net(x), want)
    torch.save(net, io.BytesIO())  # a hook a look left on it (a closure) would not pickle
    assert fn(net, x)  # the module that was compiled answers


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_weight_and_spectral_norm_are_one_layer_to_every_look(depth):
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    from somatize.torch import Audit, Trainer, parameters, probe

    torch.manual_seed(0)
    net = nn.Sequential(
        weight_norm(nn.Conv1d(2, 8, 3)), nn.ReLU(), spectral_norm(nn.Linear(6, 3)), nn.Tanh()
    )
    x, y = torch.randn(4, 2, 8), torch.randn(4, 8, 3)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    inside = architecture(net, x, depth=depth)["sequential"]
    # how torch computes a weight (its parametrizations) is not a layer the data passes
    assert [layer.path for layer in inside.layers] == ["0", "1", "2", "3"]
    assert [layer.params for layer in inside.layers] == [
        sum(p.numel() for p in m.parameters()) for m in net
    ]
    assert inside.layer("0").kind == "conv" and inside.layer("0").shape == [4, 8, 6]
    keys = set(probe(net, x, depth=depth))
    assert keys == {"sequential"} | {f"sequential.{i}" for i in range(4)}
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    g = Graph.somatize(net)
    audit = Audit(inside=True)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    Trainer(g, objective=torch.nn.functional.mse_loss, optimizer=opt, auditing=audit).fit(
        [(x, y)] * 2
    )
    assert set(audit.places) == keys  # a finding from a run lands where the probe's would


class _Batched(nn.Module):
    """A wrapper as research code writes one: forward(self, **batch)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, **batch):
        return self.l(batch["x"] * batch["mask"])


def test_a_forward_taking_any_name_is_read_on_a_dict_as_keywords():
    from somatize.torch import probe

    batch = {"x": torch.randn(3, 4), "mask": torch.ones(3, 4)}
    assert architecture(_Batched(), batch)["_batched"].layer("l").shape == [3, 2]
    assert traced(_Batched(), batch).layer("l").shape == [3, 2]
    assert set(probe(_Batched(), batch)) == {"_batched", "_batched.mul", "_batched.l"}


class _Masked(nn.Module):
    """A forward that needs two inputs, called as model(x, mask), given as the tuple."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, x, mask):
        return self.l(x * mask)


def test_a_tuple_is_read_as_the_arguments_of_a_forward_that_needs_several():
    import warnings

    from somatize.torch import Trainer, parameters, probe, proxies

    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    model = _Masked()
    assert architecture(model, (x, mask))["_masked"].layer("l").shape == [3, 2]
    assert traced(model, (x, mask)).layer("l").shape == [3, 2]
    assert probe(model, (x, mask)) == probe(model, {"x": x, "mask": mask})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # naswot: no activation layer, said elsewhere
        assert proxies(model, (x, mask)) == proxies(model, {"x": x, "mask": mask})
    g = Graph.somatize(model)
    opt = torch.optim.SGD(parameters(g), lr=0.1)
    y = torch.randn(3, 2)
    before = model.l.weight.detach().clone()
    Trainer(g, objective=torch.nn.functional.mse_loss, optimizer=opt).fit([((x, mask), y)])
    assert not torch.equal(model.l.weight, before)


def test_fold_leaves_what_was_traced_as_it_was_so_folding_twice_agrees():
    import copy

    from somatize.torch.inside._trace import Raw, Traced
    from somatize.torch.inside.fold import fold

    traced, last = Traced(), None
    for b in "012":  # three blocks alike, each two linear layers, in a chain
        traced.layers[b] = Raw(path=b, kind="block", label="Block", composite=True)
        for k in "01":
            p = f"{b}.{k}"
            traced.layers[p] = Raw(p, "linear", "Linear", shape=[2, 4], params=20, block=b)
            if last is not None:
                traced.edges.append((last, p))
            last = p
    before = copy.deepcopy(traced)
    folded = (3, ["1", "2"], ["0.0", "0.1"])  # times, repeats, made of
    first, _ = fold(traced)
    assert (first["0"].times, first["0"].repeats, first["0"].made_of) == folded
    assert traced == before
    again, _ = fold(traced)
    assert (again["0"].times, again["0"].repeats, again["0"].made_of) == folded


_EDGES = """
import json, torch
from torch import nn
from somatize.torch import traced

class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if bool(h.sum() > -1e9):  # control flow on a value: fx cannot follow, a forward reads
            h = h + self.b(h)
        return h

torch.manual_seed(0)
print(json.dumps(traced(Res(), torch.randn(2, 4)).edges))
"""


def test_a_real_forward_reads_the_same_edges_in_every_process():
    import os
    import subprocess
    import sys

    seen = {
        subprocess.run(
            [sys.executable, "-c", _EDGES],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")  # (two seeds that order a set of two paths apart)
    }
    assert len(seen) == 1  # the edges into `add` do not come in an order string hashing made


def test_a_recurrent_layer_is_labelled_by_the_width_it_gives_out():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(16, 24, num_layers=3, bidirectional=True, batch_first=True)
            self.gru = nn.GRU(48, 8, batch_first=True)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            h, _ = self.lstm(x)
            h, _ = self.gru(h)
            return self.out(h[:, -1])

    inside = architecture(Net(), torch.randn(2, 5, 16))["net"]
    lstm = inside.layer("lstm")
    assert lstm.shape == [2, 5, 48] and lstm.label == "LSTM 16→48, 3 layers, bidirectional"
    assert inside.layer("gru").label == "GRU 48→8"
    projected = architecture(nn.LSTM(4, 6, proj_size=3), torch.randn(5, 2, 4))["lstm"]
    assert projected.layers[0].label == "LSTM 4→3"


class _Gated(nn.Module):
    """Two linear layers behind a branch on the data: fx cannot follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) if h.sum() >= 0 else h


def test_a_node_that_runs_at_a_host_is_read_from_its_copy_here_with_or_without_a_broker():
    from somatize import Broker, Worker
    from somatize.torch import probe, proxies

    torch.manual_seed(0)
    body, head, x = _Gated(), nn.Linear(8, 3), torch.randn(3, 4)
    here = Graph.somatize(Node.of(body) >> Node.of(head).named("head"))
    there = Graph.somatize(Node.of(body).at("gpu") >> Node.of(head).named("head"))
    want = {n: inside.to_json() for n, inside in architecture(here, x).items()}
    assert set(want) == {"_gated", "head"} and want["_gated"]["how"] == "traced"
    probed = probe(here, x)
    assert {n: i.to_json() for n, i in architecture(there, x).items()} == want
    with Broker.embedded({"gpu": Worker.spawn(["--threads", "1"], mode="network")}) as b:
        drawn = architecture(there, x, broker=b)
        assert {n: inside.to_json() for n, inside in drawn.items()} == want
        got = probe(there, x, broker=b)
    assert set(got) == set(probed) and "_gated.a" in got
    for where, numbers in probed.items():
        assert got[where] == pytest.approx(numbers, rel=1e-6), where
    with pytest.warns(UserWarning, match="naswot"):
        scored = proxies(here, x)
    assert set(scored) == {"synflow", "zen", "jacob_cov"}  # no activation module: no naswot
    with pytest.warns(UserWarning, match="naswot"):
        assert proxies(there, x) == pytest.approx(scored, rel=1e-6)


def test_a_node_at_a_host_whose_copy_here_cannot_run_is_named():
    with torch.device("meta"):
        body = nn.Linear(4, 8)
    g = Graph.somatize(Node.of(body).at("gpu") >> Node.of(nn.Linear(8, 3)).named("head"))
    with pytest.raises(RuntimeError) as info:
        architecture(g, torch.randn(3, 4))
    assert any("node 'linear' runs .at('gpu')" in said for said in info.value.__notes__)


class Routed(nn.Module):
    """A top-1 mixture of experts: the gate's argmax picks the rows each expert gets."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 3)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        w, idx = torch.softmax(self.gate(x), -1).max(-1)
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            rows = torch.where(idx == j)[0]
            y = ex(torch.index_select(x, 0, rows)) * w[rows, None]
            out = out.index_add(0, rows, y)
        return out


class Picked(nn.Module):
    """fx reads it: values picked along an argmax of scores."""

    def __init__(self):
        super().__init__()
        self.score, self.value, self.out = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(1, 2)

    def forward(self, x):
        return self.out(torch.gather(self.value(x), 1, torch.argmax(self.score(x), -1, True)))


def test_an_index_routes_the_data_and_does_not_feed_it():
    torch.manual_seed(0)
    x = torch.randn(12, 8)
    routed = architecture(Routed(), x)["routed"]
    experts = [p for p in routed.inputs if p.startswith("experts.")]
    assert experts, routed.inputs  # the tokens enter the experts from the node's input
    assert not [e for e in routed.edges if e[1].startswith("experts.")], routed.edges
    assert ("max", "mul") in routed.edges  # the gate's weights scale what an expert gave
    for example in (None, torch.randn(4, 8)):
        picked = architecture(Picked(), example)["picked"]
        assert picked.how == "symbolic"
        assert ("value", "out") in picked.edges and ("score", "out") not in picked.edges
        assert sorted(picked.inputs) == ["score", "value"]


class Dense(nn.Module):
    """Each layer reads the concatenation of the input and all earlier outputs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Conv2d(4 + 2 * i, 2, 3, padding=1) for i in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.cat([x, torch.relu(layer(x))], 1)
        return x


def test_the_layers_reading_the_nodes_input_are_said():
    for example in (None, torch.randn(1, 4, 6, 6)):
        inside = architecture(Dense(), example)["dense"]
        assert inside.inputs == ["layers.0", "cat"], inside.to_json()
        assert all(a in {x.path for x in inside.layers} for a, _ in inside.edges)


def test_the_figure_draws_the_nodes_input_to_each_layer_that_reads_it():
    import re

    g = Graph.somatize(Dense())
    svg = g.figure(inside=architecture(g, torch.randn(1, 4, 6, 6))).svg()
    into = re.findall(r'data-from="i:dense" data-to="([^"]+)"', svg)
    assert sorted(into) == ["l:dense:cat", "l:dense:layers.0"]
    assert 'data-id="i:dense"' in svg and ">input<" in svg
    # a node whose input one layer reads needs no box for it: the edge into the node says it
    g = Graph.somatize(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))
    svg = g.figure(inside=architecture(g, torch.randn(2, 4))).svg()
    assert 'data-id="i:' not in svg and ">input<" not in svg


class EncoderDecoder(nn.Module):
    """One linear layer and one block held under two names each: in the encoder and in the
    decoder (`self.dec = nn.Sequential(lin, ...)` with the encoder's `lin`)."""

    def __init__(self):
        super().__init__()
        lin, block = nn.Linear(4, 4), Adder(4)
        self.enc = nn.Sequential(lin, nn.ReLU(), block)
        self.dec = nn.Sequential(lin, nn.Tanh(), block)

    def forward(self, x):
        return self.dec(self.enc(x))


class Adder(nn.Module):
    """x + b(relu(a(x)))."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def test_a_module_held_under_two_names_says_which_box_it_is_the_same_as():
    net = EncoderDecoder()
    inside = traced(net, torch.randn(2, 4))
    same = {x.path: x.same_as for x in inside.layers if x.same_as}
    assert same == {"dec.0": "enc.0", "dec.2": "enc.2", "dec.2.a": "enc.2.a", "dec.2.b": "enc.2.b"}
    assert inside.layer("enc.0").same_as is None and inside.layer("dec.1").same_as is None
    assert inside.params == sum(p.numel() for p in net.parameters())  # each weight once
    assert inside.to_json()["layers"][0]["same_as"] is None  # in the JSON a figure reads
    # a later call of one name is a call, not a second name
    assert all(x.same_as is None for x in traced(Looped(), torch.randn(2, 4)).layers)


def test_a_box_drawn_closed_says_what_it_holds_and_an_open_one_nothing():
    net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]))
    net.append(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    x = torch.randn(2, 3, 4)
    opened = traced(net, x)
    assert opened.layer("1").made_of and opened.layer("1").holds == []  # drawn: it says
    assert opened.layer("0").holds == []  # no children
    assert opened.layer("2").holds[:2] == ["self_attn: MultiheadAttention", "linear1: Linear"]
    closed = traced(net, x, most=3)
    assert [x.path for x in closed.layers] == ["0", "1", "2"]
    assert closed.layer("1").holds == ["0: Linear", "1: Linear", "2: Linear"]


def test_a_module_holding_a_weight_another_holds_says_which():
    from transformers import T5Config, T5Model

    inside = traced(Tied(), torch.tensor([[1, 2, 3]]))
    tied = {x.path: x.tied_to for x in inside.layers}
    assert tied == {"wte": None, "body": None, "lm_head": "wte"}  # GPT-2's head and embedding
    assert all(x.same_as is None for x in inside.layers)  # two modules, not one
    torch.manual_seed(0)
    config = T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    t5 = T5Model(config)  # its encoder's and decoder's embeddings hold one weight
    ids = torch.randint(0, 50, (1, 5))
    inside = traced(t5, {"input_ids": ids, "decoder_input_ids": ids}, most=200)
    tied = {x.path: x.tied_to for x in inside.layers if x.tied_to}
    assert tied == {"decoder.embed_tokens": "encoder.embed_tokens"}
    assert inside.params == sum(p.numel() for p in t5.parameters())


class Pair(nn.Module):
    """Gives back a tuple: one layer's output, its own input unchanged, another's."""

    def __init__(self, branchy: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.branchy = branchy

    def forward(self, x):
        b = self.b(x) if not self.branchy or bool(x.sum() > -1e9) else None  # fx cannot know
        return b, x, self.a(x)


@pytest.mark.parametrize("branchy, how", [(False, "symbolic"), (True, "traced")])
def test_the_layers_that_made_the_nodes_output_are_said_in_its_order(branchy, how):
    for example in (None, torch.randn(2, 4)) if how == "symbolic" else (torch.randn(2, 4),):
        inside = architecture(Pair(branchy), example)["pair"]
        assert inside.how == how
        assert inside.outputs == ["b", "a"], inside.to_json()  # what it passed on: no layer's
        assert inside.to_json()["outputs"] == ["b", "a"]
        assert {p for e in inside.edges for p in e} <= {x.path for x in inside.layers}
    one = architecture(nn.Linear(4, 4), torch.randn(2, 4))["linear"]  # a node that is one layer
    assert one.inputs == one.outputs == [""]
    cut = architecture(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]), None, most=3)
    assert cut["sequential"].hidden == 2 and cut["sequential"].outputs == []  # its maker cut


def test_the_layers_that_made_a_real_models_output_are_said():
    from models import zoo

    bert = zoo.bert()  # gives back last_hidden_state and pooler_output
    inside = traced(bert.model, bert.example)
    last = "encoder.layer.0.output.LayerNorm"  # the first copy of the folded layer ×2
    assert inside.outputs == [last, "pooler.activation"]
    assert inside.layer(last).repeats == ["encoder.layer.1.output.LayerNorm"]
    assert traced(bert.model, bert.example, most=4).outputs == ["encoder", "pooler"]  # closed
    gpt2 = zoo.gpt2()  # logits; its cache is no tensor a forward gives back as such
    assert traced(gpt2.model, gpt2.example).outputs == ["lm_head"]
    cnn = zoo.smallnet()
    for example in (None, cnn.example):
        assert traced(cnn.model, example).outputs == ["fc"]


class Numbered(nn.Module):
    """A residual block that knows its own number, and attends within `window` steps."""

    def __init__(self, number: int, window: int | None):
        super().__init__()
        self.layer_idx, self.window = number, window
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


def test_blocks_are_folded_by_their_settings_not_by_their_own_numbers():
    """A number one more in each block than in the one before is which block it is: blocks
    that differ only there fold. A whole-number setting that differs (a window) keeps them
    apart, as a float one does; `None` beside a number too."""
    x = torch.randn(2, 4)
    counted = traced(nn.Sequential(*(Numbered(k, 4) for k in range(3))), x)
    assert counted.layer("0").times == 3
    windows = nn.Sequential(*(Numbered(k, w) for k, w in enumerate((4, 4, 8, None))))
    assert [la.times for la in traced(windows, x).layers if la.block is None] == [2, 1, 1]
