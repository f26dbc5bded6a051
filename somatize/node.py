"""Nodes, and the expressions that declare a graph of them.

A `Node` is anything with `forward(input, ctx)`. Nodes are put together with `>>` (one after
the other) and `|` (side by side), and declared with `.named`, `.on`, `.at`, `.frozen`,
`.cached` and `.mapped`. A declaration returns a new declared piece and leaves the original
alone; said of a whole sub-expression, it reaches every node inside that did not say its own
(the innermost wins, each setting independently of the others)::

    src >> (left | right).on("cuda:0") >> join.named("head")
"""

from __future__ import annotations

import functools
import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Node", "Wrapped", "Opaque", "Expr", "Settings", "DEVICE", "unwrap", "kind_name"]

DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+|mps|meta)$")
"""What `.on(device)` accepts: cpu, cuda, cuda:N, mps, meta."""


@dataclass(frozen=True)
class Settings:
    """What was said of one node. `None` is "not said", so an outer declaration may say it."""

    name: str | None = None
    device: str | None = None
    host: str | None = None
    frozen: bool | None = None
    cached: bool | None = None
    salt: Any = None
    mapped: bool | None = None

    def under(self, outer: Settings) -> Settings:
        """These settings, with what they leave unsaid taken from `outer` (the innermost wins)."""
        unsaid = [k for k, v in vars(self).items() if v is None and k != "name"]
        return replace(self, **{k: getattr(outer, k) for k in unsaid})


