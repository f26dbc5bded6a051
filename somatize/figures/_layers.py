"""One container's children in layers, by Sugiyama's method kept small: layers by the longest
path (an edge closing a cycle left out), a waypoint in every layer an edge skips (shared by
what one source sends on), an order that crosses few edges (barycentre sweeps), positions
across pulled towards what each box is joined to (least squares, waypoints giving way), and a
container longer than its room cut into bands side by side where one edge alone crosses.
Coordinates are a container's own: `u` across its direction, `v` along it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from somatize.figures._scene import Box


@dataclass
class Item:
    key: str
    span: float  # size across the direction
    depth: float  # size along it
    box: Box | None = None
    layer: int = 0
    u: float = 0.0  # centre, across
    v: float = 0.0  # top, along
    chunk: int = 0


def _ways(pairs, items, ports, paths, bands) -> list[list[tuple[float, float, bool]]]:
    """Each edge's way at this level: out of its source (one point: what it sends on runs as
    one line until it branches), through its waypoints, into its target, spread where several
    enter one box; between bands, along the lanes past their ends (`bands`: each band's
    extent across, the longest's end along, where they start along)."""
    chunks, end, lead = bands
    leave = [items[a].u + (port or 0.0) for (a, *_), (port, _) in zip(pairs, ports, strict=True)]
    enter: dict[int, float] = {}
    by_box: dict[str, list[int]] = {}
    for k, pair in enumerate(pairs):
        by_box.setdefault(pair[1], []).append(k)
    for key, ks in by_box.items():
        item = items[key]
        near = {k: paths[pairs[k][:2]][-2] for k in ks}  # where each comes from
        free = {id(near[k]): near[k].u for k in ks if ports[k][1] is None}
        slots = sorted(free, key=free.get)
        n = len(slots) - 1
        width = min(item.span * 0.6, 12.0 * n)
        at = {p: item.u + (width * (j / n - 0.5) if n else 0.0) for j, p in enumerate(slots)}
        for k in ks:
            port = ports[k][1]
            enter[k] = at[id(near[k])] if port is None else item.u + port
    out = []
    lanes: dict[tuple[int, int], list[tuple[str, str]]] = {}  # who crosses each gap
    for k, (a, b, _, _) in enumerate(pairs):
        chain = paths[(a, b)]
        way = [(leave[k], chain[0].v + chain[0].depth, False)]
        for prev, item in zip(chain, chain[1:], strict=False):
            u = enter[k] if item is chain[-1] else item.u
            if item.chunk != prev.chunk:
                crossing = lanes.setdefault((prev.chunk, item.chunk), [])
                if (a, b) not in crossing:
                    crossing.append((a, b))
                gap = 5 * crossing.index((a, b))
                lane = chunks[item.chunk][0] - 20 + gap
                below, above = end + 12 + gap, lead - 12 - gap
                turns = [(way[-1][0], below), (lane, below), (lane, above), (u, above)]
                way += [(x, y, False) for x, y in [*turns, (u, item.v)]]
            else:
                way.append((u, item.v, True))
            if item is not chain[-1]:
                way.append((u, item.v + item.depth, False))
        out.append(way)
    return out


def place(
    items: list[Item],
    pairs: list[tuple[str, str, str, str]],
    ports: list[tuple[float | None, float | None]],
    gaps: tuple[float, float, float],
    room: float,
    across_room: float | None = None,
) -> tuple[tuple[float, float], list[list[tuple[float, float, bool]]]]:
    """Items in layers along a container, ordered and placed across; answers the extent and
    each pair's way. `pairs` are (source, target, edge's source, edge's target) at this level,
    `ports` where each pair's ends cross a container's border, off its centre (None: no port
    there); `gaps` (between layers, between items, after a port's layer), `room` the length
    along to wrap at, `across_room` the width across the bands may not pass (None: any)."""
    between, across, after_port = gaps
    by_key = {i.key: i for i in items}
    offsets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    sent: dict[tuple[str, str], set[str]] = {}  # the edges' sources each pair carries
    for (a, b, s, _), (oa, ob) in zip(pairs, ports, strict=True):
        offsets.setdefault((a, b), []).append((oa or 0.0, ob or 0.0))
        sent.setdefault((a, b), set()).add(s)
    edges = [(a, b) for a, b in offsets if a != b]
    _layers_of(items, edges)
    # waypoints for edges that skip layers: one per layer for what one source sends down
    # (a tensor read further on runs as one line beside what it skips, branching off)
    paths: dict[tuple[str, str], list[Item]] = {}
    waypoints: dict[tuple, Item] = {}
    for a, b in edges:
        ia, ib = by_key[a], by_key[b]
        lo, hi = sorted((ia.layer, ib.layer))
        down = ia.layer <= ib.layer
        dummies = []
        for k in range(lo + 1, hi):
            key = (frozenset(sent[a, b]), k) if down else (a, b, k)
            if key not in waypoints:
                waypoints[key] = Item(f"~{len(waypoints)}", 4.0, 0.0, layer=k)
            dummies.append(waypoints[key])
        paths[(a, b)] = [ia, *(dummies if down else reversed(dummies)), ib]
    every = [*items, *waypoints.values()]
    layers: list[list[Item]] = [[] for _ in range(max(i.layer for i in every) + 1)]
    for i in every:
        layers[i.layer].append(i)
    # each item's neighbours in the layers above and below, and the offset between the points
    # where their link meets them: from the centres (a port on a container is off it); a port
    # far from its centre (a wrapped block's, in another band) is not lined up with, or blocks
    # chained that way would walk off to one side
    links: list[tuple[Item, Item]] = []
    up: dict[int, list[tuple[Item, float]]] = {}
    down: dict[int, list[tuple[Item, float]]] = {}
    for (a, b), c in paths.items():
        oa, ob = (sum(side) / len(offsets[a, b]) for side in zip(*offsets[a, b], strict=True))
        if abs(oa) > by_key[a].span / 4 or abs(ob) > by_key[b].span / 4:
            oa = ob = 0.0
        if by_key[a].layer > by_key[b].layer:
            oa, ob = ob, oa
        for j in range(len(c) - 1):
            sa, sb = (oa if j == 0 else 0.0), (ob if j == len(c) - 2 else 0.0)
            links.append((c[j], c[j + 1]))
            down.setdefault(id(c[j]), []).append((c[j + 1], sb - sa))
            up.setdefault(id(c[j + 1]), []).append((c[j], sa - sb))
    _order(layers, links, up, down)
    depth = [max((i.depth for i in layer), default=0.0) for layer in layers]
    for i in every[len(items) :]:  # a waypoint runs the whole layer, so an edge curves only
        i.depth = depth[i.layer]  # between layers, never across a tall box beside it
    lengths = [d + (between if d > 0 else after_port) for d in depth]
    # bands: as few as keep each within the room along, and none when that would make the
    # whole wider than the room across (then it is long, and scrolls); cut only where one
    # edge crosses (between stages): a skip, a concat or a second input from further up
    # runs beside the column, not round the bands
    crossing = [0] * len(layers)  # how many edges cross into each layer
    for a, b in edges:
        lo, hi = sorted((by_key[a].layer, by_key[b].layer))
        for n in range(lo + 1, hi + 1):
            crossing[n] += 1
    cuts = {n for n, many in enumerate(crossing) if many <= 1}
    k = _bands_needed(lengths, room, cuts)
    while True:
        bands = _joined(_bands(lengths, k, cuts), lengths, room / 2)
        extent, *placed = _arrange_bands(layers, bands, lengths, depth, (up, down), across)
        if k == 1 or across_room is None or extent[0] <= across_room:
            return extent, _ways(pairs, by_key, ports, paths, placed)
        k -= 1


def _arrange_bands(layers, bands, lengths, depth, near, across) -> tuple:
    """The layers placed along, band by band, and across, each band beside the last: the
    extent, each band's (start, end) across, the longest's end along, where they start."""
    lead = 24.0 if len(bands) > 1 else 0.0  # room for the lanes between bands
    end = 0.0
    for c, (lo, hi) in enumerate(bands):
        v = lead
        for k in range(lo, hi):
            for i in layers[k]:
                i.v, i.chunk = v + (depth[k] - i.depth) / 2, c
            v += lengths[k]
        end = max(end, v - (lengths[hi - 1] - depth[hi - 1]))
    chunks, offset = [], 0.0
    for lo, hi in bands:
        band = layers[lo:hi]
        _positions(band, *near, across)
        left = min((i.u - i.span / 2 for layer in band for i in layer), default=0.0)
        right = max((i.u + i.span / 2 for layer in band for i in layer), default=0.0)
        for layer in band:
            for i in layer:
                i.u += offset - left
        chunks.append((offset, offset + right - left))
        offset += right - left + 44.0
    return (offset - 44.0, end + lead), chunks, end, lead


def _layers_of(items: list[Item], edges) -> None:
    """Layers by the longest path from the sources (a source just above what it feeds), an
    edge that closes a cycle left out; ports in a first and a last layer of their own."""
    inner = [i.key for i in items if not i.key.startswith(("in:", "out:"))]
    succ: dict[str, list[str]] = {k: [] for k in inner}
    for a, b in edges:
        if a in succ and b in succ:
            succ[a].append(b)
    order: list[str] = []  # depth first, in the order given: finishing order, reversed
    state: dict[str, int] = {}
    pred: dict[str, list[str]] = {k: [] for k in inner}
    for k0 in inner:
        if k0 in state:
            continue
        stack = [(k0, iter(succ[k0]))]
        state[k0] = 1
        while stack:
            k, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[k] = 2
                order.append(k)
                stack.pop()
            elif state.get(nxt) != 1:  # an edge back to the path walked is dropped
                pred[nxt].append(k)
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(succ[nxt])))
    layer: dict[str, int] = {}
    for k in reversed(order):  # a topological order of what was kept
        layer[k] = 1 + max((layer[p] for p in pred[k]), default=-1)
    for k in order:  # sinks first: each source pulled down to just above what it feeds
        if not pred[k] and succ[k]:  # (a source's edges are all kept: it starts a walk)
            layer[k] = min(layer[s] for s in succ[k]) - 1
    shift = int(any(i.key.startswith("in:") for i in items)) - min(layer.values(), default=0)
    last = max(layer.values(), default=-1) + shift + 1
    for i in items:
        if i.key.startswith("in:"):
            i.layer = 0
        elif i.key.startswith("out:"):
            i.layer = last
        else:
            i.layer = layer[i.key] + shift


