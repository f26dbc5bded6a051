"""Which weights learnt on a worker since they were last read back, whichever broker sent
them there: the copies here are behind, so another broker must not send them on as they are
(it would train or run on from older weights, silently). Followed by parameter, so a graph
built anew around the same modules is caught too."""

from __future__ import annotations

import weakref
from typing import Any

from somatize import _hooks
from somatize.remote.errors import StateLost

__all__ = ["params", "mark", "unmark", "remark", "refuse_behind"]

_AHEAD: dict[int, tuple[weakref.ref, str, str, str, weakref.ref]] = {}
"""`{id(parameter): (a weak reference to it, the broker's session, the host, the node id, a
weak reference to the node)}`: each checked to be the object itself, never an id reused."""


def params(node: Any) -> list[Any]:
    """The parameters of each module the node holds (`_hooks.state_modules`), in order."""
    return [p for m in _hooks.state_modules(node) for p in m.parameters(recurse=False)]


def mark(nid: str, node: Any, session: str, host: str) -> None:
    """Note that node `nid` learnt on `host`'s worker through the broker of `session`."""
    for p in params(node):
        if not p.requires_grad:  # a frozen weight learns nothing there
            continue
        i = id(p)
        gone = weakref.ref(p, lambda _gone, i=i: _AHEAD.pop(i, None))
        _AHEAD[i] = (gone, session, host, nid, weakref.ref(node))


def _noted(p: Any) -> tuple | None:
    """What `_AHEAD` notes of parameter `p` itself (not of another that reused its id)."""
    entry = _AHEAD.get(id(p))
    return entry if entry is not None and entry[0]() is p else None


def unmark(node: Any) -> list[tuple[int, tuple]]:
    """Forget that `node`'s weights are ahead of their copies here (they were read back, or
    loaded); what was noted, for `remark`."""
    return [(id(p), _AHEAD.pop(id(p))) for p in params(node) if _noted(p)]


def remark(marks: list[tuple[int, tuple]]) -> None:
    """Put back what `unmark` answered (a load that failed)."""
    _AHEAD.update(marks)


def refuse_behind(nid: str, node: Any, session: str) -> None:
    """`StateLost` for node `nid` when a weight of it learnt on a worker through another
    broker than the one of `session`, or as another node (a graph built anew around the same
    modules), and was not read back: the copy here is behind it."""
    for p in params(node):
        entry = _noted(p)
        if entry is not None and (entry[1] != session or entry[4]() is not node):
            through = "another broker" if entry[1] != session else "this broker"
            raise StateLost(
                f"node {nid!r} holds weights that learnt on host {entry[2]!r} (as node "
                f"{entry[3]!r}) through {through}, and what they learnt was not read back "
                "(Trainer.export) before the worker lost it or this broker asked: the copy "
                "here is behind, and nothing was sent. Read it back through that broker "
                "while it is open; or resume from the copy here, "
                "Trainer.load(error.exported), or from weights you kept, Trainer.load(weights)",
                [nid],
                {nid: _hooks.state_of(node)},
            )
