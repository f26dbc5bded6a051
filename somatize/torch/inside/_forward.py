"""Reading a module by a real forward: hooks on the modules that are drawn, and a function
mode for the torch functions between them, following each tensor to the layer that made it."""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from somatize.torch._modules import parts_of, tensors_in
from somatize.torch.inside._trace import (
    Opening,
    Traced,
    call_path,
    drawn,
    function_layer,
    joins_nothing,
    ordered,
    passes,
    prune,
    shape_of,
)
from somatize.torch.inside.kinds import function_name

__all__ = ["Calls", "Reading", "by_forward"]


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

    def __init__(self, opening: Opening, calls: Calls) -> None:
        self.opening = opening
        self.out = Traced()
        self.calls = calls  # the hooks: which blocks are open, and which call of each
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
        if drawn(name) and outs and outs[0].is_floating_point() and not joins_nothing(name, given):
            stack = self.calls.stack
            block = stack[-1] if stack else None
            if block:
                self.opening.add_block(self.out, block)
            layer = function_layer(self.out, block, func, self.counts)
            layer.shape = list(outs[0].shape)
            layer.within = self.calls.within()
            self.order.append(layer.path)
            self.link(made, layer.path)
            self.mark(outs, frozenset((layer.path,)))
        else:
            self.mark(outs, made)


class Calls:
    """Hooks on the drawn modules of a root (its layers and the blocks around them) that say
    which path each call is made under and which call of that path it is.

    A module tied in two places is one object at two paths: a call is put at the path inside
    the block that is running; `within()` says which call of each open block is running (a
    block is counted only where it is hooked). `enter(path, call, args, kwargs)` hears a
    layer's call begin and `leave(path, call, output)` hear it end; nothing inside a layer is
    heard. While `live` is False nothing is heard and nothing is counted. With `blocks` False
    the blocks are hooked only when a module is tied (their hooks are what says which path it
    is called under), for who needs the layers alone. With `only`, a module with no children
    whose paths are none of those is not hooked (nothing is heard from it)."""

    def __init__(
        self,
        opening: Opening,
        enter: Any,
        leave: Any,
        blocks: bool = True,
        only: Collection[str] | None = None,
    ) -> None:
        self.opening = opening
        self.enter = enter
        self.leave = leave
        self.blocks = blocks
        self.only = only
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
        if not parts_of(root):
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
            if (
                self.only is not None
                and not any(path in self.only for path, _ in paths)
                and not parts_of(module)
            ):
                continue  # nobody listens, and no other drawn module can be called inside it
            self.handles.append(
                module.register_forward_pre_hook(self._pre(paths), with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._post(paths)))
        return self

    def within(self) -> dict[str, int]:
        """Which call (from 1) of each block open now the running call is in."""
        return {path: self.calls.get(path, 1) for path in self.stack}

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
                self.calls[path] = self.calls.get(path, 0) + 1
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
        opening = Opening(root, depth)
        self.hooks = Calls(opening, self._layer_in, self._layer_out)
        self.hooks.live = False
        self.s = _Forward(opening, self.hooks)
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
        layer.within = self.hooks.within()
        s.order.append(layer.path)
        s.link(made, layer.path)

    def _layer_out(self, path: str, call: int, output: Any) -> None:
        if self.passing is not None:
            self.s.mark(output, self.passing)
            self.passing = None
        else:
            layer = self.s.out.layers[call_path(path, call)]
            if layer.shape is None:
                layer.shape = shape_of(output)
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
        ordered(s.out, s.order)
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
