"""The graph figure of the families `models/more.py` adds (Llama, Swin, BART, ...), as a
researcher draws one: what each box says and where each edge runs, read off the SVG."""

from __future__ import annotations

import html
import re

import torch
from models.more import CASES

from somatize import Graph, Node
from somatize.torch import architecture


def _edges(svg: str) -> set[tuple[str, str]]:
    """Every edge drawn, (from box, to box)."""
    return set(re.findall(r'class="smz-edge[^"]*"[^>]*data-from="([^"]+)" data-to="([^"]+)"', svg))


def _subtitle(svg: str, box: str) -> str:
    """The second line of a box: its output shape, named by axis."""
    group = re.search(rf'data-id="{re.escape(box)}".*?</g>', svg, re.S).group(0)
    return re.findall(r"<text[^>]*>([^<]*)</text>", group)[1]


def test_an_unfolded_llama_layer_takes_its_rotary_positions_from_the_rotary_embedding():
    """Every decoder layer reads the one rotary table the model made before them: unfolded,
    the second layer's rotations take it from `rotary_emb`, as the first's do, and only its
    residual stream from the layer before."""
    case = CASES["llama"]()
    g = Graph.somatize(Node.of(case.model).named("llama"))
    svg = g.figure(inside=architecture(g, case.example), expanded=["llama:model.layers.0"]).svg()
    edges = _edges(svg)
    at = "l:llama:model.layers"
    for k in (0, 1):
        for mul in ("mul", "mul_1", "mul_2", "mul_3"):
            into = {a for a, b in edges if b == f"{at}.{k}.self_attn.{mul}"}
            assert "l:llama:model.rotary_emb" in into, (k, mul, into)
            assert f"{at}.0.add_1" not in into, (k, mul, into)
    assert (f"{at}.0.add_1", f"{at}.1.input_layernorm") in edges
    assert (f"{at}.0.add_1", f"{at}.1.add") in edges  # the residual round its attention
    assert ("l:llama:model.embed_tokens", f"{at}.1.input_layernorm") not in edges


def test_an_unfolded_decoder_layer_attends_to_the_encoder_not_to_the_layer_before():
    """BART's second decoder layer attends to what the encoder gave, as the first does; the
    encoder's states and the decoder's have one shape here (source and target 8 tokens)."""
    case = CASES["bart"](layers=2)
    g = Graph.somatize(Node.of(case.model).named("bart"))
    example = case.example
    inside = architecture(g, example)
    unfold = ["bart:model.encoder.layers.0", "bart:model.decoder.layers.0"]
    edges = _edges(g.figure(inside=inside, expanded=unfold).svg())
    encoder = "l:bart:model.encoder.layers.1.final_layer_norm"  # the last encoder layer's
    dec = "l:bart:model.decoder"
    for k in (0, 1):
        assert (encoder, f"{dec}.layers.{k}.encoder_attn") in edges, k
    assert (f"{dec}.layers.0.final_layer_norm", f"{dec}.layers.1.encoder_attn") not in edges
    assert (f"{dec}.layers.0.final_layer_norm", f"{dec}.layers.1.self_attn") in edges
    assert (f"{dec}.dropout", f"{dec}.layers.1.self_attn") not in edges


def test_swins_merged_patches_are_not_named_as_an_image_s_channels_and_rows():
    """Swin's patch merging concatenates four (batch, h, w, channels) grids on their last
    dim: a tensor laid out channels last, which no layer of torch's defines as an image. Its
    axes are numbered, not named `ch · h · w` from the front; the patch embedding's Conv2d,
    channels first as torch defines it, keeps its names."""
    case = CASES["swin"]()
    g = Graph.somatize(Node.of(case.model).named("swin"))
    svg = g.figure(inside=architecture(g, case.example)).svg()
    merged = _subtitle(svg, "l:swin:swin.encoder.layers.0.downsample.cat")
    assert merged == "2 batch · 4 d1 · 4 d2 · 64 d3", merged
    conv = _subtitle(svg, "l:swin:swin.embeddings.patch_embeddings.projection")
    assert conv == "2 batch · 16 ch · 8 h · 8 w", conv


