"""Where a graph keeps what it produces: bytes by content, and names that point at them.

A `Store` is a directory (created if missing) or any fsspec URL (`memory://scratch`,
`s3://bucket/prefix`, `file:///tmp/x`). It keeps blobs by content (`put`, `get`) and bindings,
a name pointing at a digest with some meta (`bind`, `claim`, `resolve`, `bound`); `keep` and
`recall` do both in one go, through the codecs of `somatize.codecs`.

Every write is written aside and then renamed into place, so a crash mid-write leaves the old
value or the new one and never half of one; `clean()` removes what killed writers left aside
(and, asked with `unnamed=True`, in a directory, blobs no name points at).
What is read back is not trusted: blobs are checked against their digest, bindings must parse
as bindings, and values decode through `somatize.codecs`' bounds. Layout on disk::

    blobs/sha256/ab/cdef...        the bytes whose sha256 is abcdef...
    names/run/r1/3/.bind           the binding of the name "run/r1/3"
"""

from __future__ import annotations

import functools
import numbers
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from somatize._places import Local, Remote
from somatize.codecs import decode, encode
from somatize.codecs import digest as _digest_of
from somatize.node import unwrap

__all__ = ["Bound", "CorruptBinding", "CorruptBlob", "Store"]

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_BIND = ".bind"
UNNAMED_AFTER = 60.0
"""Seconds a blob no name points at is left by `Store.clean` at least, whatever its
`older_than`: a writer names what it put (or put again) a moment after."""


class CorruptBlob(ValueError):
    """A blob whose bytes do not hash to its name. It is never returned; delete and put again."""


class CorruptBinding(ValueError):
    """A binding file that cannot be read back (torn, truncated, or not written by a Store)."""


@dataclass(frozen=True)
class Bound:
    """What a name points at: `.name`, `.digest`, `.meta` (a list of (key, value) pairs, in
    the order given) and `.when` (seconds since the epoch when it was bound)."""

    name: str
    digest: str
    meta: list[tuple[str, Any]] = field(default_factory=list)
    when: float = 0.0

    def get(self, key: str, default: Any = None) -> Any:
        """The value of meta `key` (the last one if repeated), or `default`."""
        return dict(self.meta).get(key, default)


