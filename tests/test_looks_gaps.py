"""Gaps a user saw in the looks: what probe colours, what a label says, why two twins are
drawn apart. Each on a real model from tests/models, small configs at random init."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch
from models import more, newer, zoo
from torch import nn

from somatize import Graph, Node
from somatize.figures import graph_figure
from somatize.torch import architecture, probe

SVG = "{http://www.w3.org/2000/svg}"


def test_a_gain_past_1e41_is_drawn_in_a_tooltip_not_refused():
    # an eager attention's additive mask gives the add applying it a gain near 1e37; a
    # larger one made the figure's number() raise decimal.InvalidOperation
    plan = {"nodes": [{"id": "a"}, {"id": "b"}], "edges": [["a", "b"]]}
    svg = graph_figure(plan, colour={"a": 1e45, "b": 2.0}).svg()
    tips = [t.text for t in ET.fromstring(svg).iter(f"{SVG}title")]
    shown = [re.match(r"a\ncolour: (\S+)\n", t) for t in tips]
    assert any(m and float(m.group(1)) == pytest.approx(1e45) for m in shown), tips


def _texts(svg: str) -> dict[str, list[str]]:
    """Each layer box's texts (its label, then its shape), by its path."""
    return {
        box.get("data-id").split(":", 2)[2]: [t.text for t in box.iter(f"{SVG}text")]
        for box in ET.fromstring(svg).iter(f"{SVG}g")
        if box.get("data-id", "").startswith("l:")
    }


def test_segformer_s_decoder_flatten_holds_channels_then_the_map_s_positions():
    # SegformerMLP: (N, C, h, w).flatten(2).transpose(1, 2); the flatten's box is what it
    # gives, (N, C, h·w): stage 0's 8 channels over its 8×8 = 64 positions
    case = newer.segformer()
    g = Graph.somatize(Node.of(case.model).named("seg"))
    texts = _texts(g.figure(inside=architecture(g, case.example, most=200)).svg())
    assert texts["decode_head.linear_projections.0.flatten"][1] == "2 batch · 8 ch · 64 len"
    assert texts["decode_head.linear_projections.0.proj"][1] == "2 batch · 64 len · 16 dim"
    assert texts["segformer.stages.0.patch_embeddings.flatten"][1] == "2 batch · 8 ch · 64 len"
    # stage 1's 16 channels over its 4×4 = 16 positions: a square the shape cannot tell, the
    # call can (it merged the last two axes of a (N, C, h, w) the permute before it made)
    assert texts["decode_head.linear_projections.1.flatten"][1] == "2 batch · 16 ch · 16 len"


class _Rows(nn.Module):
    """A conv's map flattened, its channels first or (permuted) last: each (2, 16, 16)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.conv, self.last = nn.Conv2d(3, 16, 3, padding=1), last

    def forward(self, x):
        y = self.conv(x)
        return y.permute(0, 2, 3, 1).flatten(1, 2) if self.last else y.flatten(2)


@pytest.mark.parametrize(
    "last, axes", [(False, ["batch", "ch", "len"]), (True, ["batch", "len", "dim"])]
)
def test_a_flatten_s_axes_are_those_its_call_merged_not_guessed_from_its_shape(last, axes):
    g = Graph.somatize(Node.of(_Rows(last)).named("rows"))
    inside = architecture(g, torch.randn(2, 3, 4, 4))
    assert inside["rows"].layer("flatten").axes == axes
    texts = _texts(g.figure(inside=inside).svg())
    assert texts["flatten"][1] == " · ".join(
        f"{n} {a}" for n, a in zip([2, 16, 16], axes, strict=True)
    )


def _tips(svg: str) -> dict[str, str]:
    """Each box's tooltip, by its id."""
    return {
        box.get("data-id"): box.find(f"{SVG}title").text
        for box in ET.fromstring(svg).iter(f"{SVG}g")
        if box.get("data-id") and box.find(f"{SVG}title") is not None
    }


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_two_layers_a_sliding_window_keeps_apart_each_say_so_naming_it_and_both_values():
    case = more.qwen2(window=4)  # its second layer attends within 4 tokens, its first to all
    g = Graph.somatize(Node.of(case.model).named("qwen"))
    inside = architecture(g, case.example)["qwen"]
    first, second = inside.layer("model.layers.0"), inside.layer("model.layers.1")
    assert first.times == second.times == 1  # drawn apart
    assert len(first.apart) == len(second.apart) == 1
    assert first.apart[0].startswith("not folded with model.layers.1: ")
    assert "self_attn.sliding_window None ≠ 4" in first.apart[0]
    assert second.apart[0].startswith("not folded with model.layers.0: ")
    assert "self_attn.sliding_window 4 ≠ None" in second.apart[0]
    tips = [t for t in _tips(g.figure(inside={"qwen": inside}).svg()).values() if "≠" in t]
    assert len(tips) == 2 and any(second.apart[0] in t for t in tips), tips
    # without the window the two fold, and nothing says apart
    plain = more.qwen2()
    g = Graph.somatize(Node.of(plain.model).named("qwen"))
    folded = architecture(g, plain.example)["qwen"]
    assert folded.layer("model.layers.0").times == 2
    assert not any(layer.apart for layer in folded.layers)


