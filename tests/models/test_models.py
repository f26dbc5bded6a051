"""Real models as they are, through everything that looks at a graph: wrapped, run, drawn
(depth 0, 1, 2), traced, probed, scored, trained three steps under an audit, and put in a
figure; each look leaves the model exactly as it found it.

The invariants, on every model: nothing crashes; the parameter count is the model's own
(tied weights once, folded blocks multiplied once per level); the edges never loop (a module
called twice is a box per call) and follow the data to the head; kinds by what a module
computes with; a proxy that cannot be taken is absent with a warning, and synflow is finite
and the same whichever mode the model was left in."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import zoo
from _nodes import loops
from torch import nn

from somatize import Graph, Node, Opaque
from somatize.torch import Audit, Trainer, architecture, probe, proxies, traced

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")


def _snapshot(model: nn.Module) -> list:
    """Everything a look could change: weights and buffers (values, dtypes), gradients (the
    tensors themselves), requires_grad, train/eval flags, and every hook."""
    hooks = []
    for name, m in model.named_modules():
        for kind in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            hooks.append((name, kind, list(getattr(m, kind))))
    return [
        [(k, v.detach().clone(), v.dtype) for k, v in model.state_dict(keep_vars=True).items()],
        [(n, p.grad, p.requires_grad) for n, p in model.named_parameters()],
        [(n, m.training) for n, m in model.named_modules()],
        hooks,
    ]


def _same(before: list, after: list, look: str) -> None:
    (w0, g0, t0, h0), (w1, g1, t1, h1) = before, after
    assert [k for k, *_ in w0] == [k for k, *_ in w1], look
    for (k, v0, d0), (_, v1, d1) in zip(w0, w1, strict=True):
        assert d0 == d1 and torch.equal(v0, v1), f"{look} changed {k}"
    assert all(a[1] is b[1] and a[2] == b[2] for a, b in zip(g0, g1, strict=True)), look
    assert t0 == t1, f"{look} changed a train/eval flag"
    assert h0 == h1, f"{look} left a hook"


def _looks(model: nn.Module, look: str, fn):  # noqa: ANN001, ANN202
    before = _snapshot(model)
    got = fn()
    _same(before, _snapshot(model), look)
    return got


def _again(path: str) -> bool:
    """A box of a module's second or later call (`relu#2`)."""
    return "#" in path.rpartition(".")[2]


def _counted(inside) -> int:  # noqa: ANN001
    """Each box's own parameters times the folds it sits in, once per level: a layer's
    parameters, and a block's own (a class token, a layer scale: held by the block itself).
    A box of a module's second call (`attention#2`) holds the first call's parameters."""
    by = {x.path: x for x in inside.layers}
    total = 0
    for x in inside.layers:
        if _again(x.path):
            continue
        own = x.params - sum(by[c].params * by[c].times for c in x.made_of if not _again(c))
        times, block = x.times, x.block
        while block is not None:
            times *= by[block].times
            block = by[block].block
        total += own * times
    return total


# What the suite's models are made of, by role (kind_of reads what a module computes with).
KINDS = {
    "gpt2": {"transformer.h.0.attn.c_attn": "learned", "transformer.h.0": "attention"},
    "bert": {"pooler": "block", "encoder.layer.0": "attention", "pooler.dense": "learned"},
    "vit": {"vit.layers.0": "attention", "classifier": "learned"},
    "convnext": {"convnext.encoder.stages.0.layers.0": "block"},
    "smallnet": {"layer2.0": "block", "layer2.0.block": "block"},
    "transformer": {"encoder": "block", "decoder": "block"},
    "lstm": {"": "recurrent"},
}
# The last layer of each model: fed by the data, however the model got there.
HEADS = {
    "bert": "pooler.dense",
    "gpt2": "lm_head",
    "t5": "lm_head",
    "vit": "classifier",
    "resnet": "classifier.1",
    "convnext": "classifier",
    "mobilenet": "classifier",
    "transformer": "decoder.norm",
    "smallnet": "fc",
}


def _drawn(case: zoo.Case, g: Graph, node: str, depth: int):  # noqa: ANN202
    inside = _looks(
        case.model,
        f"architecture depth {depth}",
        lambda: architecture(g, case.example, depth=depth),
    )[node]
    params = zoo.unique_params(case.model)
    assert inside.params == params
    assert inside.to_json()["params"] == params
    if inside.hidden == 0:
        tied = len({id(p) for p in case.model.parameters()}) < len(
            list(case.model.named_parameters(remove_duplicate=False))
        )
        boxed = any(x.path == "" for x in inside.layers)  # a model with no parts is one box
        own = 0 if boxed else sum(p.numel() for p in case.model.parameters(recurse=False))
        counted = _counted(inside) + own
        assert (counted >= params) if tied else (counted == params)
    assert not loops(inside.edges), f"depth {depth}: the edges loop"
    paths = {x.path for x in inside.layers}
    assert all(a in paths and b in paths for a, b in inside.edges)
    head = HEADS.get(case.name)
    if head in paths:
        assert any(b == head for _, b in inside.edges), f"{head} is fed by nothing"
    for x in inside.layers:
        assert x.times >= 1 and len(x.repeats) >= x.times - 1
        assert x.label not in ("gt", "eq", "sum", "triu", "assert", "Identity")
        shape = x.shape
        assert shape is None or all(isinstance(d, int) for d in shape)
    return inside


