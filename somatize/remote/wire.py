"""The wire's one encoding: a message as a msgpack header and the raw frames of its tensors.

A message is one Python value (a dict, in practice) with tensors anywhere inside it, sent as
`[header, data_1, data_2, ...]`. Plain values are msgpack's own; the rest are extension types:

- a tuple, and an int beyond 64 bits, so that they come back as they left (as a store has
  them: `somatize.codecs.plain_ext`);
- a tensor: `[k, dtype, shape, requires_grad]`, its numbers being `data_k` in C order, sent
  from and received into the tensor's own memory (`_hooks.tensor_frame`, `frame_tensor`);
- a class or function, by name: it comes back as a `Named`, which nothing here imports or
  calls (a worker looks it up in what it was allowed to build);
- a transformers `ModelOutput`, as its class's name and its fields (`_hooks.fields_of`);
  only an output class is built back;
- any other value with a codec (`somatize.codec`), as `somatize.codecs.encode` writes it.

Decoding is bounded (frames, nesting, every tensor's shape against its frame, every frame used
exactly once, text that is UTF-8); anything else is `Malformed`, and nothing in the bytes is
run. Sealing (who may send) is `somatize.remote.seal`.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from somatize import _hooks, codecs
from somatize.codecs import Malformed

__all__ = ["Malformed", "Named", "encode", "decode", "unwritable", "MOST_FRAMES", "MOST_MESSAGE"]

MOST_FRAMES = 4096
"""The most frames one message may have (its header and its tensors)."""

MOST_MESSAGE = 4
"""A message is at most this many times as large as the largest frame a worker takes
(`--max-message`), all frames counted."""

_TENSOR, _NAMED, _VALUE, _FIELDS = 3, 4, 5, 6  # 1 and 2 are codecs.PLAIN: a tuple, a big int


@dataclass(frozen=True)
class Named:
    """A class or function that crossed by name. Never imported or called here: a worker
    resolves it against what it was allowed to build (`somatize.remote.allowed`)."""

    module: str
    qualname: str

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class _Writer:
    """msgpack's `default` for one message: gathers the tensors' frames as it goes."""

    def __init__(self, where: str | None) -> None:
        self.frames: list[Any] = []
        self.where = where

    def pack(self, value: Any) -> bytes:  # refuses what `decode` would: as a store does
        return codecs.pack(value, self.default, "strict", self.where or "a value")

    def default(self, value: Any) -> Any:
        plain = codecs.plain_ext(value, self.pack)
        if plain is not None:
            return plain
        framed = _hooks.tensor_frame(value)
        if framed is not None:
            head, buffer = framed
            self.frames.append(buffer)
            return msgpack.ExtType(_TENSOR, self.pack([len(self.frames), *head]))
        if type(value) is Named:
            return msgpack.ExtType(_NAMED, self.pack([value.module, value.qualname]))
        if isinstance(value, type) or isinstance(value, _FUNCTIONS):
            module = getattr(value, "__module__", None)
            qualname = getattr(value, "__qualname__", None)
            if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
                raise codecs.NoCodec(
                    f"{value!r:.60} is defined inside a function (or has no module) and cannot "
                    "cross by name: define it at module level, or send it as code to a worker "
                    "that accepts code (mode='network')"
                )
            return msgpack.ExtType(_NAMED, self.pack([module, qualname]))
        try:
            fields = _hooks.fields_of(value)
        except codecs.NoCodec as error:  # a cache of a kind not rebuilt: said as a store says it
            whose = f" in {self.where}" if self.where else ""
            raise codecs.NoCodec(f"the {type(value).__qualname__}{whose}: {error}") from None
        if fields is not None:
            return msgpack.ExtType(_FIELDS, self.pack(fields))
        return msgpack.ExtType(_VALUE, codecs.encode(value, where=self.where))


def encode(message: Any, *, where: str | None = None) -> list[Any]:
    """`message` as frames: its msgpack header, then one buffer per tensor in it.

    `where` says whose value it is, so that a value nobody can write down is a `NoCodec`
    naming it, and nesting that `decode` refuses a `ValueError` naming it, as a store says both.
    """
    _hooks.ready()  # torch loaded: its tensors are framed by somatize.torch
    writer = _Writer(where)
    return [writer.pack(message), *writer.frames]


def unwritable(parts: Iterable[tuple[str, Any]], error: Exception) -> Exception:
    """After a message failed to encode with `error`: the error of the first of `parts`
    (`(whose, value)` each, `whose` as `encode`'s `where`) that cannot be written down, which
    names whose value it is; `error` when each can (it was another part of the message).
    Each part is encoded again, so naming costs nothing until something fails."""
    for whose, value in parts:
        try:
            encode(value, where=whose)
        except Exception as found:
            return found
    return error


class _Reader:
    """msgpack's `ext_hook` for one message: builds tensors on its frames, bounded."""

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames
        self.used: set[int] = set()

    def unpack(self, data: Any) -> Any:  # nesting counted with any codecs.decode inside it
        return codecs.unpack(data, self.hook, text="strict")

    def hook(self, code: int, data: bytes) -> Any:
        if code in codecs.PLAIN:
            return codecs.plain_value(code, data, self.unpack)
        if code == _TENSOR:
            return self.tensor(self.unpack(data))
        if code == _NAMED:
            said = self.unpack(data)
            if type(said) is not list or len(said) != 2 or not all(type(s) is str for s in said):
                raise Malformed(f"a name that is not [module, qualname]: {said!r:.80}")
            return Named(*said)
        if code == _FIELDS:
            said = self.unpack(data)
            _hooks.ready(torch_needed=True)
            try:
                return _hooks.from_fields(said)
            except ValueError as error:  # a class of a module not imported here
                named = said[0] if type(said) is list and said and type(said[0]) is str else "?"
                raise Malformed(
                    f"a value by its fields does not build: {error}. A worker builds only "
                    f"classes of modules it has imported, and imports none a message names: "
                    f"start the worker with --import {named:.100}"
                ) from None
        if code == _VALUE:
            return _utf8(codecs.decode(data))  # Malformed or NoCodec when it does not decode
        raise Malformed(f"an extension type {code} this wire does not write")

    def tensor(self, said: Any) -> Any:
        if type(said) is not list or len(said) != 4 or type(said[0]) is not int:
            raise Malformed(f"a tensor that is not [frame, dtype, shape, grad]: {said!r:.80}")
        k = said[0]
        if not 0 < k < len(self.frames) or k in self.used:
            raise Malformed(f"a tensor names frame {k} of {len(self.frames) - 1}, or one taken")
        self.used.add(k)
        _hooks.ready(torch_needed=True)
        try:
            return _hooks.frame_tensor(said[1:], _buffer(self.frames[k]))
        except ValueError as error:
            raise Malformed(str(error)) from None


def _utf8(value: Any) -> Any:
    """`value`, unless text in it (in its lists, tuples and dicts) is not UTF-8: a lone
    surrogate, which `codecs.decode` reads back (a store may hold one) and no answer can
    carry, is `Malformed` here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode()
            except UnicodeEncodeError as error:
                raise Malformed(
                    f"text that is not UTF-8 ({error.reason}, at {error.start}): {item!r:.60}; "
                    "send text as UTF-8, or bytes"
                ) from None
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return value


def _buffer(frame: Any) -> memoryview:
    """A frame (bytes, a zmq.Frame, a numpy array) as a flat byte view, without copying."""
    view = memoryview(getattr(frame, "buffer", frame))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def decode(frames: list[Any]) -> Any:
    """The message `frames` carry (the header first), tensors built on their frames.

    Refuses (`Malformed`) frames that are not a whole message: more than `MOST_FRAMES`,
    values nested more than `somatize.codecs.DEPTH` deep, a tensor whose head does not add up
    to its frame, a frame used twice or never, text that is not UTF-8. A value of a kind no
    codec is registered for is `NoCodec`. Nothing is imported, called or unpickled.
    """
    if not frames:
        raise Malformed("a message of no frames")
    if len(frames) > MOST_FRAMES:
        raise Malformed(f"a message of {len(frames)} frames, more than {MOST_FRAMES}")
    reader = _Reader(frames)
    try:
        value = reader.unpack(_buffer(frames[0]))
    except (Malformed, codecs.NoCodec):
        raise
    except Exception as error:
        raise Malformed(f"the header does not parse: {type(error).__name__}: {error}") from None
    if len(reader.used) != len(frames) - 1:
        raise Malformed(f"{len(frames) - 1 - len(reader.used)} frame(s) no tensor names")
    return value
