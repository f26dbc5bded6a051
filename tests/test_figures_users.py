"""Figures as a researcher names things: labels in scripts whose letters are wide (Chinese,
Japanese, Korean: a full em each, as Unicode's East Asian Width says) are given the room they
are drawn in, so no title runs out of its box. The browser half is in
tests/browser/test_users_see.py."""

from __future__ import annotations

import re
import unicodedata
import xml.etree.ElementTree as ET

import pytest
from torch import nn

from somatize import Graph, Node
from somatize.figures import LiveAudit

SVG = "{http://www.w3.org/2000/svg}"
NAME = "数据处理层" * 4  # twenty ideographs: 20 em wide in any CJK font


def _least_width(text: str, px: float) -> float:
    """The least a text is drawn across at `px`: a wide letter is a full em."""
    return sum(px for ch in text if unicodedata.east_asian_width(ch) in "WF")


def test_a_node_named_in_chinese_is_drawn_in_a_box_that_holds_its_name():
    class 编码器(nn.Module):  # a layer inside, named and typed in Chinese too
        def __init__(self):
            super().__init__()
            self.线性投影层 = nn.Linear(4, 4)

        def forward(self, x):
            return self.线性投影层(x)

    import torch

    from somatize.torch import architecture

    g = Graph.somatize(Node.of(nn.Linear(4, 4)).named(NAME) >> Node.of(编码器()).named("编码"))
    svg = g.figure(inside=architecture(g, torch.randn(2, 4))).svg()
    checked = 0
    for box in ET.fromstring(svg).iter(f"{SVG}g"):
        if not box.get("data-id", "").startswith(("n:", "l:")):
            continue
        w = float(box.get("data-box").split()[2])
        for text in box.findall(f"{SVG}text"):
            need = _least_width(text.text or "", float(text.get("font-size")))
            assert need <= w, f"{box.get('data-id')}: {text.text!r} needs {need} px, box {w}"
            checked += need > 0
    assert checked >= 3  # the closed node's title, the open node's, its layer's


def test_an_audit_row_named_in_chinese_is_shortened_to_fit_its_label_column():
    audit = LiveAudit(title="训练")
    for step in range(5):
        audit({"fact": "health", "node": NAME * 2, "step": step, "grad_norm": 1.0 + step})
    root = ET.fromstring(audit.svg())
    label = next(t for t in root.iter(f"{SVG}text") if (t.text or "").startswith(("数", "…")))
    assert label.get("text-anchor") == "end"  # the row's name ends at x, left of its cells
    left = float(label.get("x")) - _least_width(label.text, float(label.get("font-size")))
    assert left >= 0, f"{label.text!r} starts {-left:.0f} px left of the picture"
    assert label.text.startswith("…") and len(label.text) < len(NAME) * 2


def test_a_folded_block_says_every_copy_s_number_where_a_colour_is_given():
    from models import zoo

    from somatize.torch import architecture, probe

    case = zoo.bert()  # two encoder layers, drawn once folded ×2
    g = Graph.somatize(Node.of(case.model).named("bert"))
    gains = {w: n["signal_gain"] for w, n in probe(g, case.example).items() if "signal_gain" in n}
    svg = g.figure(inside=architecture(g, case.example), colour=gains).svg()
    first, second = (f"bert.encoder.layer.{k}.attention.self.query" for k in (0, 1))
    tips = {
        box.get("data-id"): box.find(f"{SVG}title").text
        for box in ET.fromstring(svg).iter(f"{SVG}g")
        if box.get("data-id", "").startswith("l:")
    }
    assert "l:bert:encoder.layer.1.attention.self.query" not in tips  # folded: drawn once
    tip = tips["l:bert:encoder.layer.0.attention.self.query"]
    each = re.search(r"each copy: ([^\n]+)", tip)
    assert each, tip
    shown = [float(v) for v in each.group(1).split(", ")]  # three significant digits
    assert shown == pytest.approx([gains[first], gains[second]], rel=5e-3)


def test_an_audit_of_two_runs_names_the_first_in_its_legend_as_on_its_curve():
    audit = LiveAudit(title="adam")  # the first run is the audit's own, named by its title
    sgd = audit.run("sgd")
    for step in range(5):
        audit({"fact": "loss", "value": 2.0 - 0.1 * step, "step": step})
        sgd({"fact": "loss", "value": 3.0 - 0.1 * step, "step": step})
        for run in (audit, sgd):
            run({"fact": "health", "node": "enc", "step": step, "grad_norm": 1.0})
    texts = [t.text for t in ET.fromstring(audit.svg()).iter(f"{SVG}text")]
    assert "adam 1.6" in texts and "sgd 2.6" in texts  # each curve named at its end
    assert "run adam" in texts and "run sgd" in texts, texts  # and so in the legend
