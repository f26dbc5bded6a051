"""Gaps a user saw in the looks: what probe colours, what a label says, why two twins are
drawn apart. Each on a real model from tests/models, small configs at random init."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from models import more, newer

from somatize import Graph, Node
from somatize.figures import graph_figure
from somatize.torch import architecture

SVG = "{http://www.w3.org/2000/svg}"


def test_a_gain_past_1e41_is_drawn_in_a_tooltip_not_refused():
    # an eager attention's additive mask gives the add applying it a gain near 1e37; a
    # larger one made the figure's number() raise decimal.InvalidOperation
    plan = {"nodes": [{"id": "a"}, {"id": "b"}], "edges": [["a", "b"]]}
    svg = graph_figure(plan, colour={"a": 1e45, "b": 2.0}).svg()
    tips = [t.text for t in ET.fromstring(svg).iter(f"{SVG}title")]
    shown = [re.match(r"a\ncolour: (\d+)T\n", t) for t in tips]
    assert any(m and float(m.group(1)) * 1e12 == pytest.approx(1e45) for m in shown), tips


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
