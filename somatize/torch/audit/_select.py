"""Which modules inside a node an `Audit(inside=...)` watches (never an `nn.Identity`, which
only passes its input on), and which it leaves out past `most`; and the channel groups
`Audit(groups=...)` keeps apart."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from torch import nn

from somatize.torch._modules import join, parts_of

Named = list[tuple[str, nn.Module]]


def _children(path: str, module: nn.Module, seen: set[int]) -> Named:
    out = []
    for name, child in parts_of(module):
        if isinstance(child, nn.Identity) or id(child) in seen:
            continue
        seen.add(id(child))
        out.append((join(path, name), child))
    return out


def _roots(held: Named, seen: set[int]) -> Named:
    """The coarsest level: the node's children when the node is a module, else the modules it
    holds as attributes."""
    out: Named = []
    for name, module in held:
        seen.add(id(module))
        if not name:
            out += _children("", module, seen)
        elif not isinstance(module, nn.Identity):
            out.append((name, module))
    return out


def _leaves(path: str, module: nn.Module, seen: set[int]) -> list[str]:
    """The layers under `module` (each module once, of those not in `seen`), by path."""
    out = []
    for p, part in _children(path, module, seen):
        out += _leaves(p, part, seen) if parts_of(part) else [p]
    return out


def _finest_cut(held: Named, most: int) -> tuple[Named, list[str]]:
    """The coarsest level, then each place opened into its children in order while the count
    stays within `most`, level by level: the whole net is covered before any part of it is
    watched more finely."""
    seen: set[int] = set()
    cut = _roots(held, seen)
    left: list[str] = []
    if len(cut) > most:
        for path, m in cut[most:]:
            left += [path] + _leaves(path, m, set())
        return cut[:most], left
    level = list(cut)
    while level:
        deeper: Named = []
        for path, module in level:
            kids = _children(path, module, seen)
            if kids and len(cut) - 1 + len(kids) > most:
                left += _leaves(path, module, set())
            elif kids:
                at = [p for p, _ in cut].index(path)
                cut[at : at + 1] = kids
                deeper += kids
        level = deeper
    return cut, left


def _down_to(held: Named, depth: int, most: int) -> tuple[Named, list[str]]:
    seen: set[int] = set()
    level = _roots(held, seen)
    found: Named = []  # level by level: the coarsest first
    for _ in range(depth):
        found += level
        level = [kid for path, m in level for kid in _children(path, m, seen)]
    order = {path: i for i, (path, _) in enumerate(preorder(held))}
    kept = sorted(found[:most], key=lambda pm: order.get(pm[0], len(order)))
    return kept, [path for path, _ in found[most:]]


def preorder(held: Named) -> Named:
    """Every module under what a node holds, by path, parents first."""
    return [(path, m) for name, top in held for path, m in top.named_modules(prefix=name) if path]


def choose(
    node: str, held: Named, inside: bool | int | list[str] | None, most: int
) -> tuple[Named, list[str]]:
    """The (path, module) places inside `node` for `inside` (True, a depth, or a list of
    `"node.path"` names), and the paths left out past `most`. Named places are all taken."""
    if inside is None or inside is False:
        return [], []
    if inside is True:
        return _finest_cut(held, most)
    if isinstance(inside, int):
        return _down_to(held, inside, most)
    named = set(inside)
    return [(p, m) for p, m in preorder(held) if f"{node}.{p}" in named], []


def partitions(
    groups: Mapping[str, Mapping[str, Iterable[int]]],
) -> dict[str, dict[str, list[int]]]:
    """`Audit(groups=...)` as lists of channel indices; refused unless each place names at
    least two groups and no channel is in two."""
    out: dict[str, dict[str, list[int]]] = {}
    for where, parts in groups.items():
        if not isinstance(parts, Mapping) or len(parts) < 2:
            raise ValueError(
                f"groups[{where!r}] names at least two channel groups, "
                f"e.g. {{'audio': range(0, 64), 'text': range(64, 128)}}"
            )
        out[where] = {k: [int(i) for i in v] for k, v in parts.items()}
        for (a, ca), (b, cb) in itertools.combinations(out[where].items(), 2):
            if shared := sorted(set(ca) & set(cb)):
                raise ValueError(
                    f"groups[{where!r}]: {a!r} and {b!r} share channels {shared[:8]}; the "
                    "groups are a partition, each channel in one group at most"
                )
    return out
