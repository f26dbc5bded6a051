"""The figures of the families `models/newer.py` adds (Mamba, Gemma 2, DINOv2, SegFormer,
EfficientNet), saved with `save_html` and opened in Chromium offline, as a researcher looks at
them: every layer drawn, no label over another, each layer's names inside its shape, nothing
fetched, no error; and Gemma 2 cut into embed >> body >> head, its head's weight shared with
the embedding in the other node."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.newer import CASES  # noqa: E402
from test_users_see import _family_figure, _looked_at  # noqa: E402

from somatize import Graph, Node  # noqa: E402
from somatize.torch import architecture  # noqa: E402

# each family drawn as one node, with its repeated block unfolded where it has one
UNFOLDED = {
    "mamba": "backbone.layers.0",
    "gemma2": None,
    "dinov2": "dinov2.encoder.layer.0",
    "segformer": None,
    "efficientnet": None,
}


@pytest.mark.parametrize("name", sorted(UNFOLDED))
def test_a_newer_family_is_drawn_whole_with_its_names_inside_their_boxes(
    name, page, served, artifacts
):
    block = UNFOLDED[name]
    fig = _family_figure(CASES[name](), name, block)
    shown = _looked_at(page, served, name, fig)
    if block:  # both copies drawn, unfolded
        assert any(".1." in s for s in shown), shown
    page.screenshot(path=str(artifacts / f"newer-{name}.png"), full_page=True)


class Head(Node):
    """Gemma 2's output layer and its soft-capping of the logits, on the body's last states."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.lm_head, self.cap = model.lm_head, model.config.final_logit_softcapping

    def forward(self, out, ctx) -> torch.Tensor:
        return torch.tanh(self.lm_head(out.last_hidden_state) / self.cap) * self.cap


def embedded(h: torch.Tensor) -> dict:
    """The embedded tokens, as Gemma 2's model takes them in place of ids."""
    return {"inputs_embeds": h}


def test_gemma2_cut_into_embed_body_and_head_is_drawn_with_its_tied_head(page, served, artifacts):
    """Gemma 2 cut at its own modules gives its logits; drawn, each node's layers are there,
    and the head's tooltip names the embedding in the other node as holding its weight."""
    case = CASES["gemma2"]()
    model, ids = case.model, case.example["input_ids"]
    g = Graph.somatize(
        Node.of(model.model.embed_tokens).named("embed")
        >> Node.of(embedded)
        >> Node.of(model.model).named("body")
        >> Head(model).named("head")
    )
    with torch.no_grad():
        torch.testing.assert_close(g.forward(ids), model(input_ids=ids).logits)
    inside = architecture(g, ids)
    assert inside["head"].layer("lm_head").tied_to == "embed:"
    assert inside["body"].read_by == {"head": ["norm"]}
    fig = g.figure(inside=inside)
    for box, other in [("l:head:lm_head", "embed"), ("l:embed:", "head.lm_head")]:
        tip = re.search(rf'data-id="{re.escape(box)}"[^>]*><title>([^<]*)', fig.svg()).group(1)
        assert tip.endswith(f"weights shared with: {other}"), tip
    _looked_at(page, served, "gemma2-cut", fig)
    page.screenshot(path=str(artifacts / "newer-gemma2-cut.png"), full_page=True)
