"""How a value is written down when it leaves the process: to a store, or down a wire.

Plain values need nothing: None, bools, ints of any size, floats (nan and inf too), str, bytes,
lists, tuples and dicts, nested. They come back with the types they left with (a tuple stays a
tuple, `2**100` stays an int). Anything else needs a codec, registered once::

    somatize.codec("frame", pd.DataFrame, dump=lambda df: df.to_parquet(), load=pd.read_parquet)

The bytes are msgpack, with extension types for what JSON lacks. Nothing is ever pickled, so
reading bytes from somewhere else cannot run code, and the same value always gives the same
bytes, so a digest of them can be a cache key. Bytes read back are not trusted: tuples and
registered values nested more than `DEPTH` deep (each level costs the decoder C stack), lists
and dicts nested more than msgpack's 1024 deep, lengths longer than the bytes that hold them,
a numpy header that promises more numbers than follow, and a codec whose `load` fails are all
`Malformed` (a `ValueError` that says which bound was passed), never a crash.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import hashlib
import importlib
import io
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from somatize import _hooks
from somatize.node import note

__all__ = [
    "DEPTH",
    "Malformed",
    "NoCodec",
    "codec",
    "codecs_registered",
    "decode",
    "digest",
    "encode",
]

# Extension type codes inside the msgpack stream. Fixed forever: changing one breaks every store.
_TUPLE = 1
_BIGINT = 2
_CODEC = 3
_ORDERED = 4  # a collections.OrderedDict (a state_dict), its items as [key, value] pairs

# Kinds that ship with somatize carry their kind in the extension code itself, so their bytes
# are handed to `load` without being unpacked and copied once more. Decoding a tensor imports
# `somatize.torch` (`_hooks.ready`), so it can be recalled without importing it first.
_KNOWN = {"torch.Tensor": 16, "numpy": 17}
_KNOWN_KIND = {code: kind for kind, code in _KNOWN.items()}

DEPTH = 32
"""How deep tuples and registered values may nest inside one another, in `encode` and `decode`."""


_nesting = threading.local()  # .depth: how many extension levels this thread is inside
_RECURSION = "recursion limit exceeded"  # what msgpack's packer says, refusing to go deeper


class Malformed(ValueError):
    """Bytes that `decode` will not read: not an encoded value, or past one of its bounds.

    The message says which (a truncated value, a length longer than its bytes, nesting
    deeper than `DEPTH`, a codec that could not load its part). Nothing was run, nothing
    is half-built: the bytes are refused as a whole. The wire's `decode` refuses with it
    too (`somatize.remote.Malformed` is this class): frames that are not a message.
    """


class NoCodec(TypeError):
    """A value has a type that no codec knows how to write down.

    Raised by `encode` (and so by a store or a wire) rather than guessing: register a codec
    with `somatize.codec(kind, type, dump=..., load=...)`.
    """


@dataclass(frozen=True)
class _Codec:
    kind: str
    cls: type
    dump: Callable[[Any], bytes]
    load: Callable[[bytes], Any]


_lock = threading.Lock()
_by_kind: dict[str, _Codec] = {}
_by_type: dict[type, _Codec] = {}


def codec(
    kind: str,
    type: type,
    *,
    dump: Callable[[Any], bytes],
    load: Callable[[bytes], Any],
) -> None:
    """Say how values of `type` (and its subclasses) are written down, under the name `kind`.

    `dump(value) -> bytes` and `load(bytes) -> value` must be inverses. The kind is written
    beside the bytes, so it must stay the same for as long as stored values are read back.
    Registering a kind again replaces it. Refuses an empty kind, a `type` that is not a
    class, and a `dump` or `load` that is not callable.
    """
    cls = type  # the spec's parameter name; the builtin is `builtins.type` below
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a codec's kind is a non-empty str, not {kind!r}")
    if not isinstance(cls, builtins.type):
        given = f"{builtins.type(cls).__name__} {cls!r:.60}"
        raise TypeError(f"codec {kind!r}: type must be a class, not {given}: pass type(value)")
    if not callable(dump) or not callable(load):
        raise TypeError(f"codec {kind!r}: dump and load must both be callable")
    with _lock:
        old = _by_kind.get(kind)
        if old is not None and _by_type.get(old.cls) is old:
            del _by_type[old.cls]
        _by_kind[kind] = _by_type[cls] = _Codec(kind, cls, dump, load)


def codecs_registered() -> list[str]:
    """The kinds of codec registered so far, in the order they were first registered."""
    with _lock:
        return list(_by_kind)


def _codec_for(value: Any) -> _Codec | None:
    found = _registered(value)
    if found is None:  # asked again once somatize.torch and the libraries loaded since register
        _hooks.ready()
        _hooks.late_codecs()
        found = _registered(value)
    if found is None and "numpy" in sys.modules:  # numpy's arrays and scalars, once it is loaded
        import numpy as np

        if isinstance(value, (np.ndarray, np.generic)) and value.dtype != object:
            return _NUMPY
    return found


def _registered(value: Any) -> _Codec | None:
    """The codec registered for the value's type or the nearest class it derives from."""
    return next(filter(None, map(_by_type.get, type(value).__mro__)), None)


