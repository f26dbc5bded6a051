"""What a researcher sees of figures saved with `save_html` and opened in Chromium with the
network cut off: a real model's graph drawn whole (every node, layer and edge, no label over
another, nothing fetched, no error), and names in Chinese inside their boxes. The Chinese
check needs a CJK font (Debian: apt-get install -y fonts-wqy-zenhei)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import zoo  # noqa: E402

from somatize import Graph, Node  # noqa: E402
from somatize.torch import architecture  # noqa: E402

# every text of the drawing: its box on screen, and the box of the node or layer holding it
_TEXTS = """() => [...document.querySelectorAll('.smz-drawing svg text')]
  .filter(t => t.getBBox().width > 0 && !t.closest('.smz-legend'))
  .map(t => { const r = t.getBoundingClientRect(), g = t.closest('[data-id]');
    const s = g && g.querySelector(':scope > rect, :scope > path, :scope > polygon');
    const b = s ? s.getBoundingClientRect() : null;
    return {id: g ? g.dataset.id : '', text: t.textContent, x: r.x, y: r.y, w: r.width,
            h: r.height, box: b && {x: b.x, w: b.width}}; })"""


def _open_offline(page, served, name, fig):
    root, base = served
    fig.save_html(root / f"{name}.html")
    asked = []

    def outside(route):
        if route.request.url.startswith(base):
            return route.continue_()
        asked.append(route.request.url)
        return route.abort()

    page.route("**/*", outside)
    page.goto(f"{base}/{name}.html")
    page.wait_for_selector("body[data-rendered='yes']", timeout=20_000)
    return asked


def _family_figure(case, name, block):
    """`case`'s model drawn as one node named `name`, on its example, its repeated block
    `block` unfolded (None: drawn as it folds)."""
    g = Graph.somatize(Node.of(case.model).named(name))
    expanded = [f"{name}:{block}"] if block else []
    return g.figure(inside=architecture(g, case.example), expanded=expanded)


def _looked_at(page, served, name, fig):
    """Open `fig` offline; every layer drawn in the page, each name inside its box, no label
    over another, nothing fetched, no error. The layers shown."""
    svg = fig.svg()
    asked = _open_offline(page, served, name, fig)
    page.locator(".smz-fit").click()
    shown = page.evaluate(
        """() => [...document.querySelectorAll('.smz-drawing [data-id^="l:"]')]
                 .map(e => e.dataset.id)"""
    )
    assert sorted(shown) == sorted(
        k.split('"')[0] for k in svg.split('data-id="')[1:] if k.startswith("l:")
    )
    texts = page.evaluate(_TEXTS)
    layers = [t for t in texts if t["box"] and t["id"].startswith("l:")]
    assert len(layers) >= 2 * len(shown)  # each layer's name and shape
    for t in layers:
        box = t["box"]
        assert box["x"] - 0.5 <= t["x"] and t["x"] + t["w"] <= box["x"] + box["w"] + 0.5, t
    assert _overlapping(texts) == []
    assert asked == [] and page.errors == []
    return shown


def _overlapping(texts):
    out = []
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            across = min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"])
            down = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
            if across > 2 and down > 2:
                out.append((a["text"], b["text"]))
    return out


def test_clip_two_towers_are_drawn_whole_offline_with_no_label_over_another(
    page, served, artifacts
):
    case = zoo.clip()
    g = Graph.somatize(Node.of(case.model).named("clip"))
    fig = g.figure(inside=architecture(g, case.example))
    svg = fig.svg()
    asked = _open_offline(page, served, "clip", fig)
    page.locator(".smz-fit").click()
    shown = page.evaluate(
        """() => ({layers: [...document.querySelectorAll('.smz-drawing [data-id^="l:"]')]
                      .map(e => e.dataset.id),
                   edges: document.querySelectorAll('.smz-drawing .smz-edge[data-from]').length})"""
    )
    assert sorted(shown["layers"]) == sorted(
        k.split('"')[0] for k in svg.split('data-id="')[1:] if k.startswith("l:")
    )
    edges = re.findall(r'class="smz-edge[^"]*"[^>]*data-from=', svg)
    assert shown["edges"] == len(edges) > 30
    for tower in ("vision_model", "text_model"):  # both towers, each with its attention
        assert any(i.startswith(f"l:clip:{tower}.") and "attn" in i for i in shown["layers"])
    texts = page.evaluate(_TEXTS)
    assert _overlapping(texts) == []
    page.screenshot(path=str(artifacts / "users-clip.png"))
    assert asked == [] and page.errors == []


def test_names_in_chinese_stay_inside_their_boxes(page, served, artifacts):
    class 编码器(nn.Module):
        def __init__(self):
            super().__init__()
            self.线性投影层_第一层 = nn.Linear(4, 4)

        def forward(self, x):
            return self.线性投影层_第一层(x)

    name = "数据处理层" * 4
    g = Graph.somatize(Node.of(nn.Linear(4, 4)).named(name) >> Node.of(编码器()).named("编码器"))
    fig = g.figure(inside=architecture(g, torch.randn(2, 4)))
    asked = _open_offline(page, served, "chinese", fig)
    em = page.evaluate(
        """() => { const c = document.createElement('canvas').getContext('2d');
        c.font = '13px system-ui, sans-serif'; return c.measureText('数据').width / 2; }"""
    )
    assert em >= 12.5, "no CJK font here: apt-get install -y fonts-wqy-zenhei"
    texts = page.evaluate(_TEXTS)
    inside = [t for t in texts if t["box"] and any("\u4e00" <= ch <= "\u9fff" for ch in t["text"])]
    assert len(inside) >= 3  # the closed node's title, the open node's, its layer's
    for t in inside:
        box = t["box"]
        assert box["x"] <= t["x"] and t["x"] + t["w"] <= box["x"] + box["w"], t
    assert _overlapping(texts) == []
    page.screenshot(path=str(artifacts / "users-chinese.png"))
    assert asked == [] and page.errors == []


def test_a_folded_block_s_tooltip_shows_every_copy_s_number(page, served):
    from somatize.torch import probe

    case = zoo.bert()
    g = Graph.somatize(Node.of(case.model).named("bert"))
    gains = {w: n["signal_gain"] for w, n in probe(g, case.example).items() if "signal_gain" in n}
    fig = g.figure(inside=architecture(g, case.example), colour=gains, colour_label="gain")
    asked = _open_offline(page, served, "bert-gain", fig)
    page.locator(".smz-fit").click()
    page.locator("[data-id='l:bert:encoder.layer.0.attention.self.query']").hover()
    tip = page.locator(".smz-tooltip")
    tip.wait_for(state="visible")
    line = next(t for t in tip.inner_text().splitlines() if t.startswith("each copy"))
    shown = [float(v) for v in line.removeprefix("each copy").strip(" :").split(", ")]
    layer = "bert.encoder.layer.{}.attention.self.query"
    assert shown == pytest.approx([gains[layer.format(k)] for k in (0, 1)], rel=5e-3)
    assert asked == [] and page.errors == []
