"""Repeated blocks folded to one `×N`, and too many layers closed back into their blocks.

Both work on the raw answer of a tracer (`somatize.torch._trace.Traced`) and keep its order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from somatize.torch.inside._trace import Raw, Traced, call_path

__all__ = ["fold", "collapse", "Folded"]


@dataclass
class Folded:
    """A raw layer with what folding added: how many it stands for and which paths it hides."""

    raw: Raw
    times: int = 1
    repeats: list[str] = field(default_factory=list)
    made_of: list[str] = field(default_factory=list)


def _children(layers: dict[str, Folded]) -> dict[str | None, list[str]]:
    kids: dict[str | None, list[str]] = {}
    for path, f in layers.items():
        kids.setdefault(f.raw.block, []).append(path)
    return kids


def _descendants(path: str, kids: dict[str | None, list[str]]) -> list[str]:
    out = []
    for c in kids.get(path, []):
        out.append(c)
        out.extend(_descendants(c, kids))
    return out


def _signature(path: str, layers: dict[str, Folded], kids: dict, edges: set, memo: dict) -> Any:
    if path in memo:
        return memo[path]
    r = layers[path].raw
    within = set(_descendants(path, kids))
    n = len(path)  # the paths inside, relative to this one
    parts = tuple((c[n:], _signature(c, layers, kids, edges, memo)) for c in kids.get(path, []))
    inner = tuple(sorted((a[n:], b[n:]) for a, b in edges if a in within and b in within))
    sig = (r.kind, r.label, r.config, tuple(r.shape) if r.shape else None, r.params, parts, inner)
    memo[path] = sig
    return sig


def fold(traced: Traced) -> tuple[dict[str, Folded], list[tuple[str, str]]]:
    """Adjacent sibling blocks that are the same block (kinds, labels, settings, shapes,
    parameters and inner edges alike) become the first of them, `times` N and the others in
    `repeats`; a layer inside keeps the paths of its twins in `repeats`.

    `times` is said at each level once: a block ×2 inside a stage ×3 is ×2, and the stage
    ×3; what a layer stands for in all is the product along its blocks. Edges between copies
    disappear; edges from outside into a later copy, or out of one, are drawn to the first
    copy instead.
    """
    layers = {p: Folded(r) for p, r in traced.layers.items()}
    edges = list(traced.edges)
    queue: list[str | None] = [None]
    while queue:
        parent = queue.pop(0)
        kids = _children(layers)
        sig = functools.partial(_signature, layers=layers, kids=kids, edges=set(edges), memo={})
        siblings = kids.get(parent, [])
        i = 0
        while i < len(siblings):
            first, j = siblings[i], i + 1
            if layers[first].raw.composite or kids.get(first):  # a block: fold its run of twins
                while j < len(siblings) and sig(siblings[j]) == sig(first):
                    j += 1
                if j - i >= 2:
                    edges = _fold_run(layers, kids, edges, siblings[i:j])
            i = j
        kids = _children(layers)
        queue.extend(c for c in kids.get(parent, []) if kids.get(c))
    for path, f in layers.items():
        if f.raw.block is not None:
            layers[f.raw.block].made_of.append(path)
    return layers, edges


def _fold_run(
    layers: dict[str, Folded], kids: dict, edges: list[tuple[str, str]], run: list[str]
) -> list[tuple[str, str]]:
    keep = run[0]
    copy_of = {p: (0, p) for p in [keep, *_descendants(keep, kids)]}
    for k, other in enumerate(run[1:], start=1):
        for p in [other, *_descendants(other, kids)]:
            twin = keep + p[len(other) :]
            copy_of[p] = (k, twin)
            f = layers.pop(p)
            layers[twin].repeats.append(p)
            layers[twin].repeats.extend(f.repeats)
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
    layers: dict[str, Folded], edges: list[tuple[str, str]], most: int
) -> tuple[dict[str, Folded], list[tuple[str, str]], int]:
    """At most `most` layers: the deepest open blocks are closed first (their layers go, the
    block stays as one layer and takes their edges; a block called more than once becomes a
    box per call, `block`, `block#2`, ..., so nothing loops); what is still too many is cut off
    the end, and how many were is the third answer."""

    def level(path: str) -> int:
        n, b = 0, layers[path].raw.block
        while b is not None:
            n, b = n + 1, layers[b].raw.block
        return n

    while len(layers) > most:
        opened = [p for p, f in layers.items() if f.made_of]
        if not opened:
            break
        deepest = max(level(p) for p in opened)
        into: dict[str, str] = {}
        boxes: dict[str, Folded] = {}
        for p in opened:
            if level(p) == deepest:
                boxes.update(_calls_of(p, layers, into))
        layers = _closed(layers, boxes, into)
        moved = ((into.get(a, a), into.get(b, b)) for a, b in edges)
        edges = list(dict.fromkeys((a, b) for a, b in moved if a != b))
    hidden = max(0, len(layers) - most)
    if hidden:
        kept = list(layers)[:most]
        layers = {p: layers[p] for p in kept}
        for f in layers.values():
            f.made_of = [c for c in f.made_of if c in layers]
        edges = [(a, b) for a, b in edges if a in layers and b in layers]
    return layers, edges, hidden


def _calls_of(block: str, layers: dict[str, Folded], into: dict[str, str]) -> dict[str, Folded]:
    """Close `block`: each layer inside goes into the box of the block's call it ran in
    (written into `into`); answers those boxes by path, the block itself the first."""
    f = layers[block]
    parent = layers[f.raw.block] if f.raw.block is not None else None
    boxes: dict[str, Folded] = {}
    for c in f.made_of:
        inner = layers[c].raw
        box = call_path(block, inner.within.get(block, 1))
        into[c] = box
        if box not in boxes:
            around = {b: k for b, k in inner.within.items() if b != block}
            boxes[box] = Folded(replace(f.raw, path=box, within=around), f.times, list(f.repeats))
            if parent is not None and box != block:
                parent.made_of.append(box)
        boxes[box].raw.shape = inner.shape or boxes[box].raw.shape  # its last layer's
    return boxes


def _closed(
    layers: dict[str, Folded], boxes: dict[str, Folded], into: dict[str, str]
) -> dict[str, Folded]:
    """`layers` with the closed blocks' layers gone (`into` says which box each went into):
    a block's first box stands where the block stood, each later one where its first layer
    ran."""
    out: dict[str, Folded] = {}
    for path, f in layers.items():
        if path in into:
            box = into[path]
            if box not in out:
                out[box] = boxes[box]
        else:
            out[path] = boxes.get(path, f)
    return out
