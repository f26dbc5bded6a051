"""The looks (`architecture`, the figure, `probe`, `proxies`, `compare`) on the families
`models/newer.py` adds (Mamba, Gemma 2, GPT-NeoX, ModernBERT, DINOv2, SegFormer, EfficientNet),
as a researcher uses them before training: what each answer says is checked against the model
itself."""

from __future__ import annotations

import html
import inspect
import math
import re
import warnings

import pytest
import torch
from models import more
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


def _subtitle(svg: str, box: str) -> str:
    """The second line of a box: its output shape, named by axis."""
    group = re.search(rf'data-id="{re.escape(box)}".*?</g>', svg, re.S).group(0)
    return html.unescape(re.findall(r"<text[^>]*>([^<]*)</text>", group)[1])


def test_dinov2s_class_token_joins_a_sequence_of_patches_not_an_image():
    """DINOv2 flattens its patch grid to (batch, 32 ch, 16), transposes it to 16 patches of 32
    and puts its class token first: the join is 17 tokens of 32 (as the LayerNorm after it
    says), not 17 channels of length 32."""
    case = CASES["dinov2"]()
    g = Graph.somatize(Node.of(case.model).named("dinov2"))
    svg = g.figure(inside=architecture(g, case.example)).svg()
    at = "l:dinov2:dinov2.embeddings."
    assert _subtitle(svg, at + "patch_embeddings.projection") == "2 batch · 32 ch · 4 h · 4 w"
    assert _subtitle(svg, at + "patch_embeddings.flatten") == "2 batch · 32 ch · 16 len"
    for box in ("cat", "add", "dropout"):
        assert _subtitle(svg, at + box) == "2 batch · 17 len · 32 dim", box


def test_segformers_upsampled_maps_and_efficientnets_padded_image_are_images():
    """torch defines an interpolation and a 2-d pad on (batch, ch, h, w): SegFormer's decoder
    interpolates each stage's map to 8×8 and joins them on their channels, EfficientNet pads
    its image before its stem; each is named an image's axes, not numbered."""
    for name, want in [
        (
            "segformer",
            {
                "decode_head.interpolate": "2 batch · 16 ch · 8 h · 8 w",
                "decode_head.cat": "2 batch · 32 ch · 8 h · 8 w",
            },
        ),
        ("efficientnet", {"efficientnet.embeddings.padding": "2 batch · 3 ch · 33 h · 33 w"}),
    ]:
        case = CASES[name]()
        g = Graph.somatize(Node.of(case.model).named(name))
        svg = g.figure(inside=architecture(g, case.example)).svg()
        for box, text in want.items():
            assert _subtitle(svg, f"l:{name}:{box}") == text, box


def test_a_function_box_takes_no_path_of_a_module_in_its_block():
    """Mamba's mixer holds a Conv1d at `mixer.conv1d` and, off its fast kernels, convolves with
    `F.conv1d` on that module's weight, never calling it: the function's box is `conv1d_1`, as
    torch.fx would name it, and no box says it is the module at `mixer.conv1d` (a Conv1d of
    320 weights drawn as a function with none, and keyed so in the probe)."""
    case = CASES["mamba"]()
    inside = architecture(case.model, case.example, most=400)["mambaforcausallm"]
    mixer = "backbone.layers.0.mixer."
    paths = {la.path: la for la in inside.layers}
    assert mixer + "conv1d" not in paths  # (the module is never called)
    conv = paths[mixer + "conv1d_1"]
    assert (conv.label, conv.kind, conv.params) == ("conv1d", "conv", 0)
    found = probe(case.model, case.example, most=400)
    assert "mambaforcausallm." + mixer + "conv1d_1" in found
    assert "mambaforcausallm." + mixer + "conv1d" not in found


def test_probing_a_mamba_decoding_step_on_its_cache_says_why_it_cannot():
    """Mamba's cache holds each layer's convolution and scan state, which a step writes over in
    place after reading it, so no backward runs through a step on it (a plain forward and
    `.backward()` fail alike): the probe's error says so and what to do."""
    case = CASES["mamba"]()
    model, ids = case.model.eval(), case.example["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache_params
    with pytest.raises(RuntimeError, match="inplace") as raised:
        # the name the cache goes in by: `cache` from transformers 5.24 on, `cache_params` before
        # it (the newest release pip picks for Python 3.10 is older)
        named = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "cache_params"
        )
        probe(model, {"input_ids": ids[:, -1:], named: cache, "use_cache": True})
    said = " ".join(getattr(raised.value, "__notes__", []))
    assert "probe" in said and "cache" in said and "use_cache=False" in said, said


