"""Two ways of reading what a module is made of: torch.fx, and a real forward with hooks.

Both answer the same thing, a list of raw layers in the order they ran and the edges between
them, at the same granularity: a module with no children is one layer, a composite torch
itself ships (a TransformerEncoderLayer) is one layer until `depth` opens it, and every other
composite (a container, a user's block) is opened and becomes the block its layers sit in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from somatize.torch.inside.kinds import function_name, kind_of, label_of, recognised

__all__ = ["Raw", "Traced", "by_fx", "by_forward", "fx_trace", "Opening", "Reading"]

# Calls that carry a value along without being a layer anybody would draw.
_PASS = {
    "getattr",
    "getitem",
    "size",
    "dim",
    "type",
    "to",
    "float",
    "double",
    "half",
    "contiguous",
    "detach",
    "clone",
    "numel",
    "get",
    "requires_grad",
    "is_floating_point",
    "is_nested",
    "ndim",
    "shape",
    "device",
    "dtype",
    "set",
}


@dataclass
class Raw:
    """One layer as a tracer saw it, before folding."""

    path: str
    kind: str
    label: str
    shape: list[int] | None = None
    params: int = 0
    block: str | None = None


@dataclass
class Traced:
    """What a tracer answers: layers in the order they ran, blocks, and edges."""

    layers: dict[str, Raw] = field(default_factory=dict)
    edges: list[tuple[str, str]] = field(default_factory=list)


def _shape(value: Any) -> list[int] | None:
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            return list(t.shape)
    return None


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _counts(root: nn.Module) -> dict[str, int] | None:
    """Parameters under every path of `root`, in one pass; None when a parameter is shared
    (then each module counts its own, once each)."""
    counts: dict[str, int] = {"": 0}
    seen: set[int] = set()
    for name, p in root.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            return None
        seen.add(id(p))
        n = p.numel()
        counts[""] += n
        path = ""
        for part in name.split(".")[:-1]:
            path = f"{path}.{part}" if path else part
            counts[path] = counts.get(path, 0) + n
    return counts


class Opening:
    """Which modules of a root are opened and which are drawn as one layer."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        self.root = root
        self.depth = depth
        self.named = dict(root.named_modules(remove_duplicate=False))
        self._closed: dict[str, bool] = {}
        self._params: dict[str, int] = {}

    def params(self, path: str) -> int:
        """Parameters under the module at `path` (each counted once)."""
        if not self._params:
            self._params = _counts(self.root) or {"\0": 0}
        n = self._params.get(path)
        if n is None:
            if "\0" not in self._params:
                return 0  # counted in one pass: nothing under this path has parameters
            n = self._params[path] = _params(self.named[path] if path else self.root)
        return n

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

    def add_block(self, out: Traced, path: str) -> None:
        """Make sure the opened composite at `path` and those above it are blocks in `out`."""
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            p = ".".join(parts[:i])
            if p not in out.layers:
                m = self.named[p]
                out.layers[p] = Raw(
                    p,
                    kind_of(m),
                    type(m).__name__,
                    None,
                    self.params(p),
                    ".".join(parts[: i - 1]) or None,
                )

    def add_leaf(self, out: Traced, path: str) -> Raw:
        """The closed module at `path` as a layer of `out` (made once)."""
        layer = out.layers.get(path)
        if layer is None:
            parent = path.rpartition(".")[0]
            if parent:
                self.add_block(out, parent)
            m = self.named[path] if path else self.root
            layer = Raw(path, kind_of(m), label_of(m), None, self.params(path), parent or None)
            out.layers[path] = layer
        return layer


def _function_layer(out: Traced, block: str | None, fn: Any, counts: dict[str, int]) -> Raw:
    name = function_name(fn)
    key = f"{block}.{name}" if block else name
    n = counts.get(key, 0)
    counts[key] = n + 1
    path = key if n == 0 else f"{key}_{n}"
    layer = Raw(path, kind_of(name), name, None, 0, block)
    out.layers[path] = layer
    return layer


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
    """Symbolically, then (with args) once through the traced graph for the shapes.

    `recorded` holds what each submodule gave back when the graph ran, in call order; a layer
    found there is not run again. `trace` is what `fx_trace` already answered. Raises whatever
    fx raises when it cannot follow the forward.
    """
    graph, opening = trace if trace is not None else fx_trace(root, depth)
    out = Traced()
    made: dict[fx.Node, Raw] = {}
    counts: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            opening.add_leaf(out, n.target)
            made[n] = out.layers[n.target]
        elif n.op in ("call_function", "call_method"):
            if function_name(n.target) in _PASS:
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
        for i in n.all_input_nodes:
            for p in sorted(produced_by(i)):
                if p != layer.path:
                    edges[(p, layer.path)] = None
    out.edges = list(edges)
    if args is not None:
        _shapes(graph, root, made, args, kwargs or {}, recorded or {})
    _order(out, [made[n].path for n in graph.nodes if n in made])
    return out