def _order(layers: list[list[Item]], links: list[tuple[Item, Item]], up, down) -> None:
    """An order within each layer that crosses few edges: barycentre sweeps down and up,
    the best seen kept."""
    pos = {id(i): float(k) for layer in layers for k, i in enumerate(layer)}

    def sweep(seq: range, near: dict[int, list[tuple[Item, float]]]) -> None:
        for k in seq:
            layer = layers[k]
            keys = {}
            for n, i in enumerate(layer):
                ns = near.get(id(i), [])
                keys[id(i)] = sum(pos[id(x)] for x, _ in ns) / len(ns) if ns else pos[id(i)]
                keys[id(i)] += n * 1e-6
            layer.sort(key=lambda i: keys[id(i)])
            for n, i in enumerate(layer):
                pos[id(i)] = float(n)

    best, fewest = [list(layer) for layer in layers], _crossings(layers, links)
    for _ in range(4):
        sweep(range(1, len(layers)), up)
        sweep(range(len(layers) - 2, -1, -1), down)
        now = _crossings(layers, links)
        if now < fewest:
            best, fewest = [list(layer) for layer in layers], now
    layers[:] = best


def _crossings(layers: list[list[Item]], links: list[tuple[Item, Item]]) -> int:
    where = {id(i): k for layer in layers for k, i in enumerate(layer)}
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for a, b in links:
        if b.layer == a.layer + 1:
            by_layer.setdefault(a.layer, []).append((where[id(a)], where[id(b)]))
    pairs = (combinations(p, 2) for p in by_layer.values())
    return sum((a - c) * (b - d) < 0 for two in pairs for (a, b), (c, d) in two)


