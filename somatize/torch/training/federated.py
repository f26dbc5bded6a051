"""Federated averaging: what several training runs exported, averaged, and a store to meet in.

Each client trains, exports (`Trainer.export`), puts its round into a shared store with
`gather`, and gets the same average back; exactly one of them computes it::

    for r in range(rounds):
        trainer.fit(loader)
        trainer.load(gather(store, trainer.export(), run="fed", round=r,
                            clients=3, mine=k, size=len(loader.dataset)))

`size` is how many samples the client trained on (`len(loader)` would count batches).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from somatize.codecs import encode
from somatize.node import unwrap
from somatize.run import warn
from somatize.store import CorruptBinding, store_of
from somatize.torch.training._weights import difference, manifest

__all__ = ["fedavg", "gather"]

Export = dict[str, dict[str, torch.Tensor]]


def _not_an_export(value: Any, like: Export | None = None) -> str | None:
    """Why `value` is not an export (`{node id: {key: tensor}}` of finite numbers), or not one
    holding the nodes, keys, shapes and dtypes `like` holds; None when it is."""
    try:
        held = manifest(value)
    except TypeError as error:
        return str(error)
    for nid, state in value.items():
        for key, t in state.items():
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                return f"node {nid!r}, {key!r} holds {bad} NaN or infinite number(s)"
    return None if like is None else difference(held, manifest(like))


def _bad_size(s: Any) -> bool:
    """Whether `s` is not a sample count: a finite real number >= 0 (numpy's too), not a bool."""
    return isinstance(s, bool) or not isinstance(s, numbers.Real) or not s >= 0 or s == math.inf


def _check_sizes(sizes: Sequence[float] | None, n: int) -> list[float]:
    if sizes is None:
        return [1.0] * n
    sizes = list(sizes)
    if len(sizes) != n:
        raise ValueError(f"fedavg: {n} exports and {len(sizes)} sizes; give one size per export")
    for k, s in enumerate(sizes):
        if _bad_size(s):
            raise ValueError(
                f"fedavg: sizes[{k}] is {s!r}; a size is how many samples a client saw, "
                "a finite number >= 0"
            )
    if not sum(sizes) > 0:
        raise ValueError("fedavg: every size is 0, so there is nothing to weigh by")
    return [float(s) for s in sizes]


def fedavg(exports: Iterable[Export], sizes: Sequence[float] | None = None) -> Export:
    """The average of what several training runs exported, weight for weight.

    `sizes` is how many samples each one saw, which is what FedAvg weighs by; left out, they
    weigh the same. Floating-point tensors are averaged in float64 and cast back; anything
    else (a `num_batches_tracked` is a count) is taken from the first export. Refused, with a
    `ValueError` naming the export, the node and the key: no exports, anything that is not an
    export, an export holding NaN or infinite numbers (averaging them would spread them into
    every client's weights silently), exports that do not hold the same nodes, keys, shapes
    and dtypes, and sizes of the wrong length, negative or not finite.
    """
    exports = [unwrap(e) for e in exports]
    if not exports:
        raise ValueError("fedavg: no exports to average")
    weights = _check_sizes(sizes, len(exports))
    total = sum(weights)
    first = exports[0]
    for k, other in enumerate(exports):
        why = _not_an_export(other, first if k else None)
        if why:
            raise ValueError(f"fedavg: export {k} cannot be averaged with export 0: {why}")
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


def _put_in(store: Any, name: str, what: Export, size: float | None) -> None:
    """Keep a client's round under `name`, once: the same round put in again (a client that
    retries) is the same record; another one is refused, since the record is what explains
    the average, which may already be taken."""
    digest = store.put(encode(what, where=f"the round kept as {name!r}"))
    if store.claim(name, digest, [("size", size)]):
        return
    held = store.resolve(name)
    if held is None or held.digest != digest or held.get("size") != size:
        raise ValueError(
            f"gather: {name!r} already holds another round from this client: a client puts in "
            "each round once (is `mine` the same for two clients? a restarted client goes on "
            "from the next round, or gathers under another run)"
        )


def _turned_up(store: Any, name: str) -> bool:
    """Whether a client's record is there, readable or not (a damaged one has turned up)."""
    try:
        return store.resolve(name) is not None
    except CorruptBinding:
        return True


def _read(store: Any, name: str, mine: Export) -> tuple[Export | None, Any, str | None]:
    """A client's export and size from the store, or why it cannot be averaged with `mine`."""
    try:
        bound = store.resolve(name)
        value = store.recall(name)
    except (ValueError, TypeError, LookupError) as error:  # damaged, hostile, or unknown kind
        return None, None, f"its record cannot be read: {error}"
    why = _not_an_export(value, mine)
    size = bound.get("size") if bound is not None else None
    if why is None and size is not None and _bad_size(size):
        why = f"its size is {size!r}, not a finite number >= 0"
    return (None, None, why) if why else (value, size, None)


def _warn(run: str, round: int, meta: Any) -> None:
    """Tell a client what the average of a round (`meta`: what is kept beside it) left out
    and why, and that it weighed every client the same, some having given no size."""
    left_out, unsized = meta.get("left_out"), meta.get("unsized")
    if left_out:
        entries = left_out if isinstance(left_out, list) else [left_out]
        who = "; ".join(
            f"client {e[0]}: {e[1]}" if isinstance(e, list) and len(e) == 2 else repr(e)
            for e in entries
        )
        warn(
            f"gather: round {round} of run {run!r} was averaged without {len(left_out)} "
            f"client(s) whose record could not be used ({who}); fix or restart them",
            RuntimeWarning,
        )
    if unsized and len(unsized) < len(meta.get("averaged") or ()):
        warn(
            f"gather: round {round} of run {run!r} was averaged with every client weighing the "
            f"same, since client(s) {unsized} gave no size and the others did; give every "
            "client's size= (how many samples it saw), or none",
            RuntimeWarning,
        )


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

    `run` names the training run, `round` the round, `clients` how many there are and `mine`
    which one this is (0 to clients - 1). What is put in is kept as
    `<run>/round/<r>/client/<k>`, with `size` (how much data this client saw) beside it to
    weigh the average by. Exactly one client averages (whoever wins `store.claim`); all of them
    return the same average. Raises `TimeoutError` after `within` seconds, naming the clients
    that never turned up; `asking` is how often to look, in seconds. A client puts in each
    round once: the same export and size again (a retry) is the same round, anything else a
    `ValueError`, as the record is what the average was taken over.

    `what` that is not an export of finite numbers is a `ValueError` here, in the client that
    made the mistake. A record that turns up unusable all the same (damaged, not an export, not
    the averager's nodes, keys, shapes and dtypes, NaN or inf, a bad size) is left out rather
    than failing the round, since anyone able to write to the store can damage one: every
    client gets the same average and a `RuntimeWarning` naming who was left out and why, and
    the average's meta says so (`averaged`, `left_out`). An average that is itself unusable is
    a `ValueError` at once, naming it. Clients of which some gave `size` and some did not are
    averaged weighing the same, with a `RuntimeWarning` on every client naming those without
    (`unsized` in the meta).
    """
    store = store_of(store)
    if not isinstance(run, str) or not run or "/" in run:
        raise ValueError(f"gather: run is a name without '/', not {run!r}")
    for name, value, low in (("round", round, 0), ("clients", clients, 1)):
        if type(value) is not int or value < low:
            raise ValueError(f"gather: {name} is an int >= {low}, not {value!r}")
    if type(mine) is not int or not 0 <= mine < clients:
        raise ValueError(f"gather: mine is which client this is, 0 to {clients - 1}, not {mine!r}")
    if size is not None and _bad_size(size):
        raise ValueError(f"gather: size is how many samples this client saw, >= 0, not {size!r}")
    if size is not None:  # kept beside the export as a plain Python number
        size = int(size) if isinstance(size, numbers.Integral) else float(size)
    what = unwrap(what)
    why = _not_an_export(what)
    if why:
        raise ValueError(f"gather: client {mine} of run {run!r} cannot put in its round: {why}")
    _put_in(store, _name(run, round, "client", mine), what, size)
    deadline = time.monotonic() + within
    names = [_name(run, round, "client", k) for k in range(clients)]
    while absent := [k for k, name in enumerate(names) if not _turned_up(store, name)]:
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"gather: round {round} of run {run!r}: client(s) {absent} never turned up "
                f"within {within} s (of {clients}); start them, or gather with fewer clients"
            )
        time.sleep(min(asking, max(0.0, deadline - time.monotonic())))
    average = _name(run, round, "average")
    if store.claim(_name(run, round, "averager"), store.put(str(mine).encode())):
        read = [
            (what, size, None) if k == mine else _read(store, name, what)
            for k, name in enumerate(names)
        ]
        left_out = [[k, why] for k, (_, _, why) in enumerate(read) if why]
        averaged = [k for k, (_, _, why) in enumerate(read) if not why]
        sizes = [read[k][1] for k in averaged]
        unsized = [k for k in averaged if read[k][1] is None]
        result = fedavg([read[k][0] for k in averaged], None if unsized else sizes)
        meta = {"by": mine, "averaged": averaged, "left_out": left_out, "unsized": unsized}
        store.keep(average, result, meta=list(meta.items()))
        _warn(run, round, meta)
        return result
    while store.resolve(average) is None:
        if time.monotonic() >= deadline:
            claimed = store.resolve(_name(run, round, "averager"))
            who = (store.get(claimed.digest) or b"?").decode(errors="replace") if claimed else "?"
            raise TimeoutError(
                f"gather: round {round} of run {run!r}: every client turned up, and the "
                f"average (claimed by client {who[:20]}) did not appear within {within} s"
            )
        time.sleep(min(asking, max(0.0, deadline - time.monotonic())))
    result, _, why = _read(store, average, what)
    if why:
        raise ValueError(
            f"gather: the average of round {round} of run {run!r} ({average!r}) cannot be "
            f"loaded: {why}; it was damaged or written by someone else"
        )
    _warn(run, round, store.resolve(average))
    return result