class _Failed(Exception):
    """Its args are `(value, kind, error)`: no codec knows `value` (`kind` and `error` None),
    or codec `kind` failed on it with `error`."""


MOST = 2**32 - 1
"""The most bytes one value may take (msgpack's bound on a bytes, str or extension)."""


PLAIN = (_TUPLE, _BIGINT)
"""The extension codes of a tuple and of an int beyond 64 bits: the same in a store and on
the wire (`somatize.remote.wire`), both written by `plain_ext` and read by `plain_value`."""


def plain_ext(value: Any, pack: Callable[[Any], bytes]) -> msgpack.ExtType | None:
    """A tuple (its items as a list, written down by `pack`) or an int beyond 64 bits as its
    extension type, or None for any other value."""
    kind = type(value)
    if kind is tuple:
        return msgpack.ExtType(_TUPLE, pack(list(value)))
    if kind is int:  # msgpack asks only for one that does not fit in 64 bits
        size = (value.bit_length() + 8) // 8
        return msgpack.ExtType(_BIGINT, value.to_bytes(size, "big", signed=True))
    return None


def plain_value(code: int, data: bytes, unpack: Callable[[Any], Any]) -> Any:
    """The tuple (its items read back by `unpack`) or the int that `plain_ext` wrote with
    `code`, one of `PLAIN`; a tuple whose items are not a list is `Malformed`."""
    if code == _BIGINT:
        return int.from_bytes(data, "big", signed=True)
    items = unpack(data)
    if type(items) is not list:
        raise Malformed("a tuple that holds no items")
    return tuple(items)


def _default(value: Any) -> msgpack.ExtType:
    plain = plain_ext(value, pack)
    if plain is not None:
        return plain
    if type(value) is collections.OrderedDict:  # a state_dict; not its subclasses (outputs)
        return msgpack.ExtType(_ORDERED, pack([[k, v] for k, v in value.items()]))
    found = _codec_for(value)
    if found is None:
        raise _Failed(value, None, None)
    try:
        data = found.dump(value)
    except Exception as error:  # a meta tensor, a sparse one, the codec's own refusal
        raise _Failed(value, found.kind, error) from error
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"codec {found.kind!r}: dump returned {type(data).__name__}, not bytes, "
            f"for a {type(value).__qualname__}"
        )
    size = memoryview(data).nbytes
    if size > MOST:
        too_big = ValueError(
            f"it is {size:,} bytes written down, more than one value may take ({MOST:,}): "
            f"keep it in pieces under several names (a tensor: torch.chunk)"
        )
        raise _Failed(value, found.kind, too_big)
    if found.kind in _KNOWN:
        return msgpack.ExtType(_KNOWN[found.kind], bytes(data))
    envelope = [found.kind, bytes(data)]  # plain: no level of nesting of its own
    return msgpack.ExtType(
        _CODEC, msgpack.packb(envelope, use_bin_type=True, unicode_errors="surrogatepass")
    )


def _deeper(depth: int, reading: bool) -> int:
    """`depth` + 1, refused past `DEPTH` (`Malformed` when `reading`)."""
    if depth > DEPTH:
        doing = "read back" if reading else "written down"
        raise (Malformed if reading else _TooDeep)(
            f"tuples (or registered values) nested more than {DEPTH} deep cannot be {doing} "
            f"(somatize.codecs.DEPTH); flatten the value, or use lists, which nest without it"
        )
    return depth + 1


class _TooDeep(ValueError):
    """A value nested past a bound that `decode` reads: `pack` says whose it was."""


