"""What each node is made of: `architecture`, `traced`, `kind_of`, and the `Inside` they answer.

An `Inside` is data shaped for drawing: layers keyed by their path inside the node (the same
`node.path.to.submodule` keys the audit and the probe use), the edges between them, and
repeated blocks folded to one `×N`.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from somatize import run
from somatize.graph import as_graph
from somatize.node import unwrap
from somatize.run import in_one_line, note, warn
from somatize.torch._modules import (
    Held,
    Holder,
    Tap,
    parts_of,
    root_of,
    tensors_in,
    untouched,
)
from somatize.torch._values import mapped
from somatize.torch.audit._measures import output_of
from somatize.torch.inside._batch import batch_of
from somatize.torch.inside._forward import Reading
from somatize.torch.inside._fx import by_fx, fx_trace
from somatize.torch.inside._trace import (
    INPUT,
    OUTPUT,
    Layer,
    Opening,
    Raw,
    Traced,
    params_of,
)
from somatize.torch.inside.fold import collapse, fold
from somatize.torch.inside.kinds import kind_of

__all__ = ["Inside", "Layer", "architecture", "traced", "kind_of"]


@dataclass
class Inside:
    """What one node is made of, ready for a figure.

    `how` is "symbolic" when torch.fx followed the forward and "traced" when a real forward
    with hooks had to; `why` says why fx could not (None when it could). `hidden` counts the
    layers left out to stay under `most`. `params` is how many parameters the node holds,
    each counted once however often it is tied or its block repeats. `inputs` are the layers
    that read what the node was given (each concat of a dense block, each branch of an
    inception block, the first layer of a chain), in the order they ran; `outputs` are the
    layers that made the tensors of what it gave back, in that value's order (a BertModel's
    last `LayerNorm`, for `last_hidden_state`, then its pooler's `Tanh`; a folded block's
    first copy's layer stands for its last's): `edges` are between layers only. A node that
    is one layer says its path, `""`, in both. `read_by` names, for each node after it seen
    reading what it gave (a module, in a graph run on an example; one layer reads what the
    torch functions its forward calls read, all it is given where they read none), those of
    `outputs` that made the tensors its layers read, `[]` if none:
    `{"pool": ["pooler.activation"]}`. `unread` names the node's parameters no node's forward
    read on the example (DINOv2's mask token; a box drawn closed reads all it holds); empty
    without an example.
    """

    layers: list[Layer]
    edges: list[tuple[str, str]]
    how: str
    why: str | None = None
    hidden: int = 0
    params: int = 0
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    read_by: dict[str, list[str]] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)

    def layer(self, path: str) -> Layer:
        """The layer at `path`; KeyError naming the paths there are if there is none."""
        for layer in self.layers:
            if layer.path == path:
                return layer
        raise KeyError(f"no layer {path!r}; there are {[x.path for x in self.layers]}")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: lists, dicts, strings, numbers, None."""
        return asdict(self) | {"edges": [list(e) for e in self.edges]}

    def __repr__(self) -> str:
        return f"Inside({len(self.layers)} layers, {len(self.edges)} edges, {self.how})"


def _raw(module: nn.Module, plan: Any, gave: Any) -> tuple[Traced, str, str | None] | None:
    """The layers of `module`, how they were read and why not by fx (None where nothing was):
    `plan` is what `_plan` found before the graph ran (the `Reading` that rode along the run,
    or without an example an fx trace), `gave` the shape of what the module gave back and the
    batch on its first axis (`Layer.batch`), (None, None) where the graph was not run."""
    if _one_layer(module):  # one layer, whatever its forward does inside
        out = Traced(edges=[(INPUT, ""), ("", OUTPUT)])  # (it reads the input, and gives back)
        layer = Opening(module, 0).add_leaf(out, "")
        layer.shape, layer.batch = gave
        return out, "symbolic", None
    if isinstance(plan, Reading):  # read in the graph's run: nothing runs again
        how = "symbolic" if plan.why is None else "traced"
        return (plan.result(), how, plan.why) if plan.runs else None
    return None if plan is None else (by_fx(plan), "symbolic", None)


def _plan(roots: dict[str, nn.Module], depth: int, example: Any) -> dict[str, Any]:
    """Before the graph runs: each node's module traced by fx, or why fx refuses it; with an
    example, a `Reading` to be armed for the run instead (saying why fx refused, if it did),
    so no module is run a second time (a module that is one layer, only to see what of its
    input it reads)."""
    plans: dict[str, Any] = {}
    for node, module in roots.items():
        if _one_layer(module):
            if example is not None:
                plans[node] = Reading(module, depth)
            continue
        if not parts_of(module):  # a node holding no module: its forward, only as it runs
            plans[node] = Reading(module, depth, _NO_MODULE)
            continue
        why = _REFUSED.get(module, {}).get(depth)
        trace = None
        if why is None:
            try:
                trace = fx_trace(module, depth)
            except Exception as e:  # noqa: BLE001
                why = in_one_line(e)
                if not isinstance(module, Holder):
                    _REFUSED.setdefault(module, {})[depth] = why
        plans[node] = trace if example is None else Reading(module, depth, why)
    return plans


def _one_layer(module: nn.Module) -> bool:
    """Whether a node's module is one layer: one without parts, not the `Holder` of a node
    holding none (whose forward is read as a module's is)."""
    return not parts_of(module) and not isinstance(module, Holder)


def _roots(graph: Any, example: Any) -> dict[str, nn.Module]:
    """The module each node is read as (`root_of`); with an example, a node holding no
    module is read through a `Holder` of none, so what its forward computes is drawn (a
    VAE's sampling: `mu + std * randn_like(std)`). Without one it is left out: only the
    graph's own run reads it, never torch.fx, which would run its Python a second time."""
    roots = {}
    for n in graph.nodes():
        node = graph.implementation(n)
        root = root_of(node)
        if root is None and example is not None:
            root = Holder(node)
        if root is not None:
            roots[n] = root
    return roots


_NO_MODULE = "it holds no module: its forward is read as the graph runs it, not by torch.fx"

# Modules fx refused, by depth, and why. Only refusals are remembered: one that has since
# become traceable is at worst read as if fx still refused it.
_REFUSED: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def traced(module: Any, example: Any = None, *, depth: int = 0, most: int = 48) -> Inside | None:
    """What this module is made of. fx if it can, a real forward if it cannot.

    `example` is an input to run it on, as a graph would hand it to the module: a dict whose
    keys its forward names is passed as keywords (`input_ids=`, `attention_mask=`), a tuple
    as the arguments of a forward that needs two or more, anything else as the one
    argument; an `Opaque` is unwrapped first. Without one only the symbolic
    path is available, and a module that needs a forward answers None. A plain function
    (anything not an nn.Module) answers None. Running it changes nothing: modes, buffers and
    the random state are put back. The same module gives the same answer every time.
    """
    if not isinstance(module, nn.Module):
        return None
    return next(iter(architecture(module, example, most=most, depth=depth).values()), None)


def run_here(graph: Any, example: Any, told: list | None = None) -> Any:
    """Run `graph` on `example` in this process, as a look runs it: a node that runs
    `.at(host)` is run from its copy here (the module declared here, the one sent to the host)
    on the device that copy is on, handed what the graph's run hands it, so that the look
    reads it as it reads any other node. `told` hears the run's facts, as `watching=` would.
    A key/value cache in the example is run from a copy holding the same tensors (`mapped`
    rebuilds it): the one given is left as it was, and each run starts from it."""
    plan = run.Plan(graph)
    steps = tuple(
        step if step[4].host is None else (*step[:3], _here(step[3], step[4]), step[4], None)
        for step in plan.steps
    )
    return run.run_plan(plan, mapped(example, lambda t: t), told or [], steps)


def given(graph: Any, result: Any) -> list[torch.Tensor]:
    """The tensors of what `graph` gave (`result`, as `run_here` answers it: a graph of
    several ends, a dict of their values) that a look reads: of each end's value, from the
    one `output_of` names on, a loss given before it (a transformers model given `labels`)
    passed over; an end that gives a loss alone (a loss node) gives that loss."""
    out = []
    for value in result.values() if len(graph.leaves()) > 1 else [result]:
        tensors = tensors_in(value)
        lead = output_of(tensors)
        out += tensors[next((i for i, t in enumerate(tensors) if t is lead), 0) :]
    return out


_HERE = (
    "node {!r} runs .at({!r}), and a look (architecture, probe, proxies) runs it here, from "
    "the copy declared here, on the device that copy is on: give it a copy that runs here "
    "(its weights loaded, on a device this machine has), or look at the graph without it"
)


def _here(call: Any, ctx: Any) -> Any:
    """A remote node's step run here, its error saying so."""

    def here(x: Any, c: Any) -> Any:
        try:
            return call(x, c)
        except Exception as e:
            note(e, _HERE.format(ctx.id, ctx.host))
            raise

    return here


def _capture(
    graph: Any, roots: dict[str, nn.Module], example: Any, plans: dict
) -> tuple[dict, dict]:
    """Run the graph once, each node's `Reading` armed: {node: (the shape of what it gave
    back, the batch on its first axis)}, for each node the run reached, and {node: {node after it: the layers of the
    first that made the tensors the second's layers read}}. A plain node's modules are run
    through their `Holder`, so it is read as a module is."""
    reached: dict[str, Any] = {}
    sent: dict[str, dict[str, set[str]]] = {}
    gave: dict[str, dict[int, Any]] = {}  # what a node that is one layer gave, by id

    def heard(node: str, input: Any, ctx: Any, out: Any) -> None:
        if node not in reached:  # the shape of what it first gave back, and its batch
            found = tensors_in(out)
            shape = list(found[0].shape) if found else None
            reached[node] = shape, batch_of(shape, tensors_in(input))
        plan = plans.get(node)  # a node holding no module: nothing seen read
        read = plan.seen() if isinstance(plan, Reading) else []
        if node in roots and _one_layer(roots[node]):  # one layer made all it gave
            gave[node] = {id(t): weakref.ref(t) for t in tensors_in(out)}  # (held weakly)
            read = read or tensors_in(input)  # (seen reading none: a kernel torch does not see)
        for t in read:
            for before in graph.predecessors(node):
                if before in gave:  # a node that is one layer made all it gave: its path, ""
                    ref = gave[before].get(id(t))
                    tracked, made = ref is not None and ref() is t, frozenset({""})
                elif isinstance(up := plans.get(before), Reading):
                    tracked, made = up.made_by([t])
                else:
                    continue
                if tracked:
                    sent.setdefault(before, {}).setdefault(node, set()).update(made)

    readings = [p for p in plans.values() if isinstance(p, Reading)]
    try:
        with torch.no_grad(), Tap(graph, heard, roots):
            for reading in readings:
                reading.arm()
            run_here(graph, example)
    except RuntimeError as e:  # a value read on the meta device: say what to give instead
        on_meta = {
            n: [k for k, t in (*m.named_parameters(), *m.named_buffers()) if t.is_meta]
            for n, m in roots.items()
        }
        on_meta = {n: keys for n, keys in on_meta.items() if keys}
        if on_meta and "meta" in str(e):
            if all(t.is_meta for t in tensors_in(example)):  # all on meta: a value was read
                note(e, _META % ", ".join(map(repr, on_meta)))
            else:
                held = "; ".join(f"{n!r} {', '.join(k[:4])}" for n, k in on_meta.items())
                note(e, _PART_META % held)
        raise
    finally:
        for reading in readings:
            reading.disarm()
    return reached, sent


_META = (
    "architecture runs %s on the meta device, where a tensor has a shape and no values, and a "
    "forward that reads a value of what it is given (Tensor.item(): a transformers model "
    "making its attention mask) cannot run there: draw it on an example it reads no value of "
    "(input_ids without an attention_mask: the layers are the same), or give it weights "
    "first (model.to_empty(device='cpu'))"
)

_PART_META = (
    "node(s) hold tensors on the meta device (shapes without values: %s) beside others, or an "
    "example, elsewhere: architecture draws a net wholly on meta (the example is moved "
    "there) or wholly with values. Give them values first: module.to_empty(device='cpu') then "
    "initialise or load them, and set by hand the buffers a state_dict leaves out "
    "(persistent=False: BERT's position_ids)"
)


def _same_and_closed(root: nn.Module, layers: dict[str, Raw], node: str, owner: dict) -> None:
    """Each box of a module held under two names and drawn at both says which box it is the
    same module as (the first); each box drawn as one holding a weight that an earlier such
    box of another module holds says which box (tied: `node:path` where it is in an earlier
    node, whose boxes `owner` holds by parameter); only what is drawn closed says what it
    holds."""
    named = dict(root.named_modules(remove_duplicate=False))
    first: dict[int, str] = {}  # module object -> its first box
    for path, layer in layers.items():
        if layer.made_of:  # drawn open: what it holds is drawn, and says what it shares
            layer.holds, layer.held_kinds = [], []
        module = None if layer.function else named.get(path.partition("#")[0])
        if module is None:
            continue
        at = first.setdefault(id(module), path)
        if at.partition("#")[0] != path.partition("#")[0]:  # (a later call is no alias)
            layer.same_as = at
        if at == path and not layer.made_of:  # (the same module's boxes say so already)
            for p in module.parameters():
                held_in, other = owner.setdefault(id(p), (node, path))
                if (held_in, other) != (node, path) and layer.tied_to is None:
                    layer.tied_to = other if held_in == node else f"{held_in}:{other}"


def architecture(
    graph: Any, example: Any = None, *, most: int = 48, depth: int = 0, broker: Any = None
) -> dict[str, Inside]:
    """What each node is made of, as {node: Inside} — ready for a figure::

        g.figure(inside=architecture(g, x))

    With an example the graph is run once, and each module a node holds is read on exactly
    what reached it: a fan-in node gets the dict of its predecessors' values, as it would.
    torch.fx is asked first, module by module (the Inside says whether it could follow the
    forward, and why not), and the layers, edges and shapes are read off that one run by hooks
    and a function mode, whatever fx said, as is which of the layers that made what a node
    gave each node after it read (`Inside.read_by`). Without an example only what fx can
    answer symbolically is there, without shapes, and nothing is seen read. A node holding no
    module (a plain function, a `Node` that is no module) is read in that one run, as a module
    is (what its forward computes on the data, a random draw shaped like it included: a VAE's
    `mu + std * randn_like(std)`), and is not in the answer where it computes nothing drawn
    (`x[0]`, a tokenizer) or without an example. A composite torch ships is one box unless `depth=` opens it; blocks that are the same block fold to one `×N`; past `most`
    layers a node's deepest blocks are closed. Edges follow the data through indexing, views
    and reshapes; a module called twice is a box per call. `graph` may be a bare module (a
    graph of one node, named by its class), and an `Opaque` example is unwrapped first. A net
    built under `torch.device("meta")` (every weight and buffer there) is run on a meta copy of
    the example: drawn, shapes and all, without ever holding values. The net is left exactly
    as it was.

    The graph runs in this process: a node that runs `.at(host)` is read from its copy here
    (the declaration that was sent), on what the run hands it, so `broker` is not needed; it
    is accepted as the published signature has it.
    """
    graph = as_graph(graph)
    example = unwrap(example)
    roots = _roots(graph, example)
    held = Held(list(roots.values()), list(roots))
    tensors = [*held.params, *(b for *_, b in held.buffers)]
    if tensors and all(t.is_meta for t in tensors):  # built under torch.device("meta")
        example = mapped(example, lambda t: t.to("meta"))  # drawn with shapes alone
    held.refuse()  # before fx or a hook touches anything
    with untouched(held):  # fx runs the forward's Python too: what it changes is put back
        plans = _plan(roots, depth, example)
        reached, sent = ({}, {}) if example is None else _capture(graph, roots, example, plans)
    out: dict[str, Inside] = {}
    weights = {w for p in plans.values() if isinstance(p, Reading) for w in p.weights}  # read
    owner: dict[int, tuple[str, str]] = {}  # parameter -> the first box drawn as one holding it
    for node, root in roots.items():
        if example is not None and node not in reached:
            continue  # never reached (a branch not taken)
        got = _raw(root, plans.get(node), reached.get(node, (None, None)))
        if got is None:
            if example is None:  # fx refused it, and only a run reads it otherwise
                why = _REFUSED.get(root, {}).get(depth)
                warn(
                    f"architecture: node {node!r} is left out: torch.fx cannot follow its "
                    f"forward{f' ({why})' if why else ''}, and without an example nothing else "
                    f"reads it: pass one, architecture(g, x)"
                )
            continue
        raw, how, why = got
        if not raw.layers and not parts_of(root):  # a node holding no module that computed
            continue  # nothing drawn (`x[0]`, a tokenizer)
        sends = sent.get(node, {})  # each node after it, by an edge to OUTPUT + its name
        raw.edges += [(p, OUTPUT + n) for n, made in sends.items() for p in made if p in raw.layers]
        folded, edges = fold(raw)
        folded, edges, hidden = collapse(folded, edges, most)
        _same_and_closed(root, folded, node, owner)
        drawn = [f.name for f in fields(Layer)]  # what a tracer's layer says that a figure draws
        layers = [Layer(**{k: getattr(r, k) for k in drawn}) for r in folded.values()]
        outputs = [a for a, b in edges if b == OUTPUT]
        read_by = {n: [p for p in outputs if (p, OUTPUT + n) in edges] for n in sends}
        inputs = [b for a, b in edges if a == INPUT and b != OUTPUT]
        edges = [(a, b) for a, b in edges if a != INPUT and not b.startswith(OUTPUT)]
        params, read = params_of(root), isinstance(plans.get(node), Reading)
        unread = [n for n, p in root.named_parameters() if read and id(p) not in weights]
        out[node] = Inside(
            layers, edges, how, why, hidden, params, inputs, outputs, read_by, unread
        )
    return out
