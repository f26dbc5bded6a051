"""Federated averaging: what several training runs exported, averaged, and a store to meet in.

Each client trains, exports (`Trainer.export`), puts its round into a shared store with
`gather`, and gets the same average back; exactly one of them computes it::

    for r in range(rounds):
        trainer.fit(my_data)
        trainer.load(gather(store, trainer.export(), run="fed", round=r,
                            clients=3, mine=k, size=len(my_data)))
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["fedavg", "gather"]

Export = dict[str, dict[str, torch.Tensor]]


def _check_sizes(sizes: Sequence[float] | None, n: int) -> list[float]:
    if sizes is None:
        return [1.0] * n
    sizes = list(sizes)
    if len(sizes) != n:
        raise ValueError(f"fedavg: {n} exports and {len(sizes)} sizes; give one size per export")
    for k, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0:
            raise ValueError(
                f"fedavg: sizes[{k}] is {s!r}; a size is how many samples a client saw, "
                "a number >= 0"
            )
    if not sum(sizes) > 0:
        raise ValueError("fedavg: every size is 0, so there is nothing to weigh by")
    return [float(s) for s in sizes]


def fedavg(exports: Iterable[Export], sizes: Sequence[float] | None = None) -> Export:
    """The average of what several training runs exported, weight for weight.

    `sizes` is how many samples each one saw, which is what FedAvg weighs by; left out, they
    weigh the same. Floating-point tensors are averaged in float64 and cast back; anything
    else (a `num_batches_tracked` is a count) is taken from the first export. Refused: no
    exports, exports that do not hold the same nodes, keys, shapes and dtypes, and sizes of
    the wrong length or negative.
    """
    exports = list(exports)
    if not exports:
        raise ValueError("fedavg: no exports to average")
    weights = _check_sizes(sizes, len(exports))
    total = sum(weights)
    first = exports[0]
    for k, other in enumerate(exports[1:], start=1):
        if set(other) != set(first):
            raise ValueError(
                f"fedavg: export {k} holds nodes {sorted(other)}, export 0 holds {sorted(first)}; "
                "average exports of the same graph"
            )
        for nid, state in first.items():
            theirs = other[nid]
            if set(theirs) != set(state):
                raise ValueError(
                    f"fedavg: node {nid!r} holds keys {sorted(theirs)} in export {k} and "
                    f"{sorted(state)} in export 0"
                )
            for key, t in state.items():
                u = theirs[key]
                if u.shape != t.shape or u.dtype != t.dtype:
                    raise ValueError(
                        f"fedavg: node {nid!r}, {key!r} is {u.dtype}{tuple(u.shape)} in export "
                        f"{k} and {t.dtype}{tuple(t.shape)} in export 0"
                    )
    out: Export = {}
    with torch.no_grad():
        for nid, state in first.items():
            out[nid] = {}
            for key, t in state.items():
                if t.is_floating_point() or t.is_complex():
                    wide = torch.complex128 if t.is_complex() else torch.float64
                    acc = torch.zeros(t.shape, dtype=wide, device=t.device)
                    for w, e in zip(weights, exports, strict=True):
                        acc += e[nid][key].to(device=t.device, dtype=wide) * (w / total)
                    out[nid][key] = acc.to(t.dtype)
                else:
                    out[nid][key] = t.detach().clone()
    return out


def _name(run: str, round: int, *rest: Any) -> str:
    return "/".join([run, "round", str(round), *map(str, rest)])


def gather(
    store: Any,
    what: Any,
    *,
    run: str,
    round: int,
    clients: int,
    mine: int,
    size: float | None = None,
    within: float = 600.0,
    asking: float = 1.0,
) -> Any:
    """Puts this client's round in, waits for everybody else's, and gives back the average.

    `run` names the training run, `round` which round, `clients` how many there are and
    `mine` which one this is (0 to clients - 1). What is put in is kept as
    `<run>/round/<r>/client/<k>`, with `size` (how much data this client saw) beside it so
    the average can weigh by it. Exactly one client averages (whoever wins `store.claim`);
    all of them return the same average. Raises `TimeoutError` after `within` seconds,
    naming the clients that never turned up; `asking` is how often to look, in seconds.
    """
    from somatize.store import store_of

    store = store_of(store)
    if not isinstance(run, str) or not run or "/" in run:
        raise ValueError(f"gather: run is a name without '/', not {run!r}")
    for name, value, low in (("round", round, 0), ("clients", clients, 1)):
        if type(value) is not int or value < low:
            raise ValueError(f"gather: {name} is an int >= {low}, not {value!r}")
    if type(mine) is not int or not 0 <= mine < clients:
        raise ValueError(f"gather: mine is which client this is, 0 to {clients - 1}, not {mine!r}")
    if size is not None and (isinstance(size, bool) or not size >= 0):
        raise ValueError(f"gather: size is how many samples this client saw, >= 0, not {size!r}")
    store.keep(_name(run, round, "client", mine), what, meta=[("size", size)])
    deadline = time.monotonic() + within
    average = _name(run, round, "average")
    while True:
        bound = [store.resolve(_name(run, round, "client", k)) for k in range(clients)]
        absent = [k for k, b in enumerate(bound) if b is None]
        if not absent:
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"gather: round {round} of run {run!r}: client(s) {absent} never turned up "
                f"within {within} s (of {clients}); start them, or gather with fewer clients"
            )
        time.sleep(min(asking, max(0.0, deadline - time.monotonic())))
    if store.claim(_name(run, round, "averager"), store.put(str(mine).encode())):
        exports = [store.recall(b.name) for b in bound]
        sizes = [dict(b.meta).get("size") for b in bound]
        result = fedavg(exports, None if any(s is None for s in sizes) else sizes)
        store.keep(average, result, meta=[("by", mine)])
        return result
    while True:
        if store.resolve(average) is not None:
            return store.recall(average)
        if time.monotonic() >= deadline:
            claimed = store.resolve(_name(run, round, "averager"))
            who = (store.get(claimed.digest) or b"?").decode() if claimed else "?"
            raise TimeoutError(
                f"gather: round {round} of run {run!r}: every client turned up, and the "
                f"average (claimed by client {who}) did not appear within {within} s"
            )
        time.sleep(min(asking, max(0.0, deadline - time.monotonic())))
