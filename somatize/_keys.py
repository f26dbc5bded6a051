"""The key of a node's declaration: its class, its constructor arguments (followed into
containers, objects, closures and code, `DEPTH` levels down), its salt and, when frozen, the
digest of its state. `caching` keys a run with it; `Graph` asks `unkeyable` when a node is
declared `.cached()`."""

from __future__ import annotations

import collections
import hashlib
import inspect
import json
import os
import re
import sys
import types
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from somatize import _hooks
from somatize.codecs import NoCodec, digest, encode
from somatize.node import Wrapped

__all__ = ["DEPTH", "Unkeyable", "code_version", "declaration_key", "mix", "refusal", "unkeyable"]


def mix(*parts: str) -> str:
    """One sha256 hex digest of several strings."""
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


DEPTH = 32
"""How deep a key looks into a constructor argument (containers, an object's attributes, a
function's closure) before it gives up on it."""

_SAID_BY_REPR = {
    "builtins.ellipsis",  # x[..., 0]
    "builtins.NotImplementedType",
    "datetime.date",
    "datetime.datetime",
    "datetime.time",
    "datetime.timedelta",
    "decimal.Decimal",
    "torch.dtype",
    "torch.device",
    "torch.layout",
    "torch.memory_format",
}
"""Types of values that hold no attributes, whose repr says all there is to them."""

_OF_THIS_PROCESS = {"_original_object_hash"}
"""Attributes that hold a `hash()` of this process (str hashes are salted per process), left
out of an object's key: transformers' `GenerationConfig`, in every generative model, keeps
one, which would make its key differ in every process."""


