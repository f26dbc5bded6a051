"""What kind of thing a layer is, by role, and a short label for drawing it.

A figure shapes and colours a layer by its kind, so the answer has to be right for classes
nobody told us about: the table below is checked against a class's whole ancestry, and past it
a module is known by what it computes with (its weights, the modules it is made of); only a
module holding neither is guessed by its name.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from somatize.torch._modules import parts_of

__all__ = ["KINDS", "class_name", "kind_of", "label_of", "recognised"]

KINDS = tuple(
    "learned conv recurrent attention norm activation regular shaping block other".split()
)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _sized_classes(*names: str) -> tuple[type, ...]:
    """torch.nn's classes `<name>1d`, `<name>2d` and `<name>3d`, those this torch has."""
    found = (getattr(nn, f"{n}{d}d", None) for n in names for d in (1, 2, 3))
    return tuple(c for c in found if c is not None)


_CONVS = _sized_classes("Conv", "ConvTranspose")  # (the lazy ones are their subclasses)
#: the batch norms, whose running statistics a forward in train mode moves
BATCH_NORMS = (nn.SyncBatchNorm, *_sized_classes("BatchNorm", "LazyBatchNorm"))
_FEATURE_NORMS = (*BATCH_NORMS, *_sized_classes("InstanceNorm", "LazyInstanceNorm"))
_NORMS = (*_FEATURE_NORMS, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
_DROPOUTS = (nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout, *_sized_classes("Dropout"))
_SHAPING = (
    *_sized_classes(
        *"MaxPool AvgPool AdaptiveMaxPool AdaptiveAvgPool LPPool ConstantPad ReflectionPad "
        "ReplicationPad ZeroPad CircularPad".split()
    ),
    *(
        getattr(nn, name)
        for name in "Flatten Unflatten Upsample PixelShuffle PixelUnshuffle ChannelShuffle Fold "
        "Unfold Identity".split()
    ),
)
# (kind, base classes); checked in this order, so attention wins over "has children".
_BY_CLASS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("attention", (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)),
    ("conv", _CONVS),
    ("recurrent", (nn.RNNBase, nn.RNNCellBase)),
    ("norm", (*_NORMS, getattr(nn, "RMSNorm", nn.LayerNorm))),
    ("regular", _DROPOUTS),
    ("shaping", _SHAPING),
    ("learned", (nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag)),
    ("block", _CONTAINERS),
)

_ATTENTION = re.compile(r"Attention|Attn")
_NORM = re.compile(r"Norm(\d+d)?$")
_RECURRENT = re.compile(r"LSTM|GRU|RNN")

# Names, for a module outside torch's table that holds no weight and no module: what it does
# cannot be read off what it computes with, so its name is the best guess there is.
_BY_NAME: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", _ATTENTION),
    ("norm", _NORM),
    ("recurrent", _RECURRENT),
    ("regular", re.compile(r"Dropout|DropPath|StochasticDepth")),
    ("shaping", re.compile(r"Pool|Pad|Flatten|Upsampl|Reshape|Permute|Shuffle|View")),
    (
        "activation",
        re.compile(r"ReLU|GELU|SiLU|Swish|Mish|Sigmoid|Tanh|Softmax|Softplus|ELU|Activation"),
    ),
)

# Functions and tensor methods met between modules in a traced forward.
_FUNCTIONS: dict[str, str] = {
    **dict.fromkeys(
        "relu relu6 gelu silu mish elu selu celu sigmoid tanh softmax log_softmax softplus "
        "leaky_relu hardtanh hardswish hardsigmoid logsigmoid glu".split(),
        "activation",
    ),
    **dict.fromkeys(
        "flatten reshape view permute transpose squeeze unsqueeze cat concat stack split chunk "
        "max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d "
        "adaptive_avg_pool2d adaptive_max_pool2d pad interpolate pixel_shuffle mean t "
        "contiguous expand repeat narrow".split(),
        "shaping",
    ),
    **dict.fromkeys("dropout dropout1d dropout2d dropout3d alpha_dropout".split(), "regular"),
    **dict.fromkeys("layer_norm batch_norm group_norm instance_norm rms_norm".split(), "norm"),
    **dict.fromkeys("conv1d conv2d conv3d conv_transpose1d conv_transpose2d".split(), "conv"),
    **dict.fromkeys("linear bilinear embedding".split(), "learned"),
    "scaled_dot_product_attention": "attention",
    "multi_head_attention_forward": "attention",
}


def function_name(fn: Any) -> str:
    """The name a function or tensor method goes by: `operator.add`, `Tensor.__add__` → `add`."""
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", None) or type(fn).__name__
    name = name.strip("_")
    if name.startswith("i") and name[1:] in ("add", "sub", "mul", "truediv"):
        name = name[1:]
    return name.rstrip("_") or "op"


def _named(ancestry: list[type], pattern: re.Pattern[str]) -> bool:
    return any(pattern.search(c.__name__) for c in ancestry)


