"""From a graph figure's data to boxes to lay out: what is drawn, how big, inside what.

A graph's nodes run left to right (branches that leave one node and meet at another grouped in
a frame); an open node holds its layers top to bottom, a block its own layers, a block folded
`×N` once with a stack behind it (expanded, once per copy), a plain container (`Sequential`)
as what it holds. Each box knows its tooltip and what a click on it changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from somatize._channels import channels_first, image_of
from somatize.figures._shapes import family, shape_text
from somatize.figures._svg import number, text_width

NODE_TOP = 42  # an open node's title and subtitle, above its layers
PILL_H = 18
_PLAIN = ("Sequential", "ModuleList", "ModuleDict")  # containers drawn as what they hold
INPUT = "<input>"  # what an open node was given, among its layers' edges
OUTPUT = "<output>"  # what it gives back, there
CALL = re.compile(r"#\d+(?=\.|$)")  # a module's later call: `enc.0#2`
HOLDS = 8  # the children a closed composite's tooltip names


@dataclass
class Box:
    """One thing drawn: a node, a group of branches, a block or a layer (`kind`); containers
    hold `children` laid out down (or right, for the graph's own nodes). `edges` are the
    edges of the world this box opens (the graph's, or one node's layers'), by box id."""

    id: str
    kind: str
    label: str = ""
    sub: str = ""
    w: float = 0.0
    h: float = 0.0
    children: list[Box] = field(default_factory=list)
    down: bool = True
    pad: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # top, right, bottom, left
    edges: list[tuple[str, str]] = field(default_factory=list)
    tip: list[tuple[str, str]] = field(default_factory=list)
    click: tuple[str, str] | None = None  # (trait, key) a click toggles
    where: str = ""  # the colour key: node or node.path
    copies: list[str] = field(default_factory=list)  # in a folded block: its copies' keys
    family: str = ""
    pills: list[tuple[str, str]] = field(default_factory=list)
    stack: bool = False  # a folded block: its copies drawn behind it
    entry: str = ""  # an open node: the box inside where an edge into the node arrives
    exit: dict[str, str] = field(default_factory=dict)  # and where one to each box leaves
    x: float = 0.0
    y: float = 0.0


def walk(box: Box) -> Iterator[Box]:
    """`box` and every box inside it, outermost first."""
    yield box
    for child in box.children:
        yield from walk(child)


def reach(succ: dict[str, list[str]], start: Iterable[str], avoid: Any = None) -> set[str]:
    """Every key `start` leads to along `succ` (`start` included), the edge `avoid` not
    taken."""
    seen, stack = set(), list(start)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(y for y in succ.get(x, ()) if (x, y) != avoid)
    return seen


def _enclosing(blocks: dict[str, dict], b: Any) -> Iterator[str]:
    """The block `b` and the blocks around it, innermost first."""
    while b in blocks:
        yield b
        b = blocks[b]["parent"]


def pill_width(text: str) -> float:
    """How wide a badge is drawn."""
    return text_width(text, 9.5, True) + 12


def _layer_box(key: str, label: str, sub: str = "", **more: Any) -> Box:
    """A layer's box (id `key`), as wide as its label and its output shape (`sub`) under it."""
    w = max(text_width(label, 12, True), text_width(sub, 11) if sub else 0) + 36
    return Box(key, "layer", label, sub, max(64.0, round(w)), 38.0 if sub else 26.0, **more)


def _blocks(layers: list[dict]) -> dict[str, dict]:
    """The blocks of an inside: {path: {label, times, repeats, parent, kind}}."""
    by_path = {layer["path"]: layer for layer in layers}
    paths = [layer["block"] for layer in layers if layer.get("block")]
    paths += [layer["path"] for layer in layers if layer.get("kind") == "block"]
    blocks: dict[str, dict] = {}
    for b in dict.fromkeys(paths):
        own = by_path.get(b, {})
        blocks[b] = {
            "label": str(own.get("label") or own.get("kind") or b.split(".")[-1]),
            "times": max(1, int(own.get("times") or 1)),
            "repeats": [r for r in own.get("repeats") or [] if r != b],
            "parent": own.get("block"),
            "kind": own.get("kind"),
        }
    for b, blk in blocks.items():  # a block that does not say its parent: the longest prefix
        if blk["parent"] not in blocks:
            outer = [o for o in blocks if o != b and b.startswith(o + ".")]
            blk["parent"] = max(outer, key=len) if outer else None
    return blocks


def inside_params(inside: dict) -> int:
    """Parameters of everything an inside holds: what the inside says it holds (each
    parameter once, a tied weight one weight), else the sum over its layers, a folded block
    counted as often as it repeats (a fold inside a fold, as often as both)."""
    if isinstance(inside.get("params"), int) and inside["params"] > 0:
        return inside["params"]
    layers = inside.get("layers", [])
    blocks = _blocks(layers)
    total = 0
    for layer in layers:
        if layer["path"] in blocks:
            continue
        times = math.prod(blocks[b]["times"] for b in _enclosing(blocks, layer.get("block")))
        total += int(layer.get("params") or 0) * max(times, int(layer.get("times") or 1))
    return total


def _module(layer: dict) -> str:
    """Which module a box is of: its path less its call (`enc.0#2`), or the first box of the
    module it is the same as (held under two names)."""
    return CALL.sub("", str(layer.get("same_as") or layer["path"]))


def _where(node: str, path: str) -> str:
    """A box's key, as colours and tooltips name it: `node.path`, or `node` for its one layer."""
    return f"{node}.{path}" if path else node


def weight_ties(insides: dict) -> dict[str, list[str]]:
    """The boxes holding one weight (`tied_to`, in one node or across two: `node:path`), by
    the key of the first of them: {key: every one's key}."""
    ties: dict[str, list[str]] = {}
    for node, inside in insides.items():
        for layer in (inside or {}).get("layers", []):
            at, cut, first = str(layer.get("tied_to") or "").rpartition(":")
            tie = _where(at, first) if cut else _where(node, first or str(layer["path"]))
            ties.setdefault(tie, []).append(_where(node, str(layer["path"])))
    return ties


def _swap(path: str, old: str, new: str) -> str:
    if old and (path == old or path.startswith(old + ".")):
        return new + path[len(old) :]
    return path


class _Inside:
    """One open node's layers as boxes, and the edges between them."""

    def __init__(self, node: str, inside: dict, expanded: list, after: list, ties: dict) -> None:
        self.node = node
        self.ties = {w: t for t in ties.values() for w in t}  # each box's: all holding its weight
        self.layers = [dict(layer, path=str(layer["path"])) for layer in inside.get("layers", [])]
        self.blocks = _blocks(self.layers)
        self.expanded = set(expanded)
        self.ids: dict[str, str] = {}  # drawn path -> box id
        self.copies: list[tuple[str, list[tuple[str, str]]]] = []  # block, [(from, to)] per copy
        self.calls: dict[str, list[str]] = {}  # each module's boxes, in the order they ran
        for layer in self.layers:
            self.calls.setdefault(_module(layer), []).append(layer["path"])
        self.edges = [(str(a), str(b)) for a, b in inside.get("edges", [])]
        drawn = [la for la in self.layers if la["path"] not in self.blocks]
        if not self.edges and len(drawn) > 1:  # no edges said: a chain of the top-level layers
            chain = [la["path"] for la in drawn if not la.get("block")]
            self.edges = list(zip(chain, chain[1:], strict=False))
        # whether what feeds each layer (its first edge in) gives it channels first, in the
        # shape it has, in the order the layers ran (so what fed one is known before it)
        fed = {b: a for a, b in reversed(self.edges)}
        shapes = {la["path"]: la.get("shape") for la in self.layers}
        self.first: dict[str, bool] = {}
        grid: set[str] = set()  # outputs that are images, channels on dim 1 (a conv's, ...)
        for la in self.layers:
            path, by = la["path"], fed.get(la["path"], "")
            shape, kind = la.get("shape") or [], la.get("kind")
            label, fed_shape = str(la.get("label") or ""), shapes.get(by) or []
            held = zip(la.get("held_kinds") or [], la.get("holds") or [], strict=False)
            held = [(k, str(h).partition(": ")[2]) for k, h in held]  # (its kind, its class)
            own = any(image_of(k, c) for k, c in [(kind, label), *held])  # or one it holds
            # what follows keeps the layout it is fed (a pad, a crop, a stride change it), unless
            # its sizes are only permuted (a ConvNeXt's or a sequence's channels moved last)
            kept = shape == fed_shape or sorted(shape) != sorted(fed_shape)
            if len(shape) in (4, 5) and (own or (by in grid and kept and kind != "learned")):
                grid.add(path)
            # (its channels' size kept, or the rest's: a ViT's patches transposed keep neither)
            same = shape[1:2] == fed_shape[1:2] or shape[2:] == fed_shape[2:]
            before = self.first.get(by, False) and len(fed_shape) == len(shape) and kept and same
            if axes := la.get("axes"):  # what its call says (a flatten's: the axes it merged)
                before = axes[1] == "ch"
            self.first[path] = channels_first(kind, label, before) or path in grid
        # the layers that read what the node was given, joined to a box that stands for it
        # where more than one reads it (with one, an edge into the node goes on into it)
        inputs = [str(p) for p in inside.get("inputs") or []]
        self.inputs = inputs if len(inputs) > 1 else []
        self.edges += [(INPUT, p) for p in self.inputs]
        if not inputs and len(drawn) == 1:  # (a node that is one layer reads it there)
            inputs = [drawn[0]["path"]]
        self.reader = inputs[0] if len(inputs) == 1 else INPUT  # where the node's input goes
        # where an edge out of the node to each node `after` it leaves: the one layer that made
        # what that node read (`read_by`), where not seen what the node gave back (`outputs`);
        # not named (the node's frame) where that is several layers, or none, or not said
        read, gave = inside.get("read_by") or {}, inside.get("outputs") or []
        made = {f"n:{n}": {str(p) for p in read.get(n, gave)} for n in after}
        self.givers = {n: next(iter(m)) for n, m in made.items() if len(m) == 1}

    def boxes(self) -> list[Box]:
        out: list[Box] = [self._input()] if self.inputs else []
        for layer in self.layers:
            if layer["path"] not in self.blocks and layer.get("block") not in self.blocks:
                out.append(self._layer(layer, "", ""))
        for b, blk in self.blocks.items():
            if blk["parent"] is None:
                out.extend(self._block(b, "", ""))
        return out

    def _input(self) -> Box:
        """What the node was given, a box with an edge to each layer that reads it: the
        branches of an inception block start from it, each concat of a dense block joins it."""
        box = _layer_box(f"i:{self.node}", "input", family="input")
        box.tip = [("", f"what {self.node} was given"), ("read by", ", ".join(self.inputs))]
        self.ids[INPUT] = box.id
        return box

    def _layer(self, layer: dict, old: str, new: str) -> Box:
        path = _swap(layer["path"], old, new)
        text = str(layer.get("label") or layer.get("kind") or path)
        times = int(layer.get("times") or 1)  # said once per level: its own repeats
        if times > 1:
            text += f"  ×{times}"
        calls = self.calls.get(_module(layer), [])
        if len(calls) > 1:  # one module called again (maybe by another name): the same weights
            text += f" · call {calls.index(layer['path']) + 1}/{len(calls)}"
        kind, label, shape = layer.get("kind"), layer.get("label"), layer.get("shape")
        first = self.first.get(layer["path"], False)
        sub = shape_text(shape, kind, label, first, layer.get("axes"), layer.get("batch"))
        where = _where(self.node, path)  # "": the node is the one layer
        box = _layer_box(
            f"l:{self.node}:{path}", text, sub, where=where, family=family(kind, label)
        )
        box.tip = [
            ("kind", str(kind or "?")),
            ("path", where),
            ("shape", f"[{', '.join(map(str, shape))}]" if isinstance(shape, list) else "unknown"),
            ("parameters", number(layer.get("params") or 0)),
        ]
        box.tip += self._same(layer)
        holds = [str(h).replace(": ", ":\u00a0") for h in layer.get("holds") or []]  # one line
        if holds:  # a composite drawn closed: what it holds, since it is not drawn
            more = f", … and {len(holds) - HOLDS} more" if len(holds) > HOLDS + 1 else ""
            box.tip.append(("holds", ", ".join(holds[: HOLDS if more else None]) + more))
        self.ids[path] = box.id
        return box

    def _same(self, layer: dict) -> list[tuple[str, str]]:
        """The tooltip's lines naming the other boxes of the same module (its other calls,
        the boxes where it runs under another name), those of other modules holding one of
        its weights (tied), and the twins it is not folded with, and why (`apart`)."""
        out, path = [], layer["path"]
        calls = self.calls.get(_module(layer), [])
        if len(calls) > 1:
            others = ", ".join(f"{self.node}.{c}" for c in calls if c != path)
            shared = " (weights shared)" if layer.get("params") else ""
            out.append(("same module as", others + shared))
        where = _where(self.node, path)
        if len(ties := self.ties.get(where, [])) > 1:
            out.append(("weights shared with", ", ".join(t for t in ties if t != where)))
        return out + [("", str(why)) for why in layer.get("apart") or []]

    def _own(self, b: str) -> dict:
        """The block `b`'s own entry among the layers (made up where it has none)."""
        return next((la for la in self.layers if la["path"] == b), {"path": b, "kind": "block"})

    def _block(self, b: str, old: str, new: str) -> list[Box]:
        blk = self.blocks[b]
        own = [la for la in self.layers if la.get("block") == b and la["path"] not in self.blocks]
        kids = [k for k, v in self.blocks.items() if v["parent"] == b]
        plain = blk["label"] in _PLAIN
        if not own and not kids:  # what it holds is not drawn (past the depth): one box
            label = blk["label"]
            if plain:  # named by where it is: "Sequential" alone says nothing
                parts = b.split(".")
                tail = max((k for k, p in enumerate(parts) if not p.isdigit()), default=0)
                label = f"{'.'.join(parts[tail:])}: {label}"
            return [self._layer({**self._own(b), "label": label}, old, new)]
        # a plain container, or one holding only a block framed on its own, draws as what it holds
        if blk["times"] == 1 and (plain or (not own and len(kids) == 1 and self._framed(kids[0]))):
            out = [self._layer(la, old, new) for la in own]  # drawn as what it holds
            for k in kids:
                out.extend(self._block(k, old, new))
            return out
        key, names = f"{self.node}:{b}", [b, *blk["repeats"]]
        foldable = blk["times"] > 1
        opened = foldable and key in self.expanded
        made, copies = [], []
        for k in range(blk["times"] if opened else 1):
            path = _swap(names[k] if k < len(names) else f"{b}~{k}", old, new)  # names[0] is b
            frm, to = (old, new) if k == 0 else (b, path)
            count = f"{k + 1}/{blk['times']}" if opened else f"×{blk['times']}" if foldable else ""
            label = f"{blk['label']}  {count}" if count else blk["label"]
            box = Box(
                id=f"b:{self.node}:{path}#{k}",
                kind="block",
                label=("▾ " if opened else "▸ ") + label if foldable else label,
                w=text_width(label, 11, True) + 40,
                pad=(24.0, 10.0, 10.0, 10.0),
                click=("expanded", key) if foldable else None,
                stack=foldable and not opened,
            )
            box.tip = [("block", f"{self.node}.{path}"), *self._same(self._own(b))]
            if foldable:
                box.tip.append(("", f"×{blk['times']}: click to {'fold' if opened else 'unfold'}"))
            box.children = [self._layer(la, frm, to) for la in own]
            for inner in kids:
                box.children.extend(self._block(inner, frm, to))
            if foldable and not opened:  # its layers stand for every copy's
                at = f"{self.node}.{path}"
                for inner in walk(box):
                    wheres = [inner.where, *inner.copies] if inner.where else []
                    for n in blk["repeats"]:
                        inner.copies += [
                            _swap(w, at, f"{self.node}.{_swap(n, old, new)}") for w in wheres
                        ]
            self.ids.setdefault(path, box.id)
            made.append(box)
            copies.append((frm, to))
        if opened:
            self.copies.append((b, copies))
        return made

    def _framed(self, b: str) -> bool:
        """Whether block `b` is drawn as one frame (its own, or that of the one block it holds):
        not when closed into a box, unfolded into its copies, or a plain container of several."""
        blk = self.blocks[b]
        own = any(la.get("block") == b and la["path"] not in self.blocks for la in self.layers)
        kids = [k for k, v in self.blocks.items() if v["parent"] == b]
        if not own and not kids:
            return False
        if blk["times"] > 1:
            return f"{self.node}:{b}" not in self.expanded
        if blk["label"] in _PLAIN:
            return not own and len(kids) == 1 and self._framed(kids[0])
        return True

    def routed(self) -> tuple[list[tuple[str, str]], dict[str, str]]:
        """The edges between drawn boxes, an expanded block's copies chained one after the
        other (what entered the block enters the first, what left it leaves the last); and
        the box an edge out of the node to each node after it leaves from, by that node's box
        (its giver's, the last copy's where it is in an expanded block; "" where none is drawn)."""
        out = [*self.edges, *((g, OUTPUT + n) for n, g in self.givers.items())]
        for b, copies in self.copies:
            inside = {
                la["path"]
                for la in self.layers
                if la["path"] == b
                or la["path"].startswith(b + ".")
                or b in _enclosing(self.blocks, la.get("block"))
            }
            exits = [x for x, y in out if x in inside and y not in inside]
            stream = self._stream([x for x, y in out if y in inside and x not in inside], exits)
            n, nxt = len(copies), []
            for x, y in out:
                xi, yi = x in inside, y in inside
                if xi and yi:
                    nxt += [(_swap(x, f, t), _swap(y, f, t)) for f, t in copies]
                elif yi:
                    nxt.append((x, y))
                    for k in range(1, n):
                        froms = [_swap(e, *copies[k - 1]) for e in exits or [x]]
                        for e in froms if x in stream else [x]:
                            nxt.append((e, _swap(y, *copies[k])))
                elif xi:
                    nxt.append((_swap(x, *copies[-1]), y))
                else:
                    nxt.append((x, y))
            out = nxt
        leaves = {y[len(OUTPUT) :]: self.ids.get(x, "") for x, y in out if y.startswith(OUTPUT)}
        drawn = ((self.ids.get(x), self.ids.get(y)) for x, y in out)
        return list(dict.fromkeys((a, b) for a, b in drawn if a and b and a != b)), leaves

    def _stream(self, sources: list[str], exits: list[str]) -> set[str]:
        """Which of what enters a folded block from outside each copy after the first takes
        from the copy before (the others it takes where the first does: a rotary table, an
        encoder's states, a mask): the last made of those shaped as what the block gives
        (what a copy gives the next), or whose shape is not known; all where none is."""
        order = {la["path"]: k for k, la in enumerate(self.layers)}
        shapes = {la["path"]: la.get("shape") for la in self.layers}
        gives = [shapes.get(e) for e in exits]
        fits = [x for x in sources if shapes.get(x) is None or shapes.get(x) in gives]
        return {max(fits, key=lambda x: order.get(x, -1))} if fits else set(sources)


def branch_groups(order: list[str], edges: list[tuple[str, str]]) -> list[dict]:
    """Branches that leave one node and meet again at one node: {from, to, members}
    (`edges` between nodes of `order`)."""
    succ: dict[str, list[str]] = {n: [] for n in order}
    pred: dict[str, list[str]] = {n: [] for n in order}
    for a, b in edges:
        succ[a].append(b)
        pred[b].append(a)
    groups, taken = [], set()
    for f in order:
        outs = succ[f]
        if len(outs) < 2:
            continue
        below = [reach(succ, [s]) for s in outs]
        join = next((n for n in order if all(n in s for s in below)), None)
        if join is None:
            continue
        members = {n for n in reach(succ, outs) if n != join and join in reach(succ, [n])}
        closed = all(
            all(p == f or p in members for p in pred[n])
            and all(s == join or s in members for s in succ[n])
            for n in members
        )
        if len(members) < 2 or not closed or members & taken:
            continue
        taken |= members
        groups.append({"from": f, "to": join, "members": [n for n in order if n in members]})
    return groups


def scene(plan: dict, insides: dict, opened: list[str], expanded: list[str]) -> Box:
    """The root box: the graph's nodes (and groups of branches), each open node holding its
    layers; `edges` on the root and on each open node."""
    nodes = {str(n["id"]): n for n in plan.get("nodes", [])}
    order = list(nodes)
    edges = [(str(a), str(b)) for a, b in plan.get("edges", []) if a in nodes and b in nodes]
    root = Box(id="root", kind="root", down=False, pad=(12.0, 12.0, 12.0, 12.0))
    root.edges = [(f"n:{a}", f"n:{b}") for a, b in edges]
    ties, frames = weight_ties(insides), {}
    for k, grp in enumerate(branch_groups(order, edges)):
        n = sum(1 for a, _ in edges if a == grp["from"])
        frame = Box(f"g:{k}", "group", f"{n} branches", down=False, pad=(22.0, 10.0, 10.0, 10.0))
        frame.tip = [("from", grp["from"]), ("to", grp["to"]), ("nodes", ", ".join(grp["members"]))]
        root.children.append(frame)
        for m in grp["members"]:
            frames[m] = frame
    for nid in order:
        after = [b for a, b in edges if a == nid]
        box = _node(nid, nodes[nid], insides.get(nid), nid in opened, (expanded, after, ties))
        if box.entry and any(b == nid for _, b in edges):  # an edge comes in under its title
            box.pad = (box.pad[0] + 6.0, *box.pad[1:])
        frames.get(nid, root).children.append(box)
    return root


def _node(nid: str, node: dict, inside: dict | None, opened: bool, by: tuple) -> Box:
    """A node's box; `by`, what an open one's layers are drawn by: (the blocks unfolded, the
    nodes after it, `weight_ties`)."""
    pills = [("device", str(node["device"]))] if node.get("device") else []  # its badges
    if node.get("host"):
        pills.append(("host", f"@{node['host']}"))
    pills += [(mark, mark) for mark in ("cached", "frozen", "mapped") if node.get(mark)]
    params = inside_params(inside) if inside else None
    kind = str(node.get("kind") or "")
    sub = kind + (f" · {number(params)} params" if params else "")
    sub += "  ▾" if opened else "  ▸" if inside else ""
    pills_w = sum(pill_width(t) + 4 for _, t in pills)
    box = Box(id=f"n:{nid}", kind="node", label=nid, sub=sub, where=nid, pills=pills)
    box.w = max(90.0, round(max(text_width(nid, 13, True), text_width(sub, 11), pills_w) + 28))
    box.h = 62.0 if pills else 46.0
    box.click = ("opened", nid) if inside else None
    salt = node.get("salt")
    tip = [
        ("kind", kind or "?"),
        ("parameters", number(params)) if params is not None else None,
        ("never read", ", ".join(inside["unread"])) if (inside or {}).get("unread") else None,
        ("device", str(node.get("device") or "anywhere")),
        ("host", str(node["host"])) if node.get("host") else None,
        ("cached", "yes" if salt is None else f"yes, salt {salt}") if node.get("cached") else None,
        ("frozen", "yes") if node.get("frozen") else None,
        ("mapped", "over the items of a list") if node.get("mapped") else None,
        ("", f"click to {'close' if opened else 'open'}") if inside else None,
    ]
    box.tip = [line for line in tip if line]
    if opened and inside:
        world = _Inside(nid, inside, *by)
        box.children = world.boxes()
        box.edges, box.exit = world.routed()
        box.entry = world.ids.get(world.reader, "")  # "" where the inside does not say
        box.pad = (NODE_TOP + (PILL_H if pills else 0), 12.0, 12.0, 12.0)
    return box
