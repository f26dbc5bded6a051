"""How a transformers key/value cache is written down: the `past_key_values` that a causal or an
encoder-decoder model hands back with its output while `use_cache` is on (its default).

Two classes are written down, and read back as themselves, through transformers' public
constructors only:

- a `DynamicCache` whose layers are all full-attention `DynamicLayer`s: its layers' keys and
  values (`None` for a layer not filled yet), and whether it adds layers as they come (built
  without a config). It comes back as `DynamicCache(layers' keys and values)`, or, for one that
  adds layers, as `DynamicCache()` updated layer by layer;
- an `EncoderDecoderCache` of two such caches (T5's, BART's): the two, each as above.

Every other cache (static, quantized, sliding-window or offloaded layers, a subclass) holds
state that no public constructor takes back, so it is refused (`NoCodec`), saying to pass
`use_cache=False`. Bytes read back are checked first: each layer's keys and values are two
4-dimensional tensors of the same batch, heads and length, or two `None`s; anything else is
refused whole (`Malformed`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from somatize.codecs import Malformed, NoCodec

MODULE = "transformers.cache_utils"  # read where this process loaded it: never imported here
NAMES = ((MODULE, "DynamicCache"), (MODULE, "EncoderDecoderCache"))


def kinds() -> tuple[type, ...]:
    """The cache classes `build` rebuilds, where this process has loaded transformers' caches
    (none where it has not)."""
    found = sys.modules.get(MODULE)
    return () if found is None else tuple(getattr(found, name) for _, name in NAMES)


def any_cache(value: Any) -> bool:
    """Whether `value` is a transformers key/value cache of any kind, or a layer of one."""
    found = sys.modules.get(MODULE)
    return found is not None and isinstance(value, (found.Cache, found.CacheLayerMixin))


def fields_of(cache: Any) -> list:
    """`[[field, value], ...]` for a cache `build` can rebuild; `NoCodec` for any other, saying
    what to do."""
    found = sys.modules.get(MODULE)
    kind = type(cache)
    if kind is found.EncoderDecoderCache:
        return [
            ["self_attention_cache", cache.self_attention_cache],
            ["cross_attention_cache", cache.cross_attention_cache],
        ]
    lazy = kind is found.DynamicCache and cache.layer_class_to_replicate is found.DynamicLayer
    if (
        kind is not found.DynamicCache
        or cache.offloading
        or any(type(layer) is not found.DynamicLayer for layer in cache.layers)
        or (lazy and any(layer.keys is None for layer in cache.layers))
    ):
        layers = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        raise NoCodec(
            f"a transformers {kind.__name__} (layers: {', '.join(layers) or 'none'}"
            f"{', offloaded' if getattr(cache, 'offloading', False) else ''}) cannot be written "
            f"down: only a DynamicCache of DynamicLayers (or an EncoderDecoderCache of two) is "
            f"rebuilt through transformers' public API. Pass use_cache=False to the model (in "
            f"its input, or config.use_cache = False; for a model on a worker, in its input: "
            f"its copy there does not follow its config here) so that its output holds no cache"
        )
    layers = [[layer.keys, layer.values] for layer in cache.layers]
    return [["layers", layers], ["lazy", lazy]]


def _layer(i: int, pair: Any) -> tuple[Any, Any]:
    """Layer `i`'s keys and values as read back, checked."""
    if not (isinstance(pair, list) and len(pair) == 2):
        raise Malformed(f"layer {i} of a DynamicCache is [keys, values], not {pair!r:.60}")
    keys, values = pair
    if keys is None and values is None:
        return keys, values
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        raise Malformed(f"layer {i} of a DynamicCache holds keys and values that are not tensors")
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise Malformed(
            f"layer {i} of a DynamicCache holds keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)}, not two [batch, heads, length, dim] of the same "
            f"batch, heads and length"
        )
    return keys, values


def build(cls: type, fields: dict[str, Any]) -> Any:
    """The cache `fields_of` described, as `cls` (one of the two it writes down)."""
    found = sys.modules.get(MODULE)
    if cls is found.EncoderDecoderCache:
        if set(fields) != {"self_attention_cache", "cross_attention_cache"}:
            raise Malformed(f"an EncoderDecoderCache holds two caches, not {sorted(fields)}")
        caches = fields["self_attention_cache"], fields["cross_attention_cache"]
        if not all(type(c) is found.DynamicCache for c in caches):
            raise Malformed("an EncoderDecoderCache read back holds caches that are not dynamic")
        return cls(*caches)
    layers, lazy = fields.get("layers"), fields.get("lazy")
    if set(fields) != {"layers", "lazy"} or type(layers) is not list or type(lazy) is not bool:
        raise Malformed("a DynamicCache is [['layers', [[keys, values], ...]], ['lazy', bool]]")
    pairs = [_layer(i, pair) for i, pair in enumerate(layers)]
    if not lazy:
        return cls(pairs)
    cache = cls()
    for i, (keys, values) in enumerate(pairs):
        if keys is None:
            raise Malformed(f"layer {i} of a DynamicCache that adds its layers is empty")
        cache.update(keys, values, i)
    return cache
