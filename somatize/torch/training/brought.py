"""What a Learning brought (a head, a guesser), exported and loaded with the node it trains
under keys prefixed `learning/`, from and to the worker that holds it when it is there;
whether weights to load hold every key (`load(strict=True)`), and give a tensor two nodes hold
one value."""

from __future__ import annotations

from typing import Any

import torch

from somatize.torch.training.learning import BROUGHT
from somatize.torch.training.params import state_of

__all__ = ["learnt", "parted", "there", "tied", "whole"]


def there(trainer: Any, nid: str) -> tuple[Any, str | None]:
    """The Learning of `nid` (None: nothing trains it), and the host whose worker holds it with
    the node (None: here)."""
    learning = trainer.trains.get(nid)
    return learning, trainer.graph.setting(nid).host if learning is not None else None


def learnt(trainer: Any, nid: str) -> dict[str, torch.Tensor]:
    """What the Learning of `nid` brought, as `{"learning/<key>": tensor}` ({} without one),
    read from the worker that holds it (the copy here is brought up to it)."""
    learning, host = there(trainer, nid)
    if learning is None:
        return {}
    if host is None:
        state = state_of(learning)
    else:
        state = trainer.broker.read(host, f"{nid}/learning", learning)
    return {BROUGHT + k: v for k, v in state.items()}


def parted(trainer: Any, nid: str, given: dict[str, Any]) -> tuple[dict, dict]:
    """`given` (the weights for node `nid`) as `(the node's own, its Learning's)`, the second
    without the `learning/` prefix; keys its Learning would not take are refused, named."""
    own = {k: v for k, v in given.items() if not str(k).startswith(BROUGHT)}
    theirs = _theirs(given)
    if not theirs:
        return own, theirs
    learning = trainer.trains.get(nid)
    held = sorted(BROUGHT + k for k in theirs)
    if learning is None:
        raise ValueError(
            f"node {nid!r}: the weights hold {held}, what a Learning brought, and nothing "
            f"trains {nid!r} in this Trainer: leave those keys out, or train the node with "
            "trains= as when they were exported; nothing was loaded"
        )
    has = sorted(BROUGHT + k for k in _brings(learning, given))
    unknown = sorted(set(held) - set(has))
    if unknown:
        name = type(learning).__name__
        brings = f"brings {has}" if has else "brings nothing of its own"
        raise ValueError(
            f"node {nid!r}: the weights hold {unknown}, what the Learning that trained it "
            f"brought (a Greedy's head, a Synthetic's guesser), and the {name} that trains it "
            f"here {brings}: train {nid!r} with the technique they were exported from, or "
            "leave those keys out; nothing was loaded"
        )
    return own, theirs


def whole(trainer: Any, weights: dict[str, dict]) -> None:
    """`load(strict=True)`: refuses weights that leave out a node with weights, or a key of one
    (what its Learning brought included), naming them."""
    left = []
    for nid in trainer.graph.nodes():
        keys = set(state_of(trainer.graph.implementation(nid)))
        if nid in trainer.trains:
            learnt(trainer, nid)  # the copy here brought up to its worker's (a guesser built there)
            keys |= {BROUGHT + k for k in _brings(trainer.trains[nid], weights.get(nid, {}))}
        if keys and nid not in weights:
            left.append(f"node {nid!r}")
        elif keys - set(weights.get(nid, keys)):
            left.append(f"{nid!r}: {', '.join(sorted(keys - set(weights[nid])))}")
    if left:
        raise ValueError(
            f"load(strict=True) takes every node and key, and the weights leave out "
            f"{'; '.join(left)}; nothing was loaded (strict=False loads a subset: what is "
            "left out keeps the weights it has)"
        )


def tied(trainer: Any, weights: dict[str, dict]) -> None:
    """Refuses weights that give one tensor held by two nodes (tied weights across nodes: a
    model's embeddings in one, its output layer in another) two values, naming both keys: which
    one would win depends on the order the nodes are given in. (A node's own two keys of one
    tensor are checked with the rest of the node.)"""
    given_for: dict[int, list[tuple[str, str, Any]]] = {}  # by the tensor they load into
    held: dict[int, torch.Tensor] = {}
    for nid, given in weights.items():
        own = state_of(trainer.graph.implementation(nid))
        for key in given.keys() & own.keys():  # (not what a Learning brought)
            given_for.setdefault(id(own[key]), []).append((nid, key, given[key]))
            held[id(own[key])] = own[key]
    for tensor, named in given_for.items():
        if len({nid for nid, _, _ in named}) < 2:
            continue
        mine = held[tensor]
        (was, at, first), *rest = named
        first = first.detach().to(device=mine.device, dtype=mine.dtype)
        for nid, key, value in rest:
            if not torch.equal(first, value.detach().to(device=mine.device, dtype=mine.dtype)):
                raise ValueError(
                    f"node {was!r}'s {at!r} and node {nid!r}'s {key!r} are one tensor (tied "
                    "weights), and the weights give them different values: give both the same, "
                    "or only one; nothing was loaded"
                )


def _brings(learning: Any, given: dict[str, Any]) -> set[str]:
    """The keys (without `learning/`) `learning` holds once loaded from `given`, a node's
    weights: what it brought, and what it would build for them (`receiving`)."""
    with torch.device("meta"):  # built only to be named: no memory, no numbers
        parts = learning.receiving(_theirs(given))
    return {*state_of(learning), *state_of(torch.nn.ModuleDict(parts))}


def _theirs(given: dict[str, Any]) -> dict[str, Any]:
    return {k[len(BROUGHT) :]: v for k, v in given.items() if str(k).startswith(BROUGHT)}
