"""Reading a module with torch.fx: symbolically, then once through the traced graph on the
arguments it was really called with, for shapes and dtypes."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from somatize.torch.inside._trace import (
    Opening,
    Raw,
    Traced,
    block_call,
    drawn,
    finish,
    function_layer,
    shape_of,
)
from somatize.torch.inside.kinds import function_name


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
    trace: tuple[fx.Graph, Opening],
    args: tuple | None,
    kwargs: dict | None,
    recorded: dict[str, list[Any]] | None,
) -> Traced:
    """`trace` (what `fx_trace` answered) read, then (with args) run once for shapes and dtypes.

    `recorded` holds what each submodule gave back when the graph ran, in call order; a layer
    found there is not run again. Raises whatever running the trace raises.
    """
    graph, opening = trace
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
            if isinstance(opening.named[n.target], nn.Identity):
                continue
            calls[n.target] = k = calls.get(n.target, 0) + 1
            made[n] = opening.add_leaf(out, n.target, k)
            made[n].within = _within(n, n.target)
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
            within = _within(n)
            block = next(reversed(within), None)
            made[n] = function_layer(opening, out, block, n.target, counts)
            made[n].within = within
    producers: dict[fx.Node, set[str]] = {}  # the layers that made each node's value
    for n in graph.nodes:  # (in order: a node's inputs come before it)
        inputs = (p for i in n.all_input_nodes for p in producers[i])
        producers[n] = {made[n].path} if n in made else set(inputs)
    edges: dict[tuple[str, str], None] = {}
    for n, layer in made.items():
        if layer.shape is None and n in values:
            layer.shape = shape_of(values[n])
        for i in n.all_input_nodes:
            for p in sorted(producers[i]):
                if p != layer.path:
                    edges[(p, layer.path)] = None
    ends = {p for n in graph.nodes if n.op == "output" for p in producers[n]}
    finish(out, edges, [made[n].path for n in graph.nodes if n in made], ends)
    return out


def _within(n: fx.Node, itself: str | None = None) -> dict[str, int]:
    """The blocks a node ran inside, outermost first, each with the call of it (from 1)."""
    blocks = (block_call(key) for key in n.meta.get("nn_module_stack") or {})
    return {path: call for path, call in blocks if path != itself}


def _values(
    graph: fx.Graph, root: nn.Module, args: tuple, kwargs: dict, recorded: dict
) -> dict[fx.Node, Any]:
    """What every node of the fx graph holds on these arguments; a submodule's value is taken
    from what it gave back in the graph's run when that was recorded, not run again."""
    env: dict[fx.Node, Any] = {}
    given = list(args)
    taken: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            if given:
                value = given.pop(0)
            else:
                value = kwargs.get(str(n.target).lstrip("*"), n.args[0] if n.args else None)
        elif n.op == "output":
            break
        else:
            a, k = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
            if n.op == "get_attr":
                value = functools.reduce(getattr, str(n.target).split("."), root)
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