def _uncoloured(svg: str) -> list[str]:
    """The layer boxes drawn with no colour (tinted with their family's hue instead)."""
    return [
        box.get("data-id")
        for box in ET.fromstring(svg).iter(f"{SVG}g")
        if box.get("data-id", "").startswith("l:")
        and any(p.get("fill-opacity") == "0.13" for p in box.iter(f"{SVG}path"))
    ]


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
@pytest.mark.parametrize(
    "build",
    [newer.gemma2, more.llama, zoo.albert, newer.modernbert, zoo.t5],
    ids=["gemma2", "llama", "albert", "modernbert", "t5"],
)
def test_every_box_a_transformer_s_figure_draws_has_a_probe_colour(build):
    # gemma2: attention closed by most=48, its layers not folded (a sliding window on one);
    # llama: folded ×2, its first layer's MLP past probe's first half; albert: one layer
    # called at every depth, a closed box per call; modernbert and t5: boxes mid-model
    case = build()
    g = Graph.somatize(Node.of(case.model).named("m"))
    numbers = probe(g, case.example)
    gains = {w: n.get("jacobian_gain", n.get("signal_gain", 0.0)) for w, n in numbers.items()}
    svg = g.figure(inside=architecture(g, case.example), colour=gains).svg()
    assert _uncoloured(svg) == []
    assert len(_uncoloured(g.figure(inside=architecture(g, case.example)).svg())) > 10


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_a_block_drawn_closed_is_probed_as_the_last_box_that_ran_in_it():
    case = newer.gemma2()
    g = Graph.somatize(Node.of(case.model).named("m"))
    got = probe(g, case.example)
    closed = architecture(g, case.example)["m"].layer("model.layers.0.self_attn")
    assert not closed.made_of and "o_proj: Linear" in closed.holds  # drawn as one box
    every = probe(g, case.example, most=400)  # (layer 0's o_proj is past the first half)
    assert got["m.model.layers.0.self_attn"] == every["m.model.layers.0.self_attn.o_proj"]
    assert got["m.model.layers.1.mlp"] == got["m.model.layers.1.mlp.down_proj"]
    assert "jacobian_gain" in got["m.model.layers.1.mlp"]


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
def test_a_folded_box_its_first_copy_unprobed_shows_the_copy_probed_and_says_whose():
    case = more.llama()  # two layers folded ×2; probe's first half ends in layer 0's attention
    g = Graph.somatize(Node.of(case.model).named("m"))
    got = probe(g, case.example)
    first, second = (f"m.model.layers.{k}.mlp.down_proj" for k in (0, 1))
    assert first not in got and second in got
    gains = {w: n["jacobian_gain"] for w, n in got.items() if "jacobian_gain" in n}
    tip = _tips(g.figure(inside=architecture(g, case.example), colour=gains).svg())
    said = re.search(r"colour: (\S+) \(copy 2's\)", tip["l:m:model.layers.0.mlp.down_proj"])
    assert said and float(said.group(1)) == pytest.approx(gains[second], rel=5e-3)