def pack(
    value: Any, default: Callable = _default, text: str = "surrogatepass", where: str | None = None
) -> bytes:
    """msgpack of `value`, `default` writing what msgpack does not know (`text`: how str is);
    one level of nesting on this thread. Refuses (`ValueError`, `where` first: whose value it
    is) what `unpack` would not read back: nesting past `DEPTH` or msgpack's 1024. A store's
    values and the wire's messages alike."""
    given: collections.deque = collections.deque()

    def ask(item: Any) -> Any:  # what `default` gives, kept in the order msgpack asks
        given.append(default(item))
        return given[-1]

    depth = getattr(_nesting, "depth", 0)
    try:
        _nesting.depth = _deeper(depth, reading=False)
        # msgpack writes 1025 nested lists or dicts if the innermost is empty, but reads at
        # most 1024. Inside one more list it writes nothing that sits 1024 levels down:
        packer = msgpack.Packer(
            default=ask, autoreset=False, strict_types=True, use_bin_type=True, unicode_errors=text
        )
        try:
            packer.pack([value])
            given.clear()  # kept to be given again below, not held while the bytes are copied
            return bytes(packer.getbuffer()[1:])  # the value's bytes, after the list's header
        except ValueError as error:
            if not str(error).startswith(_RECURSION):  # a codec's own speaks of it after its name
                raise
        # Something sits 1024 levels down: a list or dict there is read by no one. Asked again
        # in the same order, `default` gives what it gave (a dump, a wire's frame) once only.
        try:
            replay = lambda v: given.popleft() if given else default(v)  # noqa: E731
            data = msgpack.packb(
                value, default=replay, strict_types=True, use_bin_type=True, unicode_errors=text
            )
            msgpack.unpackb(data, raw=True, strict_map_key=False)
            return data
        except ValueError as error:  # msgpack.StackError, reading, is one too
            if not isinstance(error, msgpack.StackError) and not str(error).startswith(_RECURSION):
                raise
            raise _TooDeep(
                "lists or dicts nested more than 1024 deep cannot be written down; flatten it"
            ) from None
    except _TooDeep as error:  # said once, by the innermost call that knows whose value
        raise error if where is None else ValueError(f"{where}: {error}") from None
    finally:
        _nesting.depth = depth


def _path_to(value: Any, bad: Any, path: str = "") -> str | None:
    """Where inside `value` the object `bad` sits, as `[0]['key']`, or None."""
    if value is bad:
        return path
    inside: list[tuple[str, Any]] = []
    if type(value) in (list, tuple):
        inside = [(f"[{i}]", item) for i, item in enumerate(value)]
    elif type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            inside += [(f" key {key!r}", key), (f"[{key!r}]", item)]
    for at, item in inside:
        found = _path_to(item, bad, path + at)
        if found is not None:
            return found
    return None


_PLAIN = (
    "plain values (None, bool, int, float, str, bytes, list, tuple, dict) need none, anything "
    "else needs one: register it with somatize.codec(kind, type, dump=..., load=...)"
)
_MODULES = {"torch.nn.modules.module.Module", "somatize.node.Node"}  # torch is not imported
_MODULE_INSTEAD = (
    "a torch module (or a node) is not written down, its weights are: keep model.state_dict() "
    "and load it into a model built the same way, model.load_state_dict(store.recall(name)); "
    "a graph's trained weights are Trainer.export(), loaded back with Trainer.load(...)"
)


def encode(value: Any, *, where: str | None = None) -> bytes:
    """The bytes that stand for `value`; `decode` gives it back with the same types.

    `where` names what is being written (say `"node 'enc'"`) so that a `NoCodec` can say
    which value had the type nobody registered. Refuses (with `NoCodec`) any value, at any
    depth, whose type is neither plain nor registered.
    """
    whose = f" in {where}" if where else ""
    try:
        return pack(value, where=where or "a value")
    except _Failed as failed:
        bad, kind, error = failed.args
        inside = _path_to(value, bad)
        said = f" at {inside.strip()}" if inside else ""
        if kind is None:
            named = [f"{c.__module__}.{c.__qualname__}" for c in type(bad).__mro__]
            raise NoCodec(
                f"no codec for {named[0]}{whose}{said}; "
                + (_MODULE_INSTEAD if _MODULES.intersection(named) else _PLAIN)
            ) from None
        text = (
            f"codec {kind!r} cannot write down the {type(bad).__qualname__}{whose}{said}: {error}"
        )
        try:
            told = type(error)(text)
        except Exception:  # an exception class that takes other arguments: a note instead
            raise note(error, text) from None
        raise told from error
    except ValueError as error:  # msgpack's bounds: one bytes, str, list or dict
        if "too large" not in str(error):
            raise
        raise ValueError(
            f"a value{whose} is too large to write down ({error}): one bytes, str, list or "
            f"dict holds at most {MOST:,} bytes or items; keep it in pieces under several names"
        ) from None


