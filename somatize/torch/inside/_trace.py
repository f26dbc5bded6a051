"""Two ways of reading what a module is made of: torch.fx, and a real forward with hooks.

Both answer the same thing, a list of raw layers in the order they ran and the edges between
them, at the same granularity: a module with no children is one layer, a composite torch
itself ships (a TransformerEncoderLayer) is one layer until `depth` opens it, and every other
composite (a container, a user's block) is opened and becomes the block its layers sit in.

Edges follow the data: each tensor is known by the layer that produced it, and an op that only
carries data along (indexing, a view, a reshape, a cast) hands its input's producers on to
what it returns. A function is drawn as a layer only when it computes a floating tensor from
the data; what works on masks and counters (`gt`, `eq`, `triu`, an assert) is bookkeeping and
is not drawn. A module called twice is a box per call (`relu`, then `relu#2`), so nothing
loops.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode

from somatize.torch._modules import tensors_in
from somatize.torch.inside.kinds import function_name, kind_of, label_of, recognised

__all__ = [
    "Raw",
    "Traced",
    "Opening",
    "Calls",
    "Reading",
    "by_fx",
    "by_forward",
    "fx_trace",
    "call_path",
]

# Calls that carry a value along without computing anything anybody would draw: their output
# is made by whoever made their input.
_PASS = frozenset(
    "getattr getitem setitem size dim type to float double half bfloat16 int long bool "
    "contiguous detach clone numel get requires_grad is_floating_point is_nested ndim shape "
    "device dtype set view view_as reshape reshape_as transpose permute swapaxes t squeeze "
    "unsqueeze expand expand_as narrow select split chunk unbind flip repeat tile "
    "movedim unflatten masked_fill where index_select gather as_strided".split()
)
# Calls on masks, counters and shapes: never a layer, even on the data.
_BOOKKEEPING = frozenset(
    "eq ne gt ge lt le logical_and logical_or logical_not logical_xor and or not xor invert "
    "assert isfinite isnan isinf any all nonzero argmax argmin arange zeros ones full empty "
    "zeros_like ones_like full_like empty_like triu tril cumsum item tolist "
    "new_zeros new_ones new_full new_empty sum".split()
)


def drawn(name: str) -> bool:
    """Whether a function of this name can be a layer (it is neither passing data along nor
    bookkeeping)."""
    return name not in _PASS and name not in _BOOKKEEPING


def passes(module: nn.Module) -> bool:
    """A module that only hands its input on (`nn.Identity`): not a layer of its own."""
    return isinstance(module, nn.Identity)


_JOINS = frozenset(("cat", "concat", "concatenate", "stack", "hstack", "vstack"))


def _joins_nothing(name: str, given: Any) -> bool:
    """A concatenation of one tensor and empty ones (a cache filling up) joins nothing."""
    return name in _JOINS and sum(1 for t in tensors_in(given) if t.numel()) <= 1


def call_path(path: str, call: int) -> str:
    """The box of the `call`-th call (from 1) of the module at `path`: `relu`, `relu#2`, ..."""
    return path if call == 1 else f"{path}#{call}"


@dataclass
class Raw:
    """One layer as a tracer saw it, before folding. `config` is what sets the module up
    beyond its shapes (its `extra_repr` and float settings such as a drop rate), so blocks
    that differ there are not folded together; `composite` marks a module with children."""

    path: str
    kind: str
    label: str
    shape: list[int] | None = None
    params: int = 0
    block: str | None = None
    config: str = ""
    composite: bool = False
    function: bool = False


@dataclass
class Traced:
    """What a tracer answers: layers in the order they ran, blocks, and edges."""

    layers: dict[str, Raw] = field(default_factory=dict)
    edges: list[tuple[str, str]] = field(default_factory=list)


def _shape(value: Any) -> list[int] | None:
    found = tensors_in(value)
    return list(found[0].shape) if found else None


def config_of(module: nn.Module) -> str:
    """What sets this module up besides its shapes: `extra_repr`, and every float it keeps."""
    parts = [module.extra_repr()]
    for name, value in vars(module).items():
        if not name.startswith("_") and isinstance(value, float):
            parts.append(f"{name}={value!r}")
    return "; ".join(parts)


class Opening:
    """Which modules of a root are opened and which are drawn as one layer, and the
    parameters under each (a weight tied in two places counted once under their parent)."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        self.root = root
        self.depth = depth
        self.named = dict(root.named_modules(remove_duplicate=False))
        self._closed: dict[str, bool] = {}
        self._params: dict[str, int] = {}

    def params(self, path: str) -> int:
        """Parameters under the module at `path`, each counted once."""
        if not self._params:
            under: dict[str, dict[int, int]] = {"": {}}
            for name, p in self.root.named_parameters(remove_duplicate=False):
                parts = name.split(".")[:-1]
                for i in range(len(parts) + 1):
                    under.setdefault(".".join(parts[:i]), {})[id(p)] = p.numel()
            self._params = {k: sum(v.values()) for k, v in under.items()}
        return self._params.get(path, 0)

    def closed(self, path: str) -> bool:
        """Whether the module at `path` is one layer rather than opened."""
        if path == "":
            return False
        known = self._closed.get(path)
        if known is not None:
            return known
        module = self.named[path]
        if next(module.children(), None) is None:
            answer = True
        elif recognised(module):
            parts = path.split(".")
            above = sum(
                1 for i in range(1, len(parts)) if recognised(self.named[".".join(parts[:i])])
            )
            answer = self.depth <= above
        else:
            answer = False
        self._closed[path] = answer
        return answer

    def drawn(self) -> list[tuple[str, nn.Module, bool]]:
        """Every (path, module, closed) that is a layer or a block, in declaration order,
        every path a module is reachable under (a tied module is at each of its paths)."""
        found: list[tuple[str, nn.Module, bool]] = []

        def visit(path: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                p = f"{path}.{name}" if path else name
                shut = self.closed(p)
                found.append((p, child, shut))
                if not shut:
                    visit(p, child)

        visit("", self.root)
        return found

    def _raw(self, path: str, block: str | None, label: str | None = None) -> Raw:
        m = self.named[path]
        composite = next(m.children(), None) is not None
        return Raw(
            path,
            kind_of(m),
            label or label_of(m),
            None,
            self.params(path),
            block,
            config_of(m),
            composite,
        )

    def add_block(self, out: Traced, path: str) -> None:
        """Make sure the opened composite at `path` and those above it are blocks in `out`."""
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            p = ".".join(parts[:i])
            if p not in out.layers:
                raw = self._raw(p, ".".join(parts[: i - 1]) or None, type(self.named[p]).__name__)
                raw.composite = True
                out.layers[p] = raw

    def add_leaf(self, out: Traced, path: str, call: int = 1) -> Raw:
        """The box of the `call`-th call of the closed module at `path` (made once)."""
        box = call_path(path, call)
        layer = out.layers.get(box)
        if layer is None:
            parent = path.rpartition(".")[0]
            if parent:
                self.add_block(out, parent)
            if path:
                layer = self._raw(path, parent or None)
            else:
                m = self.root
                layer = Raw("", kind_of(m), label_of(m), None, self.params(""), None, config_of(m))
            layer.path = box
            out.layers[box] = layer
        return layer


def _function_layer(out: Traced, block: str | None, fn: Any, counts: dict[str, int]) -> Raw:
    name = function_name(fn)
    key = f"{block}.{name}" if block else name
    n = counts.get(key, 0)
    counts[key] = n + 1
    path = key if n == 0 else f"{key}_{n}"
    layer = Raw(path, kind_of(name), name, None, 0, block, function=True)
    out.layers[path] = layer
    return layer


def prune(out: Traced, ends: set[str]) -> None:
    """Take off the functions whose result reaches nothing drawn and is not what the module
    gave back: a number read for a decision (`x.mean() > 0`) is not a layer of the net."""
    while True:
        feeding = {a for a, _ in out.edges}
        dead = {
            p for p, x in out.layers.items() if x.function and p not in feeding and p not in ends
        }
        if not dead:
            return
        for p in dead:
            del out.layers[p]
        out.edges = [(a, b) for a, b in out.edges if a not in dead and b not in dead]


class _Tracer(fx.Tracer):
    def __init__(self, opening: Opening) -> None:
        super().__init__()
        self.opening = opening

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self.opening.closed(qualname)


def fx_trace(root: nn.Module, depth: int) -> tuple[fx.Graph, Opening]:
    """The fx graph of `root` at this depth; raises whatever fx raises when it cannot follow
    the forward."""
    opening = Opening(root, depth)
    return _Tracer(opening).trace(root), opening


def by_fx(
    root: nn.Module,
    depth: int,
    args: tuple | None,
    kwargs: dict | None,
    recorded: dict[str, list[Any]] | None = None,
    trace: tuple[fx.Graph, Opening] | None = None,
) -> Traced:
    """Symbolically, then (with args) once through the traced graph for shapes and dtypes.

    `recorded` holds what each submodule gave back when the graph ran, in call order; a layer
    found there is not run again. `trace` is what `fx_trace` already answered. Raises whatever
    fx raises when it cannot follow the forward.
    """
    graph, opening = trace if trace is not None else fx_trace(root, depth)
    values = _values(graph, root, args, kwargs or {}, recorded or {}) if args is not None else {}
    out = Traced()
    made: dict[fx.Node, Raw] = {}
    data: set[fx.Node] = set()
    counts: dict[str, int] = {}
    calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            data.add(n)
        elif n.op == "call_module":
            data.add(n)
            if passes(opening.named[n.target]):
                continue
            calls[n.target] = k = calls.get(n.target, 0) + 1
            made[n] = opening.add_leaf(out, n.target, k)
        elif n.op in ("call_function", "call_method"):
            if not any(i in data for i in n.all_input_nodes):
                continue  # works on constants only: not the data
            data.add(n)
            value = values.get(n)
            floating = value is None or (
                isinstance(value, torch.Tensor) and value.is_floating_point()
            )
            if not drawn(function_name(n.target)) or not floating:
                continue
            stack = n.meta.get("nn_module_stack") or {}
            block = next(reversed(stack), None) if stack else None
            if block:
                opening.add_block(out, block)
            made[n] = _function_layer(out, block, n.target, counts)
    producers: dict[fx.Node, set[str]] = {}

    def produced_by(n: fx.Node) -> set[str]:
        if n in made:
            return {made[n].path}
        if n not in producers:
            producers[n] = set()
            producers[n] = {p for i in n.all_input_nodes for p in produced_by(i)}
        return producers[n]

    edges: dict[tuple[str, str], None] = {}
    for n, layer in made.items():
        if layer.shape is None and n in values:
            layer.shape = _shape(values[n])
        for i in n.all_input_nodes:
            for p in sorted(produced_by(i)):
                if p != layer.path:
                    edges[(p, layer.path)] = None
    out.edges = list(edges)
    ends = {p for n in graph.nodes if n.op == "output" for p in produced_by(n)}
    _order(out, [made[n].path for n in graph.nodes if n in made])
    prune(out, ends)
    return out


def _values(
    graph: fx.Graph, root: nn.Module, args: tuple, kwargs: dict, recorded: dict
) -> dict[fx.Node, Any]:
    """What every node of the fx graph holds on these arguments; a submodule's value is taken
    from what it gave back in the graph's run when that was recorded, not run again."""
    env: dict[fx.Node, Any] = {}
    given = iter(args)
    taken: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            name = str(n.target).lstrip("*")
            value = next(given, _MISSING)
            if value is _MISSING:
                value = kwargs.get(name, n.args[0] if n.args else None)
        elif n.op == "output":
            break
        else:
            a, k = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
            if n.op == "get_attr":
                value = root
                for part in str(n.target).split("."):
                    value = getattr(value, part)
            elif n.op == "call_module":
                known = recorded.get(n.target) or []
                i = taken.get(n.target, 0)
                taken[n.target] = i + 1
                value = known[i] if i < len(known) else root.get_submodule(n.target)(*a, **k)
            elif n.op == "call_function":
                value = n.target(*a, **k)
            else:
                value = getattr(a[0], n.target)(*a[1:], **k)
        env[n] = value
    return env


_MISSING = object()


def _order(out: Traced, order: list[str]) -> None:
    """Layers in the order they ran, each block just before its first layer; block shapes
    are the shape of the last layer inside them."""
    ranked: dict[str, None] = {}
    for path in order:
        chain = []
        block = out.layers[path].block
        while block is not None and block not in ranked:
            chain.append(block)
            block = out.layers[block].block
        for b in reversed(chain):
            ranked[b] = None
        ranked[path] = None
    for p in out.layers:
        ranked.setdefault(p, None)
    out.layers = {p: out.layers[p] for p in ranked}
    for path in reversed(order):
        shape = out.layers[path].shape
        block = out.layers[path].block
        while block is not None and out.layers[block].shape is None:
            out.layers[block].shape = shape
            block = out.layers[block].block


class _Functions(TorchFunctionMode):
    """Every torch function called between the drawn modules: drawn, or passing its input's
    producers on. Off inside a closed module (the Reading leaves the mode there)."""

    def __init__(self, state: _Forward) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.state.function(func, (args, kwargs), result)
        return result


class _Forward:
    """What a reading keeps while the forward runs: the layers, which tensor each made, and
    the blocks open around the call in progress."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        self.opening = Opening(root, depth)
        self.out = Traced()
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}
        self.order: list[str] = []
        # every tensor known, by id with a weak reference (an id is only that tensor's while
        # it lives): nothing is kept alive that the forward would have let go
        self.by: dict[int, tuple[weakref.ref, frozenset[str]]] = {}
        self.edges: dict[tuple[str, str], None] = {}

    def producers(self, value: Any) -> tuple[bool, frozenset[str]]:
        """Whether anything in `value` is the data, and which layers made it."""
        found: set[str] = set()
        tracked = False
        for t in tensors_in(value):
            known = self.by.get(id(t))
            if known is not None and known[0]() is t:
                tracked = True
                found |= known[1]
        return tracked, frozenset(found)

    def mark(self, value: Any, made: frozenset[str]) -> None:
        for t in tensors_in(value):
            self.by[id(t)] = (weakref.ref(t), made)

    def link(self, made: frozenset[str], path: str) -> None:
        for p in made:
            if p != path:
                self.edges[(p, path)] = None

    def function(self, func: Any, given: Any, result: Any) -> None:
        tracked, made = self.producers(given)
        if not tracked:
            return  # on constants only: not the data
        name = function_name(func)
        outs = tensors_in(result)
        if drawn(name) and outs and outs[0].is_floating_point() and not _joins_nothing(name, given):
            block = self.stack[-1] if self.stack else None
            if block:
                self.opening.add_block(self.out, block)
            layer = _function_layer(self.out, block, func, self.counts)
            layer.shape = list(outs[0].shape)
            self.order.append(layer.path)
            self.link(made, layer.path)
            self.mark(outs, frozenset((layer.path,)))
        else:
            self.mark(outs, made)


class Calls:
    """Hooks on the drawn modules of a root (its layers and the blocks around them) that say
    which path each call is made under and which call of that path it is.

    A module tied in two places is one object at two paths: a call is put at the path inside
    the block that is running. `enter(path, call, args, kwargs)` hears a layer's call begin
    and `leave(path, call, output)` hear it end; nothing inside a layer is heard. While
    `live` is False nothing is heard and nothing is counted. With `blocks` False the blocks
    are hooked only when a module is tied (their hooks are what says which path it is
    called under), for who needs the layers alone."""

    def __init__(self, opening: Opening, enter: Any, leave: Any, blocks: bool = True) -> None:
        self.opening = opening
        self.enter = enter
        self.leave = leave
        self.blocks = blocks
        self.live = True
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.inside = 0  # how deep inside layers the running call is
        self.handles: list[Any] = []

    def arm(self) -> Calls:
        """A pre- and a post-hook on every drawn module, once per module object."""
        root = self.opening.root
        aliases: dict[int, list[tuple[str, bool]]] = {}
        modules: dict[int, nn.Module] = {}
        if next(root.children(), None) is None:
            aliases[id(root)] = [("", True)]
            modules[id(root)] = root
        for path, module, shut in self.opening.drawn():
            aliases.setdefault(id(module), []).append((path, shut))
            modules[id(module)] = module
        tied = any(len(paths) > 1 for paths in aliases.values())
        for key, module in modules.items():
            paths = aliases[key]
            if not (self.blocks or tied or any(shut for _, shut in paths)):
                continue
            self.handles.append(
                module.register_forward_pre_hook(self._pre(paths), with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._post(paths)))
        return self

    def disarm(self) -> None:
        """Every hook off."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pick(self, paths: list[tuple[str, bool]]) -> tuple[str, bool]:
        here = self.stack[-1] if self.stack else ""
        for path, shut in paths:
            if path.rpartition(".")[0] == here:
                return path, shut
        return paths[0]

    def _pre(self, paths: list[tuple[str, bool]]):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.live:
                return
            if self.inside:
                self.inside += 1
                return
            path, shut = self._pick(paths)
            if not shut:
                self.stack.append(path)
                return
            self.calls[path] = k = self.calls.get(path, 0) + 1
            self.inside = 1
            self.enter(path, k, args, kwargs)

        return hook

    def _post(self, paths: list[tuple[str, bool]]):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self.live:
                return
            if self.inside:
                self.inside -= 1
                if not self.inside:
                    path, _ = self._pick(paths)
                    self.leave(path, self.calls[path], output)
                return
            if self.stack and any(self.stack[-1] == p for p, _ in paths):
                self.stack.pop()

        return hook


class Reading:
    """A read by a real forward that rides along a forward somebody else runs (the graph's
    own): `arm()` hooks what is drawn and turns the function mode on for the root's call
    only, `disarm()` takes it all off, `result()` answers what was seen. The mode is left
    while a layer runs: nothing inside a layer is a layer."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        self.root = root
        self.s = _Forward(root, depth)
        self.hooks = Calls(self.s.opening, self._layer_in, self._layer_out)
        self.hooks.live = False
        self.s.stack = self.hooks.stack
        self.handles: list[Any] = []
        self.mode: _Functions | None = None
        self.on = False  # the mode is on the stack
        self.calls = 0
        self.passing: frozenset[str] | None = None  # what an Identity being run hands on
        self.ends: set[str] = set()  # the layers that made what the root gave back

    def arm(self) -> Reading:
        """Hooks on; the root's next call is read."""
        self.handles.append(self.root.register_forward_pre_hook(self._enter, with_kwargs=True))
        self.hooks.arm()
        self.handles.append(self.root.register_forward_hook(self._leave))
        return self

    def _layer_in(self, path: str, call: int, args: tuple, kwargs: dict) -> None:
        self._mode(False)
        s = self.s
        made = s.producers((args, kwargs))[1]
        if passes(s.opening.named[path] if path else self.root):
            self.passing = made
            return
        layer = s.opening.add_leaf(s.out, path, call)
        s.order.append(layer.path)
        s.link(made, layer.path)

    def _layer_out(self, path: str, call: int, output: Any) -> None:
        if self.passing is not None:
            self.s.mark(output, self.passing)
            self.passing = None
        else:
            layer = self.s.out.layers[call_path(path, call)]
            if layer.shape is None:
                layer.shape = _shape(output)
            self.s.mark(output, frozenset((layer.path,)))
        self._mode(True)

    def _mode(self, on: bool) -> None:
        if self.mode is None or on == self.on:
            return
        if on:
            self.mode.__enter__()
        else:
            self.mode.__exit__(None, None, None)
        self.on = on

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls += 1
        if self.calls == 1:
            self.s.mark((args, kwargs), frozenset())  # the data, made by no layer
            self.hooks.live = True
            self.mode = _Functions(self.s)
            self._mode(True)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.hooks.live:
            self._mode(False)
            self.hooks.live = False  # only the first call is read
            self.ends = set(self.s.producers(output)[1])

    def disarm(self) -> None:
        """Every hook off, and the function mode too if the root's call never came back."""
        self._mode(False)
        self.hooks.live = False
        self.hooks.disarm()
        for h in self.handles:
            h.remove()
        self.handles = []

    def result(self) -> Traced:
        """What the root's first call was seen to be made of."""
        s = self.s
        s.out.edges = list(s.edges)
        _order(s.out, s.order)
        prune(s.out, self.ends)
        s.by = {}
        return s.out


def by_forward(root: nn.Module, depth: int, args: tuple, kwargs: dict | None) -> Traced:
    """A real forward with hooks on what is drawn and a function mode for what is between."""
    reading = Reading(root, depth).arm()
    try:
        root(*args, **(kwargs or {}))
    finally:
        reading.disarm()
    return reading.result()
