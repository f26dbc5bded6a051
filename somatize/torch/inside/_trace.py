"""What both ways of reading a module (torch.fx in `_fx`, a real forward in `_forward`) answer,
and the rules they share: the same raw layers in the order they ran, the same edges, at the same
granularity (a module with no children is one layer, a composite torch ships is one layer until
`depth` opens it, any other composite is opened into the block its layers sit in).

Edges follow the data: an op that only carries data along (indexing, a view, a cast, an
`nn.Identity`) hands its input's producers on; a function is a layer only when it computes a
floating tensor from the data, never on masks and counters. An index or a mask handed to a
call besides the data (a top-k's indices in `index_select(h, 0, rows)`, an argmax in `gather`)
decides where the data goes, not what it is: its producers are not the result's, so a router
feeds the weights it computes, and the experts are fed by the tokens. The node's own input is
made by `INPUT` (the root's path, `""`): an edge from it says which layers read what the node
was given, an edge to `OUTPUT` which made what it gave back (in that value's order). A module
called twice is a box per call (`relu`, `relu#2`), and each layer knows which call of each
block around it it ran in (`Raw.within`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from somatize.torch._modules import parts_of, tensors_in
from somatize.torch.inside.kinds import class_name, function_name, kind_of, label_of, recognised

# Calls that are never a layer: those that carry a value along without computing anything
# anybody would draw (their output is made by whoever made their input), and those on masks,
# counters and shapes, even on the data.
UNDRAWN = frozenset(
    "getattr getitem setitem size dim type to float double half bfloat16 int long bool "
    "contiguous detach clone numel get requires_grad is_floating_point is_nested ndim shape "
    "device dtype set view view_as reshape reshape_as transpose permute swapaxes t squeeze "
    "unsqueeze expand expand_as narrow select split chunk unbind flip repeat tile "
    "movedim unflatten masked_fill where index_select gather as_strided "
    "eq ne gt ge lt le logical_and logical_or logical_not logical_xor and or not xor invert "
    "assert isfinite isnan isinf any all nonzero argmax argmin arange zeros ones full empty "
    "triu tril cumsum item tolist sum".split()
)
# Calls that make a new tensor shaped like the data, none of its values: not the data.
FRESH = frozenset(
    "zeros_like ones_like full_like empty_like rand_like randn_like randint_like "
    "new_zeros new_ones new_full new_empty new_tensor".split()
)
# Where a call takes an index or a mask (by position, and by keyword): it decides where the
# data goes, not what it is, so its producers are not the result's when data is given besides.
# A top-k's indices routing tokens to experts do not feed the experts: the tokens do.
INDEXES = {
    **dict.fromkeys("gather index_select index_add index_copy index_fill scatter".split(), 2),
    **dict.fromkeys("scatter_add scatter_reduce".split(), 2),
    **dict.fromkeys("index_put take_along_dim masked_fill masked_scatter masked_select".split(), 1),
    **dict.fromkeys("getitem setitem".split(), 1),
    "where": 0,
}
# Of those, the random draws: noise shaped like the data (a VAE's reparameterisation, noise
# added to an input), drawn as a layer that nothing feeds, since the data gives it only a shape.
DRAWS = frozenset("rand_like randn_like".split())
INDEX_KEYWORDS = frozenset(("index", "indices", "mask", "condition"))
INPUT = ""  # what made the node's own input, in edges: the root, at path ""
OUTPUT = "<output>"  # what the node gave back, in edges: no module's path
_JOINS = frozenset(("cat", "concat", "concatenate", "stack", "hstack", "vstack"))


def joins_nothing(name: str, given: Any) -> bool:
    """A concatenation of one tensor and empty ones (a cache filling up) joins nothing."""
    return name in _JOINS and sum(1 for t in tensors_in(given) if t.numel()) <= 1


def call_path(path: str, call: int) -> str:
    """The box of the `call`-th call (from 1) of the module at `path`: `relu`, `relu#2`, ..."""
    return path if call == 1 else f"{path}#{call}"


@dataclass
class Layer:
    """One box inside a node.

    `path` is relative to the node (`""` when the node is a single layer), `kind` comes from
    `kind_of`, `shape` is the output shape (None without an example), `block` the path of the
    enclosing composite, `made_of` the paths of the layers directly inside this one (a block),
    `times` how many copies of it this box stands for at its own level (a block ×2 inside a
    stage ×3 says 2: what a layer stands for in all is the product along its blocks),
    `repeats` the paths it hides. A module called more than once is a box per call, the
    later ones at `path#2`, `path#3`, ...; a module held under two names (one layer in an
    encoder's and a decoder's `Sequential`) that ran under both is a box at each, and
    `same_as` says, on every box but the first, the first box of that module (None on a
    module held once). `tied_to` is the first box of another module holding a weight this
    one holds (GPT-2's head and its token embedding, T5's decoder embedding and its
    encoder's), written `node:path` where that box is in an earlier node of the graph (a
    head cut off its embedding, `embed:`), None where none does. `holds` is what a composite
    drawn as one box holds (a container closed by `most`, a `TransformerEncoderLayer` below
    `depth`): its children as `name: Class`, in declaration order, and `held_kinds` the kind
    of each (`kind_of`); both empty for anything drawn open or with no children. `apart` says,
    on a block not folded with a twin beside it (alike but for a setting), which and by what:
    `not folded with layers.1: self_attn.sliding_window None ≠ 4`. `axes` names what each
    axis of its output holds where its call says (a flatten: `batch, ch, len` for
    `(N, C, h, w).flatten(2)`; a box given none of the data, 2-d: `len, dim`, a table's rows),
    empty where nothing does (a figure names them from the shape). `batch` says what the
    first axis of its output holds, as a run on an example followed it from what the node was
    given: `1` the batch, `k` the batch merged with `k` of something else (MobileViT's
    patches unfolded, `batch×4`; Swin's windows), `0` not the batch (a relative position
    bias made from a parameter table has none); None where nothing was run.
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
    same_as: str | None = None
    tied_to: str | None = None
    holds: list[str] = field(default_factory=list)
    held_kinds: list[str] = field(default_factory=list)
    apart: list[str] = field(default_factory=list)
    axes: list[str] = field(default_factory=list)
    batch: int | None = None


@dataclass
class Raw(Layer):
    """One layer as a tracer saw it: a `Layer` (its `times`, `repeats` and `made_of` are what
    `fold` adds) and what the tracer knows besides. `config` is what sets the module up beyond
    its shapes (`config_of`), so blocks that differ there are not folded together; `composite`
    marks a module with children, `function`
    a torch function; `within` says which call (from 1) of each block around it this layer ran
    in, where the reader knows (a block left out was called once)."""

    config: dict[str, Any] = field(default_factory=dict)
    composite: bool = False
    function: bool = False
    within: dict[str, int] = field(default_factory=dict)  # block path → its call it ran in
    gave: dict[int, list[int]] = field(default_factory=dict)  # an open block's calls' shapes


@dataclass
class Traced:
    """What a tracer answers: layers in the order they ran, blocks, and edges."""

    layers: dict[str, Raw] = field(default_factory=dict)
    edges: list[tuple[str, str]] = field(default_factory=list)


def params_of(module: nn.Module) -> int:
    """How many parameters a module holds, each once however often it is tied."""
    return sum(p.numel() for p in module.parameters())


_PLAIN = (int, float, str, bool, type(None))
_EVERY = frozenset(vars(nn.Module()))  # what every module keeps (`training`: a mode)


def config_of(module: nn.Module) -> dict[str, Any]:
    """What sets this module up besides its shapes: its `extra_repr` (at `""`) and each plain
    value it keeps (a number, a string, a flag, None, a tuple of them: a drop rate, a sliding
    window, `layer_idx`)."""
    found: dict[str, Any] = {"": module.extra_repr()}
    for name, v in vars(module).items():
        plain = all(isinstance(x, _PLAIN) for x in (v if isinstance(v, tuple) else (v,)))
        if plain and not name.startswith("_") and name not in _EVERY:
            found[name] = v
    return found


class Opening:
    """Which modules of a root are opened and which are drawn as one layer, and the
    parameters under each (a weight tied in two places counted once under their parent)."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        self.depth = depth
        self.named = dict(root.named_modules(remove_duplicate=False))  # the root at ""

    def closed(self, path: str) -> bool:
        """Whether the module at `path` is one layer rather than opened (the root never is)."""
        if not path:
            return False
        module = self.named[path]
        parts = path.split(".")
        above = (self.named[".".join(parts[:i])] for i in range(1, len(parts)))
        return not parts_of(module) or (
            recognised(module) and self.depth <= sum(map(recognised, above))
        )

    def drawn(self, path: str = "") -> list[tuple[str, nn.Module, bool]]:
        """Every (path, module, closed) below `path` that is a layer or a block, in declaration
        order, every path a module is reachable under (a tied module is at each of its paths).
        An `nn.Identity` is neither: what it gives back is what it was given."""
        found: list[tuple[str, nn.Module, bool]] = []
        for name, child in parts_of(self.named[path]):
            if isinstance(child, nn.Identity):
                continue
            p = f"{path}.{name}" if path else name
            shut = self.closed(p)
            found.append((p, child, shut))
            if not shut:
                found += self.drawn(p)
        return found

    def _raw(self, path: str, block: str | None, label: str | None = None) -> Raw:
        m = self.named[path]
        parts = parts_of(m)
        raw = Raw(path, kind_of(m), label or label_of(m), None, params_of(m), block)
        raw.config, raw.composite = config_of(m), bool(parts)
        raw.holds = [f"{name}: {class_name(c)}" for name, c in parts]
        raw.held_kinds = [kind_of(c) for _, c in parts]
        return raw

    def add_block(self, out: Traced, path: str) -> None:
        """Make sure the opened composite at `path` and those above it are blocks in `out`
        (the root, at "", is none)."""
        if path and path not in out.layers:
            parent = path.rpartition(".")[0]
            self.add_block(out, parent)
            out.layers[path] = self._raw(path, parent or None, class_name(self.named[path]))

    def add_leaf(self, out: Traced, path: str, call: int = 1) -> Raw:
        """The box of the `call`-th call of the closed module at `path` (made once)."""
        box = call_path(path, call)
        layer = out.layers.get(box)
        if layer is None:
            parent = path.rpartition(".")[0]
            self.add_block(out, parent)
            out.layers[box] = layer = self._raw(path, parent or None)
            layer.path = box
        return layer


def function_path(block: str | None, fn: Any, counts: dict[str, int], modules: Any) -> str:
    """The box of the next call of `fn` inside `block`: `add`, then `add_1`, ... (`counts`
    keeps how many there were), passing over a path of `modules` (Mamba's `F.conv1d` beside
    the `conv1d` it holds is `conv1d_1`, as torch.fx names it)."""
    key = f"{block}.{function_name(fn)}" if block else function_name(fn)
    while True:
        n = counts.get(key, 0)
        counts[key] = n + 1
        if (path := key if n == 0 else f"{key}_{n}") not in modules:
            return path


def function_layer(opening: Opening, out: Traced, block: str | None, fn: Any, path: str) -> Raw:
    """The layer of the box `path`, a call of `fn` inside `block` (a block of `out` from then
    on)."""
    opening.add_block(out, block or "")
    name = function_name(fn)
    out.layers[path] = layer = Raw(path, kind_of(name), name, None, 0, block, function=True)
    return layer


def finish(out: Traced, edges: Any, order: list[str], ends: list[str]) -> None:
    """`out` with its edges, an edge to `OUTPUT` from each layer that made what the module
    gave back (`ends`, in its order; what it passed on from its input is made by none), its
    layers in the order they ran (each block just before its first layer, and as wide as its
    last one), and without the functions whose result reaches nothing drawn and is not what
    the module gave back: a number read for a decision (`x.mean() > 0`) is not a layer."""
    out.edges = [*edges, *((p, OUTPUT) for p in dict.fromkeys(ends) if p != INPUT)]
    ranked: dict[str, None] = {}
    for path in order:
        chain = []
        block = out.layers[path].block
        while block is not None and block not in ranked:
            chain.append(block)
            block = out.layers[block].block
        ranked.update(dict.fromkeys([*reversed(chain), path]))
    ranked.update(dict.fromkeys(out.layers))  # (the rest after, in their order)
    out.layers = {p: out.layers[p] for p in ranked}
    for layer in out.layers.values():  # a block: what its first call gave back
        layer.shape = layer.gave.get(1, layer.shape)
    for path in reversed(order):
        shape = out.layers[path].shape
        block = out.layers[path].block
        while block is not None and out.layers[block].shape is None:
            out.layers[block].shape = shape
            out.layers[block].batch = out.layers[path].batch
            block = out.layers[block].block
    while True:
        kept = {a for a, _ in out.edges}  # what feeds a layer, or what was given back
        dead = {p for p, x in out.layers.items() if x.function and p not in kept}
        if not dead:
            return
        out.layers = {p: x for p, x in out.layers.items() if p not in dead}
        out.edges = [(a, b) for a, b in out.edges if a not in dead and b not in dead]