def _positions(layers: list[list[Item]], up, down, gap: float) -> None:
    """Centres across: each box pulled towards what it is joined to (where the edge meets
    it: a container's port is off its centre), spacing kept."""
    for layer in layers:
        for i, u in zip(layer, _offsets(layer, gap), strict=True):
            i.u = u
    for turn in range(12):
        order = range(len(layers)) if turn % 2 == 0 else range(len(layers) - 1, -1, -1)
        for k in order:
            want = []
            for i in layers[k]:
                if turn >= 10:
                    ns = [*up.get(id(i), []), *down.get(id(i), [])]
                else:
                    ns = up.get(id(i), []) if turn % 2 == 0 else down.get(id(i), [])
                ns = [(x, o) for x, o in ns if x.chunk == i.chunk and x.layer != i.layer]
                real = [(x, o) for x, o in ns if x.box is not None]
                ns = real or ns  # a box lines up with boxes, a waypoint goes round them
                target = sum(x.u + o for x, o in ns) / len(ns) if ns else i.u
                dummy = i.box is None and not i.key.startswith(("in:", "out:"))
                want.append((target, 1e-3 if dummy else 1.0))  # waypoints give way
            _fit(layers[k], want, gap)


def _offsets(layer: list[Item], gap: float) -> list[float]:
    """Each centre's distance from the first's with the items packed: half of each span
    between, and `gap` (a waypoint beside anything, 8)."""
    out, total = [0.0] * len(layer), 0.0
    for n in range(1, len(layer)):
        a, b = layer[n - 1], layer[n]
        total += (a.span + b.span) / 2 + (8.0 if a.box is None and b.box is None else gap)
        out[n] = total
    return out


