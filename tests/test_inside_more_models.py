"""inside on the families `models/more.py` adds (Llama, Qwen2, Whisper, wav2vec2, Swin,
DeBERTa-v2, BART, DistilBERT), as a researcher looks at one before training it: what each look
says is checked against the model itself and against float64 computations by hand."""

from __future__ import annotations

import math

import pytest
import torch
from models.more import CASES
from models.zoo import cache_name, cache_of

from somatize import Graph, Node
from somatize.torch import architecture, probe, proxies, proxy


def test_probe_of_a_model_given_labels_follows_what_it_gives_not_the_loss_it_puts_first():
    """A transformers model given `labels` puts its loss before its logits: the probe's
    cotangent is on what the model gives (its logits, its states), so every place's numbers
    are those it has without the labels."""
    case = CASES["llama"]()
    plain = probe(case.model, case.example, most=100)
    labelled = probe(case.model, {**case.example, "labels": case.target}, most=100)
    assert plain.keys() <= labelled.keys()  # and the loss's own places
    assert "jacobian_gain" in plain["llamaforcausallm.lm_head"]
    for where, numbers in plain.items():
        assert numbers.keys() == labelled[where].keys(), where
        for name, value in numbers.items():
            got = labelled[where][name]
            if isinstance(value, float):
                assert math.isclose(got, value, rel_tol=1e-5, abs_tol=1e-9), (where, name)
            else:
                assert got == value, (where, name)


def test_proxies_of_a_model_given_labels_score_what_it_gives_not_the_loss_it_puts_first():
    """Whisper given `labels` puts its loss before its logits and the encoder's states: synflow
    sums what the net gives, zen and jacob_cov perturb it, and none of them reads that loss, so
    each scores what it scores without the labels."""
    case = CASES["whisper"]()
    plain = proxies(case.model, case.example)
    labelled = proxies(case.model, {**case.example, "labels": case.target})
    assert set(plain) == {"synflow", "zen", "naswot", "jacob_cov"} == set(labelled)
    for name, score in plain.items():
        assert math.isclose(labelled[name], score, rel_tol=1e-9), name


def _step(name: str) -> tuple[torch.nn.Module, dict]:
    """A decoding step of case `name`: the next token, and the cache the prompt left."""
    case = CASES[name]()
    model, example = case.model.eval(), dict(case.example)
    ids = example.pop("decoder_input_ids" if "decoder_input_ids" in example else "input_ids")
    with torch.no_grad():
        out = model(**example, **{"decoder_input_ids" if name == "whisper" else "input_ids": ids})
    example["decoder_input_ids" if name == "whisper" else "input_ids"] = ids[:, -1:]
    example.pop("attention_mask", None)  # (the step's mask would cover the prompt too)
    return model, {**example, cache_name(out): cache_of(out)}


@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_a_look_at_a_decoding_step_leaves_the_cache_it_was_given_as_it_was(name):
    """A researcher looks at one step of decoding, given the cache the prompt left: every look
    runs the step on that cache as it was, and leaves it so (a forward grows it)."""
    model, step = _step(name)
    cache = step["cache" if "cache" in step else "past_key_values"]
    length = cache.get_seq_length()
    twin, same = _step(name)  # built afresh: the same weights and the same cache
    with torch.no_grad():
        want = twin(**same).logits  # what the step gives
    inside = architecture(model, step)
    assert cache.get_seq_length() == length
    found = probe(model, step)
    assert cache.get_seq_length() == length
    scores = proxies(model, step)
    assert cache.get_seq_length() == length
    assert scores == {of: proxy(model, step, of) for of in scores}  # each on the same step
    assert cache.get_seq_length() == length
    node = next(iter(inside))
    assert found[node]["nan"] is False and inside[node].outputs
    with torch.no_grad():
        assert torch.equal(model(**step).logits, want)  # the step as it was, on its cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's generator needs a GPU")
