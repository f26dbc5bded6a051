"""The looks (`architecture`, the figure, `probe`, `proxies`, `compare`) on the families
`models/newer.py` adds (Mamba, Gemma 2, GPT-NeoX, ModernBERT, DINOv2, SegFormer, EfficientNet),
as a researcher uses them before training: what each answer says is checked against the model
itself."""

from __future__ import annotations

import math
import warnings

from models.newer import CASES

from somatize import Graph, Node
from somatize.torch import ProxyLeftOut, architecture, probe, proxies


def test_probe_gains_at_an_eager_attentions_additive_mask_are_finite():
    """Gemma 2's eager attention adds a mask holding float32's lowest number where a key is
    masked: the add's output holds no inf, and its RMS (about 1e38, too large to square in
    float32) is read as it is, so its gain is a large finite number, not inf."""
    case = CASES["gemma2"]()
    found = probe(case.model, case.example, most=400)
    adds = [w for w in found if w.endswith("self_attn.add_2")]
    assert len(adds) == 2, sorted(found)
    for where, numbers in found.items():
        assert numbers["inf"] is False and numbers["nan"] is False, where
        for name, value in numbers.items():
            assert not isinstance(value, float) or math.isfinite(value), (where, name, value)
    for where in adds:
        assert found[where]["signal_gain"] > 1e30, found[where]


def test_naswot_on_mamba_says_its_activation_modules_never_ran():
    """Mamba holds an `act` module in each mixer and computes with `F.silu`: naswot is left
    out saying the activation layers it holds never ran, not with torch's own error."""
    case = CASES["mamba"]()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        scores = proxies(case.model, case.example)
    left = {w.message.proxy: w.message.why for w in said if w.category is ProxyLeftOut}
    assert "naswot" not in scores and "synflow" in scores
    assert "none of them ran" in left["naswot"], left["naswot"]
    assert "F.relu" in left["naswot"], left["naswot"]


def test_an_eager_attentions_additive_mask_is_no_data_read_from_the_input():
    """Gemma 2 and ModernBERT (eager attention) turn the attention mask they are given into
    numbers, `where(mask, 0, lowest)`, added to the scores: a mask, not the data, so the node's
    input is read by its embedding alone, as Llama's (whose mask stays boolean) is, and the
    figure draws no edge from the input into each attention."""
    for name, embedding in [
        ("gemma2", "model.embed_tokens"),
        ("modernbert", "model.embeddings.tok_embeddings"),
    ]:
        case = CASES[name]()
        g = Graph.somatize(Node.of(case.model).named(name))
        for most in (48, 400):  # attention closed, and open
            assert architecture(g, case.example, most=most)[name].inputs == [embedding], most
        svg = g.figure(inside=architecture(g, case.example)).svg()
        assert f'data-from="i:{name}"' not in svg  # (no input box: one layer reads it)