def _fit(layer: list[Item], want: list[tuple[float, float]], gap: float) -> None:
    """Centres as near `want` (value, weight) as the order and spacing allow (least squares,
    by pool-adjacent-violators on the positions less their spacing)."""
    offs = _offsets(layer, gap)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for (target, w), off in zip(want, offs, strict=True):
        blocks.append([target - off, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    n = 0
    for mean, _, c in blocks:
        for _ in range(c):
            layer[n].u = mean + offs[n]
            n += 1


def _bands_needed(lengths: list[float], room: float, cuts: set[int]) -> int:
    """How many bands keep each within `room` (less the lanes between bands, which run past
    both ends; a layer alone longer than it aside), cut only before the layers in `cuts`:
    1 for few layers, or when no such cuts can."""
    total = sum(lengths)
    if total <= room or len(lengths) < 4:
        return 1
    room = max(room - 48.0, max(lengths))
    k = math.ceil(total / room)
    while max(sum(lengths[a:b]) for a, b in _bands(lengths, k, cuts)) > room * 1.02:
        if k >= len(lengths):
            return 1
        k += 1
    return k


def _joined(bands: list[tuple[int, int]], lengths: list[float], slack: float) -> list:
    """Bands joined to the one before where that makes the longest at most `slack` longer: a
    band that saves less than that (an input box cut off a decoder taller than the room) is
    not worth the lanes round it."""
    longest = max(sum(lengths[a:b]) for a, b in bands)
    out = [bands[0]]
    for a, b in bands[1:]:
        if sum(lengths[out[-1][0] : b]) <= longest + slack:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _bands(lengths: list[float], k: int, cuts: set[int]) -> list[tuple[int, int]]:
    """Consecutive layers cut into `k` bands (or fewer) about as long as each other, cut
    only before the layers in `cuts`."""
    goal = sum(lengths) / k
    bands, lo, run = [], 0, 0.0
    for n, length in enumerate(lengths):
        if run and run + length > goal * 1.08 and len(bands) < k - 1 and n in cuts:
            bands.append((lo, n))
            lo, run = n, 0.0
        run += length
    bands.append((lo, len(lengths)))
    return bands
