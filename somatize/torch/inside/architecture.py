"""What each node is made of: `architecture`, `traced`, `kind_of`, and the `Inside` they answer.

An `Inside` is data shaped for drawing: layers keyed by their path inside the node (the same
`node.path.to.submodule` keys the audit and the probe use), the edges between them, and
repeated blocks folded to one `×N`.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from somatize.torch._modules import (
    Tap,
    _One,
    as_graph,
    join,
    named_modules_of,
    tensors_in,
    untouched,
)
from somatize.torch.inside._trace import Raw, Reading, Traced, _shape, by_forward, by_fx, fx_trace
from somatize.torch.inside.fold import collapse, fold
from somatize.torch.inside.kinds import kind_of, label_of

__all__ = ["Inside", "Layer", "architecture", "traced", "kind_of"]


@dataclass
class Layer:
    """One box inside a node.

    `path` is relative to the node (`""` when the node is a single layer), `kind` comes from
    `kind_of`, `shape` is the output shape (None without an example), `block` the path of the
    enclosing composite, `made_of` the paths of the layers directly inside this one (a block),
    `times` how many layers this box stands for once repeated blocks are folded, `repeats`
    the paths it hides.
    """

    path: str
    kind: str
    label: str
    shape: list[int] | None = None
    params: int = 0
    block: str | None = None
    times: int = 1
    repeats: list[str] = field(default_factory=list)
    made_of: list[str] = field(default_factory=list)


@dataclass
class Inside:
    """What one node is made of, ready for a figure.

    `how` is "symbolic" when torch.fx followed the forward and "traced" when a real forward
    with hooks had to; `why` says why fx could not (None when it could). `hidden` counts the
    layers left out to stay under `most`.
    """

    layers: list[Layer]
    edges: list[tuple[str, str]]
    how: str
    why: str | None = None
    hidden: int = 0

    def layer(self, path: str) -> Layer:
        """The layer at `path`; KeyError naming the paths there are if there is none."""
        for layer in self.layers:
            if layer.path == path:
                return layer
        raise KeyError(f"no layer {path!r}; there are {[x.path for x in self.layers]}")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: lists, dicts, strings, numbers, None."""
        return {
            "layers": [asdict(x) for x in self.layers],
            "edges": [list(e) for e in self.edges],
            "how": self.how,
            "why": self.why,
            "hidden": self.hidden,
        }

    def __repr__(self) -> str:
        return f"Inside({len(self.layers)} layers, {len(self.edges)} edges, {self.how})"


def _finish(raw: Traced, how: str, why: str | None, most: int) -> Inside:
    folded, edges = fold(raw)
    folded, edges, hidden = collapse(folded, edges, most)
    layers = [
        Layer(
            f.raw.path,
            f.raw.kind,
            f.raw.label,
            f.raw.shape,
            f.raw.params,
            f.raw.block,
            f.times,
            list(f.repeats),
            list(f.made_of),
        )
        for f in folded.values()
    ]
    return Inside(layers, edges, how, why, hidden)


def _args(example: Any) -> tuple[tuple, dict] | None:
    if example is None:
        return None
    if isinstance(example, _Call):
        return example.args, example.kwargs
    return (example,), {}


class _Call:
    """The exact arguments a module was called with, caught by a pre-hook."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs


def _single(module: nn.Module, call: tuple[tuple, dict] | None) -> Traced:
    """A module with no children is one layer, whatever its forward does inside."""
    out = Traced()
    layer = Raw(
        "", kind_of(module), label_of(module), None, sum(p.numel() for p in module.parameters())
    )
    if call is not None:
        layer.shape = _shape(module(*call[0], **call[1]))
    out.layers[""] = layer
    return out


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()


def _raw(
    module: nn.Module,
    example: Any,
    depth: int,
    recorded: dict | None = None,
    plan: Any = None,
) -> tuple[Traced, str, str | None] | None:
    """`plan` is what `_plan` found before the graph ran: an fx trace, or why fx refused and
    the `Reading` that rode along the graph's run instead."""
    call = _args(example)
    if next(module.children(), None) is None:
        return _single(module, call), "symbolic", None
    if isinstance(plan, _Read):
        if plan.reading.calls:
            return plan.reading.result(), "traced", plan.why
        return None
    try:
        trace = plan if isinstance(plan, tuple) else None
        raw = by_fx(module, depth, *(call if call else (None, None)), recorded, trace)
        return raw, "symbolic", None
    except Exception as e:  # noqa: BLE001  (fx refuses in many ways; each is a reason)
        why = _why(e)
    if call is None:
        return None
    raw = by_forward(module, depth, *call)
    return raw, "traced", why


