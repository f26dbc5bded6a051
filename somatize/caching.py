"""Running a plan against a store: `.cached()` nodes are looked up before they compute.

A node's key is its declaration (class, constructor arguments, salt, the digest of its state
when frozen), the train/eval mode of each module it holds and the keys of its inputs; the
graph's input is keyed by the digest of its bytes. A node that is not cached but feeds a cached
one still passes a key on; a node that feeds none is run as an uncached forward runs it, unkeyed.
A `.mapped().cached()` node is keyed item by item and handed only the items that are missing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from somatize import _hooks
from somatize._keys import Unkeyable, code_version, declaration_key, mix, refusal
from somatize.codecs import Malformed, decode, digest, encode
from somatize.node import unwrap
from somatize.run import ONE, ROOT, Plan, _noted, in_one_line, not_a_list, run_plan, tell, warn
from somatize.store import CorruptBinding, CorruptBlob

__all__ = ["walk_cached", "state_changed"]

_Declared = tuple[str, str, Callable[[], list[bool]] | None, Callable | None]
# per plan: the `_changes` its declarations (by node) and keyed steps were worked out at
_declared: weakref.WeakKeyDictionary[Plan, tuple] = weakref.WeakKeyDictionary()
_changes = 0  # how many times a node's state was changed through the library


def state_changed(*_: Any) -> None:
    """Say that a node's state changed (`Trainer.load`, `freeze`, a module's `load_state_dict`,
    whose post hook this is): every plan's keys are worked out again at its next cached walk.
    (`g.invalidate()` is what to call after changing weights in place by hand.)"""
    global _changes
    _changes += 1


_watched: weakref.WeakSet[Any] = weakref.WeakSet()  # modules whose loads say state_changed


def _watch(node: Any) -> None:
    """Hang `state_changed` as a load_state_dict post hook on each module the node holds, once."""
    for module in _hooks.state_modules(node):
        if module not in _watched:
            try:
                module.register_load_state_dict_post_hook(state_changed)
            except RuntimeError:  # a TorchScript module takes no hooks: g.invalidate() for it
                pass
            _watched.add(module)


def _declared_as(g: Any, nid: str, unsalted: str | None) -> _Declared:
    """Node `nid`'s `(declaration key, code version, modes, look)`; `modes` reads the train/eval
    mode of each module the node holds (None for a node holding none), which goes in the key at
    every forward; `look` (`_one`, `_mapped`, None if not cached) looks its value up. An argument
    no key reads is refused as the graph refuses it when built, for node `unsalted` (no salt
    stands for it), if any."""
    s = g.setting(nid)
    node = g.implementation(nid)
    state = _hooks.state_digest(node) if s.frozen else None
    _watch(node)  # its modules' state is in a key: its digest, or keyed as arguments
    if state is not None and _hooks.trainable(node):
        warn(
            f"node {nid!r} is declared .frozen() and is not settled: its "
            "parameters still ask for gradients, its modules may be in train mode "
            "(dropout, batch-norm statistics), and what is cached is what it "
            "computes so; call somatize.torch.freeze(g) first (eval mode, no "
            "gradients)"
        )
    look = (_mapped if s.mapped else _one) if s.cached else None
    try:
        mine = declaration_key(node, s.salt, state, salted=unsalted is None)
    except Unkeyable as why:  # changed since the graph was built
        raise refusal(unsalted or nid, nid, why) from None
    return mine, code_version(node), _hooks.modes(node), look


def _keyed(plan: Plan) -> dict[int, str | None]:
    """The steps a cached node's key reads (the cached nodes and every node that feeds one),
    each with the first cached node at or below it that has no salt (None if none)."""
    keyed: dict[int, str | None] = {}
    for i, mode, src, _, ctx, _ in reversed(plan.steps):  # each after what feeds it
        s = plan.graph.setting(ctx.id)
        if s.cached:
            keyed[i] = ctx.id if s.salt is None else keyed.get(i)
        if i in keyed and mode != ROOT:
            for j in [src] if mode == ONE else [j for _, j in src]:
                keyed[j] = keyed.get(j) or keyed[i]
    return keyed


def walk_cached(plan: Plan, input: Any, store: Any, told: list[Callable[[dict], Any]]) -> Any:
    """Run `plan` on `input`, looking `.cached()` nodes up in `store` and keeping what they make.
    Keys come from the declarations (worked out once per plan, and again after
    `state_changed`), the modules' train/eval modes now and the input's digest alone, so one
    pass works them out; what fails in it is noted with its node, as a failing run is."""
    said: dict[str, str] = {}  # node id: "hit", "miss" or "partial", as its step found it

    def relay(fact: dict) -> None:
        if fact.get("node") in said:
            fact["cache"] = said[fact["node"]]
        tell(told, fact)

    g = plan.graph
    changes = _changes
    seen, decl, keyed = _declared.get(plan, (-1, {}, {}))
    fresh = seen != changes
    if fresh:
        decl, keyed = {}, _keyed(plan)
    keys: list[str] = [""] * len(plan.steps)
    steps = []
    input_key: str | None = None
    i, device = 0, None
    try:
        for step in plan.steps:
            i, mode, src, fn, ctx, device = step
            if i not in keyed:  # no cached node's key reads it: it runs as uncached
                steps.append(step)
                continue
            if fresh:
                decl[ctx.id] = _declared_as(g, ctx.id, keyed[i])
            if mode == ONE:
                in_key = keys[src]
            elif mode == ROOT:
                if input_key is None:
                    input_key = digest(encode(input, where="the graph's input"))
                in_key = input_key
            else:
                in_key = mix(*(f"{p}={keys[j]}" for p, j in src))
            mine, code, modes, look = decl[ctx.id]
            if modes is not None:  # train and eval compute different things (dropout, norms)
                mine = mix(mine, "".join("t" if m else "e" for m in modes()))
            keys[i] = key = mix(mine, in_key)
            if look is not None:
                fn = partial(look, ctx.id, fn, mine if look is _mapped else key, code, store, said)
            steps.append((i, mode, src, fn, ctx, device))
    except BaseException as e:
        _noted(e, plan, i, device)
        raise
    if fresh:
        _declared[plan] = (changes, decl, keyed)
    return run_plan(plan, input, [relay] if told else [], tuple(steps))


def _name(key: str) -> str:
    return f"cache/{key[:2]}/{key}"


def _recall(nid: str, name: str, code: str, store: Any) -> tuple[bool, Any]:
    """`(True, value)` kept under `name`, or `(False, None)` when nothing is, or (warned) what
    is cannot be read back: it is then computed and kept again, repairing the store."""
    try:
        bound = store.resolve(name)
        if bound is None:
            return False, None
        data = store.get(bound.digest)
        if data is None:
            raise LookupError(f"it points at {bound.digest}, which the store no longer holds")
        value = decode(data)
    except (LookupError, CorruptBlob, CorruptBinding, Malformed) as error:
        warn(
            f"node {nid!r}: its cached value {name} cannot be read back ({in_one_line(error)}); "
            "it is computed again and kept anew",
            RuntimeWarning,
        )
        return False, None
    kept = bound.get("code")
    if kept is not None and kept != code:
        warn(
            f"node {nid!r}: the cached value was kept by another version of its code "
            f"({kept} != {code}); pass .cached(salt=...) with a new salt to recompute"
        )
    return True, value


def _keep(nid: str, kept: list[tuple[str, Any]], code: str, store: Any) -> None:
    """Keep each `(name, value)`, all written down first: one that no codec writes keeps none."""
    data = [encode(value, where=f"node {nid!r}") for _, value in kept]
    for (name, _), one in zip(kept, data, strict=True):
        store.bind(name, store.put(one), meta=[("node", nid), ("code", code)])


def _one(
    nid: str, fn: Callable, key: str, code: str, store: Any, said: dict, x: Any, ctx: Any
) -> Any:
    name = _name(key)
    hit, value = _recall(nid, name, code, store)
    said[nid] = "hit" if hit else "miss"
    if hit:
        return value
    out = unwrap(fn(x, ctx))  # kept, and handed on, as Store.keep keeps it: what it wraps
    _keep(nid, [(name, out)], code, store)
    return out


def _mapped(
    nid: str, fn: Callable, mine: str, code: str, store: Any, said: dict, x: Any, ctx: Any
) -> list:
    if not isinstance(x, list):
        raise not_a_list(nid, x)
    names = [
        _name(mix(mine, digest(encode(item, where=f"an item for node {nid!r}")))) for item in x
    ]
    recalled = [_recall(nid, name, code, store) for name in names]
    out = [value for _, value in recalled]
    missing = [k for k, (hit, _) in enumerate(recalled) if not hit]
    if missing:
        made = unwrap(fn([x[k] for k in missing], ctx))  # the plan's step checks lengths
        for k, value in zip(missing, made, strict=True):
            out[k] = value
        _keep(nid, [(names[k], out[k]) for k in missing], code, store)
    said[nid] = "hit" if not missing else ("miss" if len(missing) == len(x) else "partial")
    return out
