"""Where the core and the worker ask for what only torch knows.

The core and `somatize.remote` never import `somatize.torch`: they call the functions here,
always as `_hooks.name(...)`. Until `somatize.torch` registers its own (it does on import), each
answers as if no value were a tensor and no node held state. `ready()` is the one place that
imports it: once torch is loaded (or when a tensor has to be read back), so that its answers
are here before they are asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


def move(value: Any, device: str) -> Any:
    """`value` with every tensor inside it (dicts, lists, tuples too) on `device`."""
    return value


def place(node: Any, device: str) -> None:
    """Move what a node holds (its modules) to `device`, in place."""


def state_digest(node: Any) -> str | None:
    """A digest of the node's state (its weights), or None for a stateless node."""
    return None


def state_modules(node: Any) -> list[Any]:
    """Every module whose state `state_digest` reads for this node (its modules and theirs)."""
    return []


def trainable(node: Any) -> bool:
    """Whether the node holds parameters that an optimizer could move."""
    return False


def entry(node: Any) -> Callable[[Any, Any], Any]:
    """What the engine calls to run a node: `node.forward`, or the module's `__call__` so that
    hooks registered on a node that is an `nn.Module` fire."""
    return node.forward


def state_of(node: Any) -> dict[str, Any]:
    """The node's weights as `{key: tensor}` (detached), keyed as `Trainer.export` keys them."""
    return {}


def stage_state(
    node: Any, state: dict[str, Any], *, dtypes: bool = False
) -> Callable[[], Callable[[], Any]]:
    """Check `state` (as `state_of` gives it) against the node and make the copies it would
    load (cast to the node's dtypes; with `dtypes`, the node's tensors take those of `state`),
    changing nothing; the function given back copies them in and answers the function that puts
    back what was there (calling it at once loads `state`). A mismatch is refused before
    anything."""
    if state:
        raise ValueError(f"{type(node).__name__} holds no weights to load (torch is not loaded)")
    return lambda: lambda: None  # nothing to copy in, nothing to put back


def modes(node: Any) -> Callable[[], list[bool]] | None:
    """A function that reads the train/eval mode of each module the node holds (`True`:
    training), or None for a node holding none: what its copy on a worker is told when they
    change."""
    return None


def set_modes(node: Any, modes: str) -> None:
    """Put the node's modules in the modes `modes(node)` read from its copy elsewhere."""


def serve(server: Any, session: Any, op: str, message: dict) -> Any:
    """Answer a worker request that only the torch half knows (a trainer's stage)."""
    raise ValueError(f"unknown request {op!r}")


def tensor_frame(value: Any) -> tuple[list, Any] | None:
    """`([dtype, shape, requires_grad], buffer)` for a tensor (its numbers in C order, as one
    flat byte buffer that is the tensor's own memory when it can be), or None for a value that
    is not one. Refuses a tensor that has no plain numbers (sparse, quantized, meta)."""
    return None


def frame_tensor(head: list, buffer: Any) -> Any:
    """The tensor `tensor_frame` described, built on `buffer` without copying it; a head that
    does not add up to the buffer's length is refused (`ValueError`)."""
    raise ValueError("a tensor arrived, and torch is not loaded to build it")


def constructible(modules: list[Any]) -> list[Any]:
    """What a worker may build or call by name without `--accept-code`, beside what the
    modules it was told to import define: torch's optimizers, `torch.nn.functional`'s
    functions, the Learning classes somatize ships, and optimizer classes defined in those
    `modules`."""
    return []


def no_grad() -> Any:
    """A context in which nothing records a gradient (`torch.no_grad()`): how a worker runs
    a plain forward, so that no autograd graph is kept for nobody."""
    return contextlib.nullcontext()


def late_codecs() -> bool:
    """Register the codecs of libraries loaded since the backend was (transformers' model
    outputs), for a value no codec knew; whether any was registered."""
    return False


def fields_of(value: Any) -> list | None:
    """A value the wire sends as its class's name and its fields, with the tensors in them
    framed (a transformers `ModelOutput`): `[module, class name, [[field, value], ...]]`, or
    None for any other value."""
    return None


def from_fields(said: Any) -> Any:
    """The value `fields_of` described, or a `ValueError` for a name the backend will not
    build."""
    raise ValueError("a value arrived by its fields, and torch is not loaded to build it")


def ready(torch_needed: bool = False) -> None:
    """Let `somatize.torch` register its answers: when torch is already loaded, or when
    `torch_needed` (a tensor is about to be read back). Cheap after the first time."""
    if "somatize.torch" in sys.modules:
        return
    if torch_needed or "torch" in sys.modules:
        importlib.import_module("somatize.torch")


def register(**functions: Callable[..., Any]) -> None:
    """Answer one or more of the questions (`move=`, `place=`, ...) with these functions from
    now on; an unknown name is refused and nothing is replaced."""
    unknown = set(functions) - set(HOOKS)
    if unknown:
        raise ValueError(f"unknown hook(s) {sorted(unknown)}; known: {sorted(HOOKS)}")
    globals().update(functions)


HOOKS = tuple(
    name
    for name, value in list(globals().items())
    if type(value) is types.FunctionType
    and value.__module__ == __name__
    and name not in ("ready", "register")
)
"""The questions a backend answers (the functions above, in order, but `ready` and
`register`); `register` replaces the function of that name here."""

__all__ = ["register", "ready", *HOOKS]