def test_a_look_on_the_gpu_leaves_its_random_stream_as_it_was():
    """A researcher training on a GPU probes between epochs: the looks seed CUDA's generator
    while they run (dropout draws the same masks each time) and put it back after, so the
    training's dropout goes on drawing what it would have drawn."""
    case = CASES["distilbert"]()  # in train mode: its dropout draws from CUDA's generator
    model = case.model.cuda()
    example = {k: v.cuda() for k, v in case.example.items()}
    torch.cuda.manual_seed_all(5)
    want = torch.rand(8, device="cuda")
    torch.cuda.manual_seed_all(5)
    architecture(model, example)
    probe(model, example)
    proxies(model, example, target=case.target.cuda(), objective=case.objective)
    assert torch.equal(torch.rand(8, device="cuda"), want)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_rotary_positions_have_no_gain_against_the_states_they_are_handed_for_their_dtype(name):
    """Llama's rotary embedding is handed the hidden states and reads only their dtype: its
    cosines come from the positions. A gain against those states means nothing, so it has
    none, and every place after it, computed from the states, has its own."""
    case = CASES[name]()
    found = probe(case.model, case.example, most=100)
    node = next(iter(found))
    rotary = found[f"{node}.model.rotary_emb"]
    assert "signal_gain" not in rotary and "jacobian_gain" not in rotary
    assert rotary["zero_frac_max"] < 1 and rotary["nan"] is False  # what it gave is measured
    for box in ("model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj", "lm_head"):
        assert found[f"{node}.{box}"]["signal_gain"] > 0


class Layers(Node):
    """Llama's decoder layers and final norm as one node, handed the embedded tokens: rotary
    positions made here, as `LlamaModel` makes them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers, self.rotary_emb = model.model.layers, model.model.rotary_emb
        self.norm = model.model.norm

    def forward(self, h: torch.Tensor, ctx) -> torch.Tensor:
        positions = torch.arange(h.shape[1])[None]
        cos_sin = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, position_ids=positions, position_embeddings=cos_sin)
        return self.norm(h)


def test_llama_cut_into_embed_layers_and_head_is_drawn_read_and_probed_as_the_whole():
    """Llama cut at its own modules, embed >> layers >> head: the graph gives the model's
    logits; each node says which of its layers the next node read (the embedding, one layer,
    its own path); and each place is probed as it is in the whole model."""
    model = CASES["llama"]().model
    ids = CASES["llama"]().example["input_ids"]
    g = Graph.somatize(
        Node.of(model.model.embed_tokens).named("embed")
        >> Layers(model).named("layers")
        >> Node.of(model.lm_head).named("head")
    )
    with torch.no_grad():
        torch.testing.assert_close(g.forward(ids), model(input_ids=ids).logits)
    inside = architecture(g, ids)
    assert inside["embed"].read_by == {"layers": [""]}
    assert inside["layers"].read_by == {"head": ["norm"]}
    assert inside["head"].read_by == {}
    assert sum(i.params for i in inside.values()) == sum(p.numel() for p in model.parameters())
    cut, whole = probe(g, ids, most=100), probe(model, {"input_ids": ids}, most=100)
    same = {"head": "llamaforcausallm.lm_head"}
    same |= {k: "llamaforcausallm.model." + k[len("layers.") :] for k in cut if "." in k}
    assert len(same) > 40
    for here, there in same.items():
        for name in ("signal_gain", "jacobian_gain", "zero_frac_max"):
            if name in whole[there]:
                assert math.isclose(cut[here][name], whole[there][name], rel_tol=1e-4), here


def test_wav2vec2s_weight_normed_positional_conv_is_drawn_as_the_conv_it_is():
    """wav2vec2 over raw audio: its conv stack's shapes as the strides make them, and its
    positional convolution, weight-normed (`parametrize`), one conv box labelled by its own
    class (not the class torch makes to hold the parametrization), its parameters counted."""
    case = CASES["wav2vec2"]()
    inside = architecture(case.model, case.example, most=100)["wav2vec2forsequenceclassification"]
    conv = inside.layer("wav2vec2.encoder.pos_conv_embed.conv")
    assert conv.kind == "conv" and conv.label == "Conv1d 32→32 8"
    held = case.model.wav2vec2.encoder.pos_conv_embed.conv
    assert conv.params == sum(p.numel() for p in held.parameters()) == 32 * 16 * 8 + 8 + 32
    first = inside.layer("wav2vec2.feature_extractor.conv_layers.0.conv")
    second = inside.layer("wav2vec2.feature_extractor.conv_layers.1.conv")
    assert first.shape == [2, 16, (400 - 10) // 5 + 1] and second.shape == [
        2,
        16,
        (79 - 3) // 2 + 1,
    ]
    assert inside.inputs == ["wav2vec2.feature_extractor.conv_layers.0.conv"]


def _state(model: torch.nn.Module) -> tuple:
    """Everything a look must leave as it was: values and dtypes, modes, `requires_grad`."""
    return (
        {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        [m.training for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
    )


TIED = {
    "qwen2": {"lm_head": "model.embed_tokens"},
    "whisper": {"proj_out": "model.decoder.embed_tokens"},
}
TIED["bart"] = {"lm_head": "model.encoder.embed_tokens"}
TIED["bart"]["model.decoder.embed_tokens"] = "model.encoder.embed_tokens"


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_family_is_counted_tied_once_and_left_as_it_was_by_every_look(name):
    """Each family as a node: the parameters the look counts are the model's, a tied weight
    once, each box holding a tied weight says which box holds it first; and architecture,
    probe and proxies leave weights, buffers, modes, requires_grad and the random stream as
    they were."""
    case = CASES[name]()
    model = case.model.eval() if name == "wav2vec2" else case.model  # (as probe's error says)
    before, rng = _state(model), torch.get_rng_state()
    inside = architecture(model, case.example, most=100)
    probe(model, case.example)
    proxies(model, case.example, target=case.target, objective=case.objective)
    after = _state(model)
    assert torch.equal(rng, torch.get_rng_state())
    assert before[1:] == after[1:] and before[0].keys() == after[0].keys()
    for key, value in before[0].items():
        assert value.dtype == after[0][key].dtype and torch.equal(value, after[0][key]), key
    (drawn,) = inside.values()
    assert drawn.params == sum(p.numel() for p in model.parameters())  # each parameter once
    tied = {la.path: la.tied_to for la in drawn.layers if la.tied_to}
    assert tied == TIED.get(name, {})


class _Squared(Node):
    """A loss node: the mean square of what it is given, one number."""

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return x.pow(2).mean()


def test_a_graph_ending_in_a_loss_node_beside_a_head_probes_the_loss_node_too():
    """A loss given first by one model is passed over; a node whose output is a loss, one of
    the graph's ends beside a head, gives that loss: the backward starts from it as from the
    head, and its place has its Jacobian as the head's has."""
    torch.manual_seed(0)
    body = Node.of(torch.nn.Linear(4, 4)).named("body")
    head = Node.of(torch.nn.Linear(4, 2)).named("head")
    g = Graph.somatize(body >> (_Squared().named("loss") | head))
    found = probe(g, torch.randn(3, 4))
    assert "jacobian_gain" in found["loss"] and "jacobian_gain" in found["head"]