def _ext_hook(code: int, data: bytes) -> Any:
    if code in PLAIN:
        return plain_value(code, data, unpack)
    if code == _ORDERED:
        items = unpack(data)
        if type(items) is not list or not all(type(i) is list and len(i) == 2 for i in items):
            raise Malformed("an OrderedDict that does not hold [key, value] pairs")
        try:
            return collections.OrderedDict(items)
        except TypeError as error:  # a key that cannot be one (a list, a dict)
            raise Malformed(f"an OrderedDict with a key that cannot be one: {error}") from None
    if code == _CODEC:
        kind, payload = _envelope(data)
    elif code in _KNOWN_KIND:
        kind, payload = _KNOWN_KIND[code], data
    else:
        raise Malformed(f"unknown msgpack extension type {code} in encoded bytes")
    found = _by_kind.get(kind, _NUMPY if kind == "numpy" else None)
    if found is None:  # registered by somatize.torch, or for a library loaded since
        # a model's output, whose codec somatize.torch registers once transformers is loaded:
        # transformers is imported where it is installed (a fixed name, never one the bytes give)
        library = kind.startswith("transformers.")
        _hooks.ready(torch_needed=kind == "torch.Tensor" or library)
        if library:
            with contextlib.suppress(ImportError):  # not installed: NoCodec below says so
                importlib.import_module("transformers")
        _hooks.late_codecs()
        found = _by_kind.get(kind)
    if found is None:
        raise NoCodec(
            f"the bytes hold a value of kind {kind!r} and no codec of that kind is "
            f"registered (registered: {codecs_registered()}); import the module that "
            f"registers it, or register one with somatize.codecs.codec({kind!r}, type, "
            f"dump=..., load=...)"
        )
    try:
        return found.load(payload)
    except (Malformed, NoCodec):
        raise
    except Exception as error:  # its text may quote the payload back: say its start only
        said = str(error)
        if len(said) > 300:
            said = f"{said[:300]}… ({len(said):,} characters)"
        raise Malformed(
            f"codec {kind!r} could not load its bytes: {type(error).__name__}: {said}"
        ) from error


def _envelope(data: bytes) -> tuple[str, bytes]:
    """The kind and the bytes of a registered value, refusing anything else in their place."""
    try:
        kind, payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as error:
        raise Malformed(f"a registered value's envelope does not parse: {error!r}") from error
    if type(kind) is not str or type(payload) is not bytes:
        raise Malformed("a registered value's envelope is not (kind, bytes)")
    return kind, payload


def unpack(data: Any, hook: Callable = _ext_hook, text: str = "surrogatepass") -> Any:
    """The value `pack` wrote, `hook` reading its extension types back; one level of nesting,
    refused past `DEPTH`. Lists or dicts nested more than 1024 deep are `Malformed`."""
    depth = getattr(_nesting, "depth", 0)
    try:
        _nesting.depth = _deeper(depth, reading=True)
        return msgpack.unpackb(
            data, ext_hook=hook, raw=False, strict_map_key=False, unicode_errors=text
        )
    except msgpack.StackError:
        raise Malformed(
            "lists or dicts nested more than 1024 deep cannot be read back (msgpack's bound)"
        ) from None
    finally:
        _nesting.depth = depth


def decode(data: bytes) -> Any:
    """The value that `encode` wrote as `data`.

    Refuses (with `Malformed`, a `ValueError`) bytes that are not a whole encoded value or
    that pass one of the bounds in this module's docstring, and (with `NoCodec`) a kind that
    no codec is registered for. Never runs code carried by the bytes; never crashes on them.
    """
    try:
        memoryview(data)  # bytes, or anything holding them (bytearray, mmap, a numpy buffer)
    except TypeError:
        raise Malformed(
            f"decode reads the bytes encode wrote, not a {type(data).__name__}"
        ) from None
    try:
        return unpack(data)
    except (NoCodec, Malformed):
        raise
    except (msgpack.UnpackException, ValueError, TypeError) as error:
        raise Malformed(f"these {len(data)} bytes are not an encoded value: {error}") from error


def digest(data: bytes) -> str:
    """The content address of `data`: `"sha256:<64 hex digits>"`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# numpy is a dependency of the package but not of `import somatize`: its arrays and scalars
# are written with numpy's own .npy format (allow_pickle=False).
def _numpy_dump(value: Any) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    buffer.write(b"s" if isinstance(value, np.generic) else b"a")
    np.save(buffer, np.asarray(value), allow_pickle=False)
    return buffer.getvalue()


def _numpy_load(data: bytes) -> Any:
    import numpy as np

    stream = io.BytesIO(data[1:])
    try:  # the header says how many numbers follow: check it before anything is allocated
        one = np.lib.format.read_magic(stream) == (1, 0)
        read = np.lib.format.read_array_header_1_0 if one else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(stream)
    except ValueError as error:
        raise Malformed(f"a numpy value's header does not parse: {error}") from error
    promised, held = math.prod(shape) * dtype.itemsize, len(data) - 1 - stream.tell()
    if dtype.hasobject or promised != held:
        raise Malformed(
            f"a numpy value's header promises {shape} {dtype} ({promised} bytes) and "
            f"{held} bytes follow"
        )
    stream.seek(0)
    array = np.load(stream, allow_pickle=False)
    return array[()] if data[:1] == b"s" else array


_NUMPY = _Codec("numpy", object, _numpy_dump, _numpy_load)