def test_a_convnexts_channels_moved_last_are_not_named_as_an_image_s():
    """ConvNeXt permutes its depthwise conv's (batch, ch, h, w) to (batch, h, w, ch) for its
    LayerNorm and MLP: what the norm gives is numbered, not `4 ch · 4 h · 16 w`; the residual
    sum, permuted back, is an image again."""
    from models import zoo

    case = zoo.convnext()
    g = Graph.somatize(Node.of(case.model).named("net"))
    svg = g.figure(inside=architecture(g, case.example)).svg()
    at = "l:net:convnext.encoder.stages.1.layers.0"
    assert _subtitle(svg, f"{at}.dwconv") == "2 batch · 16 ch · 4 h · 4 w"
    assert _subtitle(svg, f"{at}.layernorm") == "2 batch · 4 d1 · 4 d2 · 16 d3"
    assert _subtitle(svg, f"{at}.add") == "2 batch · 16 ch · 4 h · 4 w"


def test_wav2vec2s_positional_conv_keeps_its_channels_first_through_its_same_pad():
    """wav2vec2's positional Conv1d gives (batch, 32 ch, 40 len); its same-pad layer drops the
    last step and the GELU after it keeps that layout: both are `32 ch · 39 len`, not a
    sequence of 32 steps of 39 features."""
    case = CASES["wav2vec2"]()
    g = Graph.somatize(Node.of(case.model).named("w"))
    svg = g.figure(inside=architecture(g, case.example)).svg()
    at = "l:w:wav2vec2.encoder.pos_conv_embed"
    assert _subtitle(svg, f"{at}.conv") == "2 batch · 32 ch · 40 len"
    for layer in ("padding", "activation"):
        assert _subtitle(svg, f"{at}.{layer}") == "2 batch · 32 ch · 39 len", layer
    assert _subtitle(svg, "l:w:wav2vec2.encoder.add") == "2 batch · 39 len · 32 dim"


def _boxes(svg: str) -> dict[str, tuple[float, ...]]:
    """Every box and frame drawn, by its id: (x, y, w, h)."""
    found = re.findall(r'data-id="([^"]+)" data-box="([^"]+)"', svg)
    return {k: tuple(float(v) for v in box.split()) for k, box in found}


def test_swins_second_stage_of_one_layer_is_framed_as_a_stage():
    """Swin's second stage holds one SwinLayer (in a ModuleList): it is framed and named
    `SwinStage` as the first is, not drawn as a bare layer after the first stage; and the
    encoder holding both stages is framed round them."""
    case = CASES["swin"]()
    g = Graph.somatize(Node.of(case.model).named("swin"))
    drawn = _boxes(g.figure(inside=architecture(g, case.example)).svg())

    def within(inner: str, outer: str) -> bool:
        (x, y, w, h), (X, Y, W, H) = drawn[inner], drawn[outer]
        return X <= x and Y <= y and x + w <= X + W and y + h <= Y + H

    stages = "b:swin:swin.encoder.layers"
    assert within("l:swin:swin.encoder.layers.1.blocks.0", f"{stages}.1#0")
    assert within("l:swin:swin.encoder.layers.0.blocks.0", f"{stages}.0#0")
    assert not within("l:swin:swin.encoder.layers.1.blocks.0", f"{stages}.0#0")
    for k in (0, 1):
        assert within(f"{stages}.{k}#0", "b:swin:swin.encoder#0")


class WhisperEncoder(Node):
    """Whisper's encoder as a node: its states, and the decoder's tokens handed on."""

    def __init__(self, whisper: torch.nn.Module) -> None:
        self.encoder = whisper.model.encoder

    def forward(self, x, ctx):
        states = self.encoder(x["input_features"]).last_hidden_state
        return {"states": states, "tokens": x["decoder_input_ids"]}


