"""Reading a module by a real forward: hooks on the modules that are drawn, and a function
mode for the torch functions between them, following each tensor to the layer that made it.

`Boxes` hears where each box is as the forward runs (a probe measures each box there);
`Reading` builds, from the same run, architecture's picture of what each box is and how they
are joined."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from somatize.torch._modules import tensors_in
from somatize.torch.inside._batch import Batches
from somatize.torch.inside._trace import (
    DRAWS,
    FRESH,
    INPUT,
    UNDRAWN,
    Opening,
    Raw,
    Traced,
    call_path,
    finish,
    function_layer,
    function_path,
    joins_nothing,
)
from somatize.torch.inside.kinds import function_name


def _axes(name: str, args: tuple, kwargs: dict, rank: int, shape: list[int]) -> list[str]:
    """What each axis of a flatten's 3-d output holds, as its call says: the axes it merged
    are positions, what is before them (past the batch) channels, what is after features;
    (N, C, h, w).flatten(2) gives `batch, ch, len`, (N, h, w, C).flatten(1, 2) `batch, len,
    dim`. Empty for any other call (`rank`: its input's)."""
    start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    if name != "flatten" or len(shape) != 3 or not isinstance(start, int):
        return []
    return {1: ["batch", "len", "dim"], 2: ["batch", "ch", "len"]}.get(start % rank, [])


class Boxes(TorchFunctionMode):
    """Where each box of a root is, heard by a real forward riding along a forward somebody
    else runs (the graph's own). `arm()` puts a pre- and a post-hook on every drawn module
    (its layers and the blocks around them, once per module object) and turns this function
    mode on for the root's first call (off while a layer runs: nothing inside a layer is a
    layer), so every torch function between the drawn modules is heard; `disarm()` takes it
    all off. A subclass hears each box's calls begin (`_began`, a closed module's) and end
    (`_ended`, `_function`).

    A module tied in two places is one object at two paths: a call is put at the path inside
    the block that is running. Each tensor is followed to the boxes that made it (`made_by`),
    by id with a weak reference (an id is only that tensor's while it lives): nothing is kept
    alive that the forward would have let go."""

    def __init__(self, root: nn.Module, depth: int) -> None:
        super().__init__()
        self.root = root
        self.opening = Opening(root, depth)
        self.counts: dict[str, int] = {}  # each function's calls in each block so far
        self.by: dict[int, tuple[weakref.ref, frozenset[str]]] = {}
        self.given: dict[str, weakref.ref] = {}  # each tensor the root was given, by its own mark
        self.live = False  # the root's first call is running
        self.on = False  # the mode is on the stack
        self.runs = 0  # the root's calls
        self.stack: list[str] = []  # the blocks open now
        self.calls: dict[str, int] = {}  # each drawn path's calls so far
        self.inside = 0  # how deep inside layers the running call is
        self.handles: list[Any] = []

    def arm(self) -> Boxes:
        """Hooks on; the root's next call is read."""
        aliases: dict[int, tuple[nn.Module, list[tuple[str, bool]]]] = {}  # by module object
        for path, module, shut in self.opening.drawn():
            aliases.setdefault(id(module), (module, []))[1].append((path, shut))
        for module, paths in aliases.values():
            pre, post = self._hooks(module, paths)
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(post, with_kwargs=True))
        self.handles.append(self.root.register_forward_pre_hook(self._enter, with_kwargs=True))
        self.handles.append(self.root.register_forward_hook(self._leave))
        return self

    def disarm(self) -> None:
        """Every hook off, and the function mode too if the root's call never came back."""
        self._mode(False)
        self.live = False
        for h in self.handles:
            h.remove()
        self.handles = []

    def made_by(
        self, tensors: list[torch.Tensor], data_only: bool = False
    ) -> tuple[bool, frozenset[str]]:
        """Whether any of `tensors` is the data, and which boxes made them. `data_only`: an
        integer or boolean tensor (an index, a mask) given besides a floating one decides
        where the data goes, not what it is, and its makers are left out."""
        found: set[str] = set()
        index: set[str] = set()
        tracked = floating = False
        for t in tensors:
            known = self.by.get(id(t))
            if known is not None and known[0]() is t:
                tracked = True
                real = t.is_floating_point() or t.is_complex()
                floating |= real
                (found if real or not data_only else index).update(known[1])
        return tracked, frozenset(found if floating else found | index)

    def _mark(self, tensors: list[torch.Tensor], made: frozenset[str]) -> None:
        for t in tensors:
            self.by[id(t)] = (weakref.ref(t), made)

    def _hooks(self, module: nn.Module, paths: list[tuple[str, bool]]) -> tuple[Any, Any]:
        """The pre- and post-hook of a module drawn at `paths`."""

        def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.live:
                return
            if self.inside:
                self.inside += 1
                return
            path, shut = self._pick(paths)
            self.calls[path] = call = self.calls.get(path, 0) + 1
            if shut:
                self.inside = 1
                self._mode(False)
                self._began(path, call, module, tensors_in((args, kwargs)))
            else:
                self.stack.append(path)

        def post(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self.live:
                return
            if self.inside:
                self.inside -= 1
                if not self.inside:
                    path, _ = self._pick(paths)
                    box = call_path(path, self.calls[path])
                    self._ended(box, module, tensors_in((args, kwargs)), tensors_in(output))
                    self._mode(True)
                return
            if self.stack and any(self.stack[-1] == p for p, _ in paths):
                path = self.stack.pop()
                self._left(path, self.calls[path], tensors_in(output))

        return pre, post

    def _pick(self, paths: list[tuple[str, bool]]) -> tuple[str, bool]:
        """The path of a module drawn at `paths` inside the block running now (the first)."""
        here = self.stack[-1] if self.stack else ""
        return next((p for p in paths if p[0].rpartition(".")[0] == here), paths[0])

    def _began(self, path: str, call: int, module: nn.Module, given: list[torch.Tensor]) -> None:
        """The `call`-th call of the closed module at `path` begins on `given` (mode off)."""

    def _ended(self, box: str, module: nn.Module, given: list, outs: list) -> None:
        """The closed module's call `box` on `given` gave back `outs` (mode still off)."""
        self._mark(outs, frozenset((box,)))

    def _function(
        self, box: str, block: str | None, call: tuple, made: frozenset[str], ins: list, outs: list
    ) -> None:
        """The call `box` inside `block`, `call` (the function, its args and kwargs), on `ins`
        (made by `made`), gave `outs`."""

    def _left(self, path: str, call: int, outs: list) -> None:
        """The `call`-th call of the open block at `path` gave back `outs`."""

    def _handed(self, ins: list[torch.Tensor]) -> None:
        """A torch function between the boxes was handed `ins` (before anything is known of
        it)."""

    def _passed(self, name: str, args: tuple, kwargs: dict, ins: list, outs: list) -> None:
        """A torch function `name` on the data, `ins`, gave `outs` (before it is marked)."""

    def _gave(self, outs: list[torch.Tensor]) -> None:
        """The root's first call gave back `outs`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        """Each torch function called: a layer, or passing its input's makers on."""
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        ins = tensors_in((args, kwargs))
        self._handed(ins)
        tracked, made = self.made_by(ins, data_only=True)
        name = function_name(func)
        if tracked and name in DRAWS:  # noise shaped like the data: a layer nothing feeds
            made = frozenset()
        elif not tracked or name in FRESH or (name == "where" and not self.made_by(ins[1:])[0]):
            return result  # on constants only, or none of the data's values (a boolean mask
            # made numbers, `where(mask, 0, lowest)`, an additive one): not the data
        outs = tensors_in(result)
        self._passed(name, args, kwargs, ins, outs)
        floating = bool(outs) and outs[0].is_floating_point()
        if floating and name not in UNDRAWN and not joins_nothing(name, ins):
            block = self.stack[-1] if self.stack else None
            path = function_path(block, func, self.counts, self.opening.named)
            self._function(path, block, (func, args, kwargs), made, ins, outs)
            self._mark(outs, frozenset((path,)))
        else:
            self._mark(outs, made)
        return result

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing heard while inside: the function mode off, and back on after if it was."""
        was = self.on
        self._mode(False)
        try:
            yield
        finally:
            self._mode(was)

    def _mode(self, on: bool) -> None:
        if on != self.on:
            if on:
                self.__enter__()
            else:
                self.__exit__(None, None, None)
            self.on = on

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.runs += 1
        if self.runs == 1:
            for k, t in enumerate(tensors_in((args, kwargs))):  # made by no layer, each marked
                self.given[f"<{k}>"] = weakref.ref(t)
                self._mark([t], frozenset((INPUT, f"<{k}>")))
            self.live = True
            self._mode(True)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.live:
            self._mode(False)
            self.live = False  # only the first call is read
            self._gave(tensors_in(output))


class Reading(Boxes):
    """Architecture's picture of the root's first call, read off the boxes a `Boxes` hears:
    each box as a layer (what it is, its shape, which call of each block around it it ran
    in), the edges along which the data went between them, and the layers that made what
    the root gave back. `why` says why torch.fx could not read the root instead; `result()`
    answers what was seen."""

    def __init__(self, root: nn.Module, depth: int, why: str | None = None) -> None:
        super().__init__(root, depth)
        self.why = why
        self.out = Traced()  # the boxes, as layers
        self.order: list[str] = []
        self.edges: dict[tuple[str, str], None] = {}
        self.ends: list[str] = []  # the layers that made what the root gave back, in order
        self.read: set[str] = set()  # the marks of the tensors given that a layer read
        self.weights: set[int] = set()  # the parameters the run read, by id
        self.batches = Batches()  # the batch on each tensor's first axis

    def _ran(self, layer: Raw, made: frozenset[str]) -> None:
        """`layer` ran now, on what the layers in `made` made."""
        layer.within = {path: self.calls.get(path, 1) for path in self.stack}  # their calls
        self.order.append(layer.path)
        self.read |= made & self.given.keys()
        for p in sorted(made - self.given.keys()):  # (a set: in path order, in every process)
            if p != layer.path:
                self.edges[(p, layer.path)] = None

    def seen(self) -> list[torch.Tensor]:
        """The tensors the root's first call was given that a layer read, while they live."""
        return [t for m in sorted(self.read) if (t := self.given[m]()) is not None]

    def _began(self, path: str, call: int, module: nn.Module, given: list[torch.Tensor]) -> None:
        read = [*module.parameters(), *given]  # (a closed box reads all it holds, and is given)
        self.weights.update(id(t) for t in read if isinstance(t, nn.Parameter))
        self._ran(self.opening.add_leaf(self.out, path, call), self.made_by(given)[1])

    def _handed(self, ins: list[torch.Tensor]) -> None:
        self.weights.update(id(t) for t in ins if isinstance(t, nn.Parameter))

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.runs:
            self.batches.given(tensors_in((args, kwargs)))
        super()._enter(module, args, kwargs)

    def _passed(self, name: str, args: tuple, kwargs: dict, ins: list, outs: list) -> None:
        self.batches.followed(name, args, kwargs, ins, outs)

    def _ended(self, box: str, module: nn.Module, given: list, outs: list) -> None:
        layer = self.out.layers[box]
        self.batches.followed("", (), {}, given, outs)
        if layer.shape is None and outs:
            layer.shape = list(outs[0].shape)
            layer.batch = self.batches.first(outs[0])
            if len(layer.shape) == 2 and not self.made_by(given)[0]:  # none of the data: a
                layer.axes = ["len", "dim"]  # table's rows (positions looked up by arange)
        super()._ended(box, module, given, outs)

    def _function(
        self, box: str, block: str | None, call: tuple, made: frozenset[str], ins: list, outs: list
    ) -> None:
        fn, args, kwargs = call
        layer = function_layer(self.opening, self.out, block, fn, box)
        layer.shape = list(outs[0].shape)
        layer.batch = self.batches.first(outs[0])
        layer.axes = _axes(function_name(fn), args, kwargs, ins[0].dim(), layer.shape)
        self._ran(layer, made)

    def _left(self, path: str, call: int, outs: list) -> None:
        if path in self.out.layers and outs:  # (none where nothing drawn ran inside it)
            self.out.layers[path].gave[call] = list(outs[0].shape)
            if call == 1:
                self.out.layers[path].batch = self.batches.first(outs[0])

    def _gave(self, outs: list[torch.Tensor]) -> None:
        self.ends = [p for t in outs for p in sorted(self.made_by([t])[1] - self.given.keys())]

    def result(self) -> Traced:
        """What the root's first call was seen to be made of."""
        finish(self.out, self.edges, self.order, self.ends)
        self.by, self.batches = {}, Batches()
        return self.out