def test_a_comparison_names_a_dead_box_once_not_again_at_the_block_that_holds_it():
    import torch
    from torch import nn

    from somatize.figures import compare

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with torch.no_grad():
        block[0].bias.fill_(-100.0)  # every unit below zero: the ReLU gives zeros
    net = nn.Sequential(block, nn.Linear(8, 3))
    x = torch.randn(6, 4)
    assert probe(net, x)["sequential.0"] == probe(net, x)["sequential.0.1"]  # the block's last
    flags = compare({"net": net}, x).loc["net", "probe:flags"].split(", ")
    assert "DEAD@sequential.0.1" in flags, flags
    assert not any(f.endswith("@sequential.0") for f in flags), flags


def test_a_comparison_flags_what_probe_s_facts_flag_a_node_and_its_one_box_each():
    from somatize.figures import compare
    from somatize.health import Verdicts

    # a node that is one ReLU given what it kills: the node is a place of the graph (as an
    # audit names it) and its box another, with the same numbers; neither repeats the other
    dead = nn.Linear(4, 8)
    with torch.no_grad():
        dead.bias.fill_(-100.0)
    g = Graph.somatize(Node.of(dead).named("pre") >> Node.of(nn.Sequential(nn.ReLU())).named("act"))
    x = torch.randn(6, 4)
    facts: list[dict] = []
    got = probe(g, x, watching=facts.append)
    assert got["act"] == got["act.0"]
    said = Verdicts(last=None).feed(facts).flags()
    flags = compare({"g": g}, x).loc["g", "probe:flags"].split(", ")
    assert sorted(flags) == sorted(f"{f}@{w}" for w, fs in said.items() for f in fs)
    assert {"DEAD@act", "DEAD@act.0"} <= set(flags), flags


def test_a_folded_box_with_a_nan_of_its_own_stays_unpainted_a_copy_does_not_hide_it():
    import figure_data as fd

    colour = {"enc.blocks.0.conv": float("nan"), "enc.blocks.1.conv": 2.0, "enc.act": 1.0}
    colour["enc.blocks.2.bn"] = 3.0  # the bn's first two copies have none: its third's shown
    tips = _tips(graph_figure(fd.plan(), inside={"enc": fd.inside_enc()}, colour=colour).svg())
    conv, bn = tips["l:enc:blocks.0.conv"], tips["l:enc:blocks.0.bn"]
    assert "colour: NaN\n" in conv and "copy" not in conv.split("\n")[1], conv
    assert "colour: 3 (copy 3's)\n" in bn, bn
    unpainted = _uncoloured(
        graph_figure(fd.plan(), inside={"enc": fd.inside_enc()}, colour=colour).svg()
    )
    assert "l:enc:blocks.0.conv" in unpainted and "l:enc:blocks.0.bn" not in unpainted


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
@pytest.mark.parametrize("most", [8, 20])
def test_a_figure_and_a_probe_at_a_smaller_most_leave_no_box_uncoloured(most):
    # bert at most=20: the figure folds its two layers and draws each one's attention,
    # intermediate and output closed; the probe, counting both layers, closes the layers
    # themselves, and answers the last copy's attention, intermediate and output on the way
    case = zoo.bert()
    g = Graph.somatize(Node.of(case.model).named("m"))
    numbers = probe(g, case.example, most=most)
    gains = {w: n.get("jacobian_gain", 0.0) for w, n in numbers.items()}
    inside = architecture(g, case.example, most=most)
    assert _uncoloured(g.figure(inside=inside, colour=gains).svg()) == []


def test_whisper_s_position_table_looked_up_by_arange_has_no_batch_axis():
    # WhisperEncoder: embed_positions(arange(16)), a (16, 32) table added to each sample's
    # (2, 16, 32): its rows are positions, not samples, as nothing of the data reached it
    case = more.whisper()
    g = Graph.somatize(Node.of(case.model).named("w"))
    inside = architecture(g, case.example)
    assert inside["w"].layer("model.encoder.embed_positions").axes == ["len", "dim"]
    assert inside["w"].layer("model.encoder.conv1").axes == []  # given the data: its shape says
    texts = _texts(g.figure(inside=inside).svg())
    assert texts["model.encoder.embed_positions"][1] == "16 len · 32 dim"
    assert texts["model.encoder.add"][1] == "2 batch · 16 len · 32 dim"
