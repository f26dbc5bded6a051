"""Newer real models, families neither `zoo.py` nor `more.py` holds, each from a small config at
random init (nothing is downloaded): Mamba (a selective state-space model: no attention, a
causal depthwise convolution and a scan, its own cache), Gemma 2 (logit soft-capping, local and
global attention layers alternating, norms before and after each block, tied embeddings),
GPT-NeoX (attention and MLP side by side off one residual, rotary on part of each head),
ModernBERT (local and global attention alternating, GeGLU), DINOv2 (a ViT with layer scale and
a mask token it holds but a plain forward never reads), SegFormer (overlapping patch merging and
attention over a spatially reduced sequence, a per-pixel output) and EfficientNet (depthwise
convolutions, squeeze-excitation). Each is a `zoo.Case`; `CASES` names the builders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models.zoo import BATCH, TEXT, VOCAB, Case, _image, _tokens, class_loss, token_loss


def mamba() -> Case:
    """Mamba: each block a gated causal conv and a selective scan (torch's slow path on a CPU);
    its output carries a cache of conv and state tensors unless told `use_cache=False`."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    )
    example = {"input_ids": _tokens(41)["input_ids"]}  # (Mamba takes no attention mask)
    return Case(
        "mamba", MambaForCausalLM(config), example, example["input_ids"].roll(-1, 1), token_loss
    )


def gemma2() -> Case:
    """Gemma 2: attention and final logits soft-capped by tanh, a sliding-window layer then a
    global one, RMSNorm before and after attention and MLP, tied input and output embeddings."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        **TEXT,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        attn_implementation="eager",
    )
    example = _tokens(42)
    return Case(
        "gemma2", Gemma2ForCausalLM(config), example, example["input_ids"].roll(-1, 1), token_loss
    )


def gpt_neox() -> Case:
    """GPT-NeoX (Pythia's architecture): attention and MLP in parallel off one residual,
    rotary positions on a quarter of each head."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        **TEXT,
        rotary_pct=0.25,
        use_parallel_residual=True,
    )
    example = _tokens(43)
    return Case(
        "gpt_neox",
        GPTNeoXForCausalLM(config),
        example,
        example["input_ids"].roll(-1, 1),
        token_loss,
    )


def modernbert() -> Case:
    """ModernBERT: global attention every other layer, local (a window) between, GeGLU MLPs,
    no biases; a sequence classifier on its pooled output."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    torch.manual_seed(0)
    config = ModernBertConfig(
        **TEXT,
        global_attn_every_n_layers=2,
        local_attention=4,
        num_labels=3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        attn_implementation="eager",
    )
    return Case(
        "modernbert",
        ModernBertForSequenceClassification(config),
        _tokens(44),
        torch.tensor([2, 0]),
        class_loss,
    )


def dinov2() -> Case:
    """DINOv2: a ViT whose blocks scale each residual branch by a learnt per-channel vector
    (layer scale); it holds a mask token a plain forward never reads."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(0)
    config = Dinov2Config(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        mlp_ratio=2,
        num_labels=5,
    )
    return Case(
        "dinov2", Dinov2ForImageClassification(config), _image(45), torch.tensor([3, 1]), class_loss
    )


def pixel_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per pixel of a segmentation's logits, at the logits' own resolution."""
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return F.cross_entropy(logits, target)


def segformer() -> Case:
    """SegFormer: overlapping patch embeddings, attention over a sequence reduced by a strided
    conv, Mix-FFN (a depthwise conv in the MLP), and a light all-MLP decoder giving a class per
    pixel at a quarter of the image's side."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    config = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=16,
        num_labels=4,
    )
    target = torch.randint(0, 4, (BATCH, 8, 8), generator=torch.Generator().manual_seed(46))
    return Case(
        "segformer", SegformerForSemanticSegmentation(config), _image(46), target, pixel_loss
    )


def efficientnet() -> Case:
    """EfficientNet: inverted residual blocks of depthwise convolutions with squeeze-excitation,
    widths and depths scaled from one config."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(0)
    config = EfficientNetConfig(
        image_size=32,
        width_coefficient=0.25,
        depth_coefficient=0.25,
        hidden_dim=320,  # (the top conv's width at this width_coefficient)
        num_labels=5,
    )
    return Case(
        "efficientnet",
        EfficientNetForImageClassification(config),
        _image(47),
        torch.tensor([0, 4]),
        class_loss,
    )


CASES = {
    f.__name__: f for f in (mamba, gemma2, gpt_neox, modernbert, dinov2, segformer, efficientnet)
}
"""Every case by name, each a function building it afresh."""
