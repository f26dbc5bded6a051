"""Gaps a user saw in the looks: what probe colours, what a label says, why two twins are
drawn apart. Each on a real model from tests/models, small configs at random init."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from models import newer

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
