"""How the core moves values and nodes to a device, and reads a node's state.

Registered with `somatize._hooks` when `somatize.torch` is imported. Both ways of being a torch
node count: a node that *is* an `nn.Module`, and a plain node holding modules as attributes.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch import nn

from somatize import _hooks
from somatize.node import Wrapped, kind_name
from somatize.torch._values import mapped
from somatize.torch.codec import _plain

__all__ = ["entry", "modules_of", "named_modules_of", "move", "place", "state_digest", "trainable"]


def named_modules_of(node: Any) -> list[tuple[str, nn.Module]]:
    """The modules a node is made of, named: `("", node)` when the node is one, else each
    module it holds as an attribute (`net`; `blocks.0` for one in a list, `heads.a` for one
    in a dict), each once. A module stood in a graph as it is (`Node.of`) is the node."""
    if isinstance(node, Wrapped):
        return [("", node.held)] if isinstance(node.held, nn.Module) else []
    if isinstance(node, nn.Module):
        return [("", node)]
    found: dict[int, tuple[str, nn.Module]] = {}  # by module object: each once
    for name, value in vars(node).items():
        if name == "_somatize_args":  # what it was built with: what it holds is below
            continue
        if isinstance(value, (list, tuple)):
            items: Any = enumerate(value)
        elif isinstance(value, dict):
            items = value.items()
        else:
            items = [(None, value)]
        for key, item in items:
            where = name if key is None else f"{name}.{key}"
            if isinstance(item, nn.Module):
                found.setdefault(id(item), (where, item))
            elif isinstance(item, torch.Tensor) and isinstance(item, nn.Parameter):  # (fast first)
                raise TypeError(
                    f"a {kind_name(node)} holds an nn.Parameter as {where!r}, outside any "
                    "module, where no tool sees it (parameters, export, freeze, .on): make the "
                    f"node a module (class {type(node).__name__}(Node, nn.Module)), or hold it "
                    "in one (nn.ParameterList, nn.ParameterDict, or a layer)"
                )
    return list(found.values())


def modules_of(node: Any) -> list[nn.Module]:
    """The modules a node is made of: itself if it is one, else the modules it holds."""
    return [module for _, module in named_modules_of(node)]


def move(value: Any, device: str) -> Any:
    """`value` with every tensor in it on `device`; containers kept as they were
    (`somatize.torch._values.mapped`), the rest untouched."""
    return mapped(value, lambda t: t.to(device))


def place(node: Any, device: str) -> None:
    """Move every module the node holds to `device`. A device this machine does not have
    (`cuda` without CUDA, `mps` without MPS) is refused with a `ValueError` naming it."""
    kind = torch.device(device).type
    backend = {"cuda": torch.cuda, "mps": torch.backends.mps}.get(kind)
    if backend is not None and not backend.is_available():
        raise ValueError(
            f"a {kind_name(node)} is placed .on({device!r}), and this machine has no "
            f"{kind.upper()} ({backend.__name__}.is_available() is False): place it .on('cpu'), "
            f"or run it on a worker that has {kind.upper()} (.at(host))"
        )
    modules = modules_of(node)
    if kind == "meta" and any(
        t.device.type != "meta" for m in modules for t in m.state_dict().values()
    ):
        warnings.warn(
            f"a {kind_name(node)} placed .on('meta') loses its weights' values: its modules "
            "(your own, not a copy) are moved to the meta device, which keeps only shapes; "
            "build the model on meta instead (with torch.device('meta'): ...)",
            stacklevel=2,
        )
    for module in modules:
        module.to(device)


def state_digest(node: Any) -> str | None:
    """sha256 over the node's state_dict (names, dtypes, shapes, bytes), or None if empty.
    Refuses (`TypeError`, naming the entry) a sparse, nested, quantized or meta tensor in it."""
    h = hashlib.sha256()
    anything = False
    for i, module in enumerate(modules_of(node)):
        for key, tensor in module.state_dict().items():
            anything = True
            try:
                t = _plain(tensor, "be digested (a frozen or cached node's state is)", "digest")
            except TypeError as error:
                raise TypeError(f"the state {key!r} of a {kind_name(node)}: {error}") from None
            h.update(f"{i}.{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-dim too
    return "sha256:" + h.hexdigest() if anything else None


def state_modules(node: Any) -> list[nn.Module]:
    """Every module whose state `state_digest` reads: the node's modules and theirs."""
    return [m for top in modules_of(node) for m in top.modules()]


def trainable(node: Any) -> bool:
    """Whether any parameter the node holds would get a gradient."""
    return any(p.requires_grad for m in modules_of(node) for p in m.parameters())


def entry(node: Any) -> Any:
    """A node that is an `nn.Module` is called through `__call__`, so its hooks fire."""
    return node if isinstance(node, nn.Module) else node.forward


_hooks.register(
    move=move,
    place=place,
    state_digest=state_digest,
    state_modules=state_modules,
    trainable=trainable,
    entry=entry,
)
