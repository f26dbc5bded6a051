"""Running a plan against a store: `.cached()` nodes are looked up before they compute.

A node's key is its declaration (class, constructor arguments, salt, the digest of its state
when frozen) and the keys of its inputs; the graph's input is keyed by the digest of its bytes.
A node that is not cached still passes a key on, so a cached node after it keeps working. A
`.mapped().cached()` node is keyed item by item and handed only the items that are missing.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from somatize import _hooks
from somatize.codecs import decode, digest, encode
from somatize.node import Opaque
from somatize.run import ONE, ROOT, Plan, _noted, not_a_list, run_plan, tell, warn

__all__ = ["walk_cached", "declarations", "declaration_key", "code_version"]

_declared: weakref.WeakKeyDictionary[Plan, dict[str, tuple[str, str]]] = weakref.WeakKeyDictionary()


def declarations(plan: Plan) -> dict[str, tuple[str, str]]:
    """`{id: (declaration key, code version)}`, worked out once per plan."""
    known = _declared.get(plan)
    if known is None:
        g = plan.graph
        known = {}
        for nid in plan.ids:
            s = g.setting(nid)
            node = g.implementation(nid)
            state = _hooks.state_digest(node) if s.frozen else None
            known[nid] = (declaration_key(node, s.salt, state), code_version(node))
        _declared[plan] = known
    return known


def _mix(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def walk_cached(plan: Plan, input: Any, store: Any, told: list[Callable[[dict], Any]]) -> Any:
    """Run `plan` on `input`, looking `.cached()` nodes up in `store` and keeping what they make."""
    said: dict[str, str] = {}  # node id: "hit", "miss" or "partial", as its step found it

    def relay(fact: dict) -> None:
        if fact.get("node") in said:
            fact["cache"] = said[fact["node"]]
        tell(told, fact)

    steps = _cached_steps(plan, input, store, said)
    return run_plan(plan, input, [relay] if told else [], steps)


def _cached_steps(plan: Plan, input: Any, store: Any, said: dict[str, str]) -> tuple:
    """`plan.steps`, each `.cached()` node's call looking it up in `store` first. Keys come
    from the declarations and the input's digest alone, so one pass works them all out."""
    g = plan.graph
    decl = declarations(plan)
    keys: list[str] = [""] * len(plan.steps)
    steps = []
    input_key: str | None = None
    i, device = 0, None
    try:
        for i, mode, src, fn, ctx, device in plan.steps:
            if mode == ONE:
                in_key = keys[src]
            elif mode == ROOT:
                if input_key is None:
                    input_key = digest(encode(input, where="the graph's input"))
                in_key = input_key
            else:
                in_key = _mix(*(f"{p}={keys[j]}" for p, j in src))
            mine, code = decl[ctx.id]
            keys[i] = key = _mix(mine, in_key)
            s = g.setting(ctx.id)
            if s.cached:
                look = _mapped if s.mapped else _one
                fn = partial(look, ctx.id, fn, mine if s.mapped else key, code, store, said)
            steps.append((i, mode, src, fn, ctx, device))
    except BaseException as e:
        _noted(e, plan, i, device)
        raise
    return tuple(steps)


def _name(key: str) -> str:
    return f"cache/{key[:2]}/{key}"


def _recall(nid: str, name: str, code: str, store: Any) -> tuple[bool, Any]:
    bound = store.resolve(name)
    if bound is None:
        return False, None
    kept = bound.get("code")
    if kept is not None and kept != code:
        warn(
            f"node {nid!r}: the cached value was kept by another version of its code "
            f"({kept} != {code}); pass .cached(salt=...) with a new salt to recompute"
        )
    data = store.get(bound.digest)
    if data is None:
        raise LookupError(
            f"node {nid!r}: its cached value {name} points at {bound.digest}, which the store "
            "no longer holds: give the node a new salt, .cached(salt=...), to compute it again"
        )
    return True, decode(data)


def _keep(nid: str, name: str, value: Any, code: str, store: Any) -> None:
    data = encode(value, where=f"node {nid!r}")
    store.bind(name, store.put(data), meta=[("node", nid), ("code", code)])


def _one(
    nid: str, fn: Callable, key: str, code: str, store: Any, said: dict, x: Any, ctx: Any
) -> Any:
    name = _name(key)
    hit, value = _recall(nid, name, code, store)
    said[nid] = "hit" if hit else "miss"
    if hit:
        return value
    out = fn(x, ctx)
    if type(out) is Opaque:
        out = out.value
    _keep(nid, name, out, code, store)
    return out


def _mapped(
    nid: str, fn: Callable, mine: str, code: str, store: Any, said: dict, x: Any, ctx: Any
) -> list:
    if not isinstance(x, list):
        raise not_a_list(nid, x)
    names = [
        _name(_mix(mine, digest(encode(item, where=f"an item for node {nid!r}")))) for item in x
    ]
    recalled = [_recall(nid, name, code, store) for name in names]
    out = [value for _, value in recalled]
    missing = [k for k, (hit, _) in enumerate(recalled) if not hit]
    if missing:
        made = fn([x[k] for k in missing], ctx)  # the plan's step: lengths checked there
        for k, value in zip(missing, made, strict=True):
            out[k] = value
            _keep(nid, names[k], value, code, store)
    said[nid] = "hit" if not missing else ("miss" if len(missing) == len(x) else "partial")
    return out


# -- keys -----------------------------------------------------------------------------------


def _canonical(value: Any) -> Any:
    """A JSON-able stand-in for a constructor argument, stable across runs (no addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_canonical(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", sorted((str(k), _canonical(v)) for k, v in value.items())]
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return ["callable", getattr(value, "__module__", ""), value.__qualname__]
    try:
        return ["value", digest(encode(value))]
    except Exception:
        return ["repr", type(value).__qualname__, re.sub(r"0x[0-9a-fA-F]+", "0x", repr(value))]


def declaration_key(node: Any, salt: Any, state: str | None) -> str:
    """What a node *is*, for a cache: its class, its constructor arguments, salt, frozen state."""
    cls = type(node)
    said = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "args": _canonical(getattr(node, "_somatize_args", {})),
        "salt": _canonical(salt),
        "state": state,
    }
    return _mix(json.dumps(said, sort_keys=True))


def code_version(node: Any) -> str:
    """A digest of the source of the node's class: noted beside a kept value."""
    cls = type(node)
    try:
        text = inspect.getsource(cls)
    except (OSError, TypeError):
        text = f"{cls.__module__}.{cls.__qualname__}"
    return _mix(text)[:16]
