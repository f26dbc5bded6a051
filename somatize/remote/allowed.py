"""What a worker may build when a client sends a node by name (a worker without `--accept-code`).

An explicit list, made when the worker starts and never from what a client names: the node
classes and functions of the modules it was told to import (`--import MODULE`), the optimizers
of `torch.optim`, the functions of `torch.nn.functional` and somatize's Learning classes
(`somatize._hooks.constructible`). A class named by a definition or a `Named` among its
arguments is looked up there: nothing is imported, followed or called before it is found.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import types
from typing import Any

from somatize import _hooks, codecs
from somatize.node import Node
from somatize.remote.wire import Named

__all__ = ["Allowed", "version_of"]


def version_of(module: Any) -> str | None:
    """What says which code a module is: its `__version__`, or else a digest of its source
    file, or None when it has neither (or is None)."""
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    path = getattr(module, "__file__", None)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


class Allowed:
    """The classes this worker may build by name, keyed by `(module, qualname)`."""

    def __init__(self, imports: list[str] = ()) -> None:
        # what the person starting the worker asked for, by name
        modules = {name: importlib.import_module(name) for name in imports}
        self.versions = {name: version_of(m) for name, m in modules.items()}
        found: list[Any] = []
        for module in modules.values():  # its node classes and functions
            for value in list(vars(module).values()):
                node = isinstance(value, type) and issubclass(value, Node)
                if node or isinstance(value, types.FunctionType):
                    if value.__module__ == module.__name__:
                        found.append(value)
        _hooks.ready()  # torch loaded: somatize.torch answers what it adds
        found += _hooks.constructible(list(modules.values()))
        self.classes = {(v.__module__, v.__qualname__): v for v in found}

    def node_class(self, module: Any, qualname: Any, nid: Any, version: Any = None) -> type:
        """The Node class a definition names, if this worker may build it: refused otherwise,
        saying how to start the worker so that it may (and before anything is imported)."""
        found = self.classes.get((module, qualname)) if isinstance(module, str) else None
        if not (isinstance(found, type) and issubclass(found, Node)):
            raise PermissionError(
                f"node {nid!r}: this worker may not build {module}.{qualname}: it builds the "
                f"node classes of the modules it was started to import ({sorted(self.versions)}"
                "); start it with --import MODULE (Worker.spawn(..., send=[MODULE])), or with "
                "--accept-code to take code from trusted clients (mode='network')"
            )
        mine = self.versions.get(found.__module__)
        if version is not None and mine is not None and version != mine:
            raise ImportError(
                f"node {nid!r}: {module} is version {version} where it was sent from and "
                f"{mine} on this worker: install the same code on both"
            )
        return found

    def resolved(self, value: Any, nid: Any, depth: int = 0) -> Any:
        """`value` with every `Named` in it (inside lists, tuples and dicts) replaced by the
        class it names, if this worker may build it; refused otherwise, naming it."""
        if depth > codecs.DEPTH:
            raise ValueError(f"node {nid!r}: constructor arguments nested too deep")
        kind = type(value)
        if kind is Named:
            found = self.classes.get((value.module, value.qualname))
            if found is None:
                raise PermissionError(
                    f"node {nid!r}: an argument names {value}, which this worker may not build "
                    "(it builds torch.optim's optimizers, somatize's Learning classes and the "
                    "classes of the modules it imports): start it with --import MODULE, or "
                    "with --accept-code (mode='network')"
                )
            return found
        if kind is list or kind is tuple:
            return kind(self.resolved(v, nid, depth + 1) for v in value)
        if kind is dict:
            return {k: self.resolved(v, nid, depth + 1) for k, v in value.items()}
        return value


def construct(cls: type, args: dict[str, Any]) -> Any:
    """`cls` built from its captured constructor arguments (`Node._somatize_args`): those up
    to its `*args` by position, the rest by name."""
    if not isinstance(args, dict):
        raise TypeError(f"{cls.__qualname__}: constructor arguments are a dict, not {args!r:.60}")
    named = dict(args)
    if cls.__init__ is object.__init__:
        return cls()
    signature = inspect.signature(cls.__init__)
    parameters = list(signature.parameters.values())[1:]
    if "args" in named and "args" not in [p.name for p in parameters]:
        try:  # an `args=` its **kwargs took binds; a capture that could not bind does not
            signature.bind(None, **named)
        except TypeError:  # captured as {"args": positional, **keywords}
            return cls(*named.pop("args"), **named)
    positional: list[Any] = []
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            positional.extend(named.pop(p.name, ()))
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.name not in named:
            break
        positional.append(named.pop(p.name))
    return cls(*positional, **named)  # the rest by name, with what **kwargs gathered
