"""The wire: how one message between a broker and a worker is cut into ZeroMQ frames.

A message is one Python value (a dict, in practice) with tensors anywhere inside it. It goes as

    [MAGIC + seal + header, data_0, data_1, ...]

so a message without large tensors is one frame, sent and received in one call each.

- ``MAGIC`` is ``b"SMZ5"`` (4 bytes), so a stray connection (or a peer of another version) is
  told apart from a peer at once;
- ``seal`` is 32 bytes: a fresh random 16-byte nonce, then the tag of the nonce, the number
  of parts and every part's length (so frames cannot be re-cut, added or dropped), and every
  byte of the header and of every data frame: keyed BLAKE2b (a PRF) under the token's session
  key, one C call per part. A data frame of 64 KB or more goes through GMAC first (AES-GCM
  with nothing to encrypt, many GB/s) under a key derived for this one message from its
  nonce, in pieces of 8 MB each under its own GCM nonce, hashed on several threads at once
  (OpenSSL runs without the GIL); its tags stand in its place. A header of 2 KB or more
  (many small tensors inline) goes through Poly1305 under a one-time key instead of BLAKE2b
  (docs/remote.md, "Why BLAKE2b, Poly1305 and GMAC");
- ``header`` is msgpack, written by `somatize.codecs` (exact types: a tuple stays a tuple,
  a bool a bool), where each tensor is replaced by a reference holding its safetensors header
  (dtype, shape, byte range) and whether it asks for a gradient: that header and the tensor's
  bytes are a safetensors file cut in two. A tensor under 64 KB carries its bytes in its
  reference; a larger one names its data frame. The message sent most, a repeated run of a
  slice the worker holds (only its id and its tensors) and its plain answer, goes as a fixed
  record instead (a header whose first byte is 0xC1, which msgpack never writes): the
  request's id and names, then each tensor's slot, safetensors header and bytes (or data
  frame), so that neither side walks msgpack's hooks for it;
- each ``data_k`` is the raw bytes of one large tensor, sent straight from the tensor's own
  memory and received into a frame the tensor is then built on, so a large tensor is never
  copied on its way through (only moved to the cpu first if it lives elsewhere).

A class or function of torch or somatize (an optimizer factory, say) crosses by name and is
imported on the other side. Nothing here unpickles, and a message that does not verify is
refused before its header is even read (`Refused`); bytes that verify but do not parse are
`Malformed`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

import msgpack
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

from somatize import codecs

__all__ = [
    "MAGIC",
    "REFUSED",
    "Malformed",
    "Refused",
    "pack",
    "unpack",
    "send",
    "receive",
    "sealed",
    "run_record",
    "answer_record",
    "sign",
    "verify",
]

MAGIC = b"SMZ5"
"""The first bytes of every message (of its first frame)."""

REFUSED = b"SMZ5-REFUSED"
"""The one-frame notice a worker answers a message whose signature does not verify."""

_TENSOR = 64  # msgpack extension code for a tensor reference; codecs owns 1..3
_REF = 65  # an importable class or function, by name, from a package in REFERABLE

REFERABLE = ("torch", "somatize")
"""Packages whose classes and functions may cross by name (`torch.optim.SGD` as an argument):
resolved by import on the other side, never unpickled. Anything else needs `--accept-code`."""
_KDF = b"smz poly1305 key"  # domain of the per-message key derivation (BLAKE2b person)
_SESSION = b"smz session key"  # domain of the token's session key
_MAC = b"smz small tag"  # domain of the tag of a message under _TINY bytes
_ONE = struct.Struct("<4s2Q")  # the count and lengths of a one-frame message
_AT = struct.Struct("<IQ")  # a GMAC nonce: which frame, which piece of it
_blake2b = hashlib.blake2b
_TINY = 2048  # bytes outside large frames up to which BLAKE2b tags (above: Poly1305, faster)
_NONCE = 16
_SEAL = len(MAGIC) + _NONCE + 16  # the first frame's bytes before its header
_AT_TAG = len(MAGIC) + _NONCE  # where the tag begins
_PIECE = 8 << 20  # a large frame is GMACed in pieces of this size (on several threads)
_SMALL = 1 << 16  # a tensor below this goes inside the header, above it as its own frame

# safetensors' names for dtypes, and back.
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
}
_CODES = {v: k for k, v in _DTYPES.items()}


class Refused(Exception):
    """A message whose signature does not verify under the token: nothing in it is read."""


class Malformed(ValueError):
    """Frames that verify but are not a message (or are not even frames of one)."""


_keyed: dict[Any, tuple[Any, Any]] = {}
_modules = sys.modules
_urandom = os.urandom
_MORE = 2  # zmq.SNDMORE (the wire itself does not import zmq)


def _states(token: str | bytes) -> tuple[Any, Any]:
    """The token's two keyed BLAKE2b states (tags of small messages; the key derivation),
    under the session key BLAKE2b(token), worked out once per token: a message copies one
    instead of keying BLAKE2b afresh."""
    found = _keyed.get(token)
    if found is None:
        raw = token.encode() if isinstance(token, str) else bytes(token)
        session = _blake2b(raw, digest_size=64, person=_SESSION).digest()
        if len(_keyed) > 64:
            _keyed.clear()
        found = _keyed[token] = (
            _blake2b(key=session, digest_size=16, person=_MAC),
            _blake2b(key=session, digest_size=32, person=_KDF),
        )
    return found


def _bytes(frame: Any) -> memoryview:
    """A frame (bytes, zmq.Frame, numpy array) as a flat byte view, without copying."""
    view = memoryview(getattr(frame, "buffer", frame))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _tag(token: str | bytes, nonce: bytes, views: list[memoryview]) -> bytes:
    mac, kdf = _states(token)
    if len(views) == 1:  # the usual small message: its header alone
        total = small = views[0].nbytes
        lengths = _ONE.pack(MAGIC, 1, total)
    else:
        sizes = [v.nbytes for v in views]
        lengths = struct.pack(f"<4s{len(sizes) + 1}Q", MAGIC, len(sizes), *sizes)
        small = sum([n for n in sizes if n < _SMALL])
    # Keyed BLAKE2b (a PRF) over the nonce, the count and lengths, and every byte: one C
    # call per part. A large frame goes through GMAC first (AES-GCM with nothing to encrypt,
    # ~20x BLAKE2b's speed here) under a key made for this one message, and its tag stands in
    # its place; the lengths, hashed first, say which parts are frames and which tags.
    h = mac.copy() if small < _TINY else None
    if h is None:  # a header of many small tensors: Poly1305 runs 4x faster than BLAKE2b
        keys = kdf.copy()
        keys.update(nonce)
        h = Poly1305(keys.digest())
    h.update(nonce)
    h.update(lengths)
    keys = gmac = None
    for i, view in enumerate(views):
        if view.nbytes < _SMALL:
            h.update(view)
            continue
        if gmac is None:  # the message's own GMAC key: BLAKE2b(nonce) under the session key
            keys = kdf.copy()
            keys.update(nonce + b"gmac")
            gmac = AESGCM(keys.digest())
        for tag in _gmac(gmac, i, view):
            h.update(tag)
    return h.digest() if type(h) is not Poly1305 else h.finalize()


def _gmac(gmac: Any, i: int, view: memoryview) -> list[bytes]:
    """The GMAC tags of frame `i`'s pieces, each under its own nonce (frame, piece). A frame
    of several pieces is hashed on several threads at once (OpenSSL runs without the GIL):
    in a round trip the other side waits meanwhile, so there is a core to run on."""
    n = view.nbytes
    if n <= _PIECE:
        return [gmac.encrypt(_AT.pack(i, 0), b"", view)]
    pieces = [(_AT.pack(i, j), view[at : at + _PIECE]) for j, at in enumerate(range(0, n, _PIECE))]
    return list(_pool().map(lambda piece: gmac.encrypt(piece[0], b"", piece[1]), pieces))


_threads: Any = None
_threads_pid = 0


def _pool() -> Any:
    """The threads large frames are GMACed on, made on first use (and made again in a forked
    child, where the parent's threads do not exist)."""
    global _threads, _threads_pid
    if _threads is None or _threads_pid != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _threads = ThreadPoolExecutor(
            max_workers=max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="somatize-gmac"
        )
        _threads_pid = os.getpid()
    return _threads


def sign(token: str | bytes, frames: list[Any]) -> bytes:
    """The 32-byte seal of `frames` (the header, then the data frames) under `token`: a fresh
    random nonce and the tag of the nonce, the frames' count and lengths and every byte.

    The keys come from the session key BLAKE2b(token), worked out once per token: the tag
    is keyed BLAKE2b under it; a large frame's GMAC key (and a long header's Poly1305 key) is
    BLAKE2b of the nonce under it, never used for another message and unknown without the
    token.
    """
    nonce = os.urandom(_NONCE)
    return nonce + _tag(token, nonce, [_bytes(f) for f in frames])


def sealed(token: str | bytes, frames: list[Any]) -> list[Any]:
    """`frames` (a header, then data frames) as a message: ``[MAGIC + seal + header, *data]``."""
    header = frames[0]
    if len(frames) == 1 and type(header) is bytes and len(header) < _TINY:
        # The usual small message, as `_tag` tags it, in one go: fewer calls for a process
        # that has just woken up to send it.
        nonce = _urandom(_NONCE)
        h = (_keyed.get(token) or _states(token))[0].copy()
        h.update(nonce)
        h.update(_ONE.pack(MAGIC, 1, len(header)))
        h.update(header)
        return [b"".join((MAGIC, nonce, h.digest(), header))]
    first = b"".join([MAGIC, sign(token, frames), header])
    return [first, *frames[1:]]


def verify(token: str | bytes, frames: list[Any]) -> list[memoryview]:
    """The header and the data frames, if `frames` is a message sealed with `token`.

    Raises `Malformed` for frames that are not a message at all and `Refused` for one whose
    tag does not match (a wrong token, or bytes changed, added, dropped or re-cut on the way).
    """
    if len(frames) == 1:  # the usual small message, as `_tag` tags it, in one go
        first = frames[0]
        if type(first) is not bytes:
            # A small received frame is read as bytes (a copy of under 2 KB): a memoryview
            # of the frame and its slices cost more to a process that has just woken up.
            small = hasattr(first, "bytes") and len(first) < _SEAL + _TINY
            first = first.bytes if small else _bytes(first)
        n = len(first) - _SEAL if type(first) is bytes else first.nbytes - _SEAL
        if 0 <= n < _TINY and first[:4] == MAGIC:
            h = (_keyed.get(token) or _states(token))[0].copy()
            h.update(first[4:_AT_TAG])
            h.update(_ONE.pack(MAGIC, 1, n))
            header = first[_SEAL:]
            h.update(header)
            if not hmac.compare_digest(h.digest(), first[_AT_TAG:_SEAL]):
                raise Refused("the seal does not verify: wrong token, or bytes changed on the way")
            return [memoryview(header)]
    views = [_bytes(f) for f in frames]
    if not views or views[0][:4] != MAGIC:
        raise Malformed(f"not a somatize message ({len(views)} frames, no {MAGIC!r} first)")
    first = views[0]
    if first.nbytes < _SEAL:
        raise Malformed("not a somatize message (its first frame is shorter than a seal)")
    seal = first[4:_SEAL].tobytes()
    views[0] = first[_SEAL:]
    if not hmac.compare_digest(_tag(token, seal[:_NONCE], views), seal[_NONCE:]):
        raise Refused("the seal does not verify: wrong token, or bytes changed on the way")
    return views


class _Writer:
    """msgpack's `default` for one message: gathers the tensors' data frames as it goes.

    An object rather than closures, so nothing refers back to itself and the frames are
    freed the moment the message is (not at the next garbage collection).
    """

    __slots__ = ("buffers", "torch")

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.torch = _torch()
        if self.torch is not None and not _NUMPY:
            _numpy_dtypes()

    def default(self, value: Any) -> Any:
        if type(value) is tuple:
            return msgpack.ExtType(codecs._TUPLE, self.packb(list(value)))
        torch = self.torch
        if torch is not None and isinstance(value, torch.Tensor):
            return msgpack.ExtType(_TENSOR, _tensor_ref(value, self.buffers))
        named = _reference(value)
        if named is not None:
            return msgpack.ExtType(_REF, msgpack.packb(named))
        return codecs._default(value)

    def packb(self, value: Any) -> bytes:
        return codecs._pack(value, self.default)


def pack(
    token: str | bytes, message: Any, *, where: str | Callable[[], str] | None = None
) -> list[Any]:
    """`message` as signed frames ready for `send_multipart(..., copy=False)`.

    Refuses (`somatize.NoCodec`) a value inside whose type no codec knows; `where` says
    whose value it was (or is a function that says it, called only then).
    """
    if type(message) is dict:
        record = _record(message)
        if record is not None:  # a repeated run or its answer: a fixed record, not msgpack
            return sealed(token, record)
    writer = _Writer()
    try:
        header = writer.packb(message)
    except codecs._Missing:
        if callable(where):
            where = where()
        codecs.encode(message, where=where)  # raises the NoCodec that names the value
        raise
    return sealed(token, [header, *writer.buffers])


def send(sock: Any, frames: list[Any], *, prefix: list[bytes] | None = None) -> None:
    """Send `frames` (from `pack`) on the ZeroMQ socket `sock` as one message, in one call.

    A large tensor's frame goes from its own memory (zero-copy); the first frame (and anything
    under pyzmq's copy threshold) is copied by libzmq, which costs less than the bookkeeping
    of a zero-copy send. `prefix` goes first (a ROUTER's peer identity).
    """
    if prefix:
        for part in prefix:
            sock.send(part, _MORE, copy=True)
    last = len(frames) - 1
    if not last:
        sock.send(frames[0], copy=True)
        return
    # One call per frame rather than send_multipart (which checks every part in Python
    # first); pyzmq copies a frame under its copy threshold anyway.
    for i, frame in enumerate(frames):
        sock.send(frame, _MORE if i < last else 0, copy=False)


def receive(sock: Any, first: Any = None) -> list[Any]:
    """The frames of one message from the ZeroMQ socket `sock` (a ROUTER's peer identity
    first), zero-copy: each part read by itself, its `more` flag saying whether another
    follows, rather than `recv_multipart`'s extra socket option read per part; `first` is
    its first part when that was received already. Raises `zmq.Again` when the socket's
    receive timeout passes first."""
    frame = sock.recv(copy=False) if first is None else first
    if not frame.more:
        return [frame]
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


class _Reader:
    """msgpack's `ext_hook` for one message: builds tensors on its data frames."""

    __slots__ = ("data", "owners")

    def __init__(self, data: list[memoryview], owners: list[Any]) -> None:
        self.data = data
        self.owners = owners

    def hook(self, code: int, payload: bytes) -> Any:
        if code == _TENSOR:
            return _tensor_from(payload, self.data, self.owners)
        if code == codecs._TUPLE:
            return tuple(self.unpackb(payload))
        if code == _REF:
            return _resolve(payload)
        return codecs._ext_hook(code, payload)

    def unpackb(self, payload: Any) -> Any:
        return codecs._unpack(payload, self.hook)


def unpack(token: str | bytes, frames: list[Any]) -> Any:
    """The message `frames` carry, after checking its signature (see `verify`).

    Tensors are built on the received frames without copying. Raises `Refused` or
    `Malformed`; never runs code carried by the bytes.
    """
    body = verify(token, frames)
    header = body[0]
    if header.nbytes and header[0] == _RECORD:  # msgpack never writes this byte
        return _read_record(header, body[1:], frames[1:])
    try:
        return _Reader(body[1:], frames[1:]).unpackb(header)
    except codecs.NoCodec:
        raise
    except Malformed:
        raise
    except Exception as error:
        raise Malformed(f"the header does not parse: {error!r}") from error


def _reference(value: Any) -> list[str] | None:
    """`[module, qualname]` for a class or function of a package in `REFERABLE`, else None."""
    import types

    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return None
    module = getattr(value, "__module__", None) or ""
    qualname = getattr(value, "__qualname__", "")
    if module.split(".")[0] not in REFERABLE or "<" in qualname:
        return None
    return [module, qualname]


def _resolve(payload: bytes) -> Any:
    import importlib

    try:
        module, qualname = msgpack.unpackb(payload)
    except Exception as error:
        raise Malformed(f"a reference does not parse: {error!r}") from error
    if not isinstance(module, str) or module.split(".")[0] not in REFERABLE or "<" in qualname:
        raise Malformed(f"a reference to {module!r}, outside {REFERABLE}: refused")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as error:
        raise Malformed(f"a reference to {module}.{qualname} does not resolve") from error
    return found


def _torch() -> Any:
    return _modules.get("torch")


_HEADS: dict[str, tuple[Any, list[int], int]] = {}  # a tensor's header, parsed once
_SMALL_HEADS: dict[tuple, str] = {}  # a small tensor's header, by dtype and shape


def _tensor_ref(tensor: Any, buffers: list[Any]) -> bytes:
    torch = _torch()
    plain = tensor.detach()
    if type(plain) is torch.Tensor and plain.dtype in _NUMPY:
        # The common case, quickly: a small cpu tensor numpy can read as it is. numpy refuses
        # what it cannot (another device, sparse, meta, a conj or neg view): the slow path
        # below then resolves it or says why not.
        try:
            array = plain.numpy()
        except (TypeError, RuntimeError):
            array = None
        if array is not None and array.nbytes < _SMALL:
            key = (plain.dtype, array.shape)
            head = _SMALL_HEADS.get(key)
            if head is None:
                shape = ",".join([str(s) for s in array.shape])
                code, size = _NUMPY[plain.dtype], array.nbytes
                head = f'{{"dtype":"{code}","shape":[{shape}],"data_offsets":[0,{size}]}}'
                if len(_SMALL_HEADS) > 1024:
                    _SMALL_HEADS.clear()
                _SMALL_HEADS[key] = head
            # tobytes: the numbers in C order, whatever the strides (a view is sent as values)
            return _pack_ref([array.tobytes(), head, tensor.requires_grad])
    from somatize.torch.codec import _plain  # the tensor codec's checks and packing

    plain = _plain(plain)
    code = _CODES.get(str(plain.dtype)[6:])
    if code is None:
        raise TypeError(f"a {plain.dtype} tensor cannot cross the wire (no safetensors dtype)")
    size = plain.nbytes
    shape = ",".join([str(s) for s in plain.shape])
    head = f'{{"dtype":"{code}","shape":[{shape}],"data_offsets":[0,{size}]}}'
    if size >= _SMALL:  # its own frame, sent from the tensor's memory
        buffers.append(plain.reshape(-1).view(torch.uint8).numpy())
        return msgpack.packb([len(buffers), head, tensor.requires_grad])
    data = plain.reshape(-1).view(torch.uint8).numpy().tobytes() if size else b""
    return msgpack.packb([data, head, tensor.requires_grad])  # its bytes inside the header


_NUMPY: dict[Any, str] = {}  # torch dtype: safetensors name, for dtypes numpy reads
_pack_ref = msgpack.Packer(use_bin_type=True).pack  # flat lists of bytes, str and bool only


def _numpy_dtypes() -> None:
    import torch

    for code, name in _DTYPES.items():
        if name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
            _NUMPY[getattr(torch, name)] = code


def _parsed(head: str) -> tuple[Any, list[int], int]:
    """(dtype, shape, byte count) of a tensor's safetensors header, checked."""
    found = _HEADS.get(head)
    if found is not None:
        return found
    import torch

    parsed = json.loads(head)  # the safetensors header of this one tensor
    dtype = getattr(torch, _DTYPES[parsed["dtype"]])
    shape = [int(s) for s in parsed["shape"]]
    start, end = (int(x) for x in parsed["data_offsets"])
    count = 1
    for s in shape:
        if s < 0:
            raise Malformed(f"a tensor reference has a negative size in {shape}")
        count *= s
    if start != 0 or count * dtype.itemsize != end:
        raise Malformed(f"a tensor of {shape} {parsed['dtype']} does not hold {end} bytes")
    if len(_HEADS) > 1024:
        _HEADS.clear()
    found = _HEADS[head] = (dtype, shape, end)
    return found


def _tensor_from(payload: bytes, data: list[memoryview], owners: list[Any]) -> Any:
    try:
        where, head, grad = msgpack.unpackb(payload)
        dtype, shape, end = _parsed(head)
        if type(where) is bytes:  # small: its bytes are in the reference
            frame = owner = memoryview(where)
        elif type(where) is int and 0 < where <= len(data):  # large: frame `where` after the seal
            frame, owner = data[where - 1], owners[where - 1]
        else:
            raise Malformed(f"a tensor reference names no data ({where!r})")
    except Malformed:
        raise
    except Exception as error:
        raise Malformed(f"a tensor reference does not parse: {error!r}") from error
    if end != frame.nbytes:
        raise Malformed(
            f"a tensor of {shape} {dtype} does not fit its frame of {frame.nbytes} bytes"
        )
    made = _built(frame, owner, dtype, shape, end)
    if grad:
        if not (made.is_floating_point() or made.is_complex()):
            raise Malformed(f"a {dtype} tensor cannot ask for a gradient")
        made.requires_grad_(True)
    return made


def _built(frame: memoryview, owner: Any, dtype: Any, shape: list, end: int) -> Any:
    torch = _modules["torch"]  # imported by `_parsed`, which has seen this header

    if end == 0:
        return torch.empty(shape, dtype=dtype)
    if end < _SMALL or frame.readonly and owner is frame:
        made = torch.frombuffer(bytearray(frame), dtype=dtype)
    else:
        buffer = memoryview(getattr(owner, "buffer", owner))
        if buffer.readonly:  # bytes handed in by hand, not a received frame: copy once
            buffer = memoryview(bytearray(buffer))
        # A received frame is writable and ours alone, so torch has nothing to warn about.
        made = torch.frombuffer(buffer, dtype=dtype)
    return made if len(shape) == 1 else made.reshape(shape)  # frombuffer's is 1-d already


# -- the fixed record: a repeated run request and its answer ------------------------------
#
# The one message sent again and again (run slice `sid` on these tensors; here are the
# tensors it made) goes as a fixed record instead of msgpack: no hooks, no extension types,
# no dict walked, so both sides touch less code per message (what a process woken for it
# pays for most). Each tensor keeps its safetensors header, cached by dtype and shape, so a
# tensor is still a safetensors file cut in two. The seal covers the record like any header:
# nothing in it is read before it verifies. Anything else (a first run, node definitions,
# per-node times, a value that is not a plain cpu tensor, an error) goes as msgpack.

_RECORD = 0xC1  # a header that starts with this byte is a record (msgpack never writes 0xC1)
_RUN, _ANSWER = 1, 2  # the record's kinds
_REC = struct.Struct("<BBHQ")  # marker, kind, number of tensors, rid
_ENTRY = struct.Struct("<qBHH")  # slot (-1: the graph's input), grad, data frame (0: inline), head
_RECORD_HEADS: dict[tuple, bytes] = {}  # a tensor's safetensors header, by dtype and shape


def _record(m: dict) -> list[Any] | None:
    """`m` as a record and its data frames, when it is a run of a slice the worker holds
    (nothing defined, no steps, no per-node times) or its plain answer, and every value in it
    is a cpu tensor numpy can read; otherwise None (msgpack writes it)."""
    n = len(m)
    try:  # nine keys (four), each of them read: exactly the keys of a run (an answer)
        if n == 9 and m["op"] == "run":
            given = m["given"]
            if m["slice"] is not None or m["define"] or m["timed"] is not False:
                return None
            if type(given) is not dict:
                return None
            session, sid, rid = m["session"], m["sid"], m["rid"]
            session, sid = _TEXTS.get(session) or _text(session), _TEXTS.get(sid) or _text(sid)
            if not session or not sid:  # not short ascii str: msgpack
                return None
            texts = session + sid
            values = list(given.items())
            if m["input"] is not None:
                values.append((None, m["input"]))  # slot -1 in the record
            kind = _RUN
        elif n == 4 and m["ok"] is True:
            value, worker, rid = m["value"], m["worker"], m["rid"]
            if type(value) is not dict or len(value) != 2:
                return None
            ran = value["ran"]
            if type(ran) is not list or ran:
                return None
            out = value["out"]
            if type(out) is not dict:
                return None
            texts = _TEXTS.get(worker) or _text(worker)  # b"" when it cannot: msgpack
            values = list(out.items())
            kind = _ANSWER
        else:
            return None
    except (KeyError, TypeError):  # not those keys (or an unhashable name)
        return None
    return _written(kind, rid, texts, values)


def run_record(
    token: str | bytes, rid: Any, session: Any, sid: Any, given: Any, input: Any
) -> list[Any] | None:
    """The sealed frames of the run request `{"op": "run", "rid": rid, "session": session,
    "sid": sid, "define": [], "slice": None, "given": given, "input": input, "timed": False}`
    as a record (what `pack` makes of it), written without the dict; None when it cannot be
    a record (then `pack` writes it as msgpack)."""
    if type(session) is not str or type(sid) is not str or type(given) is not dict:
        return None
    session, sid = _TEXTS.get(session) or _text(session), _TEXTS.get(sid) or _text(sid)
    if not session or not sid:
        return None
    values = list(given.items())
    if input is not None:
        values.append((None, input))  # slot -1 in the record
    frames = _written(_RUN, rid, session + sid, values)
    return None if frames is None else sealed(token, frames)


def answer_record(token: str | bytes, rid: Any, worker: Any, out: Any) -> list[Any] | None:
    """The sealed frames of the plain answer `{"rid": rid, "ok": True, "worker": worker,
    "value": {"out": out, "ran": []}}` as a record (what `pack` makes of it), written without
    the dicts; None when it cannot be a record (then `pack` writes it as msgpack)."""
    if type(out) is not dict or type(worker) is not str:
        return None
    frames = _written(_ANSWER, rid, _TEXTS.get(worker) or _text(worker), list(out.items()))
    return None if frames is None else sealed(token, frames)


def _written(kind: int, rid: Any, texts: bytes, values: list) -> list[Any] | None:
    """A record of `kind` and its data frames: `texts` (its names, as `_text` writes them),
    then each `(slot, tensor)` of `values` (slot None: the graph's input); None when it
    cannot be one."""
    torch = _modules.get("torch")
    if (
        not texts
        or type(rid) is not int
        or not 0 <= rid < 1 << 64
        or torch is None
        or len(values) > 0xFFFF
    ):
        return None
    tensor = torch.Tensor
    parts: list[Any] = [b"", texts]
    buffers: list[Any] = []
    for slot, value in values:
        if slot is None:
            slot = -1
        elif type(slot) is not int or not 0 <= slot < 1 << 62:
            return None
        if type(value) is not tensor:
            return None
        # asked first: numpy() refuses a tensor that asks for a gradient, and a refusal costs
        # 8.5 µs against detach().numpy()'s 1.2
        grad = value.requires_grad
        try:  # numpy refuses another device, sparse, meta, a conj or neg view: msgpack then
            array = value.detach().numpy() if grad else value.numpy()
        except (TypeError, RuntimeError):
            return None
        key = (value.dtype, array.shape)
        head = _RECORD_HEADS.get(key)
        if head is None:
            head = _record_head(value.dtype, array)
            if head is None:
                return None
            _RECORD_HEADS[key] = head
        if array.nbytes < _SMALL:  # its numbers in C order, inside the record
            parts += (_ENTRY.pack(slot, grad, 0, len(head)), head, array.tobytes())
        elif array.flags.c_contiguous and len(buffers) < 0xFFFF:  # its own frame, its memory
            buffers.append(array)
            parts += (_ENTRY.pack(slot, grad, len(buffers), len(head)), head)
        else:
            return None
    parts[0] = _REC.pack(_RECORD, kind, len(values), rid)
    return [b"".join(parts), *buffers]


_TEXTS: dict[Any, bytes] = {}  # a name as the record writes it: its length, then its bytes


def _text(text: Any) -> bytes:
    """`text` as a record writes it, or b"" when it cannot (not a short ascii str)."""
    if type(text) is not str:
        return b""
    found = bytes((len(text),)) + text.encode() if text.isascii() and len(text) < 256 else b""
    if len(_TEXTS) > 1024:
        _TEXTS.clear()
    _TEXTS[text] = found
    return found


def _record_head(dtype: Any, array: Any) -> bytes | None:
    """The safetensors header of a tensor of `dtype` shaped like `array`, or None when
    safetensors has no name for the dtype."""
    if not _NUMPY:
        _numpy_dtypes()
    code = _NUMPY.get(dtype)
    if code is None:
        return None
    if len(_RECORD_HEADS) > 1024:
        _RECORD_HEADS.clear()
    shape = ",".join([str(s) for s in array.shape])
    return f'{{"dtype":"{code}","shape":[{shape}],"data_offsets":[0,{array.nbytes}]}}'.encode()


def _read_record(view: memoryview, data: list[memoryview], owners: list[Any]) -> dict:
    """The message a record (verified already) stands for: the same dict msgpack would have
    given back. Anything that does not add up exactly is `Malformed`."""
    try:
        _, kind, n, rid = _REC.unpack_from(view)
        if kind != _RUN and kind != _ANSWER:
            raise Malformed(f"a record of unknown kind {kind}")
        at = _REC.size
        texts = []
        for _ in range(2 if kind == _RUN else 1):
            length = view[at]
            text = view[at + 1 : at + 1 + length]
            if text.nbytes != length:
                raise Malformed("a record ends inside a name")
            texts.append(str(text, "ascii"))
            at += 1 + length
        values: dict[int, Any] = {}
        input = None
        for _ in range(n):
            slot, grad, frame, length = _ENTRY.unpack_from(view, at)
            at += _ENTRY.size
            head = view[at : at + length].tobytes()
            at += length
            dtype, shape, end = _HEADS.get(head) or _parsed(head)
            if frame == 0:  # inline
                found = owner = view[at : at + end]
                at += end
            elif frame <= len(data):
                found, owner = data[frame - 1], owners[frame - 1]
            else:
                raise Malformed(f"a tensor in a record names data frame {frame}, of {len(data)}")
            if found.nbytes != end:
                raise Malformed(
                    f"a tensor of {shape} {dtype} does not fit its {found.nbytes} bytes"
                )
            if 0 < end < _SMALL:  # its own copy of the numbers (the frame is freed)
                made = _modules["torch"].frombuffer(bytearray(found), dtype=dtype)
                if len(shape) != 1:
                    made = made.reshape(shape)
            else:
                made = _built(found, owner, dtype, shape, end)
            if grad:
                if grad != 1 or not (made.is_floating_point() or made.is_complex()):
                    raise Malformed(f"a {dtype} tensor cannot ask for a gradient")
                made.requires_grad_(True)
            if slot >= 0 and slot not in values:
                values[slot] = made
            elif slot == -1 and kind == _RUN and input is None:
                input = made
            else:
                raise Malformed(f"a record names slot {slot} twice, or a slot it cannot have")
        if at != view.nbytes:
            raise Malformed(f"a record of {view.nbytes} bytes holds {at}")
    except Malformed:
        raise
    except Exception as error:
        raise Malformed(f"a record does not parse: {error!r}") from error
    if kind == _RUN:
        return {
            "op": "run",
            "rid": rid,
            "session": texts[0],
            "sid": texts[1],
            "define": [],
            "slice": None,
            "given": values,
            "input": input,
            "timed": False,
        }
    return {"rid": rid, "ok": True, "worker": texts[0], "value": {"out": values, "ran": []}}
