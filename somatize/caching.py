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
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from somatize import _hooks
from somatize.codecs import decode, digest, encode
from somatize.node import Opaque
from somatize.run import ONE, ROOT, Plan, _noted, _result, finished, not_a_list, tell

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
    g = plan.graph
    decl = declarations(plan)
    n = len(plan.steps)
    vals: list[Any] = [None] * n
    keys: list[str] = [""] * n
    input_key: str | None = None
    clock = time.perf_counter_ns
    start = clock()
    i, device = 0, None
    try:
        for i, mode, src, fn, ctx, device in plan.steps:
            began = clock()
            nid = ctx.id
            if mode == ONE:
                x, in_key = vals[src], keys[src]
            elif mode == ROOT:
                if input_key is None:
                    input_key = digest(encode(input, where="the graph's input"))
                x, in_key = input, input_key
            else:
                x = {p: vals[j] for p, j in src}
                in_key = _mix(*(f"{p}={keys[j]}" for p, j in src))
            if device is not None:
                x = _hooks.move(x, device)
            mine, code = decl[nid]
            keys[i] = key = _mix(mine, in_key)
            s = g.setting(nid)
            said = None
            if not s.cached:
                out = fn(x, ctx)
            elif s.mapped:
                out, said = _mapped(nid, fn, x, ctx, mine, code, store)
            else:
                out, said = _one(nid, fn, x, ctx, key, code, store)
            vals[i] = out.value if type(out) is Opaque else out
            if told:
                fact = {
                    "fact": "ran",
                    "node": nid,
                    "began_us": (began - start) / 1e3,
                    "took_us": (clock() - began) / 1e3,
                }
                if said is not None:
                    fact["cache"] = said
                tell(told, fact)
    except BaseException as e:
        _noted(e, plan, i, device)
        raise
    if told:
        tell(told, finished(start))
    return _result(plan, vals)


def _name(key: str) -> str:
    return f"cache/{key[:2]}/{key}"


def _recall(nid: str, name: str, code: str, store: Any) -> tuple[bool, Any]:
    bound = store.resolve(name)
    if bound is None:
        return False, None
    kept = bound.get("code")
    if kept is not None and kept != code:  # stacklevel 3: walk_cached's caller
        warnings.warn(
            f"node {nid!r}: the cached value was kept by another version of its code "
            f"({kept} != {code}); pass .cached(salt=...) with a new salt to recompute",
            stacklevel=3,
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


def _one(nid: str, fn: Callable, x: Any, ctx: Any, key: str, code: str, store: Any) -> Any:
    name = _name(key)
    hit, value = _recall(nid, name, code, store)
    if hit:
        return value, "hit"
    out = fn(x, ctx)
    if type(out) is Opaque:
        out = out.value
    _keep(nid, name, out, code, store)
    return out, "miss"


def _mapped(
    nid: str, fn: Callable, x: Any, ctx: Any, mine: str, code: str, store: Any
) -> tuple[list, str]:
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
    said = "hit" if not missing else ("miss" if len(missing) == len(x) else "partial")
    return out, said


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
    return hashlib.sha256(json.dumps(said, sort_keys=True).encode()).hexdigest()


def code_version(node: Any) -> str:
    """A digest of the source of the node's class: noted beside a kept value."""
    cls = type(node)
    try:
        text = inspect.getsource(cls)
    except (OSError, TypeError):
        text = f"{cls.__module__}.{cls.__qualname__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
