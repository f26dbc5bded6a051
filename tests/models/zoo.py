"""Real models as users bring them, each built from a small config at random init (nothing is
downloaded): transformers' BERT, GPT-2 (also with peft's LoRA), T5, ViT, ALBERT (one layer
shared across depth), CLIP (two towers on two inputs), Mixtral (a mixture of experts), ResNet,
ConvNext and MobileNetV2, torch's `nn.Transformer`, LSTM and GRU, and a small torchvision-style
CNN written here (residual blocks with a shared ReLU called twice, inverted-residual blocks
with squeeze-excitation and stochastic depth whose rates grow block by block, as
EfficientNet's do).

Each entry is a `Case`: the model, an example as the model takes it (a tensor, or a dict of
its forward's keywords), a target and an objective for three training steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96
SEQ = 8
BATCH = 2
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 32,
}
"""The small sizes every transformer of the suite written in these keywords is built at."""


@dataclass
class Case:
    """One model of the suite, with what it is run and trained on."""

    name: str
    model: nn.Module
    example: Any
    target: Any
    objective: Any


def _torch_init(model: nn.Module) -> nn.Module:
    """torch's own default initialisation, layer by layer (transformers' N(0, 0.02) starves
    a small vision model's signal)."""
    for m in model.modules():
        if m is not model and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return model


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's logits against the target tokens."""
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hidden_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the last hidden state (and the pooled output, if any), so
    every output the model gives is touched by the loss."""
    loss = F.mse_loss(out.last_hidden_state, target)
    pooled = getattr(out, "pooler_output", None)
    if pooled is not None:
        loss = loss + pooled.pow(2).mean()
    return loss


def class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the class logits."""
    return F.cross_entropy(_logits(out), target)


def sequence_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of an RNN's output sequence, and its last state toward zero."""
    seq, last = out
    last = last[0] if isinstance(last, tuple) else last
    return F.mse_loss(seq, target) + last.pow(2).mean()