class WhisperDecoder(Node):
    """Whisper's decoder and head, attending to what the encoder node gave."""

    def __init__(self, whisper: torch.nn.Module) -> None:
        self.decoder, self.head = whisper.model.decoder, whisper.proj_out

    def forward(self, x, ctx):
        out = self.decoder(input_ids=x["tokens"], encoder_hidden_states=x["states"])
        return self.head(out.last_hidden_state)


def test_a_decoder_node_taller_than_the_room_is_not_cut_from_its_input_box():
    """A decoder node whose decoder alone is taller than the figure is drawn down one column,
    its `input` box above the decoder that reads it: cutting the box off into a column of its
    own shortens nothing worth it and sends every edge out of it round the bottom."""
    case = CASES["whisper"]()
    g = Graph.somatize(
        WhisperEncoder(case.model).named("enc") >> WhisperDecoder(case.model).named("dec")
    )
    drawn = _boxes(g.figure(inside=architecture(g, case.example)).svg())
    x, y, w, h = drawn["i:dec"]
    X, Y, W, H = drawn["b:dec:decoder#0"]
    assert X < x + w / 2 < X + W, (drawn["i:dec"], drawn["b:dec:decoder#0"])
    assert y + h <= Y


def test_a_node_s_input_box_is_not_cut_off_into_a_column_of_its_own():
    """DeBERTa drawn as one node is taller than the figure: its head goes into a column beside
    the model, but its `input` box stays above the model that reads it (a column of one small
    box saves nothing and sends its edges round the bottom)."""
    case = CASES["deberta"]()
    g = Graph.somatize(Node.of(case.model).named("deberta"))
    drawn = _boxes(g.figure(inside=architecture(g, case.example)).svg())
    x, y, w, h = drawn["i:deberta"]
    X, Y, W, H = drawn["b:deberta:deberta#0"]
    assert X < x + w / 2 < X + W, (drawn["i:deberta"], drawn["b:deberta:deberta#0"])
    assert y + h <= Y
    cx, cy, _, _ = drawn["l:deberta:classifier"]
    assert cx > X + W and cy < Y + H / 2  # the head: in a column beside it, from its top


def _tips(svg: str) -> dict[str, str]:
    """Every box's tooltip, by its id."""
    found = re.findall(r'<g [^>]*data-id="([^"]+)"[^>]*><title>([^<]*)</title>', svg)
    return {k: html.unescape(t) for k, t in found}


def test_qwen2s_head_and_embedding_in_two_nodes_are_drawn_as_one_weight():
    """Qwen2 ties its output layer to its token embedding; cut into embed >> head, the two
    boxes are in two nodes: the head says it holds the embedding's weight (`tied_to`, the
    earlier node's box, `node:path`), and each box's tooltip names the other."""
    model = CASES["qwen2"]().model
    ids = CASES["qwen2"]().example["input_ids"]
    g = Graph.somatize(
        Node.of(model.model.embed_tokens).named("embed") >> Node.of(model.lm_head).named("head")
    )
    inside = architecture(g, ids)
    assert inside["head"].layer("").tied_to == "embed:"
    assert inside["embed"].layer("").tied_to is None
    tips = _tips(g.figure(inside=inside).svg())
    assert tips["l:head:"].endswith("weights shared with: embed")
    assert tips["l:embed:"].endswith("weights shared with: head")


def _subtitles(svg: str) -> dict[str, str]:
    """Every box's second line, by box."""
    found = re.finditer(r'data-id="(l:[^"]+)"(.*?)</g>', svg, re.S)
    texts = {m.group(1): re.findall(r"<text[^>]*>([^<]*)</text>", m.group(2)) for m in found}
    return {box: t[1] for box, t in texts.items() if len(t) > 1}