class _Read:
    """fx refused this module: why, and the reading that rides along the graph's run."""

    def __init__(self, module: nn.Module, depth: int, why: str) -> None:
        self.reading = Reading(module, depth)
        self.why = why


def _plan(graph: Any, depth: int) -> dict[tuple[str, str], Any]:
    """Before the graph runs: each held module with children traced by fx, or — where fx
    refuses — a `_Read` to be armed for the run, so no module is run a second time."""
    plans: dict[tuple[str, str], Any] = {}
    for node in graph.nodes():
        for name, module in named_modules_of(graph.implementation(node)):
            if next(module.children(), None) is None:
                continue
            refused = _REFUSED.get(module, {}).get(depth)
            if refused is not None:
                plans[(node, name)] = _Read(module, depth, refused)
                continue
            try:
                plans[(node, name)] = fx_trace(module, depth)
            except Exception as e:  # noqa: BLE001
                why = _why(e)
                _REFUSED.setdefault(module, {})[depth] = why
                plans[(node, name)] = _Read(module, depth, why)
    return plans


# Modules fx refused, by depth, and why: asking again costs a millisecond and a failed trace.
# Only refusals are remembered: reading by a real forward is right for any module, so a
# module that has since become traceable is at worst read the slower way.
_REFUSED: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def traced(module: Any, example: Any = None, *, depth: int = 0, most: int = 48) -> Inside | None:
    """What this module is made of. fx if it can, a real forward if it cannot.

    `example` is an input to run it on; without one only the symbolic path is available, and a
    module that needs a forward answers None. A plain function (anything not an nn.Module)
    answers None. Running it changes nothing: modes, buffers and the random state are put
    back. The same module gives the same answer every time.
    """
    if not isinstance(module, nn.Module):
        return None
    with untouched([module]), torch.no_grad():
        got = _raw(module, example, depth)
    if got is None:
        return None
    return _finish(*got, most)


def _prefixed(inside: Inside, name: str, module: nn.Module) -> Inside:
    """The Inside of a module held as attribute `name`, as seen from the node holding it."""
    if not name:
        return inside
    layers = []
    single = len(inside.layers) == 1 and inside.layers[0].path == ""
    if not single:
        tops = [join(name, x.path) for x in inside.layers if x.block is None]
        shape = next((x.shape for x in reversed(inside.layers) if x.shape is not None), None)
        params = sum(p.numel() for p in module.parameters())
        layers.append(
            Layer(name, kind_of(module), type(module).__name__, shape, params, None, made_of=tops)
        )
    for x in inside.layers:
        layers.append(
            Layer(
                join(name, x.path),
                x.kind,
                x.label,
                x.shape,
                x.params,
                join(name, x.block) if x.block else (None if single else name),
                x.times,
                [join(name, r) for r in x.repeats],
                [join(name, c) for c in x.made_of],
            )
        )
    return Inside(
        layers,
        [(join(name, a), join(name, b)) for a, b in inside.edges],
        inside.how,
        inside.why,
        inside.hidden,
    )


def _ends(inside: Inside) -> tuple[list[str], list[str]]:
    """The layers nothing inside feeds (sources) and that feed nothing inside (sinks)."""
    leaves = [x.path for x in inside.layers if not x.made_of]
    fed = {b for _, b in inside.edges}
    feeding = {a for a, _ in inside.edges}
    return [p for p in leaves if p not in fed], [p for p in leaves if p not in feeding]


def _held(parts: list[Inside], links: list[tuple[int, int]]) -> Inside:
    """One Inside for a plain node from those of the modules it holds, each under its name;
    `links` says which held module fed which, as seen when the graph ran."""
    layers: list[Layer] = []
    edges: list[tuple[str, str]] = []
    how, why, hidden = "symbolic", None, 0
    for inside in parts:
        layers.extend(inside.layers)
        edges.extend(inside.edges)
        hidden += inside.hidden
        if inside.how == "traced":
            how, why = "traced", inside.why
    for a, b in links:
        sinks = _ends(parts[a])[1]
        sources = _ends(parts[b])[0]
        edges.extend((x, y) for x in sinks for y in sources)
    return Inside(layers, edges, how, why, hidden)