@pytest.mark.parametrize("name", list(zoo.CASES))
def test_a_model_as_it_is_through_every_tool(name, tmp_path):
    case = zoo.CASES[name]()
    model = case.model
    g = Graph.somatize(model)
    (node,) = g.nodes()
    assert node == type(model).__name__.lower()

    # forward: what the graph gives is what the model gives, as it is
    torch.manual_seed(0)
    out = g.forward(case.example)
    torch.manual_seed(0)
    plain = model(**case.example) if isinstance(case.example, dict) else model(case.example)
    assert type(out) is type(plain)
    for a, b in zip(zoo.tensors(out), zoo.tensors(plain), strict=True):
        assert torch.equal(a, b)
    model.zero_grad(set_to_none=True)

    # architecture at three depths, and traced on the same input
    insides = [_drawn(case, g, node, depth) for depth in (0, 1, 2)]
    for path, kind in KINDS.get(name, {}).items():
        assert insides[0].layer(path).kind == kind, path
    alone = _looks(model, "traced", lambda: traced(model, case.example))
    assert alone.to_json() == insides[0].to_json()
    assert (
        architecture(
            model,
            Opaque(case.example)
            if not isinstance(case.example, dict)
            else {k: Opaque(v) for k, v in case.example.items()},
        )[node].to_json()
        == insides[0].to_json()
    )

    # probe: every place it draws at depth 0 is measured, on the example as given
    numbers = _looks(model, "probe", lambda: probe(model, case.example))
    assert node in numbers
    for where, n in numbers.items():
        assert where == node or where.startswith(node + ".")
        assert type(n["nan"]) is bool and type(n["inf"]) is bool
        # (no zero_frac_max where a place was given only zeros, after LoRA's B: its input's)
        assert 0.0 <= n.get("zero_frac_max", 0.0) <= 1.0 and 0.0 <= n["sat_frac_max"] <= 1.0
        if "jacobian_gain" in n:
            assert math.isfinite(n["jacobian_gain"]) and n["jacobian_gain"] >= 0

    # proxies: what can be taken is, what cannot is absent and said; synflow is mode-free
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        scores = _looks(
            model,
            "proxies",
            lambda: proxies(model, case.example, target=case.target, objective=case.objective),
        )
    absent = [
        p
        for p in ("synflow", "zen", "naswot", "jacob_cov", "snip", "grasp", "grad_norm", "fisher")
        if p not in scores
    ]
    for p in absent:
        assert any(p in str(w.message) for w in said), f"{p} is absent and nothing says why"
    assert all(isinstance(v, float) for v in scores.values())
    synflow = scores["synflow"]
    assert math.isfinite(synflow) and synflow >= 0
    was = model.training
    model.train(not was)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what is absent was said above
        flipped = proxies(model, case.example)["synflow"]
    model.train(was)
    assert flipped == synflow

    # three steps of training, audited, over the parameters that get a gradient
    trainer = Trainer(
        model,
        objective=case.objective,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        auditing=Audit(every=1),
    )
    losses = [trainer.step((case.example, case.target)) for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)

    # the figure: the node opens into what architecture found, its count the model's own
    fig = _looks(model, "figure", lambda: Graph.somatize(model).figure(inside={node: insides[0]}))
    assert fig.inside[node]["params"] == zoo.unique_params(model)
    assert "<svg" in fig.svg()


def test_a_module_stands_in_an_expression_as_it_is():
    case = zoo.CASES["bert"]()
    head = nn.Linear(32, 3)

    def first_token(out):
        return out.last_hidden_state[:, 0]

    g = Graph.somatize(Node.of(case.model) >> Node.of(first_token) >> Node.of(head).named("head"))
    assert g.nodes() == ["bertmodel", "first_token", "head"]
    assert g.forward(case.example).shape == (zoo.BATCH, 3)
    got = architecture(g, case.example)
    assert set(got) == {"bertmodel", "head"}  # a plain function holds no module
    assert got["head"].params == 32 * 3 + 3


