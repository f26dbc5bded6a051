"""Reading a module by a real forward: hooks on the modules that are drawn, and a function
mode for the torch functions between them, following each tensor to the layer that made it."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from somatize.torch._modules import tensors_in
from somatize.torch.inside._trace import (
    FRESH,
    INPUT,
    UNDRAWN,
    Opening,
    Raw,
    Traced,
    call_path,
    finish,
    function_layer,
    joins_nothing,
    shape_of,
)
from somatize.torch.inside.kinds import function_name


class Calls:
    """Hooks on the drawn modules of a root (its layers and the blocks around them) that say
    which path each call is made under and which call of that path it is.

    A module tied in two places is one object at two paths: a call is put at the path inside
    the block that is running. `enter(path, call, args, kwargs)` hears a layer's call begin
    and `leave(path, call, (args, kwargs), output)` hears it end; nothing inside a layer is
    heard, nor anything while `live` is False."""

    def __init__(self, opening: Opening, enter: Any, leave: Any) -> None:
        self.opening = opening
        self.enter = enter
        self.leave = leave
        self.live = True
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.inside = 0  # how deep inside layers the running call is
        self.handles: list[Any] = []

    def arm(self) -> Calls:
        """A pre- and a post-hook on every drawn module, once per module object."""
        aliases: dict[int, tuple[nn.Module, list[tuple[str, bool]]]] = {}  # by module object
        for path, module, shut in self.opening.drawn():
            aliases.setdefault(id(module), (module, []))[1].append((path, shut))
        for module, paths in aliases.values():
            pre = module.register_forward_pre_hook(self._pre(paths), with_kwargs=True)
            post = module.register_forward_hook(self._post(paths), with_kwargs=True)
            self.handles += [pre, post]
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
        return next((p for p in paths if p[0].rpartition(".")[0] == here), paths[0])

    def _pre(self, paths: list[tuple[str, bool]]):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.live:
                return
            if self.inside:
                self.inside += 1
                return
            path, shut = self._pick(paths)
            self.calls[path] = k = self.calls.get(path, 0) + 1
            if shut:
                self.inside = 1
                self.enter(path, k, args, kwargs)
            else:
                self.stack.append(path)

        return hook

    def _post(self, paths: list[tuple[str, bool]]):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self.live:
                return
            if self.inside:
                self.inside -= 1
                if not self.inside:
                    path, _ = self._pick(paths)
                    self.leave(path, self.calls[path], (args, kwargs), output)
                return
            if self.stack and any(self.stack[-1] == p for p, _ in paths):
                self.stack.pop()

        return hook


class Reading(TorchFunctionMode):
    """A read by a real forward that rides along a forward somebody else runs (the graph's
    own): `arm()` hooks what is drawn and turns this function mode on for the root's first
    call (off while a layer runs: nothing inside a layer is a layer), so every torch function
    between the drawn modules is heard; `disarm()` takes it all off, `result()` answers what
    was seen. `why` says why torch.fx could not read the root instead. `heard`, when given,
    is told `(box, module, given, output)` as each box's call ends (a function's module is
    None): a probe measures each box there."""

    def __init__(
        self, root: nn.Module, depth: int, why: str | None = None, heard: Any = None
    ) -> None:
        super().__init__()
        self.root = root
        self.why = why
        self.heard = heard
        self.opening = Opening(root, depth, bare=heard is not None)
        self.hooks = Calls(self.opening, self._layer_in, self._layer_out)
        self.hooks.live = False
        self.out = Traced()
        self.counts: dict[str, int] = {}
        self.order: list[str] = []
        # every tensor known, by id with a weak reference (an id is only that tensor's while
        # it lives): nothing is kept alive that the forward would have let go
        self.by: dict[int, tuple[weakref.ref, frozenset[str]]] = {}
        self.edges: dict[tuple[str, str], None] = {}
        self.on = False  # the mode is on the stack
        self.calls = 0
        self.ends: set[str] = set()  # the layers that made what the root gave back

    def arm(self) -> Reading:
        """Hooks on; the root's next call is read."""
        self.hooks.arm().handles += [
            self.root.register_forward_pre_hook(self._enter, with_kwargs=True),
            self.root.register_forward_hook(self._leave),
        ]
        return self

    def producers(self, value: Any, data_only: bool = False) -> tuple[bool, frozenset[str]]:
        """Whether anything in `value` is the data, and which layers made it. `data_only`: an
        integer or boolean tensor (an index, a mask) given besides a floating one decides
        where the data goes, not what it is, and its producers are left out."""
        found: set[str] = set()
        index: set[str] = set()
        tracked = floating = False
        for t in tensors_in(value):
            known = self.by.get(id(t))
            if known is not None and known[0]() is t:
                tracked = True
                real = t.is_floating_point() or t.is_complex()
                floating |= real
                (found if real or not data_only else index).update(known[1])
        return tracked, frozenset(found if floating else found | index)

    def mark(self, value: Any, made: frozenset[str]) -> None:
        for t in tensors_in(value):
            self.by[id(t)] = (weakref.ref(t), made)

    def _ran(self, layer: Raw, made: frozenset[str]) -> None:
        """`layer` ran now, on what the layers in `made` made."""
        layer.within = self.hooks.within()
        self.order.append(layer.path)
        for p in sorted(made):  # (a set: in path order, the same in every process)
            if p != layer.path:
                self.edges[(p, layer.path)] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        """Each torch function called: a layer, or passing its input's producers on."""
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        given = (args, kwargs)
        tracked, made = self.producers(given, data_only=True)
        name = function_name(func)
        if not tracked or name in FRESH:
            return result  # on constants only, or none of the data's values: not the data
        outs = tensors_in(result)
        floating = bool(outs) and outs[0].is_floating_point()
        if floating and name not in UNDRAWN and not joins_nothing(name, given):
            block = self.hooks.stack[-1] if self.hooks.stack else None
            layer = function_layer(self.opening, self.out, block, func, self.counts)
            layer.shape = list(outs[0].shape)
            self._ran(layer, made)
            self.mark(outs, frozenset((layer.path,)))
            if self.heard is not None:
                self.heard(layer.path, None, given, result)
        else:
            self.mark(outs, made)
        return result

    def _layer_in(self, path: str, call: int, args: tuple, kwargs: dict) -> None:
        self._mode(False)
        if not isinstance(self.opening.named[path], nn.Identity):  # (it hands its input on)
            made = self.producers((args, kwargs))[1]
            self._ran(self.opening.add_leaf(self.out, path, call), made)

    def _layer_out(self, path: str, call: int, given: Any, output: Any) -> None:
        if isinstance(self.opening.named[path], nn.Identity):
            self.mark(output, self.producers(given)[1])
        else:
            layer = self.out.layers[call_path(path, call)]
            if layer.shape is None:
                layer.shape = shape_of(output)
            self.mark(output, frozenset((layer.path,)))
            if self.heard is not None:
                self.heard(layer.path, self.opening.named[path], given, output)
        self._mode(True)

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
        self.calls += 1
        if self.calls == 1:
            self.mark((args, kwargs), frozenset((INPUT,)))  # the data, made by no layer
            self.hooks.live = True
            self._mode(True)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.hooks.live:
            self._mode(False)
            self.hooks.live = False  # only the first call is read
            self.ends = set(self.producers(output)[1])

    def disarm(self) -> None:
        """Every hook off (the root's are among `hooks`'), and the function mode too if the
        root's call never came back."""
        self._mode(False)
        self.hooks.live = False
        self.hooks.disarm()

    def result(self) -> Traced:
        """What the root's first call was seen to be made of."""
        finish(self.out, self.edges, self.order, self.ends)
        self.by = {}
        return self.out

