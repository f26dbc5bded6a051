"""Looking without touching: the modules a node holds, and a net put back as it was found.

Everything that looks inside a network (architecture, probe, proxies) runs it, and a forward
in training mode moves batch-norm statistics, a dropout draws from the global generator, and
a proxy may swap weights for their magnitudes. `untouched` puts all of it back, exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrize import is_parametrized

from somatize.node import Opaque
from somatize.torch.placement import named_modules_of


def join(*parts: str) -> str:
    """Dotted path from parts, skipping the empty ones."""
    return ".".join(p for p in parts if p)


class Holder(nn.Module):
    """The modules a node holds, under their attribute names (a `Node.of`'s as `held`), as
    one module whose forward is the node's as it is when the Holder is made (its instance's,
    if replaced there): so a plain node is read, probed and drawn as a module is, and an
    Audit hears each node through one of its own."""

    def __init__(self, node: Any) -> None:
        super().__init__()
        self.node_forward = node.forward
        made: dict[str, nn.Module] = {}  # the levels made here, by path: only these are filled
        for name, module in named_modules_of(node):
            *path, last = (name or "held").split(".")  # `heads.v1.0`: a dict's key "v1.0"
            box: nn.Module = self
            for k, part in enumerate(path):
                at = ".".join(path[: k + 1])
                if at not in made:
                    _free(box, part, node, name)
                    box.add_module(part, made.setdefault(at, nn.ModuleDict()))
                box = made[at]
            _free(box, last, node, name)
            box.add_module(last, module)

    def forward(self, input: Any, ctx: Any = None) -> Any:
        return self.node_forward(input, ctx)


def _free(box: nn.Module, part: str, node: Any, name: str) -> None:
    """Refuses a part of a held module's name that `box` cannot take as a child's: empty, or
    a name it has already (another module's, or nn.Module's own: `type`, `training`)."""
    if part and not hasattr(box, part):
        return
    why = "empty" if not part else "a name another module or nn.Module itself takes"
    kind = type(node).__name__
    raise ValueError(
        f"a {kind} holds a module as {name!r}, which cannot be read as one module: {part!r} "
        f"is {why}; rename it (dict keys without dots), or make the node a module: "
        f"class {kind}(Node, nn.Module)"
    )


def root_of(node: Any) -> nn.Module | None:
    """The one module a node is read as: the module it is (or holds as it is, `Node.of`), a
    `Holder` of the modules a plain node holds, or None when it holds none."""
    held = named_modules_of(node)
    if len(held) == 1 and held[0][0] == "":
        return held[0][1]
    return Holder(node) if held else None


def parts_of(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A module's children as its input goes through them: what it is made of, less a
    parametrized module's `parametrizations` (`torch.nn.utils.parametrize`, as weight and
    spectral norm use it), which compute its weight from its parameters and are no layer the
    data passes. A module without parts is one layer to every look."""
    named = list(module.named_children())
    if any(name == "parametrizations" for name, _ in named) and is_parametrized(module):
        return [(name, child) for name, child in named if name != "parametrizations"]
    return named


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a value (mappings, a `ModelOutput` among them, lists, tuples, a
    dataclass's fields, an `Opaque`), in order: the outputs one differentiates, so not those a
    key/value cache holds (`stages.carried` counts those too)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, str)):  # (the most common others)
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, Opaque):
        return tensors_in(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(getattr(value, f.name))]
    return []


def _in_place(m: nn.Module) -> bool | None:
    flag = vars(m).get("inplace")  # a plain attribute where torch keeps it, when there is one
    return flag if isinstance(flag, bool) else None


def _compiled(m: nn.Module) -> str | None:
    """What compiled `m`, said for a message, or None for a module that runs eagerly."""
    if isinstance(m, torch.jit.ScriptModule):
        return "a TorchScript module (torch.jit.script(model) or torch.jit.trace)"
    kind = type(m)
    if kind.__name__ == "OptimizedModule" and kind.__module__.startswith("torch._dynamo"):
        return "a compiled module (torch.compile(model))"
    return None


