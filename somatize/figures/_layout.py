"""A layered layout for boxes inside boxes: each container laid out on its own
(`_layers.place`), innermost first, its children down it (or right, for the graph's nodes).
An edge that crosses a container's border goes through a port there, placed like a box in a
first (or last) layer of its own; its parts, one per container crossed, are joined here.
"""

from __future__ import annotations

import math

from somatize.figures._layers import Item, place
from somatize.figures._scene import Box, walk

# x, y, and how the way to it curves (between layers): "v" down, "h" across, "" straight
Point = tuple[float, float, str]


class _Layout:
    def __init__(self, root: Box, room: tuple[float, float]) -> None:
        self.room = room
        # what laying out each container left behind, in its coordinates: where its ports are
        # (by `in:source` and `out:source`: what one box sends out leaves by one port) and
        # each edge's part of the way at its level
        self.ports: dict[str, dict[str, tuple[float, float]]] = {}
        self.parts: dict[str, dict[tuple[str, str], list[Point]]] = {}
        self.parent = {child.id: box for box in walk(root) for child in box.children}
        self.boxes = {box.id: box for box in walk(root)}
        self._arrange(root, root.edges)

    def _child_of(self, box: Box, key: str) -> Box | None:
        """The child of `box` that is `key` or holds it; None if `key` is not under `box`."""
        while key in self.parent and self.parent[key] is not box:
            key = self.parent[key].id
        return self.boxes[key] if key in self.parent else None

    def _arrange(self, box: Box, edges: list[tuple[str, str]]) -> None:
        """Lay out `box`'s children (theirs first) with the edges of the world it is in: the
        graph's, or an open node's own and those that come into it (to its `entry`) or leave
        it (from its `exit` to where they go)."""
        if box.edges or box.kind in ("root", "node"):
            ends = [
                (s, d)
                for s, d in edges
                if d == box.id and box.entry or s == box.id and box.exit.get(d)
            ]
            edges = [*box.edges, *ends]
        for child in box.children:
            if child.children:
                self._arrange(child, edges)
        if not box.children:
            return
        border = self.ports[box.id] = {}
        parts = self.parts[box.id] = {}

        def flip(a: float, b: float) -> tuple[float, float]:  # (across, along) as (x, y), and back
            return (a, b) if box.down else (b, a)

        items = {c.id: Item(c.id, *flip(c.w, c.h), box=c) for c in box.children}
        pairs: list[tuple[str, str, str, str]] = []  # level source, level target, edge (exit, end)
        for s, d in edges:
            src = self._end(s, d)
            a, b = self._child_of(box, src), self._child_of(box, self._end(d))
            if a is None and b is None or a is b:
                continue
            ends = (f"in:{src}" if a is None else a.id, f"out:{src}" if b is None else b.id)
            for key in ends:  # a port where the edge enters or leaves from outside
                items.setdefault(key, Item(key, 0.0, 0.0))
            pairs.append((*ends, src, d))
        # (between layers, between items, after a port: room for an edge to curve down)
        gaps = (40.0, 20.0, 8.0) if box.kind in ("root", "group") else (22.0, 16.0, 22.0)
        top, right, bottom, left = box.pad
        room = self.room[1] - top - bottom if box.down else self.room[0] - left - right
        if box.kind == "block":  # a block is read down one column; only what holds it wraps
            room = math.inf
        ports = [
            (self.port(items[a].box, s, True), self.port(items[b].box, s, False))
            for a, b, s, d in pairs
        ]
        across_room = self.room[0] - left - right if box.down else None  # a root's rows scroll down
        extent, ways = place(list(items.values()), pairs, ports, gaps, room, across_room)
        w, h = flip(*extent)
        box.w = max(box.w, w + left + right)
        box.h = h + top + bottom
        shift_u, shift_v = flip(left, top)
        # center the content when the box is wider than it (a long label)
        if box.down:
            shift_u += (box.w - left - right - w) / 2
        for key, item in items.items():
            cx, cy = flip(item.u + shift_u, item.v + shift_v)
            if item.box is None:
                border[key] = (cx, cy)
            elif box.down:
                item.box.x, item.box.y = cx - item.box.w / 2, cy
            else:
                item.box.x, item.box.y = cx, cy - item.box.h / 2
        # an open node's exits each on a lane of its own along its bottom, the rightmost
        # highest: no two edges run to its side along one line
        outs = sorted((k for k in border if k.startswith("out:")), key=lambda k: -border[k][0])
        drop = {k: 8.0 * n for n, k in enumerate(outs)} if box.kind == "node" else {}
        box.h += 8.0 * max(len(drop) - 1, 0)
        bend = "v" if box.down else "h"
        for (_, b, s, d), way in zip(pairs, ways, strict=True):
            parts[(s, d)] = [
                (*flip(u + shift_u, v + shift_v), bend if curve else "") for u, v, curve in way
            ]
            if b in drop:  # (a node is laid out down: x, y)
                x, y, c = parts[(s, d)][-1]
                parts[(s, d)][-1] = (x, y + drop[b], c)
        border.update({k: (border[k][0], border[k][1] + dv) for k, dv in drop.items()})

    def _end(self, key: str, to: str = "") -> str:
        """Where an edge to `key` ends (or, `to` given, one from it to `to` starts): an open
        node's entry, the box inside that reads what the node is given (its exit to `to`, the
        one that made what `to` reads); anything else, and a node without one, itself."""
        box = self.boxes.get(key)
        return (box.exit.get(to) if to else box.entry) or key if box is not None else key

    def port(self, box: Box | None, key: str, out: bool) -> float | None:
        """Where an edge to (or from) `key` crosses the border of `box`, across its
        parent's direction and in its frame offset from the box's centre, if it has one."""
        side = f"{'out' if out else 'in'}:{key}"
        at = self.ports.get(box.id, {}).get(side) if box is not None else None
        if at is None:
            return None
        return (at[0] - box.w / 2) if self.parent[box.id].down else (at[1] - box.h / 2)

    def absolute(self, root: Box) -> dict[tuple[str, str], list[Point]]:
        """Boxes moved to the root's frame; each edge's route, its parts joined in order."""
        origin: dict[str, tuple[float, float]] = {root.id: (0.0, 0.0)}
        for box in walk(root):
            ox, oy = origin[box.id]
            for child in box.children:
                child.x += ox
                child.y += oy
                origin[child.id] = (child.x, child.y)
        routes: dict[tuple[str, str], list[Point]] = {}
        for world in [root, *[b for b in walk(root) if b.kind == "node" and b.children]]:
            for s, d in world.edges:
                points: list[Point] = []
                for box in self._chain(s, d):
                    ox, oy = origin[box.id]
                    part = self.parts[box.id].get((self._end(s, d), d), [])
                    points.extend((x + ox, y + oy, c) for x, y, c in part)
                if points:
                    routes[(s, d)] = points
        return routes

    def _chain(self, s: str, d: str) -> list[Box]:
        """The containers an edge passes through, from the source's side to the target's."""
        up_s, up_d = self._ups(self._end(s, d)), self._ups(self._end(d))
        ids_d = [b.id for b in up_d]
        k = next(k for k, b in enumerate(up_s) if b.id in ids_d)  # the nearest box around both
        return [*up_s[: k + 1], *reversed(up_d[: ids_d.index(up_s[k].id)])]

    def _ups(self, key: str) -> list[Box]:
        out = []
        while key in self.parent:
            box = self.parent[key]
            out.append(box)
            key = box.id
        return out


def layout(root: Box, room: tuple[float, float]) -> dict[tuple[str, str], list[Point]]:
    """Lay out the scene under `root` within `room` (width, height) where it can: sets each
    box's `x`, `y`, `w`, `h` and answers the route of every edge."""
    return _Layout(root, room).absolute(root)