def _tokens(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0  # the second sentence is shorter: a real mask
    return {"input_ids": ids, "attention_mask": mask}


def _image(seed: int, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, size, size, generator=g)


def bert(*, dropout: float | None = None) -> Case:
    """BERT at random init (seed 0); `dropout` sets both its hidden and attention dropout
    (0.0: a run that is the same whatever the random stream), None keeps BERT's own."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    drops = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    drops = {} if dropout is None else dict.fromkeys(drops, dropout)
    config = BertConfig(**TEXT, **drops)
    model = BertModel(config)
    target = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(1))
    return Case("bert", model, _tokens(0), target, hidden_loss)


def gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    example = _tokens(2)
    return Case("gpt2", model, example, example["input_ids"].roll(-1, 1), token_loss)


def lora() -> Case:
    """GPT-2 fine-tuned the way most are now: peft's LoRA on its attention projection, the
    base frozen, the model a `PeftModel` whose forward takes `*args, **kwargs`."""
    from peft import LoraConfig, get_peft_model

    base = gpt2().model
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    example = _tokens(14)
    return Case("lora", model, example, example["input_ids"].roll(-1, 1), token_loss)


def t5() -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    example = _tokens(3)
    example["decoder_input_ids"] = example["input_ids"].flip(1)
    return Case("t5", model, example, example["input_ids"], token_loss)


def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        num_labels=5,
    )
    model = ViTForImageClassification(config)
    return Case("vit", model, _image(4), torch.tensor([1, 3]), class_loss)


def albert() -> Case:
    """ALBERT: one encoder layer shared across depth, called three times."""
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = AlbertModel(config)
    target = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(12))
    return Case("albert", model, _tokens(12), target, hidden_loss)


def mixtral() -> Case:
    """Mixtral: a mixture of experts, two of four per token (an expert no token was routed
    to gets no gradient that step), whose expert kernel runs in float32 only."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    model = MixtralForCausalLM(config)
    example = _tokens(13)
    return Case("mixtral", model, example, example["input_ids"].roll(-1, 1), token_loss)


def clip_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """CLIP's contrastive loss: each image against each text, `target` the text each image
    goes with."""
    logits = out.logits_per_image
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def clip() -> Case:
    """CLIP: a text tower and a vision tower on two inputs, and a temperature the model itself
    holds (a parameter in no layer)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    config = CLIPConfig(
        text_config={
            **tower,
            "vocab_size": VOCAB,
            "num_attention_heads": 2,
            "max_position_embeddings": 32,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        vision_config={**tower, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    model = CLIPModel(config)
    example = {**_tokens(13), "pixel_values": _image(13)}
    return Case("clip", model, example, torch.arange(BATCH), clip_loss)


def resnet() -> Case:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[2, 1],
        layer_type="basic",
        num_labels=5,
    )
    model = _torch_init(ResNetForImageClassification(config))
    return Case("resnet", model, _image(5), torch.tensor([0, 4]), class_loss)


def convnext() -> Case:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[2, 1], num_labels=5, image_size=32
    )
    model = _torch_init(ConvNextForImageClassification(config))
    return Case("convnext", model, _image(6), torch.tensor([2, 1]), class_loss)


def mobilenet() -> Case:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    config = MobileNetV2Config(depth_multiplier=0.25, image_size=32, num_labels=5)
    model = _torch_init(MobileNetV2ForImageClassification(config))
    return Case("mobilenet", model, _image(7), torch.tensor([3, 0]), class_loss)


def transformer() -> Case:
    torch.manual_seed(0)
    model = nn.Transformer(
        d_model=16,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dim_feedforward=32,
        batch_first=True,
    )
    g = torch.Generator().manual_seed(8)
    example = {
        "src": torch.randn(BATCH, SEQ, 16, generator=g),
        "tgt": torch.randn(BATCH, 5, 16, generator=g),
    }
    target = torch.randn(BATCH, 5, 16, generator=g)
    return Case("transformer", model, example, target, F.mse_loss)


def lstm() -> Case:
    torch.manual_seed(0)
    model = nn.LSTM(6, 12, num_layers=2)  # sequence first: (time, batch, features)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(SEQ, BATCH, 6, generator=g)
    return Case("lstm", model, x, torch.randn(SEQ, BATCH, 12, generator=g), sequence_loss)


def gru() -> Case:
    torch.manual_seed(0)
    model = nn.GRU(6, 12, batch_first=True)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(BATCH, SEQ, 6, generator=g)
    return Case("gru", model, x, torch.randn(BATCH, SEQ, 12, generator=g), sequence_loss)


class SqueezeExcitation(nn.Module):
    """Channel weights from the pooled input (torchvision's, with a hard sigmoid)."""

    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class StochasticDepth(nn.Module):
    """Drops the whole residual branch of a sample with probability p while training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty([x.shape[0]] + [1] * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class BasicBlock(nn.Module):
    """ResNet's: conv-bn-relu-conv-bn, plus the input, then the same ReLU again."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class MBConv(nn.Module):
    """EfficientNet's inverted residual: expand, depthwise, squeeze-excite, project, and the
    input added back through stochastic depth."""

    def __init__(self, c: int, p: float) -> None:
        super().__init__()
        wide = 2 * c
        self.block = nn.Sequential(
            nn.Conv2d(c, wide, 1, bias=False),
            nn.BatchNorm2d(wide),
            nn.Hardswish(),
            nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False),
            nn.BatchNorm2d(wide),
            nn.Hardswish(),
            SqueezeExcitation(wide, max(1, c // 2)),
            nn.Conv2d(wide, c, 1, bias=False),
            nn.BatchNorm2d(c),
        )
        self.stochastic_depth = StochasticDepth(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.stochastic_depth(self.block(x))


class SmallNet(nn.Module):
    """A torchvision-style CNN: a stem, two residual blocks, three inverted-residual blocks
    whose stochastic-depth rates grow (0.0, 0.05, 0.1), a pooled linear head."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.layer2 = nn.Sequential(*[MBConv(c, 0.05 * i) for i in range(3)])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def smallnet() -> Case:
    torch.manual_seed(0)
    return Case("smallnet", SmallNet(), _image(11, 16), torch.tensor([4, 2]), class_loss)


CASES = {
    f.__name__: f
    for f in (
        bert,
        gpt2,
        lora,
        t5,
        vit,
        albert,
        clip,
        mixtral,
        resnet,
        convnext,
        mobilenet,
        transformer,
        lstm,
        gru,
        smallnet,
    )
}
"""Every case of the suite by name, each a function building it afresh."""


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor a model gave back (a tensor, a tuple, a ModelOutput), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def unique_params(model: nn.Module) -> int:
    """The model's parameters, each counted once however often it is tied."""
    return sum(p.numel() for p in model.parameters())


def cache_name(out) -> str:
    """The field a transformers output holds its cache in: `cache` from transformers 5.24 on,
    `past_key_values` before it (the newest release pip picks for Python 3.10 is older)."""
    return "cache" if "cache" in out else "past_key_values"


def cache_of(out):
    """The key/value cache a transformers output carries, under whichever name it has."""
    return out[cache_name(out)]