class Opaque:
    """A value wrapped so that it crosses an edge untouched.

    Kept for code written against the published package: any value already crosses an edge
    untouched here, and an `Opaque` is unwrapped when it arrives.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Opaque({self.value!r})"


_DEEPEST = 64  # how many levels of tuples, lists and dicts `unwrap` looks down


def unwrap(value: Any, depth: int = 0) -> Any:
    """`value` with every `Opaque` in it replaced by what it wraps, inside tuples (a namedtuple
    stays one), lists and dicts too, down to 64 levels (deeper, as it is): what crosses an edge
    and what an entry point takes. The same object when nothing changed; a chain of Opaques
    that comes back on itself is a ValueError."""
    kind = type(value)
    if kind is Opaque:
        value = _wrapped(value)
        kind = type(value)
    if depth >= _DEEPEST:
        return value
    if kind is tuple or kind is list or (isinstance(value, tuple) and hasattr(kind, "_fields")):
        items = [unwrap(v, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return kind(items) if kind is tuple or kind is list else kind(*items)  # a namedtuple
    if kind is dict:
        pairs = {k: unwrap(v, depth + 1) for k, v in value.items()}
        if all(pairs[k] is v for k, v in value.items()):
            return value
        return pairs
    return value


def _wrapped(value: Opaque) -> Any:
    """What a chain of Opaques wraps, however long, without recursing; a chain that comes back
    on itself is refused."""
    seen: set[int] = set()
    while type(value) is Opaque:
        if id(value) in seen:
            raise ValueError(
                f"a chain of {len(seen)} Opaques comes back on itself and wraps no value "
                "to hand on: wrap the value itself"
            )
        seen.add(id(value))
        value = value.value
    return value


class Expr:
    """A declared piece of a graph: a node, a chain, or branches, with what was said of it."""

    _settings: Settings

    # -- composition -----------------------------------------------------------------------
    def __rshift__(self, other: Any) -> Expr:
        return _joined(Chain, self, other)

    def __rrshift__(self, other: Any) -> Expr:
        return _joined(Chain, other, self)

    def __or__(self, other: Any) -> Expr:
        return _joined(Branches, self, other)

    def __ror__(self, other: Any) -> Expr:
        return _joined(Branches, other, self)

    # -- declarations ----------------------------------------------------------------------
    def _said(self, **change: Any) -> Expr:
        raise NotImplementedError

    def named(self, id: str) -> Expr:
        """Give the node its id (otherwise its class name lower-cased, then `_2`, `_3`, ...)."""
        if not isinstance(id, str) or not id or "/" in id or "." in id:
            raise ValueError(f"a node id must be a non-empty string without '/' or '.', not {id!r}")
        if id.startswith("<") and id.endswith(">"):  # the cut's "<input>", "<loss>"
            raise ValueError(
                f"{id!r} names a graph's own input or loss, not a node: .named() it otherwise"
            )
        count = sum(1 for _ in self.pieces())
        if count != 1:
            raise ValueError(
                f".named({id!r}) names one node, and this expression holds {count}: "
                "name the nodes inside it one by one"
            )
        return self._said(name=id)

    def on(self, device: str) -> Expr:
        """Run here: `cpu`, `cuda`, `cuda:N`, `mps` or `meta` (checked when the graph is built)."""
        return self._said(device=device)

    def at(self, host: str) -> Expr:
        """Run in another process, named by a host that a `Broker` resolves when it runs."""
        if not isinstance(host, str) or not host:
            raise ValueError(f"a host is a non-empty name, not {host!r}")
        return self._said(host=host)

    def frozen(self) -> Expr:
        """Declare that the state of these nodes does not change while the graph runs."""
        return self._said(frozen=True)

    def cached(self, salt: Any = None) -> Expr:
        """Look what these nodes produce up in the store before computing, and keep it after."""
        return self._said(cached=True, salt=salt)

    def mapped(self) -> Expr:
        """The node maps over the items of a list: a list in, a list as long out."""
        return self._said(mapped=True)

    def pieces(self, outer: Settings | None = None) -> Iterator[tuple[Node, Settings]]:
        """Every node inside, in declaration order, with what was said of it."""
        raise NotImplementedError


def _joined(kind: type[_Group], a: Any, b: Any) -> Expr:
    """`a` and `b` as one `kind`, an undeclared one of that kind given by its parts."""
    parts: list[Expr] = []
    for expr in (a, b):
        if not isinstance(expr, Expr):
            raise TypeError(
                f"cannot use {type(expr).__name__} {expr!r:.60} with {kind.sign!r} in a graph "
                "expression: only Nodes (and expressions of them) can be chained with >> or "
                "put side by side with |"
            )
        undeclared = type(expr) is kind and expr._settings == Settings()
        parts += expr.parts if undeclared else [expr]  # type: ignore[attr-defined]
    return kind(parts)


class Piece(Expr):
    """One node with what was said of it. The node itself is shared, never copied."""

    __slots__ = ("node", "_settings")

    def __init__(self, node: Node, settings: Settings) -> None:
        self.node = node
        self._settings = settings

    def _said(self, **change: Any) -> Expr:
        return Piece(self.node, replace(self._settings, **change))

    def pieces(self, outer: Settings | None = None) -> Iterator[tuple[Node, Settings]]:
        yield self.node, self._settings.under(outer or Settings())

    def __repr__(self) -> str:
        said = vars(self._settings).items()
        shown = ", ".join(f"{k}={v!r}" for k, v in said if v is not None)
        if not shown:
            return repr(self.node)
        kind = repr(self.node) if isinstance(self.node, Wrapped) else type(self.node).__name__
        return f"{kind}({shown})"


class _Group(Expr):
    __slots__ = ("parts", "_settings")
    sign = ""

    def __init__(self, parts: list[Expr], settings: Settings | None = None) -> None:
        self.parts = tuple(parts)
        self._settings = settings or Settings()

    def _said(self, **change: Any) -> Expr:
        return type(self)(list(self.parts), replace(self._settings, **change))

    def pieces(self, outer: Settings | None = None) -> Iterator[tuple[Node, Settings]]:
        mine = self._settings.under(outer or Settings())
        for part in self.parts:
            yield from part.pieces(mine)

    def __repr__(self) -> str:
        return "(" + f" {self.sign} ".join(repr(p) for p in self.parts) + ")"


class Chain(_Group):
    """Parts one after the other: every exit of a part feeds every entry of the next."""

    sign = ">>"


class Branches(_Group):
    """Parts side by side: all of them receive what the branches receive."""

    sign = "|"


class Node(Expr, ABC):
    """One step of a graph: `forward(input, ctx)` returns what the node produced.

    `ctx.device` is where the node was told to run (`None`: nowhere in particular). A torch
    layer is a node either by being one (`class Enc(Node, nn.Module)`) or by holding modules
    as attributes; every tool treats the two the same.

    The constructor's arguments are captured when a node is built, bound to its signature
    (so `Layer(64, 32)` and `Layer(in_=64, out=32)` are one declaration): they are half of a
    cached value's key.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Node:
        self = super().__new__(cls)
        object.__setattr__(self, "_somatize_args", _bind(cls, args, kwargs))
        return self

    @abstractmethod
    def forward(self, input: Any, ctx: Any) -> Any:
        """What this node produces from `input`; `ctx` says where it runs."""

    @classmethod
    def of(cls, what: Any) -> Node:
        """`what` as a node that can stand in an expression, as it is.

        A `Node` comes back unchanged. A module (an `nn.Module`) or a plain function becomes a
        `Wrapped` node that calls it: a dict arriving at it whose keys its `forward` names is
        passed as keywords (`input_ids=`, `attention_mask=`), as is one naming every parameter
        a `forward(self, x, **extra)` or `forward(self, **batch)` needs; a tuple is the
        arguments of a forward that needs two or more (`forward(self, x, mask)` given
        `(x, mask)`); anything else is the one argument. Whatever it returns (a tuple, a
        `ModelOutput`) crosses as it is::

            Graph.somatize(Node.of(backbone) >> Node.of(head).named("head"))

        Refused (TypeError): a class instead of an instance, and anything that cannot be called.
        """
        return what if isinstance(what, Node) else Wrapped(what)

    def _said(self, **change: Any) -> Expr:
        return Piece(self, Settings(**change))

    def pieces(self, outer: Settings | None = None) -> Iterator[tuple[Node, Settings]]:
        yield self, Settings().under(outer or Settings())

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


_read_signature = functools.lru_cache(maxsize=4096)(inspect.signature)