def kind_of(what: Any) -> str:
    """What kind of thing this is, by role and never by exact class name.

    `what` is a module, a module class, or a function met in a forward (`torch.relu`,
    `operator.add`). The answer is one of `KINDS`: learned, conv, recurrent, attention, norm,
    activation, regular (dropout and the like), shaping (pool, pad, flatten, upsample, ...),
    block (containers and anything made of other modules), other.

    torch's own classes are known by their ancestry (a subclass keeps its role). Past them a
    module is known by what it computes with: one made of modules is a block, or attention
    when attention is among them (a transformer layer) or its name says so; one holding
    weights is a convolution when a weight has a kernel (three or more dimensions), else a
    learned layer (GPT-2's `Conv1D` is a linear layer) or a normalisation when its name ends
    in `Norm`. Only a module holding neither weights nor modules is guessed by its name.
    """
    if isinstance(what, nn.Module) or (isinstance(what, type) and issubclass(what, nn.Module)):
        cls = what if isinstance(what, type) else type(what)
        for kind, bases in _BY_CLASS:
            if issubclass(cls, bases):
                return kind
        ancestry = [c for c in cls.__mro__ if issubclass(c, nn.Module) and c is not nn.Module]
        # (MultiheadAttention is in that module too, and answered above)
        if any(c.__module__ == "torch.nn.modules.activation" for c in ancestry):
            return "activation"
        if isinstance(what, nn.Module):
            children = [child for _, child in parts_of(what)]
            if children:
                if _named(ancestry, _ATTENTION) or any(kind_of(c) == "attention" for c in children):
                    return "attention"
                return "block"
            weights = list(what.parameters(recurse=False))
            if weights:
                if any(p.dim() >= 3 for p in weights):
                    return "conv"
                for kind, pattern in (("norm", _NORM), ("recurrent", _RECURRENT)):
                    if _named(ancestry, pattern):
                        return kind
                return "learned"
        for kind, pattern in _BY_NAME:
            if _named(ancestry, pattern):
                return kind
        return "other"
    return _FUNCTIONS.get(function_name(what), "other")


def recognised(module: nn.Module) -> bool:
    """A composite everybody recognises: torch's own, not a plain container, with children.

    These are drawn as one box (a TransformerEncoderLayer, a MultiheadAttention) unless a
    `depth=` opens them; a user's own composite is always opened.
    """
    torchs = type(module).__module__.startswith("torch.")
    return torchs and not isinstance(module, _CONTAINERS) and bool(parts_of(module))


def _pair(v: Any) -> str:
    if isinstance(v, tuple):
        return "×".join(str(x) for x in v) if len(set(v)) > 1 else str(v[0])
    return str(v)


def class_name(module: nn.Module) -> str:
    """The name of `module`'s class: for a parametrized one (`weight_norm`, `spectral_norm`),
    the class the parametrization was put on, not the one torch makes to hold it
    (`ParametrizedConv1d`)."""
    kind = type(module)
    return (kind.__bases__[0] if is_parametrized(module) else kind).__name__


def label_of(module: nn.Module) -> str:
    """A short label for a layer: its class and what sizes it, `Conv2d 3→16 3 /2`."""
    name = class_name(module)
    if isinstance(module, _CONVS):
        text = f"{name} {module.in_channels}→{module.out_channels} {_pair(module.kernel_size)}"
        stride = module.stride if isinstance(module.stride, tuple) else (module.stride,)
        if any(s != 1 for s in stride):
            text += f" /{_pair(module.stride)}"
        return text
    if isinstance(module, nn.Linear):
        return f"{name} {module.in_features}→{module.out_features}"
    if isinstance(module, nn.Embedding):
        return f"{name} {module.num_embeddings}×{module.embedding_dim}"
    if isinstance(module, _FEATURE_NORMS):
        return f"{name} {module.num_features}"
    if isinstance(module, nn.LayerNorm):
        return f"{name} {_pair(tuple(module.normalized_shape))}"
    if isinstance(module, nn.MultiheadAttention):
        return f"{name} {module.embed_dim}/{module.num_heads}h"
    if isinstance(module, nn.RNNBase):  # its output: each direction's hidden state, side by side
        ways = 2 if module.bidirectional else 1
        width = ways * (getattr(module, "proj_size", 0) or module.hidden_size)
        said = f"{name} {module.input_size}→{width}"
        said += f", {module.num_layers} layers" if module.num_layers > 1 else ""
        return said + (", bidirectional" if ways == 2 else "")
    if isinstance(module, _DROPOUTS):
        return f"{name} {module.p:g}"
    return _sized(module, name)


def _sized(module: nn.Module, name: str) -> str:
    """A learned layer of someone else's (GPT-2's `Conv1D`) sized as a Linear is, `in→out`:
    its one matrix and the bias that says which of its sides is the output."""
    if parts_of(module) or kind_of(module) != "learned":
        return name
    held = dict(module.named_parameters(recurse=False))
    weight, bias = held.get("weight"), held.get("bias")
    if weight is None or weight.dim() != 2:
        return name
    rows, cols = weight.shape
    if bias is not None and bias.dim() == 1 and rows != cols:
        if len(bias) == rows:
            return f"{name} {cols}→{rows}"
        if len(bias) == cols:
            return f"{name} {rows}→{cols}"
    return f"{name} {rows}→{cols}" if rows == cols else name