def _name_path(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a store name is a str, not {type(name).__name__}: {name!r}")
    if not name:
        raise ValueError("a store name cannot be empty")
    if name.startswith("/"):
        raise ValueError(f"store name {name!r} is absolute; names are relative, like 'run/r1/3'")
    escaped = []
    for part in name.split("/"):
        if part == "":
            raise ValueError(f"store name {name!r} has an empty segment (a '//' or a trailing '/')")
        if part in (".", ".."):
            raise ValueError(f"store name {name!r} has a {part!r} segment; names cannot climb")
        safe = quote(part, safe="-_.~@+=,")
        if safe.startswith("."):  # only the store's own files (.bind, .tmp-...) begin with '.'
            safe = "%2E" + safe[1:]
        if len(safe.encode()) > 200:
            raise ValueError(f"store name segment {part[:40]!r}... is too long for a file name")
        escaped.append(safe)
    path = "names/" + "/".join(escaped) + "/" + _BIND
    if len(path) > 1000:  # S3 keys stop at 1024 bytes, and many paths at 4096
        raise ValueError(f"store name {name[:40]!r}... is too long ({len(path)} bytes escaped)")
    return path


def _meta_pairs(meta: Any, name: str) -> list[tuple[str, Any]]:
    if meta is None:
        return []
    said = f"meta of {name!r} is a dict or (key, value) pairs"
    try:
        items = iter(meta.items() if isinstance(meta, Mapping) else meta)
    except TypeError:
        raise TypeError(f"{said}, not {type(meta).__name__} {meta!r:.60}") from None
    pairs: list[tuple[str, Any]] = []
    for item in items:
        try:
            key, value = None if isinstance(item, (str, bytes)) else item  # not "ab" as a, b
        except (TypeError, ValueError):
            raise TypeError(f"{said}; got the item {item!r}") from None
        if not isinstance(key, str):
            raise TypeError(f"meta keys of {name!r} are str; got {key!r}")
        pairs.append((key, value))
    return pairs


class Store:
    """Bytes kept by content, and names that point at them; see the module docstring.

    `where` is a directory (created if missing; `~` is the home directory, as in a shell) or an
    fsspec URL; `storage_options` go to fsspec (say `endpoint_url=` or `key=` for s3). Safe to
    share between threads; processes sharing a directory (or a bucket) see each other's writes.
    """

    def __init__(self, where: str | os.PathLike[str], **storage_options: Any) -> None:
        text = os.fspath(where) if isinstance(where, (str, os.PathLike)) else None
        if not isinstance(text, str):
            said = f"{type(where).__name__} {where!r:.60}"
            raise TypeError(f"a store is a directory or a URL, not {said}: pass a str or a path")
        self._where = text
        self._options = storage_options
        if "://" not in text:
            if storage_options:
                raise TypeError(f"storage options are for fsspec URLs, not the directory {text!r}")
            self._place: Local | Remote = Local(os.path.expanduser(text))  # "~/runs" as a shell
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(text, **storage_options)
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._place = Local(root) if {"file", "local"} & set(protocols) else Remote(fs, root)

    @property
    def where(self) -> str:
        """The directory or URL this store was opened on, as given."""
        return self._where

    def __repr__(self) -> str:
        return f"Store({self._where!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial(Store, **self._options), (self._where,))

    # -- blobs ---------------------------------------------------------------------------

    @staticmethod
    def _blob_path(key: str) -> str:
        if not isinstance(key, str) or not _DIGEST.fullmatch(key):
            raise ValueError(f"{key!r} is not a digest; digests look like 'sha256:<64 hex>'")
        hexed = key[len("sha256:") :]
        return f"blobs/sha256/{hexed[:2]}/{hexed[2:]}"

    def put(self, data: bytes) -> str:
        """Keep `data`; answer its digest, `"sha256:<hex>"`. Putting the same bytes twice
        writes them once (a corrupt copy already there is replaced). Refuses non-bytes."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"put takes bytes, not {type(data).__name__}; use keep for values")
        data = bytes(data)
        key = _digest_of(data)
        self._put(key, data)
        return key

    def _put(self, key: str, data: bytes) -> None:
        """Keep `data`, whose digest is `key`, unless the same bytes are there already."""
        path = self._blob_path(key)
        if self._place.read(path) != data:
            self._place.write(path, data)
        else:  # new again, so that `clean` leaves it to the name it is about to get
            self._place.touch(path)

    def get(self, digest: str) -> bytes | None:
        """The bytes whose digest is `digest`, or None if this store has none. Raises
        `CorruptBlob` if the bytes kept under that digest no longer hash to it."""
        path = self._blob_path(digest)
        data = self._place.read(path)
        if data is None or (held := _digest_of(data)) == digest:
            return data
        raise CorruptBlob(
            f"blob {digest} at {self._place.where(path)} holds {len(data)} bytes that hash to "
            f"{held}: it is corrupt and was not returned; delete the file and put the value again"
        )

    def _drop(self, digest: str) -> None:
        """Remove the blob `digest`, if there: one nothing names and only its putter knows of
        (`Trainer(parallel=)`'s check that every rank sees this store)."""
        self._place.drop(self._blob_path(digest))

    # -- names ---------------------------------------------------------------------------

    def _binding(self, name: str, key: str, meta: Any) -> bytes:
        self._blob_path(key)  # refuses a malformed digest before anything is written
        record = {
            "name": name,
            "digest": key,
            "meta": _meta_pairs(meta, name),
            "when": time.time(),
        }
        return encode(record, where=f"the meta of {name!r}")

    def bind(self, name: str, digest: str, meta: Any = None) -> None:
        """Point `name` at `digest`, with `meta` (a dict or (key, value) pairs),
        replacing whatever it pointed at. Refuses a malformed name or digest (`ValueError`)
        and meta values no codec can write (`NoCodec`); a refused bind changes nothing."""
        self._place.write(_name_path(name), self._binding(name, digest, meta))

    def claim(self, name: str, digest: str, meta: Any = None) -> bool:
        """Bind `name` to `digest` only if nothing is bound to it yet; True if this call did.
        Of many claimers racing for one name, threads or processes, exactly one gets True:
        on a directory by a hard link (or, where there are none, an exclusive marker that a
        killed claimer does not leave standing in the way), on S3 by a conditional put the
        server decides (a 409, another write in flight, is asked again; a 412 is False). On
        an fsspec filesystem without exclusive create it is best effort (see docs/store.md)."""
        return self._place.create(_name_path(name), self._binding(name, digest, meta))

    def _read_binding(self, name: str, path: str, data: bytes) -> Bound:
        try:
            record = decode(data)
            meta = [(k, v) for k, v in record["meta"]]
            if not (
                type(record["name"]) is str
                and type(record["digest"]) is str
                and _DIGEST.fullmatch(record["digest"])
                and all(type(k) is str for k, _ in meta)
            ):
                raise ValueError("its fields are not a name, a digest and str meta keys")
            return Bound(record["name"], record["digest"], meta, float(record["when"]))
        except Exception as error:
            raise CorruptBinding(
                f"the binding of {name!r} at {self._place.where(path)} cannot be read "
                f"({len(data)} bytes; {error}); it was torn or not written by a Store: "
                f"delete it and bind the name again"
            ) from None

    def resolve(self, name: str) -> Bound | None:
        """What `name` points at, or None if nothing is bound to it. Raises `CorruptBinding`
        if its binding file cannot be read back."""
        path = _name_path(name)
        data = self._place.read(path)
        return None if data is None else self._read_binding(name, path, data)

    def bound(self, prefix: str | None = None) -> list[Bound]:
        """Every binding in the store, by name; with `prefix` (a name such as `"run/r1"`)
        only that name and the names below it. Raises `CorruptBinding` on an unreadable one."""
        read = ((name, path, self._place.read(path)) for name, path in self._bindings(prefix))
        found = [self._read_binding(n, p, data) for n, p, data in read if data is not None]
        return sorted(found, key=lambda b: b.name)

    def _bindings(self, prefix: str | None) -> list[tuple[str, str]]:
        """`(name, path)` of every binding file under `prefix` (all of them for None)."""
        folder = "names" if prefix is None else _name_path(prefix)[: -len(_BIND) - 1]
        found = []
        for path in self._place.files(folder):
            parts = path.split("/")
            if parts[-1] == _BIND and len(parts) >= 3:
                found.append(("/".join(unquote(p) for p in parts[1:-1]), path))
        return found

    # -- values --------------------------------------------------------------------------

    def keep(self, name: str, value: Any, meta: Any = None) -> str:
        """Write `value` down through the codecs, bind `name` to it, and answer its digest.
        An `Opaque` (anywhere in it) is kept as the value it wraps, as an edge unwraps it.
        Refuses a bad name or meta as `bind` does, and (with `NoCodec`) a value no codec can
        write, all before writing anything: a refused keep leaves no blob behind."""
        path = _name_path(name)
        data = encode(unwrap(value), where=f"the value kept as {name!r}")
        key = _digest_of(data)
        binding = self._binding(name, key, meta)  # refuses bad meta before the blob is put
        self._put(key, data)  # hashed once, above
        self._place.write(path, binding)
        return key

    def recall(self, name: str) -> Any:
        """The value kept under `name`, or None if nothing is bound to it. Raises
        `LookupError` if the name points at bytes this store does not hold, `CorruptBlob` or
        `CorruptBinding` if they were damaged, and `somatize.codecs.Malformed` if the bytes
        are not a value `decode` will read (say, written by someone hostile)."""
        bound = self.resolve(name)
        if bound is None:
            return None
        data = self.get(bound.digest)
        if data is None:
            raise LookupError(
                f"{name!r} is bound to {bound.digest}, which is not in {self!r}; "
                f"the blob was removed: keep the value again"
            )
        return decode(data)

    def names(self, prefix: str | None = None) -> list[str]:
        """The bound names (optionally under `prefix`), without reading their bindings."""
        return sorted(name for name, _ in self._bindings(prefix))

    def clean(self, *, older_than: float = 3600.0, unnamed: bool = False) -> dict[str, int]:
        """Remove what killed writers left behind, and answer `{"files": n, "bytes": b}`.

        A write goes through a temp file beside its target (`.tmp-...`); a writer killed
        mid-write leaves it there, unread but taking space. Such a file goes when its writer
        is seen dead on this machine, or when nobody has written to it for `older_than`
        seconds (a writer on another machine sharing the directory). A live writer's file is
        never touched. Claim markers go once the claim they decided stands. With `unnamed=True`,
        in a directory, a blob no name points at (its name could not be written, or bytes
        `put` and never bound: asked for in so many words, as they may be a user's, kept by
        digest) goes once nobody has put it for `older_than` seconds, and at least
        `UNNAMED_AFTER`; none goes while a binding cannot be read. On an fsspec store, where a
        put cannot make a blob's age new, `unnamed=True` is refused. On an object store nothing
        is written aside (a big object's unfinished multipart upload is the bucket lifecycle's
        to abort). Refuses a negative `older_than`."""
        if not isinstance(older_than, numbers.Real):  # numpy's numbers too, as before
            raise TypeError(f"older_than is seconds >= 0, not {older_than!r}")
        if isinstance(older_than, bool) or not older_than >= 0:
            raise ValueError(f"older_than is seconds >= 0, not {older_than!r}")
        if unnamed and isinstance(self._place, Remote):
            raise ValueError(
                f"clean(unnamed=True) removes unnamed blobs only in a directory: on {self!r} "
                "putting bytes that are there already cannot make them new again, so a blob a "
                "writer is about to name could go. Call clean() there without unnamed=True"
            )
        removed = self._place.clean(float(older_than))
        if not unnamed:
            return removed
        grace = max(float(older_than), UNNAMED_AFTER)
        old = self._place.aged("blobs", grace)
        if not old:
            return removed
        try:
            named = {self._blob_path(b.digest) for b in self.bound()}
        except CorruptBinding:  # which blob it names is not known: every one stays
            return removed
        gone = self._place.remove([p for p in old if p not in named], grace)
        return {k: n + gone[k] for k, n in removed.items()}


def store_of(store: Store | str | os.PathLike[str]) -> Store:
    """What a `store=` argument names: `store` itself if it is a `Store`, else the store at
    that directory or URL. Refuses anything else with a `TypeError`."""
    if isinstance(store, Store):
        return store
    if isinstance(store, (str, os.PathLike)):
        return Store(store)
    raise TypeError(f"a store is a Store, a directory or a URL, not {type(store).__name__}")