class Held:
    """What a net holds, found once: `modules`, every module inside `roots` (themselves
    included), each once, in declaration order; `params`, every parameter, each once however
    many modules share it; `buffers`, each buffer as (module holding it, its name there,
    the buffer). `names`, one a root, are the nodes its refusals name (else its class)."""

    __slots__ = ("roots", "names", "modules", "params", "buffers")

    def __init__(self, roots: list[nn.Module], names: list[str] | None = None) -> None:
        self.roots = roots
        self.names = names
        modules: dict[int, nn.Module] = {}
        buffers: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor]] = {}
        for root in roots:  # one walk for the modules, one for the buffers
            at = dict(root.named_modules(remove_duplicate=False))
            for sub in at.values():
                modules.setdefault(id(sub), sub)
            for name, b in root.named_buffers(remove_duplicate=False):
                path, _, leaf = name.rpartition(".")
                buffers.setdefault((id(at[path]), leaf), (at[path], leaf, b))
        self.modules = list(modules.values())
        self.params = list({id(p): p for m in roots for p in m.parameters()}.values())
        self.buffers = list(buffers.values())

    def refuse(
        self, why: str = "a look leaves the net as it found it", *, reads: str | None = None
    ) -> None:
        """Refuse a net no look can run as it is: one holding a lazy module's weights not
        made yet (its first forward would turn the module into another class; `why` says
        what is at stake), or a compiled module (`torch.compile`, TorchScript), which hooks
        cannot read. With `reads` (a look that reads the numbers a net computes: probe,
        proxies, an Audit), also one holding weights on the meta device, which `architecture`
        and `traced` draw as it is."""
        for m in self.modules:
            if made := _compiled(m):
                raise ValueError(
                    f"{type(m).__name__} is {made}: a look or an Audit reads a net through "
                    "hooks on its modules, run eagerly, and this one runs compiled code "
                    "instead; give it the module that was compiled (model), which holds the "
                    "same weights"
                )
        if unmade := self._holding(is_lazy):
            raise ValueError(
                f"{unmade} not made yet (a lazy module makes them in its first forward), and "
                f"{why}: run it once first (model(example), or g.forward(example))"
            )
        if reads is not None and (shapes := self._holding(lambda t: t.is_meta)):
            raise ValueError(
                f"{shapes} on the meta device (shapes without values), and {reads} reads the "
                "numbers the net computes: give it weights first (load them, or "
                "model.to_empty(device='cpu') and initialise them); architecture and traced "
                "draw it as it is"
            )

    def _holding(self, which: Callable[[torch.Tensor], bool]) -> str | None:
        """ "node 'enc' (Model) holds a.weight, b.bias" ('Model holds ...' without `names`) for
        the first root holding such tensors, if any."""
        if not any(which(p) for p in self.params) and not any(which(b) for *_, b in self.buffers):
            return None  # (the names are looked for only when there is something to name)
        for k, m in enumerate(self.roots):
            named = itertools.chain(m.named_parameters(), m.named_buffers())
            found = [name for name, t in named if which(t)]
            if found:
                more = f" and {len(found) - 4} more" if len(found) > 4 else ""
                who = (
                    type(m).__name__
                    if self.names is None
                    else f"node {self.names[k]!r} ({type(m).__name__})"
                )
                return f"{who} holds {', '.join(found[:4])}{more}"
        return None

    def differentiable(self) -> None:
        """Every module computing out of place and every parameter asking for its gradient:
        what a look that differentiates through a net needs. For use inside `untouched`,
        which puts both back."""
        for m in self.modules:
            if _in_place(m):
                m.inplace = False
        for p in self.params:
            p.requires_grad_(True)