def test_architecture_without_an_example_says_why_a_node_it_cannot_read_is_not_there():
    """torch.fx cannot follow a transformers DINOv2, and without an example nothing else can
    read it: the answer has no entry for it, and a warning names the node, fx's reason and the
    fix, rather than an empty dict with nothing said."""
    case = CASES["dinov2"]()
    with pytest.warns(UserWarning, match="dinov2forimageclassification") as said:
        assert architecture(case.model) == {}
    text = str(said[0].message)
    assert "torch.fx" in text and "example" in text, text


def test_probe_gains_of_efficientnets_vanishing_signal_are_its_own():
    """EfficientNet at random init shrinks its signal block by block to about 1e-20 and less,
    whose squares are under float32's normal numbers: each place's signal_gain is still the
    RMS of its output over the RMS of its input, as float64 reads them by hand (a SiLU on
    values that small halves them: 0.5), not a 0 or a number off by half."""
    case = CASES["efficientnet"]()
    model = case.model.eval()
    found = probe(model, case.example, most=1000)
    rms: dict[str, tuple[float, float]] = {}

    def heard(path):
        def hook(module, args, out):
            if path not in rms:
                rms[path] = tuple(t.double().pow(2).mean().sqrt().item() for t in (args[0], out))

        return hook

    hooks = [
        m.register_forward_hook(heard(p))
        for p, m in model.named_modules()
        if p and not list(m.children()) and not isinstance(m, torch.nn.Dropout)
    ]
    with torch.no_grad():
        model(case.example)
    for h in hooks:
        h.remove()
    checked = 0
    for path, (given, made) in rms.items():
        numbers = found.get(f"efficientnetforimageclassification.{path}", {})
        if given > 0 and "signal_gain" in numbers:
            assert math.isclose(numbers["signal_gain"], made / given, rel_tol=1e-4), path
            checked += 1
    assert checked > 30 and min(g for g, _ in rms.values() if g > 0) < 1e-19


def test_mambas_scan_starting_from_a_state_of_zeros_is_not_called_dead():
    """Mamba's scan (torch's path on a CPU) starts from a state of zeros: its first step
    multiplies that state, so the product is zeros because a factor it was given is, not a
    dead unit; the probe does not count its zeros, and the comparison flags nothing dead."""
    from somatize.figures import compare

    case = CASES["mamba"]()
    found = probe(case.model, case.example, most=1000)
    first = found["mambaforcausallm.backbone.layers.0.mixer.mul_3"]
    assert "zero_frac_max" not in first and first["nan"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProxyLeftOut)
        df = compare({"mamba": case.model}, case.example)
    assert "DEAD" not in df.loc["mamba", "probe:flags"], df.loc["mamba", "probe:flags"]


def test_architecture_names_the_weights_a_forward_never_read():
    """DINOv2 holds a mask token its plain forward never reads (it would stand in for masked
    patches): the look names it, and only it (its class token and position table are read by
    the functions between its layers). Gemma 2, its head tied to its embedding, and Mamba,
    whose convolution weight is read by `F.conv1d` though its `conv1d` is never called, read
    every weight they hold."""
    case = CASES["dinov2"]()
    inside = architecture(case.model, case.example)["dinov2forimageclassification"]
    assert inside.unread == ["dinov2.embeddings.mask_token"]
    assert inside.to_json()["unread"] == ["dinov2.embeddings.mask_token"]
    g = Graph.somatize(Node.of(case.model).named("dinov2"))
    svg = g.figure(inside=architecture(g, case.example)).svg()
    tip = re.search(r'data-id="n:dinov2"[^>]*><title>([^<]*)', svg).group(1)
    assert "never read: dinov2.embeddings.mask_token" in html.unescape(tip), tip
    for name, node in [("gemma2", "gemma2forcausallm"), ("mamba", "mambaforcausallm")]:
        case = CASES[name]()
        for most in (48, 400):  # the mixer closed, and open
            assert architecture(case.model, case.example, most=most)[node].unread == [], name
    case = more.CASES["deberta"]()  # its relative positions' table handed to a LayerNorm
    assert architecture(case.model, case.example)["debertav2forsequenceclassification"].unread == []


def _embedded(h: torch.Tensor) -> dict:
    """Embedded tokens, as Gemma 2's model takes them in place of ids."""
    return {"inputs_embeds": h}


def test_a_weight_another_node_reads_is_not_called_never_read():
    """Gemma 2 cut into embed >> body: the body holds the embedding it is handed the output of
    and does not call it, the embed node does; no node says that weight is never read."""
    case = CASES["gemma2"]()
    model, ids = case.model, case.example["input_ids"]
    g = Graph.somatize(
        Node.of(model.model.embed_tokens).named("embed")
        >> Node.of(_embedded)
        >> Node.of(model.model).named("body")
    )
    assert {n: i.unread for n, i in architecture(g, ids).items()} == {"embed": [], "body": []}