def test_lora_trains_its_adapters_and_leaves_the_base_as_it_was():
    case = zoo.CASES["lora"]()
    model = case.model
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    adapters = {k for k, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in k for k in adapters)
    trainer = Trainer(
        model,
        objective=case.objective,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        auditing=Audit(every=1, inside=True),
    )
    for _ in range(3):
        trainer.step((case.example, case.target))
    after = dict(model.named_parameters())
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == adapters
    assert all(not after[k].requires_grad for k in before if k not in adapters)


def test_a_model_on_the_meta_device_is_drawn_and_refused_by_what_reads_numbers():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):  # how a model too large to allocate is built
        model = GPT2LMHeadModel(GPT2Config(vocab_size=zoo.VOCAB, n_embd=32, n_layer=2, n_head=2))
    example = {"input_ids": torch.zeros(zoo.BATCH, zoo.SEQ, dtype=torch.long, device="meta")}
    (inside,) = architecture(model, example, depth=1).values()
    assert inside.params == zoo.unique_params(model) > 0
    drawn = architecture(model, example)["gpt2lmheadmodel"]
    assert traced(model, example).to_json() == drawn.to_json()
    told = r"node .gpt2lmheadmodel. \(GPT2LMHeadModel\) holds transformer\.wte\.weight, .* on the meta device.*{}"
    with pytest.raises(ValueError, match=told.format("probe reads")):
        probe(model, example)
    with pytest.raises(ValueError, match=told.format("proxies reads")):
        proxies(model, example)
    with pytest.raises(ValueError, match=told.format("an Audit reads")):
        Audit().watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"node 'gpt2lmheadmodel' holds .* a Trainer computes"):
        Trainer(model, objective=zoo.token_loss, optimizer=opt, auditing=Audit())
    assert all(p.is_meta for p in model.parameters())


def test_a_meta_model_that_reads_a_value_of_its_input_is_refused_naming_what_to_give():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    with torch.device("meta"):
        model = BertModel(config)
    ids = torch.zeros(zoo.BATCH, zoo.SEQ, dtype=torch.long, device="meta")
    mask = torch.ones(zoo.BATCH, zoo.SEQ, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="meta") as info:  # BERT's mask code reads a value
        architecture(model, {"input_ids": ids, "attention_mask": mask})
    said = " ".join(info.value.__notes__)
    assert "'bertmodel' on the meta device" in said
    assert "input_ids without an attention_mask" in said
    drawn = architecture(model, {"input_ids": ids})["bertmodel"]  # what it says works
    assert drawn.params == zoo.unique_params(model) and all(p.is_meta for p in model.parameters())


def test_gpt2s_conv1d_is_sized_in_its_figure_as_a_linear_layer_is():
    case = zoo.gpt2()
    g = Graph.somatize(case.model)
    (node,) = g.nodes()
    inside = architecture(g, case.example)[node]
    assert inside.layer("transformer.h.0.attn.c_attn").label == "Conv1D 32→96"
    assert inside.layer("transformer.h.0.mlp.c_proj").label == "Conv1D 128→32"
    svg = g.figure(inside={node: inside}).svg()
    assert "Conv1D 32→96" in svg and "Linear 32→96" in svg  # the lm_head, as torch's


def test_probe_reads_a_resnet_layer_adding_its_shortcut_in_place_by_hand_in_float64():
    # transformers' ResNet adds the shortcut in place (`hidden_state += residual`), then
    # applies its activation: the add is measured against the branch as it was, and the
    # activation against the sum (not against the branch the sum was written over)
    case = zoo.resnet()
    model, x = case.model, case.example
    got = probe(model, x)
    ref = zoo.resnet().model.double()  # the same weights (seeded), in float64
    seen: dict[str, dict[str, torch.Tensor]] = {}
    layers = [n for n, m in ref.named_modules() if type(m).__name__ == "ResNetBasicLayer"]
    for name in layers:
        m, at = ref.get_submodule(name), seen.setdefault(name, {})
        m.layer.register_forward_hook(lambda _m, _a, out, at=at: at.update(branch=out.clone()))
        m.activation.register_forward_hook(lambda _m, a, out, at=at: at.update(sum=a[0], out=out))
    with torch.no_grad():
        ref(x.double())
    rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
    eps = torch.finfo(torch.float32).eps
    assert len(layers) == 3
    for name in layers:
        at, where = seen[name], f"resnetforimageclassification.{name}"
        add, act = got[f"{where}.add"], got[f"{where}.activation"]
        # float32 through a dozen layers of at most 144-term sums, batch norm between them
        want = rms(at["sum"]) / rms(at["branch"])
        assert add["signal_gain"] == pytest.approx(want, rel=256 * eps)
        assert add["jacobian_gain"] == pytest.approx(1.0, rel=8 * eps)  # d(b + r)/db = I
        want = rms(at["out"]) / rms(at["sum"])
        assert act["signal_gain"] == pytest.approx(want, rel=256 * eps)
