"""Where the core asks for what only torch knows.

The core never imports torch. `somatize.torch` registers these functions on import; until it
does, the defaults below answer as if no value were a tensor and no node held state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register", "move", "place", "state_digest", "trainable", "entry"]


def _move(value: Any, device: str) -> Any:
    return value


def _place(node: Any, device: str) -> None:
    return None


def _state_digest(node: Any) -> str | None:
    return None


def _trainable(node: Any) -> bool:
    return False


def _entry(node: Any) -> Callable[[Any, Any], Any]:
    return node.forward


_table: dict[str, Callable[..., Any]] = {
    "move": _move,
    "place": _place,
    "state_digest": _state_digest,
    "trainable": _trainable,
    "entry": _entry,
}


def register(**functions: Callable[..., Any]) -> None:
    """Replace the default answer to one or more questions (`move`, `place`, ...)."""
    unknown = set(functions) - set(_table)
    if unknown:
        raise ValueError(f"unknown hook(s) {sorted(unknown)}; known: {sorted(_table)}")
    _table.update(functions)


def move(value: Any, device: str) -> Any:
    """`value` with every tensor inside it (dicts, lists, tuples too) on `device`."""
    return _table["move"](value, device)


def place(node: Any, device: str) -> None:
    """Move what a node holds (its modules) to `device`, in place."""
    _table["place"](node, device)


def state_digest(node: Any) -> str | None:
    """A digest of the node's state (its weights), or None for a stateless node."""
    return _table["state_digest"](node)


def trainable(node: Any) -> bool:
    """Whether the node holds parameters that an optimizer could move."""
    return bool(_table["trainable"](node))


def entry(node: Any) -> Callable[[Any, Any], Any]:
    """What the engine calls to run a node: `node.forward`, or the module's `__call__` so that
    hooks registered on a node that is an `nn.Module` fire."""
    return _table["entry"](node)