def _signature(fn: Any) -> inspect.Signature:
    """`inspect.signature(fn)`, read once per function (a bound method by its function)."""
    key = getattr(fn, "__func__", fn)
    sig = _read_signature(key)
    if key is not fn and sig.parameters:  # bound: without its first parameter
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


class _Takes:
    """What `fn` (a module's `forward`, or a function) takes, by name and by position."""

    __slots__ = ("named", "required", "any_name", "places", "needs", "any_number")

    def __init__(self, fn: Any) -> None:
        forward = getattr(fn, "forward", None)
        try:
            sig = _signature(forward if callable(forward) else fn)
        except (TypeError, ValueError):
            sig = inspect.Signature()
        params = sig.parameters.values()
        kinds = {p.kind for p in params}
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        placed = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.named = frozenset(p.name for p in named)
        self.required = frozenset(p.name for p in named if p.default is p.empty)
        self.any_name = inspect.Parameter.VAR_KEYWORD in kinds
        self.places = len(placed)
        self.needs = sum(1 for p in placed if p.default is p.empty)
        self.any_number = inspect.Parameter.VAR_POSITIONAL in kinds

    def arguments(self, input: Any) -> tuple[tuple, dict]:
        """`(args, kwargs)` the forward is called with on `input`, by the rule `Node.of` says."""
        if isinstance(input, Mapping) and input:
            if self.named.issuperset(input) or (
                self.any_name
                and all(isinstance(k, str) for k in input)
                and self.required.issubset(input)
            ):
                return (), dict(input)
        if (
            isinstance(input, tuple)
            and 2 <= self.needs <= len(input)
            and (self.any_number or len(input) <= self.places)
        ):
            return tuple(input), {}
        return (input,), {}

    def whole(self, input: Mapping) -> str:
        """Why a mapping went as the one argument, and what to give instead."""
        keys = sorted(map(str, input))
        takes = ", ".join(sorted(self.named)) + (", **kwargs" if self.any_name else "")
        return (
            f"it was given a {type(input).__name__} with keys {keys[:8]} as its one argument: "
            f"its forward takes ({takes}), which does not name them all; give it the names "
            f"its forward takes, or put a node before it that picks one out "
            f"(Node.of(lambda batch: batch[{keys[0]!r}]))"
        )


class Wrapped(Node):
    """A module or a plain function standing in a graph as it is (what `Node.of` makes).

    Every tool treats the module it holds as the node itself: its parameters are the node's,
    its submodules are the places `node.path.to.layer` inside it, and its default id is its
    class name lower-cased (a function's name, for a function). `held` is the module or
    function itself: `g.implementation(id).held` is the model one built (to unfreeze it,
    call `.requires_grad_(True)` on it, say).
    """

    def __init__(self, held: Any) -> None:
        to_call(held, "Node.of", "a module or a function to call")
        self.held = held
        self.takes = _Takes(held)

    def forward(self, input: Any, ctx: Any) -> Any:
        """Call what is held on `input`, as `Node.of` says: by name, by position, or whole."""
        args, kwargs = self.takes.arguments(input)
        try:
            return self.held(*args, **kwargs)
        except Exception as error:
            if not kwargs and isinstance(input, Mapping) and input:  # said why it went whole
                note(error, self.takes.whole(input))
            raise

    def __repr__(self) -> str:
        return f"Node.of({kind_name(self)})"


def to_call(value: Any, where: str, takes: str) -> None:
    """Refuse (`TypeError`) a `value` that `where` (which `takes` something to call) was
    given: a class, whose call would build one (it says to build it), or a non-callable."""
    if isinstance(value, type):
        name = value.__name__
        raise TypeError(f"{where} is given the class {name}: build one, {name}(...), and pass it")
    if not callable(value):
        raise TypeError(f"{where} takes {takes}, not {type(value).__name__} {value!r:.60}")


def kind_name(node: Any) -> str:
    """The class name a node goes by (its id, lower-cased, unless it was named): the held
    module's class for a `Wrapped` one, a function's own name."""
    if isinstance(node, Wrapped):
        held = node.held
        if inspect.isfunction(held) or inspect.isbuiltin(held) or inspect.ismethod(held):
            return re.sub(r"\W", "", held.__name__) or "function"
        return type(held).__name__
    return type(node).__name__


def note(error: BaseException, text: str) -> BaseException:
    """Add `text` to `error` as a PEP 678 note, once: the `__notes__` list that Python 3.11
    and later print under the traceback (set here as `add_note` would, which 3.10 lacks)."""
    notes = getattr(error, "__notes__", None)
    if notes is None or text not in notes:
        error.__notes__ = [*(notes or []), text]  # type: ignore[attr-defined]
    return error


def takes_ctx(node: Any) -> bool:
    """Whether `node.forward` can be called as forward(input, ctx)."""
    try:
        _signature(node.forward).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): trust it
        pass
    return True


def _bind(cls: type, args: tuple, kwargs: dict) -> dict[str, Any]:
    init = cls.__init__
    if init is object.__init__:
        return {}
    try:
        sig = _signature(init)
        bound = sig.bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return {"args": args, **kwargs}
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(sig.parameters)), None)  # self
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    return named