def _batch_named_honestly(subtitles: dict[str, str], batch: int) -> None:
    """The first axis called `batch` is as long as the batch; `batch×k`, k times as long."""
    for box, text in subtitles.items():
        size, name = text.split(" · ")[0].split(" ")
        if name == "batch":
            assert int(size) == batch, (box, text)
        elif name.startswith("batch×"):
            assert int(size) == batch * int(name.partition("×")[2]), (box, text)


def _mobilevit() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import MobileViTConfig, MobileViTForImageClassification

    torch.manual_seed(0)
    config = MobileViTConfig(
        image_size=32,
        patch_size=2,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        num_attention_heads=2,
        num_labels=3,
    )
    image = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    return MobileViTForImageClassification(config), image


def test_mobilevits_unfolded_patches_are_the_batch_times_the_patch_area_not_the_batch():
    """MobileViT unfolds a (2, 16, 4, 4) map into 2×2 patches, (batch × patch area, patches,
    dim) = (8, 4, 16), for its transformer, and folds them back after: the transformer's boxes
    say `8 batch×4`, not `8 batch`; the map folded back is the batch again."""
    model, image = _mobilevit()
    g = Graph.somatize(Node.of(model).named("m"))
    subtitles = _subtitles(g.figure(inside=architecture(g, image)).svg())
    at = "l:m:mobilevit.encoder.layer.2"
    assert subtitles[f"{at}.layernorm"] == "8 batch×4 · 4 len · 16 dim"
    assert subtitles[f"{at}.transformer"] == "8 batch×4 · 4 len · 16 dim"
    assert subtitles[f"{at}.conv_projection"] == "2 batch · 16 ch · 4 h · 4 w"
    _batch_named_honestly(subtitles, 2)


def test_swins_windows_are_the_batch_times_the_windows_and_its_position_bias_has_no_batch():
    """Swin attends within windows: (batch × windows, window area, dim) = (8, 16, 16) in its
    first stage (4 windows of 4×4 patches), (2, 16, 32) in its second (one window). The
    relative position bias, made from a parameter table by indexing, a permute and an
    unsqueeze, (1, heads, 16, 16), comes from no input: its first axis is numbered, not the
    batch."""
    case = CASES["swin"]()
    g = Graph.somatize(Node.of(case.model).named("swin"))
    subtitles = _subtitles(g.figure(inside=architecture(g, case.example, most=500)).svg())
    first = "l:swin:swin.encoder.layers.0.blocks.0"
    biases = [n for n, _ in case.model.named_modules() if n.endswith("relative_position_bias")]
    for name in biases:  # a module of its own in transformers' newer Swin, inline before it
        assert subtitles[f"l:swin:{name}"] == "1 d0 · 2 d1 · 16 d2 · 16 d3", name
    assert "8 batch×4 · 16 len · 16 dim" in subtitles.values()
    assert subtitles[f"{first}.layernorm_before"] == "2 batch · 64 len · 16 dim"
    _batch_named_honestly(subtitles, 2)


def test_berts_embeddings_name_the_batch_where_each_is_as_long_as_it():
    """BERT's three embeddings: the words' come from the input ids (the batch), the token
    types' from a buffer expanded to the batch (as long as it: the batch too), the positions'
    from a table with a leading 1 (no batch: numbered)."""
    from models import zoo

    case = zoo.bert()
    g = Graph.somatize(Node.of(case.model).named("b"))
    svg = g.figure(inside=architecture(g, case.example)).svg()
    at = "l:b:embeddings"
    assert _subtitle(svg, f"{at}.word_embeddings") == "2 batch · 8 len · 32 dim"
    assert _subtitle(svg, f"{at}.token_type_embeddings") == "2 batch · 8 len · 32 dim"
    assert _subtitle(svg, f"{at}.position_embeddings") == "1 d0 · 8 len · 32 dim"
