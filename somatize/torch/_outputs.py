"""How transformers' values are written down: a `ModelOutput`, a key/value cache in it
(`somatize.torch._caches`), and a tokenizer's `BatchEncoding` or a processor's `BatchFeature`.
Each is `[module, class name, [[field, value], ...]]` (tensors by their own codec; on the wire,
framed as every tensor there), read back as the same class with the same fields. It is what a
`Node.of(model)` hands on, what a cached frozen backbone keeps, what comes back from a worker,
and what a tokenizer hands a graph. A batch's fields are its data: the tokenizer's alignment
(`encodings`, which `word_ids()` reads) is not written down, and a batch comes back without it.

Reading names a class, so it may name only a `ModelOutput` subclass, `BatchEncoding`,
`BatchFeature`, `DynamicCache` or `EncoderDecoderCache`, defined at the top of a transformers
module; anything else is refused whole (`Malformed`). A module named by the bytes is never
imported (no module `__getattr__` runs): an output's must be loaded already. The four others'
modules are fixed here, and imported where transformers is installed (a worker sent a batch
before it loaded its model). The codecs are registered the first time a value or bytes of
these kinds meet no codec while transformers is loaded (`late_codecs`); a codec the user
registered for one of these classes (or a class it derives from) is found before, and wins.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

from somatize import _hooks, codecs
from somatize.codecs import Malformed, NoCodec, codec, decode, encode
from somatize.torch import _caches

KIND = "transformers.ModelOutput"

_BATCHES = {
    "transformers.BatchEncoding": ("transformers.tokenization_utils_base", "BatchEncoding"),
    "transformers.BatchFeature": ("transformers.feature_extraction_utils", "BatchFeature"),
}
_FIXED = {*_BATCHES.values(), *_caches.NAMES}
"""What may be imported to be built (where transformers is installed and not loaded yet)."""
_SMALL = (*(m for m, _ in _BATCHES.values()), _caches.MODULE, "transformers.modeling_outputs")
"""Modules imported once transformers is loaded: the batches', the caches' and the outputs
every model shares (`BaseModelOutput`, `CausalLMOutput`, ...), so that a value kept in another
process reads back here; a model's own outputs (`CLIPOutput`) need its module imported."""
_registered: set[str] = set()


def _loaded(module: str, name: str) -> type | None:
    """The class `module.name` if this process has imported that module, else None."""
    found = sys.modules.get(module)
    cls = vars(found).get(name) if found is not None else None
    return cls if isinstance(cls, type) else None


def _families() -> dict[str, type]:
    """`{kind: class}` of what is written down here, for the modules loaded now."""
    from transformers.utils import ModelOutput

    found = {KIND: ModelOutput, "transformers.Cache": _loaded(_caches.MODULE, "Cache")}
    found |= {kind: _loaded(module, name) for kind, (module, name) in _BATCHES.items()}
    return {kind: cls for kind, cls in found.items() if cls is not None}


def fields_of(value: Any) -> list | None:
    """`[module, class name, [[field, value], ...]]` for a value written down here, None for
    anything else: what the store's codec writes down, and what the wire sends with the tensors
    in it framed (so they keep `requires_grad`, as every tensor on the wire does). A cache no
    public constructor rebuilds is refused (`NoCodec`)."""
    if "transformers" not in sys.modules:
        return None
    families = _families()
    cls = type(value)
    if isinstance(value, families.get("transformers.Cache", ())):  # (of any kind)
        fields = _caches.fields_of(value)
    elif isinstance(value, families[KIND]) or cls in families.values():  # an output, a batch
        fields = [[k, v] for k, v in value.items()]
    else:
        return None
    if (
        not cls.__module__.startswith("transformers.")
        or _loaded(cls.__module__, cls.__name__) is not cls
    ):
        raise NoCodec(
            f"a {cls.__module__}.{cls.__qualname__} is a ModelOutput of your own: reading one "
            f"back builds only transformers' own classes by name, so it would be kept and "
            f"never read back. Register a codec for it, e.g. somatize.codec("
            f"'{cls.__name__}', {cls.__name__}, dump=lambda o: somatize.codecs.encode("
            f"dict(o)), load=lambda b: {cls.__name__}(**somatize.codecs.decode(b)))"
        )
    return [cls.__module__, cls.__qualname__, fields]


def from_fields(got: Any, kind: str | None = None) -> Any:
    """The value that `fields_of` described (of `kind`, when given), refusing (`Malformed`)
    any other name, and an output where transformers is not loaded (a module the bytes name is
    imported for nobody)."""
    if not (isinstance(got, list) and len(got) == 3):
        raise Malformed(f"a {KIND} is [module, class, fields], not {type(got).__name__}")
    module, name, fields = got
    if type(module) is not str or type(name) is not str or type(fields) is not list:
        raise Malformed(f"a {KIND} is [module, class, fields] of str, str and list")
    if not module.startswith("transformers.") or "." in name:
        raise Malformed(f"a {KIND} names {module}.{name}, which is not a transformers output")
    if (module, name) in _FIXED and module not in sys.modules:
        try:  # one we name (a batch a worker is sent), never one the bytes name
            importlib.import_module(module)
        except ImportError as error:
            raise Malformed(
                f"a {module} value arrived, and transformers is not installed here: {error}"
            ) from None
    if "transformers" not in sys.modules:
        raise Malformed(f"a {kind or KIND} arrived, and this process has not loaded transformers")
    families = _families()
    cls = _loaded(module, name)
    output = cls is not None and issubclass(cls, families[KIND])
    cache = cls is not None and (module, name) in _caches.NAMES
    if not (output or cache or cls in families.values()):
        raise Malformed(
            f"a {kind or KIND} names {module}.{name}, which is not a ModelOutput class (nor a "
            f"cache or a batch) this process has imported: import {module} first"
        )
    if kind and not issubclass(cls, families[kind]):
        raise Malformed(f"a {kind} names {module}.{name}, which is not a {kind}")
    if not all(isinstance(f, list) and len(f) == 2 and type(f[0]) is str for f in fields):
        raise Malformed(f"the fields of a {KIND} are [name, value] pairs")
    try:
        if output:
            return cls(**dict(fields))
        if cache:
            return _caches.build(cls, dict(fields))
        return cls(dict(fields))
    except (TypeError, ValueError) as error:
        raise Malformed(f"a {KIND} {name} could not be built from its fields: {error}") from None


def late_codecs() -> bool:
    """Register the codecs of the transformers classes loaded now that have none yet (the
    user's own, registered before, stays); whether this call registered any."""
    if "transformers" not in sys.modules:
        return False
    for module in _SMALL:  # small, once transformers is: a batch or an output recalled
        with contextlib.suppress(ImportError):  # in a process that has made none yet is read
            importlib.import_module(module)
    fresh = False
    for kind, cls in _families().items():
        # the user's codec for it or a class it derives from wins (no public lookup in core)
        if kind in _registered or any(c in codecs._by_type for c in cls.__mro__[:-1]):
            continue
        codec(
            kind,
            cls,
            dump=lambda value: encode(fields_of(value)),
            load=lambda data, kind=kind: from_fields(decode(data), kind),
        )
        _registered.add(kind)
        fresh = True
    return fresh


_hooks.register(late_codecs=late_codecs, fields_of=fields_of, from_fields=from_fields)