class Unkeyable(Exception):
    """A constructor argument a key cannot take in honestly: `where` it is (`fn`,
    `tok.vocab`) and `why`."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where
        self.why = why


class _Keying:
    """One node's arguments on their way to a key: the containers on the way down (`path`),
    whether modules are digested, those whose state (`covered`) or mode (`moded`) is keyed
    elsewhere already."""

    __slots__ = ("path", "digesting", "covered", "moded")

    def __init__(self, digesting: bool, covered: frozenset[int], moded: frozenset[int]) -> None:
        self.path: list[int] = []
        self.digesting = digesting
        self.covered = covered
        self.moded = moded

    def said(self, value: Any, where: str) -> Any:
        """A JSON-able stand-in for `value`, the same for equal values in any process (no
        address, hash or order not the value's own); `Unkeyable` where none says it all."""
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if len(self.path) > DEPTH:
            raise Unkeyable(where, f"it is nested more than {DEPTH} deep")
        if id(value) in self.path:  # a cycle: where it goes back to, counted from here
            return ["back", len(self.path) - self.path.index(id(value))]
        self.path.append(id(value))
        try:
            return _inner(value, where, self)
        finally:
            self.path.pop()


def _type_name(kind: type | Callable) -> str:
    """A class's (or a function's) name with its module's: `torch.nn.modules.linear.Linear`."""
    return f"{kind.__module__}.{kind.__qualname__}"


def _inner(value: Any, where: str, k: _Keying) -> Any:
    kind = type(value)
    if isinstance(value, (list, tuple)):
        return [_type_name(kind), [k.said(v, f"{where}[{i}]") for i, v in enumerate(value)]]
    if isinstance(value, dict):
        pairs = [
            [k.said(a, f"{where} (a key)"), k.said(b, f"{where}[{a!r:.40}]")]
            for a, b in value.items()
        ]
        ordered = isinstance(value, collections.OrderedDict)  # its order is in its equality
        said = [_type_name(kind), pairs if ordered else sorted(pairs, key=repr)]
        factory = getattr(value, "default_factory", None)  # a defaultdict's answer when missing
        return said if factory is None else [*said, k.said(factory, f"{where}.default_factory")]
    if isinstance(value, (set, frozenset)):
        items = [k.said(v, f"{where} (an item)") for v in value]
        return [_type_name(kind), sorted(items, key=repr)]
    if isinstance(value, complex):
        return ["complex", value.real, value.imag]
    if isinstance(value, (range, slice)):
        return [kind.__name__, k.said([value.start, value.stop, value.step], where)]
    if isinstance(value, os.PathLike):
        return ["path", _type_name(kind), str(os.fspath(value))]
    if isinstance(value, re.Pattern):  # a tokenizer's; its repr cuts a long pattern short
        return ["pattern", k.said(value.pattern, where), value.flags]
    if isinstance(value, type):
        return ["class", _type_name(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, types.CodeType):
        return _code(value, where, k)
    if isinstance(value, types.FunctionType):
        return _function(value, where, k)
    if isinstance(value, types.MethodType):
        return ["method", k.said(value.__func__, where), k.said(value.__self__, f"{where}'s self")]
    if isinstance(value, partial):
        return ["partial", k.said([value.func, value.args, value.keywords], where)]
    if isinstance(value, types.BuiltinFunctionType):  # len, torch.relu, [].append
        owner = value.__self__
        if owner is None or isinstance(owner, (type, types.ModuleType)):
            return ["builtin", getattr(value, "__module__", None), value.__qualname__]
        return ["builtin", value.__qualname__, k.said(owner, f"{where}'s self")]
    if isinstance(value, weakref.ref):  # an RNN's _flat_weight_refs: what it points at
        return ["weakref", k.said(value(), f"{where} (what it refers to)")]
    if _type_name(kind) in _SAID_BY_REPR:
        return ["repr", _type_name(kind), repr(value)]
    wrapped = getattr(value, "__wrapped__", None)
    if isinstance(wrapped, types.FunctionType):  # functools.lru_cache(f), np.mean: what f is
        return ["wrapper", _type_name(kind), k.said(wrapped, f"{where} (what it wraps)")]
    named = _by_name(value)
    if named is not None:  # a singleton its module holds (a ufunc, a torch op, str.upper)
        return named
    if callable(getattr(value, "state_dict", None)) and hasattr(value, "_modules"):
        return _module(value, where, k)
    try:
        return ["value", _type_name(kind), digest(encode(value))]
    except NoCodec:
        pass
    except (TypeError, ValueError) as error:  # its codec refuses it (a sparse tensor, say)
        raise Unkeyable(where, str(error)) from None
    return _object(value, where, k)


def _code(code: types.CodeType, where: str, k: _Keying) -> list:
    """What code computes: its bytecode, constants and names read; not where it sits."""
    return [
        "code",
        hashlib.sha256(code.co_code).hexdigest(),
        k.said(list(code.co_consts), where),
        list(code.co_names),
        [code.co_argcount, code.co_kwonlyargcount, code.co_flags],
    ]


def _function(fn: types.FunctionType, where: str, k: _Keying) -> list:
    """A function by its code, its defaults and the values its closure holds."""
    closure = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            held = cell.cell_contents
        except ValueError:  # a cell not filled yet
            closure.append([name, ["empty"]])
        else:
            closure.append([name, k.said(held, f"{where}'s {name}")])
    return [
        "function",
        fn.__module__,
        fn.__qualname__,
        _code(fn.__code__, where, k),
        k.said([fn.__defaults__, fn.__kwdefaults__], f"{where}'s defaults"),
        closure,
    ]


def _by_name(value: Any) -> list | None:
    """`["named", module, qualname]` for a value its module holds by that name, else None."""
    name = getattr(value, "__module__", None) or getattr(
        getattr(value, "__objclass__", None), "__module__", None
    )
    module = sys.modules.get(name or "")
    qual = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if module is None or not isinstance(qual, str):
        return None
    found: Any = module
    for part in qual.split("."):
        found = getattr(found, part, None)
    return ["named", module.__name__, qual] if found is value else None


_HOOKS = re.compile(r"^_.*hook")


def _module(module: Any, where: str, k: _Keying) -> list:
    """A torch module by its class, its attributes but hooks, and its state's digest (a
    compiled one by the module it compiled)."""
    compiled = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and compiled is not None:
        return ["compiled", k.said(compiled, f"{where} (the module it compiled)")]
    said = {n: v for n, v in vars(module).items() if not _HOOKS.match(n)}
    if id(module) in k.moded:  # its mode is keyed at each forward, not as it was when first keyed
        said.pop("training", None)
    for held in ("_parameters", "_buffers"):  # its state: in the digest, or in the node's
        said[held] = sorted(said.get(held) or ())
    digested = k.digesting and id(module) not in k.covered
    state = _hooks.state_digest(Wrapped(module)) if digested else None
    covered = k.covered
    if digested:  # its state covers its submodules' (not a module it holds in a dict)
        k.covered = covered | {id(m) for m in module.modules()}
    try:
        return ["module", _type_name(type(module)), k.said(said, where), state]
    finally:
        k.covered = covered


def _object(value: Any, where: str, k: _Keying) -> list:
    """An object by its class and its attributes (`vars`, and `__slots__` that are set)."""
    kind = type(value)
    held = getattr(value, "__dict__", None) or {}
    said = {n: v for n, v in held.items() if n not in _OF_THIS_PROCESS}
    slots = _slots(kind)
    for name in slots:
        if name != "__weakref__" and hasattr(value, name):
            said[name] = getattr(value, name)
    if not said and not hasattr(value, "__dict__") and not slots:
        raise Unkeyable(
            where,
            f"a {_type_name(kind)} keeps its state where Python cannot read it (no attributes, "
            "no codec)",
        )
    return [
        "object",
        _type_name(kind),
        [[n, k.said(v, f"{where}.{n}")] for n, v in sorted(said.items())],
    ]


def _slots(kind: type) -> list[str]:
    """The attribute names the `__slots__` of `kind` and its bases hold (mangled), but `__dict__`."""
    names = []
    for c in kind.__mro__:
        declared = vars(c).get("__slots__", ())
        for s in (declared,) if isinstance(declared, str) else declared:
            private = s.startswith("__") and not s.endswith("__") and c.__name__.strip("_")
            names.append(f"_{c.__name__.lstrip('_')}{s}" if private else s)
    return [s for s in names if s != "__dict__"]


def _arguments(node: Any, k: _Keying) -> list:
    args = getattr(node, "_somatize_args", {})
    return [[name, k.said(v, name)] for name, v in sorted(args.items())]


def unkeyable(node: Any, salt: Any = None) -> Unkeyable | None:
    """What a key of `node` cannot take in honestly, or None: in its salt if it is given one,
    else in its constructor arguments (which a salt stands for)."""
    keying = _Keying(False, frozenset(), frozenset())
    try:
        if salt is None:
            _arguments(node, keying)
        else:
            keying.said(salt, "salt")
    except Unkeyable as e:
        return e
    return None


def declaration_key(node: Any, salt: Any, state: str | None, salted: bool = True) -> str:
    """What a node *is*, for a cache: its class, its constructor arguments, salt, frozen state.
    An argument that cannot be keyed (`unkeyable`) is said by where it is alone if `salted` (a
    salt stands for it), else raised as `Unkeyable`."""
    # a module the node's own state digest reads is in the key already; one it holds
    # anywhere else (in a dict, in an object) is digested where its argument is keyed
    held = frozenset(id(m) for m in _hooks.state_modules(node))  # the modules caching's modes read
    try:
        said_args = _arguments(node, _Keying(True, held if state else frozenset(), held))
    except Unkeyable as e:
        if not salted:
            raise
        said_args = ["unkeyed", e.where]
    said = {
        "class": _type_name(type(node)),
        "args": said_args,
        "salt": _Keying(True, frozenset(), frozenset()).said(salt, "salt"),
        "state": state,
    }
    return mix(json.dumps(said, sort_keys=True))


def code_version(node: Any) -> str:
    """A digest of the source of the node's class (for `Node.of(x)`, of `x`'s class, or of
    the function itself): noted beside a kept value."""
    held = node.held if isinstance(node, Wrapped) else node
    what = held if isinstance(held, (types.FunctionType, types.MethodType)) else type(held)
    try:
        text = inspect.getsource(what)
    except (OSError, TypeError):
        text = _type_name(what)
    return mix(text)[:16]


def refusal(cached: str, whose: str, why: Unkeyable) -> ValueError:
    """The refusal of node `cached`, whose key could not tell node `whose`'s argument's values
    apart (`whose` may be `cached` itself)."""
    arg = f"its constructor argument {why.where!r}"
    if whose != cached:
        arg = f"constructor argument {why.where!r} of node {whose!r}, which feeds it"
    return ValueError(
        f"node {cached!r} is .cached() but its key cannot tell apart the values of {arg}: "
        f"{why.why}; two of them could share one kept value. Pass plain values (numbers, "
        f"strings, lists, dicts, tensors, functions), or give {cached!r} a salt you change "
        f"whenever that argument does: .cached(salt=...)"
    )