@contextlib.contextmanager
def untouched(held: Held) -> Iterator[None]:
    """Whatever happens inside, the modules `held` (refused first where no look can run
    them: `Held.refuse`) come out exactly as they went in.

    Modes, parameter values and dtypes, gradients (the same tensors), `requires_grad`,
    buffers, `inplace` flags, and the global random state (CUDA's too, where it is in use);
    the weight of an embedding with a `max_norm`, which its forward renormalises in place, is
    copied for it. Inside, the global generators are seeded with 0, so a dropout draws the
    same masks every call.
    """
    modes = [(m, m.training) for m in held.modules]
    inplace = [(m, flag) for m in held.modules if (flag := _in_place(m)) is not None]
    params = [(p, p.data, p.grad, p.requires_grad) for p in held.params]
    renormed = [
        (m.weight, m.weight.detach().clone())
        for m in held.modules
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
    ]
    buffers = [(m, name, b, b.detach().clone()) for m, name, b in held.buffers]
    rng = torch.get_rng_state()
    gpus = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        # the CPU generator, and CUDA's where it is in use (seeded and put back as
        # torch.manual_seed would seed them, without paying for every backend)
        torch.default_generator.manual_seed(0)
        if gpus is not None:
            torch.cuda.manual_seed_all(0)
        yield
    finally:
        torch.set_rng_state(rng)
        if gpus is not None:
            torch.cuda.set_rng_state_all(gpus)
        with torch.no_grad():
            for m, mode in modes:
                if m.training is not mode:  # nn.Module.__setattr__ is slow: only if moved
                    m.training = mode
            for m, flag in inplace:
                if m.inplace is not flag:
                    m.inplace = flag
            for p, data, grad, requires in params:
                p.data = data
                p.grad = grad
                p.requires_grad_(requires)
            for w, saved in renormed:
                w.copy_(saved)
            for m, name, b, saved in buffers:
                if getattr(m, name, None) is not b:  # the buffer itself, if it was replaced
                    setattr(m, name, b)
                if b.shape == saved.shape and b.dtype == saved.dtype:
                    b.copy_(saved)
                else:
                    b.data = saved


def _wrap(ids: list[str], original: Any, tap: Tap) -> Any:
    def forward(*args: Any, **kw: Any) -> Any:
        if not tap.live:
            return original(*args, **kw)
        ctx = args[1] if len(args) > 1 else kw.get("ctx")
        node_id = ctx.id if len(ids) > 1 and getattr(ctx, "id", None) in ids else ids[0]
        out = tap.through.get(node_id, original)(*args, **kw)
        if tap.on_node is not None:
            tap.on_node(node_id, args[0] if args else kw.get("input"), ctx, out)
        return out

    return forward


class Tap:
    """Every node's `forward` wrapped so `on_node(node, input, ctx, output)` hears each call.

    The engine calls a node that is a module through `__call__`, and any other through its
    `forward`: either way an instance attribute shadowing `forward` is what runs, seen by a
    freshly compiled plan. The graph's compiled plan is set aside while tapped and given back
    after. Of `roots` (the module each node id is read as: its `root_of`, or a `Holder` of
    its own), a node whose root is a `Holder` is called through it, so that Holder's module
    hooks fire; the same node standing at several ids is told, and called through, at the
    id it runs as. `live` False: the wrappers stay, and call the node's own forward, telling
    nothing (an Audit's unmeasured steps pay one call per node).
    """

    def __init__(self, graph: Any, on_node: Any, roots: dict[str, Any] | None = None) -> None:
        self.graph = graph
        self.on_node = on_node
        self.through = {n: r for n, r in (roots or {}).items() if isinstance(r, Holder)}
        self.live = True
        self._undo: list[tuple[Any, bool, Any]] = []
        self._plan: Any = None

    def on(self) -> Tap:
        """Wrap every node, once however many ids it stands at; the next forward compiles a
        plan that sees the wrappers."""
        ids: dict[int, tuple[Any, list[str]]] = {}
        for node_id in self.graph.nodes():
            node = self.graph.implementation(node_id)
            ids.setdefault(id(node), (node, []))[1].append(node_id)
        for node, named in ids.values():
            self._undo.append((node, "forward" in vars(node), vars(node).get("forward")))
            object.__setattr__(node, "forward", _wrap(named, node.forward, self))
        self._plan, self.graph._plan = self.graph._plan, None
        return self

    def off(self) -> None:
        """Unwrap every node and give the graph its plan back."""
        for node, had, before in reversed(self._undo):
            if had:
                object.__setattr__(node, "forward", before)
            else:
                with contextlib.suppress(AttributeError):
                    object.__delattr__(node, "forward")
        self._undo = []
        self.graph._plan = self._plan
        self._plan = None

    def __enter__(self) -> Tap:
        return self.on()

    def __exit__(self, *exc: object) -> None:
        self.off()
