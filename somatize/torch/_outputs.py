"""How a transformers `ModelOutput` is written down: `[module, class name, [[field, value], ...]]`,
its fields in order (tensors by their own codec; on the wire, framed as every tensor there), read
back as the same class with the same fields. It is what a `Node.of(model)` hands on, what a
cached frozen backbone keeps and what comes back from a worker.

Reading names a class, so it may name only a `ModelOutput` subclass defined at the top of a
transformers module this process has already imported (nothing is imported, no module
`__getattr__` runs); anything else is refused whole (`Malformed`). The codec is registered the
first time a value or bytes of this kind meet no codec while transformers is loaded
(`late_codecs`); a codec the user registered for these classes is found before, and wins.
"""

from __future__ import annotations

import sys
from typing import Any

from somatize import _hooks
from somatize.codecs import Malformed, codec, decode, encode

KIND = "transformers.ModelOutput"

_registered = False


def fields_of(value: Any) -> list | None:
    """`[module, class name, [[field, value], ...]]` for a `ModelOutput`, None for anything
    else: what the store's codec writes down, and what the wire sends with the tensors in
    it framed (so they keep `requires_grad`, as every tensor on the wire does)."""
    if "transformers" not in sys.modules:
        return None
    from transformers.utils import ModelOutput

    if not isinstance(value, ModelOutput):
        return None
    cls = type(value)
    return [cls.__module__, cls.__qualname__, [[k, v] for k, v in value.items()]]


def from_fields(got: Any) -> Any:
    """The `ModelOutput` that `fields_of` described, refusing (`Malformed`) any other name,
    and any at all where transformers is not loaded (it is not imported for anybody)."""
    if "transformers" not in sys.modules:
        raise Malformed(f"a {KIND} arrived, and this process has not loaded transformers")
    from transformers.utils import ModelOutput

    if not (isinstance(got, list) and len(got) == 3):
        raise Malformed(f"a {KIND} is [module, class, fields], not {type(got).__name__}")
    module, name, fields = got
    if type(module) is not str or type(name) is not str or type(fields) is not list:
        raise Malformed(f"a {KIND} is [module, class, fields] of str, str and list")
    if not module.startswith("transformers.") or "." in name:
        raise Malformed(f"a {KIND} names {module}.{name}, which is not a transformers output")
    found = sys.modules.get(module)
    cls = vars(found).get(name) if found is not None else None
    if not (isinstance(cls, type) and issubclass(cls, ModelOutput)):
        raise Malformed(
            f"a {KIND} names {module}.{name}, which is not a ModelOutput class this process "
            f"has imported: import {module} first"
        )
    if not all(isinstance(f, list) and len(f) == 2 and type(f[0]) is str for f in fields):
        raise Malformed(f"the fields of a {KIND} are [name, value] pairs")
    try:
        return cls(**dict(fields))
    except TypeError as error:
        raise Malformed(f"a {KIND} {name} could not be built from its fields: {error}") from None


def late_codecs() -> bool:
    """Register the `ModelOutput` codec if transformers is loaded and it is not yet; whether
    this call registered it."""
    global _registered
    if _registered or "transformers" not in sys.modules:
        return False
    from transformers.utils import ModelOutput

    codec(
        KIND,
        ModelOutput,
        dump=lambda value: encode(fields_of(value)),
        load=lambda data: from_fields(decode(data)),
    )
    _registered = True
    return True


_hooks.register(late_codecs=late_codecs, fields_of=fields_of, from_fields=from_fields)
