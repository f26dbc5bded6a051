"""More real models, the families the first zoo (`zoo.py`) leaves out, each from a small config
at random init (nothing is downloaded): Llama (rotary positions, grouped-query attention, a
key-value cache it hands back), Qwen2, Whisper (an audio encoder-decoder), wav2vec2 (a conv
feature extractor under a transformer), Swin (windowed attention over an image), DeBERTa-v2
(disentangled relative attention), BART and DistilBERT. Each is a `zoo.Case`; `CASES` names
the builders."""

from __future__ import annotations

import torch
from models.zoo import BATCH, SEQ, TEXT, VOCAB, Case, _image, _tokens, class_loss, token_loss


def llama() -> Case:
    """Llama: RMSNorm, rotary positions, two query heads sharing one key-value head, SiLU
    gates; its output carries a `DynamicCache` unless told `use_cache=False`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **TEXT,
        num_key_value_heads=1,
    )
    example = _tokens(21)
    return Case(
        "llama", LlamaForCausalLM(config), example, example["input_ids"].roll(-1, 1), token_loss
    )


def qwen2(window: int | None = None) -> Case:
    """Qwen2: Llama's shape with biases on the query, key and value projections, and tied
    input and output embeddings; with `window`, its second layer attends within that many
    tokens (its cache then holds a `DynamicSlidingWindowLayer`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **TEXT,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        use_sliding_window=window is not None,
        sliding_window=window or 4096,
        max_window_layers=1,
    )
    example = _tokens(22)
    return Case(
        "qwen2", Qwen2ForCausalLM(config), example, example["input_ids"].roll(-1, 1), token_loss
    )


def whisper() -> Case:
    """Whisper: two 1-d convolutions over a log-mel spectrogram, an encoder, and a decoder that
    attends to it, given decoder tokens."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        decoder_start_token_id=0,
    )
    g = torch.Generator().manual_seed(23)
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    example = {
        "input_features": torch.randn(BATCH, 8, 32, generator=g),
        "decoder_input_ids": tokens,
    }
    return Case(
        "whisper", WhisperForConditionalGeneration(config), example, tokens.roll(-1, 1), token_loss
    )


def wav2vec2() -> Case:
    """wav2vec2: a stack of 1-d convolutions (group norm on the first) over raw audio, a
    positional convolution, and a transformer; classified by its sequence head."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        num_labels=3,
        classifier_proj_size=16,
        mask_time_prob=0.0,
    )
    g = torch.Generator().manual_seed(24)
    audio = torch.randn(BATCH, 400, generator=g)
    return Case(
        "wav2vec2",
        Wav2Vec2ForSequenceClassification(config),
        audio,
        torch.tensor([0, 2]),
        class_loss,
    )


def swin() -> Case:
    """Swin: attention within shifted windows of an image, patches merged stage by stage."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    config = SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=5,
    )
    return Case(
        "swin", SwinForImageClassification(config), _image(25), torch.tensor([1, 4]), class_loss
    )


def deberta() -> Case:
    """DeBERTa-v2: attention that keeps content and relative position apart."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    config = DebertaV2Config(
        **TEXT,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        num_labels=3,
    )
    return Case(
        "deberta",
        DebertaV2ForSequenceClassification(config),
        _tokens(26),
        torch.tensor([2, 0]),
        class_loss,
    )


def bart(layers: int = 1) -> Case:
    """BART: an encoder-decoder whose input and output embeddings are one tensor; `layers`
    in the encoder and in the decoder."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
    )
    example = _tokens(27)
    example["decoder_input_ids"] = example["input_ids"].flip(1)
    return Case(
        "bart", BartForConditionalGeneration(config), example, example["input_ids"], token_loss
    )


def distilbert() -> Case:
    """DistilBERT: BERT's encoder without token types, sinusoid-free learnt positions."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    return Case(
        "distilbert",
        DistilBertForSequenceClassification(config),
        _tokens(28),
        torch.tensor([1, 0]),
        class_loss,
    )


CASES = {f.__name__: f for f in (llama, qwen2, whisper, wav2vec2, swin, deberta, bart, distilbert)}
"""Every case by name, each a function building it afresh."""