def _shapes(
    graph: fx.Graph, root: nn.Module, made: dict, args: tuple, kwargs: dict, recorded: dict
) -> None:
    env: dict[fx.Node, Any] = {}
    given = iter(args)
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
                known = recorded.get(n.target)
                if known:
                    value = known.pop(0)
                else:
                    value = root.get_submodule(n.target)(*a, **k)
            elif n.op == "call_function":
                value = n.target(*a, **k)
            else:
                value = getattr(a[0], n.target)(*a[1:], **k)
        env[n] = value
        layer = made.get(n)
        if layer is not None and layer.shape is None:
            layer.shape = _shape(value)


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
    def __init__(self, state: _Forward) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        result = func(*args, **(kwargs or {}))
        s = self.state
        if s.inside == 0 and function_name(func) not in _PASS:
            outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            if outs:
                block = s.stack[-1] if s.stack else None
                if block:
                    s.opening.add_block(s.out, block)
                layer = _function_layer(s.out, block, func, s.counts)
                layer.shape = list(outs[0].shape)
                s.order.append(layer.path)
                s.link((args, kwargs), layer.path)
                s.mark(outs, layer.path)
        return result


class _Forward:
    def __init__(self, root: nn.Module, depth: int) -> None:
        self.opening = Opening(root, depth)
        self.out = Traced()
        self.stack: list[str] = []
        self.inside = 0
        self.counts: dict[str, int] = {}
        self.order: list[str] = []
        self.by: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []
        self.edges: dict[tuple[str, str], None] = {}
        self.quiet: Any = None

    def hush(self) -> None:
        """Function mode back on, after a layer turned it off."""
        if self.quiet is not None:
            self.quiet.__exit__(None, None, None)
            self.quiet = None

    def link(self, value: Any, path: str) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                p = self.by.get(id(t))
                if p is not None and p != path:
                    self.edges[(p, path)] = None

    def mark(self, tensors: list[torch.Tensor], path: str) -> None:
        for t in tensors:
            self.by[id(t)] = path
            self.keep.append(t)


_DONE = 1 << 40


class Reading:
    """A read by a real forward that rides along a forward somebody else runs (the graph's
    own): `arm()` hooks what is drawn and turns the function mode on for the root's call
    only, `disarm()` takes it all off, `result()` answers what was seen."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        self.root = root
        self.s = _Forward(root, depth)
        self.handles: list[Any] = []
        self.mode: _Functions | None = None
        self.calls = 0

    def arm(self) -> Reading:
        """Hooks on; the root's next call is read."""
        s, handles = self.s, self.handles
        s.opening.params("")  # counted now, not under the function mode
        handles.append(self.root.register_forward_pre_hook(self._enter))

        def visit(path: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                p = f"{path}.{name}" if path else name
                if s.opening.closed(p):
                    handles.append(child.register_forward_pre_hook(_leaf_in(s, p)))
                    handles.append(child.register_forward_hook(_leaf_out(s, p)))
                else:
                    handles.append(child.register_forward_pre_hook(_block_in(s, p)))
                    handles.append(child.register_forward_hook(_block_out(s, p)))
                    visit(p, child)

        if next(self.root.children(), None) is None:
            handles.append(self.root.register_forward_pre_hook(_leaf_in(s, "")))
            handles.append(self.root.register_forward_hook(_leaf_out(s, "")))
        else:
            visit("", self.root)
        handles.append(self.root.register_forward_hook(self._leave))
        return self

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.calls += 1
        if self.calls == 1:
            self.mode = _Functions(self.s)
            self.mode.__enter__()

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._off()
        self.s.inside += _DONE  # only the first call is read: every hook is quiet after it

    def _off(self) -> None:
        self.s.hush()
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def disarm(self) -> None:
        """Every hook off, and the function mode too if the root's call never came back."""
        self._off()
        for h in self.handles:
            h.remove()
        self.handles = []

    def result(self) -> Traced:
        """What the root's first call was seen to be made of."""
        s = self.s
        s.out.edges = list(s.edges)
        _order(s.out, s.order)
        return s.out


def by_forward(root: nn.Module, depth: int, args: tuple, kwargs: dict | None) -> Traced:
    """A real forward with hooks on what is drawn and a function mode for what is between."""
    reading = Reading(root, depth).arm()
    try:
        root(*args, **(kwargs or {}))
    finally:
        reading.disarm()
    return reading.result()


def _leaf_in(s: _Forward, path: str):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple) -> None:
        if s.inside == 0:
            s.opening.add_leaf(s.out, path)
            s.order.append(path)
            s.link(args, path)
            s.quiet = torch._C.DisableTorchFunction()  # nothing inside a layer is a layer
            s.quiet.__enter__()
        s.inside += 1

    return hook


def _leaf_out(s: _Forward, path: str):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        s.inside -= 1
        if s.inside == 0:
            s.hush()
            layer = s.out.layers[path]
            if layer.shape is None:
                layer.shape = _shape(output)
            s.mark([t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)], path)

    return hook


def _block_in(s: _Forward, path: str):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple) -> None:
        if s.inside == 0:
            s.stack.append(path)

    return hook


def _block_out(s: _Forward, path: str):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if s.inside == 0 and s.stack and s.stack[-1] == path:
            s.stack.pop()
            layer = s.out.layers.get(path)
            if layer is not None and layer.shape is None:
                layer.shape = _shape(output)

    return hook
