"""Gaps a user saw in the looks: what probe colours, what a label says, why two twins are
drawn apart. Each on a real model from tests/models, small configs at random init."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from somatize.figures import graph_figure

SVG = "{http://www.w3.org/2000/svg}"


def test_a_gain_past_1e41_is_drawn_in_a_tooltip_not_refused():
    # an eager attention's additive mask gives the add applying it a gain near 1e37; a
    # larger one made the figure's number() raise decimal.InvalidOperation
    plan = {"nodes": [{"id": "a"}, {"id": "b"}], "edges": [["a", "b"]]}
    svg = graph_figure(plan, colour={"a": 1e45, "b": 2.0}).svg()
    tips = [t.text for t in ET.fromstring(svg).iter(f"{SVG}title")]
    shown = [re.match(r"a\ncolour: (\d+)T\n", t) for t in tips]
    assert any(m and float(m.group(1)) * 1e12 == pytest.approx(1e45) for m in shown), tips
