"""The figures of the families `models/more.py` adds, saved with `save_html` and opened in
Chromium offline, as a researcher looks at them: every layer drawn, no label over another, each
layer's names inside its shape (in the browser's own fonts), nothing fetched, no error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.more import CASES  # noqa: E402
from test_users_see import _TEXTS, _family_figure, _looked_at, _open_offline, _overlapping  # noqa: E402

from somatize import Graph, Node  # noqa: E402
from somatize.torch import architecture  # noqa: E402

# each family drawn as one node, with its repeated block unfolded where it has one
UNFOLDED = {"llama": "model.layers.0", "wav2vec2": "wav2vec2.encoder.layers.0", "swin": None}


@pytest.mark.parametrize("name", sorted(UNFOLDED))
def test_a_new_family_is_drawn_whole_with_its_names_inside_their_boxes(
    name, page, served, artifacts
):
    block = UNFOLDED[name]
    fig = _family_figure(CASES[name](), name, block)
    _looked_at(page, served, name, fig)
    page.screenshot(path=str(artifacts / f"more-{name}.png"), full_page=True)


def test_qwen2s_sliding_window_layer_is_drawn_beside_its_full_attention_layer(
    page, served, artifacts
):
    """Qwen2 told a sliding window on its second layer: both layers are drawn (not one ×2),
    each with its own boxes, no label over another, nothing fetched, no error."""
    case = CASES["qwen2"](window=4)
    g = Graph.somatize(Node.of(case.model).named("qwen2"))
    fig = g.figure(inside=architecture(g, case.example))
    asked = _open_offline(page, served, "qwen2-window", fig)
    page.locator(".smz-fit").click()
    shown = page.evaluate(
        """() => [...document.querySelectorAll('.smz-drawing [data-id^="b:"]')]
                 .map(e => e.dataset.id)"""
    )
    for k in (0, 1):
        assert any(s.startswith(f"b:qwen2:model.layers.{k}#") for s in shown), (k, shown)
    assert _overlapping(page.evaluate(_TEXTS)) == []
    page.screenshot(path=str(artifacts / "more-qwen2-window.png"), full_page=True)
    assert asked == [] and page.errors == []
