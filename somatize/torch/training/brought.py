"""What a Learning brought (a head, a guesser), exported and loaded with the node it trains.

`Trainer.export` puts it beside the node's own weights under keys of its own, prefixed
`learning/` (`{"mid": {"lin.weight": ..., "learning/head.weight": ...}}`), and `Trainer.load`
takes them back, checked with the rest before anything is copied. A node on a worker whose
Learning is there already is asked there, and loaded there too; until the Learning has gone,
the copy here is the one that travels with it.
"""

from __future__ import annotations

from typing import Any

import torch

from somatize.torch.training.learning import BROUGHT
from somatize.torch.training.params import state_of

__all__ = ["learnt", "parted", "sent"]


def _there(trainer: Any, nid: str) -> tuple[Any, str | None]:
    """The Learning of `nid`, and the host whose worker holds it (None: it is here)."""
    learning = trainer.trains.get(nid)
    host = trainer.graph.setting(nid).host
    broker = trainer.broker
    if learning is None or not host or not broker.holds(host, broker.key(learning)):
        return learning, None
    return learning, host


def learnt(trainer: Any, nid: str) -> dict[str, torch.Tensor]:
    """What the Learning of `nid` brought, as `{"learning/<key>": tensor}` ({} without one)."""
    learning, host = _there(trainer, nid)
    if learning is None:
        return {}
    if host is None:
        state = state_of(learning)
    else:
        state = trainer.broker.request(host, {"op": "state", "key": trainer.broker.key(learning)})
    return {BROUGHT + k: v for k, v in state.items()}


def parted(trainer: Any, nid: str, given: Any) -> tuple[Any, list[tuple[torch.Tensor, Any]]]:
    """`given` (the weights for node `nid`) less what is for its Learning, and the copies that
    would put those into the Learning: `(node's own, [(into, from)])`. Refused, naming the key:
    weights for a Learning the node does not have, a key it does not hold, a shape it does not
    have. Nothing is copied here."""
    if not isinstance(given, dict) or not any(str(k).startswith(BROUGHT) for k in given):
        return given, []
    own = {k: v for k, v in given.items() if not str(k).startswith(BROUGHT)}
    theirs = {k[len(BROUGHT) :]: v for k, v in given.items() if str(k).startswith(BROUGHT)}
    learning = trainer.trains.get(nid)
    if learning is None:
        raise ValueError(
            f"node {nid!r}: the weights hold {sorted(BROUGHT + k for k in theirs)}, what a "
            f"Learning brought, and nothing trains {nid!r} in this Trainer: leave those keys "
            "out, or train the node with trains= as when they were exported; nothing was loaded"
        )
    learning.receiving(theirs)
    state = state_of(learning)
    plan = []
    for key, tensor in theirs.items():
        mine = state.get(key)
        if mine is None:
            raise ValueError(
                f"node {nid!r}: the weights hold {BROUGHT + key!r}, and its {learning!r} brought "
                f"{sorted(BROUGHT + k for k in state)}; nothing was loaded"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.shape != mine.shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
            raise ValueError(
                f"node {nid!r}, {BROUGHT + key!r}: the weights give shape {shape!r:.60}, its "
                f"{type(learning).__name__} has {tuple(mine.shape)}; nothing was loaded"
            )
        plan.append((mine, tensor))
    return own, plan


def sent(trainer: Any, nid: str, given: Any) -> None:
    """What is for the Learning of `nid` in `given`, sent to the worker that holds it (if
    one does: otherwise it travels with the Learning, from the copy here)."""
    learning, host = _there(trainer, nid)
    if host is None or not isinstance(given, dict):
        return
    theirs = {k[len(BROUGHT) :]: v for k, v in given.items() if str(k).startswith(BROUGHT)}
    if theirs:
        key = trainer.broker.key(learning)
        trainer.broker.request(host, {"op": "load", "key": key, "state": theirs})
