"""Repeated blocks folded to one `×N`, and too many layers closed back into their blocks.

Both work on the raw layers of a tracer (`somatize.torch.inside._trace.Traced`), filling in
their `times`, `repeats` and `made_of`, and keep their order.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from typing import Any

from somatize.torch.inside._trace import INPUT, OUTPUT, Raw, Traced, call_path

__all__ = ["fold", "collapse"]


def _children(layers: dict[str, Raw]) -> dict[str | None, list[str]]:
    kids: dict[str | None, list[str]] = {}
    for path, f in layers.items():
        kids.setdefault(f.block, []).append(path)
    return kids


def _descendants(path: str, kids: dict[str | None, list[str]]) -> list[str]:
    return [d for c in kids.get(path, []) for d in (c, *_descendants(c, kids))]


def _signature(path: str, layers: dict[str, Raw], kids: dict, edges: set, memo: dict) -> Any:
    if path in memo:
        return memo[path]
    r = layers[path]
    within = set(_descendants(path, kids))
    n = len(path)  # the paths inside, relative to this one
    parts = tuple((c[n:], _signature(c, layers, kids, edges, memo)) for c in kids.get(path, []))
    inner = tuple(sorted((a[n:], b[n:]) for a, b in edges if a in within and b in within))
    sig = (r.kind, r.label, tuple(r.shape) if r.shape else None, r.params, parts, inner)
    memo[path] = sig
    return sig


def _twin(path: str, layers: dict[str, Raw], kids: dict, edges: set, memo: dict) -> Any:
    """What a sibling is folded with its twins by: a block's signature, a layer's own path."""
    if layers[path].composite or kids.get(path):
        return _signature(path, layers, kids, edges, memo)
    return path


def _alike(run: list[str], layers: dict[str, Raw], kids: dict) -> list[list[str]]:
    """`run`, twins but for their settings (their layers' and theirs, `Raw.config`), cut where
    one changes. A whole number one more in each copy than in the one before (`layer_idx`)
    says which copy it is, and is no setting: two copies told windows of 4 and 5 tokens are
    taken for copies 4 and 5."""
    found = [
        {
            (q[len(p) :], k): v
            for q in [p, *_descendants(p, kids)]
            for k, v in layers[q].config.items()
        }
        for p in run
    ]

    def counts(key: tuple[str, str]) -> bool:  # which copy it is
        v = [f.get(key) for f in found]
        return all(type(x) is int for x in v) and all(b - a == 1 for a, b in itertools.pairwise(v))

    settings = [k for k in sorted({k for f in found for k in f}) if not counts(k)]
    by = [tuple((k in f, f.get(k)) for k in settings) for f in found]
    for i in range(1, len(run)):
        if by[i] != by[i - 1]:  # twins kept apart: each says by what
            for k, j in ((i - 1, i), (i, i - 1)):
                why = f"not folded with {run[j]}: {_apart(found[k], found[j], settings)}"
                layers[run[k]].apart = [*layers[run[k]].apart, why]
    return [[run[i] for i in g] for _, g in itertools.groupby(range(len(run)), by.__getitem__)]


def _apart(this: dict, that: dict, settings: list[tuple[str, str]]) -> str:
    """The settings two copies differ in, this one's value first: `self_attn.sliding_window
    None ≠ 4` (a setting one of them has not: `unset`)."""

    def said(found: dict, key: tuple[str, str]) -> str:
        return repr(found[key]) if key in found else "unset"

    differ = [k for k in settings if (k in this, this.get(k)) != (k in that, that.get(k))]
    return ", ".join(
        [
            f"{q[1:] + '.' if q else ''}{k} {said(this, (q, k))} ≠ {said(that, (q, k))}"
            for q, k in differ
        ]
    )


def fold(traced: Traced) -> tuple[dict[str, Raw], list[tuple[str, str]]]:
    """Adjacent sibling blocks that are the same block (kinds, labels, settings, shapes,
    parameters and inner edges alike) become the first of them, `times` N and the others in
    `repeats`; a layer inside keeps the paths of its twins in `repeats`.

    `times` is said at each level once: a block ×2 inside a stage ×3 is ×2, and the stage
    ×3; what a layer stands for in all is the product along its blocks. Edges between copies
    disappear; edges from outside into a later copy, or out of one, are drawn to the first
    copy instead.
    """
    # fresh copies: folding writes times, repeats and made_of, and `traced` stays as it was
    layers = {
        p: replace(r, repeats=list(r.repeats), made_of=list(r.made_of))
        for p, r in traced.layers.items()
    }
    edges = list(traced.edges)
    queue: list[str | None] = [None]
    while queue:
        parent = queue.pop(0)
        kids = _children(layers)
        twin = functools.partial(_twin, layers=layers, kids=kids, edges=set(edges), memo={})
        for _, twins in itertools.groupby(kids.get(parent, []), twin):
            twins = list(twins)
            for run in _alike(twins, layers, kids) if len(twins) >= 2 else []:
                if len(run) >= 2:
                    edges = _fold_run(layers, kids, edges, run)
        kids = _children(layers)
        queue.extend(c for c in kids.get(parent, []) if kids.get(c))
    for path, f in layers.items():
        if f.block is not None:
            layers[f.block].made_of.append(path)
    return layers, edges


def _fold_run(
    layers: dict[str, Raw], kids: dict, edges: list[tuple[str, str]], run: list[str]
) -> list[tuple[str, str]]:
    keep = run[0]
    copy_of = {p: (0, p) for p in [keep, *_descendants(keep, kids)]}
    for k, other in enumerate(run[1:], start=1):
        for p in [other, *_descendants(other, kids)]:
            twin = keep + p[len(other) :]
            copy_of[p] = (k, twin)
            layers[twin].repeats += [p, *layers.pop(p).repeats]
    layers[keep].times = len(run)
    out: dict[tuple[str, str], None] = {}
    for a, b in edges:
        ka, a2 = copy_of.get(a, (None, a))
        kb, b2 = copy_of.get(b, (None, b))
        if ka is not None and kb is not None and ka != kb:
            continue
        if a2 != b2:
            out[(a2, b2)] = None
    return list(out)


def collapse(
    layers: dict[str, Raw], edges: list[tuple[str, str]], most: int
) -> tuple[dict[str, Raw], list[tuple[str, str]], int]:
    """At most `most` layers: the deepest open blocks are closed first (their layers go, the
    block stays as one layer and takes their edges; a block called more than once becomes a
    box per call, `block`, `block#2`, ..., so nothing loops); what is still too many is cut off
    the end, and how many were is the third answer."""

    def level(path: str) -> int:
        n, b = 0, layers[path].block
        while b is not None:
            n, b = n + 1, layers[b].block
        return n

    while len(layers) > most:
        opened = [p for p, f in layers.items() if f.made_of]
        if not opened:
            break
        deepest = max(level(p) for p in opened)
        into: dict[str, str] = {}
        boxes: dict[str, Raw] = {}
        for p in opened:
            if level(p) == deepest:
                boxes.update(_calls_of(p, layers, into))
        kept: dict[str, Raw] = {}  # a block's first box where it stood, a later one where it ran
        for path, f in layers.items():
            if path in into:
                kept.setdefault(into[path], boxes[into[path]])
            else:
                kept[path] = boxes.get(path, f)
        layers = kept
        moved = ((into.get(a, a), into.get(b, b)) for a, b in edges)
        edges = list(dict.fromkeys((a, b) for a, b in moved if a != b))
    hidden = max(0, len(layers) - most)
    if hidden:
        layers = dict(list(layers.items())[:most])
        for f in layers.values():
            f.made_of = [c for c in f.made_of if c in layers]
        left = {*layers, INPUT}  # edges between them stay, and from them to OUTPUT (+ a node)
        edges = [(a, b) for a, b in edges if a in left and (b in left or b.startswith(OUTPUT))]
    return layers, edges, hidden


def _calls_of(block: str, layers: dict[str, Raw], into: dict[str, str]) -> dict[str, Raw]:
    """Close `block`: each layer inside goes into the box of the block's call it ran in
    (written into `into`); answers those boxes by path, the block itself the first."""
    f = layers[block]
    parent = layers[f.block] if f.block is not None else None
    boxes: dict[str, Raw] = {}
    for c in f.made_of:
        inner = layers[c]
        call = inner.within.get(block, 1)
        into[c] = box = call_path(block, call)
        if box not in boxes:
            around = {b: k for b, k in inner.within.items() if b != block}
            boxes[box] = replace(f, path=box, within=around, repeats=list(f.repeats), made_of=[])
            if parent is not None and box != block:
                parent.made_of.append(box)
        boxes[box].shape = f.gave.get(call) or inner.shape or boxes[box].shape  # (its last's)
    return boxes
