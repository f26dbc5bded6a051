"""Reading a module with torch.fx, symbolically: what `architecture` draws without an example."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from somatize.torch.inside._trace import (
    DRAWS,
    FRESH,
    INDEX_KEYWORDS,
    INDEXES,
    INPUT,
    UNDRAWN,
    Opening,
    Raw,
    Traced,
    finish,
    function_layer,
    function_path,
)
from somatize.torch.inside.kinds import function_name


class _Tracer(fx.Tracer):
    def __init__(self, opening: Opening) -> None:
        super().__init__()
        self.opening = opening

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self.opening.closed(qualname) and not isinstance(m, nn.Identity)  # (no box)


def fx_trace(root: nn.Module, depth: int) -> tuple[fx.Graph, Opening]:
    """The fx graph of `root` at this depth; raises whatever fx raises when it cannot follow
    the forward."""
    opening = Opening(root, depth)
    return _Tracer(opening).trace(root), opening


def by_fx(trace: tuple[fx.Graph, Opening]) -> Traced:
    """`trace` (what `fx_trace` answered) read: its layers and edges, without shapes."""
    graph, opening = trace
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
            calls[n.target] = k = calls.get(n.target, 0) + 1
            made[n] = opening.add_leaf(out, n.target, k)
            made[n].within = _within(n, n.target)
        elif n.op in ("call_function", "call_method"):
            name = function_name(n.target)
            if not any(i in data for i in n.all_input_nodes) or name in FRESH - DRAWS:
                continue  # works on constants only, or on none of the data's values
            data.add(n)
            if name in UNDRAWN:
                continue
            within = _within(n)
            block = next(reversed(within), None)
            path = function_path(block, n.target, counts, opening.named)
            made[n] = function_layer(opening, out, block, n.target, path)
            made[n].within = within
    producers: dict[fx.Node, set[str]] = {}  # the layers that made each node's value
    given: dict[fx.Node, set[str]] = {}  # the layers that made what each node computes with
    for n in graph.nodes:  # (in order: a node's inputs come before it)
        drawn = n.op in ("call_function", "call_method") and function_name(n.target) in DRAWS
        given[n] = set() if drawn else _given(n, producers)  # (noise: a shape, no values)
        producers[n] = {made[n].path} if n in made else given[n]
        if n.op == "placeholder":
            producers[n] = {INPUT}
    edges: dict[tuple[str, str], None] = {}
    for n, layer in made.items():
        for p in sorted(given[n]):
            if p != layer.path:
                edges[(p, layer.path)] = None
    given_back: list[fx.Node] = []  # what the forward returns, in its order
    for n in graph.nodes:
        if n.op == "output":
            fx.node.map_arg(n.args, given_back.append)
    ends = [p for n in given_back for p in sorted(producers[n])]
    finish(out, edges, [made[n].path for n in graph.nodes if n in made], ends)
    return out


def _given(n: fx.Node, producers: dict[fx.Node, set[str]]) -> set[str]:
    """The layers that made what `n` computes with: an index or a mask it is handed besides
    the data (`INDEXES`) decides where the data goes, and is left out; `where`'s mask on
    constants, `where(mask, 0, lowest)`, makes a mask of numbers, none of the data."""
    everything = {p for i in n.all_input_nodes for p in producers[i]}
    calls = n.op in ("call_function", "call_method")
    name = function_name(n.target) if calls else None
    if (at := INDEXES.get(name)) is None:
        return everything
    index: list[fx.Node] = []
    where = [n.args[at]] if len(n.args) > at else []
    where += [v for k, v in n.kwargs.items() if k in INDEX_KEYWORDS]
    fx.node.map_arg(where, index.append)
    rest = {p for i in n.all_input_nodes if i not in index for p in producers[i]}
    return rest if name == "where" else rest or everything  # (a mask made numbers: no data)


def _within(n: fx.Node, itself: str | None = None) -> dict[str, int]:
    """The blocks a node ran inside, outermost first, each with the call of it (from 1): fx
    keys a block by its path, then `path@1` for its second call, ..."""
    found: dict[str, int] = {}
    for key in n.meta.get("nn_module_stack") or {}:
        path, at, k = key.rpartition("@")
        path, call = (path, int(k) + 1) if at and k.isdigit() else (key, 1)
        if path != itself:
            found[path] = call
    return found