def _capture(
    graph: Any, example: Any, broker: Any, plans: dict[tuple[str, str], Any]
) -> tuple[dict, dict, dict]:
    """Run the graph once; what reached each module a node holds, as its exact arguments,
    and what each module held by a plain node gave back. Modules fx can follow have what
    their submodules gave back recorded (for the shapes); those it cannot are read by their
    `Reading`, armed for this run."""
    seen: dict[tuple[str, str], _Call] = {}
    gave: dict[tuple[str, str], list[torch.Tensor]] = {}
    outputs: dict[tuple[str, str], dict[str, list[Any]]] = {}
    handles = []
    modules: list[nn.Module] = []
    for node in graph.nodes():
        for name, module in named_modules_of(graph.implementation(node)):
            modules.append(module)
            if not name:
                continue  # the node itself: heard through the tap

            def hook(m: nn.Module, args: tuple, kwargs: dict, key=(node, name)) -> None:
                seen.setdefault(key, _Call(args, kwargs))

            def done(m: nn.Module, args: tuple, out: Any, key=(node, name)) -> None:
                gave.setdefault(key, tensors_in(out))

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            handles.append(module.register_forward_hook(done))
        for name, module in named_modules_of(graph.implementation(node)):
            if not isinstance(plans.get((node, name)), tuple):
                continue  # childless, or read by its Reading: nothing to record
            mine = outputs.setdefault((node, name), {})
            for path, sub in module.named_modules():
                if path:

                    def record(m: nn.Module, args: tuple, out: Any, into=mine, path=path) -> None:
                        into.setdefault(path, []).append(out)

                    handles.append(sub.register_forward_hook(record))

    def heard(node: str, input: Any, ctx: Any, out: Any) -> None:
        if isinstance(graph, _One):
            seen.setdefault((node, ""), _Call((input,), {}))
        elif isinstance(graph.implementation(node), nn.Module):
            seen.setdefault((node, ""), _Call((input, ctx), {}))

    readings = [p.reading for p in plans.values() if isinstance(p, _Read)]
    try:
        with untouched(modules), torch.no_grad(), Tap(graph, heard):
            for reading in readings:
                reading.arm()
            if broker is not None:
                graph.forward(example, broker=broker)
            else:
                graph.forward(example)
    finally:
        for reading in readings:
            reading.disarm()
        for h in handles:
            h.remove()
    return seen, gave, outputs


def _links(node: str, names: list[str], calls: dict, gave: dict) -> list[tuple[int, int]]:
    links = []
    for a, first in enumerate(names):
        made = {id(t) for t in gave.get((node, first), [])}
        for b, second in enumerate(names):
            call = calls.get((node, second))
            if a != b and call is not None:
                if made & {id(t) for t in tensors_in((call.args, call.kwargs))}:
                    links.append((a, b))
    return links


def architecture(
    graph: Any, example: Any = None, *, most: int = 48, depth: int = 0, broker: Any = None
) -> dict[str, Inside]:
    """What each node is made of, as {node: Inside} — ready for a figure::

        g.figure(inside=architecture(g, x))

    With an example the graph is run once, and each module a node holds is read on exactly
    what reached it: a fan-in node gets the dict of its predecessors' values, as it would.
    torch.fx is asked first, module by module, and where it cannot follow the forward a real
    forward with hooks answers instead (the Inside says which, and why). Without an example
    only what fx can answer symbolically is there, without shapes. Nodes holding no module
    (a plain function, a tokenizer) are not in the answer. A composite torch ships is one box
    unless `depth=` opens it; blocks that are the same block fold to one `×N`; past `most`
    layers a node's deepest blocks are closed. The net is left exactly as it was.
    """
    graph = as_graph(graph)
    plans = _plan(graph, depth)
    if example is not None:
        calls, gave, outputs = _capture(graph, example, broker, plans)
    else:
        calls, gave, outputs = {}, {}, {}
    out: dict[str, Inside] = {}
    for node in graph.nodes():
        held = named_modules_of(graph.implementation(node))
        parts, names = [], []
        for name, module in held:
            call = calls.get((node, name))
            if example is not None and call is None:
                continue  # never reached (a branch not taken, or run elsewhere)
            plan = plans.get((node, name))
            if isinstance(plan, _Read):
                got = _raw(module, call, depth, None, plan)  # read in the run: nothing runs
            else:
                with untouched([module]), torch.no_grad():
                    got = _raw(module, call, depth, outputs.get((node, name)), plan)
            if got is None:
                continue
            parts.append(_prefixed(_finish(*got, most), name, module))
            names.append(name)
        if not parts:
            continue
        if len(held) == 1 and held[0][0] == "":
            out[node] = parts[0]
        else:
            out[node] = _held(parts, _links(node, names, calls, gave))
    return out