def test_qwen2s_sliding_window_layer_is_not_folded_with_its_full_attention_layer():
    """Qwen2 told a sliding window attends within 4 tokens in its second layer only: both
    layers run the same ops on the same shapes, but they differ in a setting the user gave,
    so they are drawn as two layers, not one ×2. Without the window they are one layer ×2
    (each still knowing its own `layer_idx`, which is which copy it is)."""
    for window, times in ((None, [2]), (4, [1, 1])):
        case = CASES["qwen2"](window=window)
        (inside,) = architecture(case.model, case.example, most=100).values()
        layers = [la for la in inside.layers if la.block == "model.layers"]
        assert [la.times for la in layers] == times, window


def test_debertas_closed_attention_says_the_shape_it_gives_back_not_its_last_ops():
    """DeBERTa's DisentangledSelfAttention ends in a batched matmul over (batch·heads, seq,
    head dim) and reshapes it back: drawn closed (most=48) or open, its box says what it gives
    back, (batch, seq, hidden), not what its last op made."""
    case = CASES["deberta"]()
    for most in (48, 100):
        (inside,) = architecture(case.model, case.example, most=most).values()
        box = inside.layer("deberta.encoder.layer.0.attention.self")
        assert box.shape == [2, 8, 32], (most, box.shape)
