"""What g.edge, g.declare, g.node and Graph.somatize refuse above a cached node, against a model.

The model reads the graph back through its public readers and answers as a graph built at
that moment would: a `.cached()` node fed (at any depth) by a node not `.frozen()` whose
parameters ask for a gradient is refused naming the nearest such node (breadth first, each
node's predecessors in the order their edges were added), else one fed by a constructor
argument no key can take in, unless salted, naming the first such node found depth first.
Random build sequences turn `requires_grad` on and off between calls.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import replace
from functools import reduce
from operator import or_, rshift

import pytest
from _nodes import Lin
from torch import nn

from somatize import Graph, Node


class Holder(Node):
    """A plain node holding a module as an attribute."""

    def __init__(self) -> None:
        self.net = nn.Linear(2, 2)

    def forward(self, input, ctx):
        return self.net(input)


class Plain(Node):
    def forward(self, input, ctx):
        return input


class Guard:
    """State nowhere a key can read it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class Locked(Node):
    def __init__(self, guard) -> None:
        self.guard = guard

    def forward(self, input, ctx):
        return input


def module_of(node):
    return node if isinstance(node, Lin) else getattr(node, "net", None)


def trainable(node) -> bool:
    module = module_of(node)
    return module is not None and any(p.requires_grad for p in module.parameters())


def around(start, links):
    found, seen = [start], {start}
    for here in found:
        for nxt in links(here):
            if nxt not in seen:
                seen.add(nxt)
                found.append(nxt)
    return found


def first_unkeyable(g, start):
    if isinstance(g.implementation(start), Locked):
        return start
    return next((u for p in g.predecessors(start) if (u := first_unkeyable(g, p))), None)


def stale(g, said, a, cached):
    """The refusal (a regex) of the `cached` nodes below `a`, `said` giving each node's
    settings as they would be; None if none."""
    if not cached:
        return None
    up = next(
        (
            n
            for n in around(a, g.predecessors)
            if not said(n).frozen and trainable(g.implementation(n))
        ),
        None,
    )
    if up is not None:
        return rf"^node '{cached[0]}' is \.cached\(\) but is fed by node '{up}', which holds"
    unsalted = [c for c in cached if said(c).salt is None]
    if unsalted and (up := first_unkeyable(g, a)) is not None:
        return rf"^node '{unsalted[0]}' is \.cached\(\) but its key .* of node '{up}', which"
    return None


def settle(nid, node, s):
    if s.cached and not s.frozen and trainable(node):
        return rf"^node '{nid}' is \.cached\(\) but holds trainable state"
    if s.cached and s.salt is None and isinstance(node, Locked):
        return rf"^node '{nid}' is \.cached\(\) but its key .* of its constructor argument"
    return None


def expect_edge(g, a, b):
    if b in g.successors(a):
        return None
    down = around(b, g.successors)
    if a in down:
        return f"^the edge '{a}' -> '{b}' would close a cycle"
    return stale(g, g.setting, a, [n for n in down if g.setting(n).cached])


def expect_declare(g, nid, said):
    new = replace(g.setting(nid), **said)

    def setting(n):
        return new if n == nid else g.setting(n)

    down = around(nid, g.successors)
    refused = stale(g, setting, nid, [n for n in down[1:] if setting(n).cached])
    for p in g.predecessors(nid) if new.cached else ():
        refused = refused or stale(g, setting, p, [nid])
    return refused or settle(nid, g.implementation(nid), new)


def made(rng, name, cached=0.5, frozen=0.4, grad=0.4):
    """A new node of a random kind, declared at random, and the regex of its refusal."""
    node = rng.choice([Lin, Holder, Plain, Plain, "locked", "locked"])
    node = Locked(Guard()) if node == "locked" else node()
    if module_of(node) is not None:
        module_of(node).requires_grad_(rng.random() < grad)
    expr = node.named(name)
    if rng.random() < frozen:
        expr = expr.frozen()
    if rng.random() < cached:
        expr = expr.cached(salt=rng.choice([None, None, "s"]))
    ((node, s),) = list(expr.pieces())
    return node, expr, settle(name, node, s)


def tried(expected, call, *args, **kw):
    """Make the call, check it is refused exactly when and as `expected` says, and give back
    what it said when refused."""
    try:
        call(*args, **kw)
    except ValueError as e:
        assert expected is not None and re.search(expected, str(e)), (str(e), expected)
        return str(e)
    assert expected is None, expected
    return None


def state(g):
    return g.edges(), {n: g.setting(n) for n in g}


@pytest.mark.parametrize("seed", range(8))
def test_refusals_above_a_cached_node_answer_as_a_graph_built_now(seed):
    rng = random.Random(seed)
    refused = accepted = 0
    for _ in range(40):
        g = Graph()
        nodes = []
        for _ in range(40):
            before = state(g)
            roll = rng.random()
            if roll < 0.25 or len(nodes) < 2:
                node, expr, expected = made(rng, f"n{len(nodes)}")
                ok = tried(expected, g.node, expr) is None
                nodes += [node] if ok else []
            elif roll < 0.65:
                a, b = rng.sample(list(g), 2)
                ok = tried(expect_edge(g, a, b), g.edge, a, b) is None
            elif roll < 0.85:
                nid = rng.choice(list(g))
                said = rng.choice(
                    [{"frozen": True}, {"frozen": False}, {"cached": True}, {"cached": False}]
                    + [{"salt": None}, {"salt": "s"}, {"cached": True, "salt": "s"}]
                )
                ok = tried(expect_declare(g, nid, said), g.declare, nid, **said) is None
            else:  # weights set aside by hand, or turned back on
                held = [module_of(n) for n in nodes if module_of(n) is not None]
                if held:
                    rng.choice(held).requires_grad_(rng.random() < 0.5)
                continue
            if not ok:
                assert state(g) == before  # a refusal leaves the graph as it was
            refused, accepted = refused + (not ok), accepted + ok
    assert refused > 150 and accepted > 600  # both answers were put to the test


def blocks_of(rng, n):
    """Random blocks (one node, or several side by side) of new nodes, named b0, b1, ..."""
    blocks, k = [], 0
    for _ in range(n):
        block = []
        for _ in range(rng.choice([1, 1, 2, 2, 3])):
            block.append(made(rng, f"b{k}", cached=0.15, frozen=0.2, grad=0.6))
            k += 1
        blocks.append(block)
    return blocks


def laid_by_hand(blocks):
    """The graph laid as `Graph.somatize` lays the blocks chained (a block's nodes, then the
    edges into it), each call checked against the model; or what the first refusal said."""
    g, last = Graph(), []
    for block in blocks:
        ids = []
        for _, expr, expected in block:
            if said := tried(expected, g.node, expr):
                return None, said
            ids.append(g.nodes()[-1])
        for a in last:
            for b in ids:
                if said := tried(expect_edge(g, a, b), g.edge, a, b):
                    return None, said
        last = ids
    return g, None


@pytest.mark.parametrize("seed", range(4))
def test_somatize_refuses_what_the_same_graph_built_edge_by_edge_refuses(seed):
    rng = random.Random(100 + seed)
    refused = 0
    for _ in range(60):
        blocks = blocks_of(rng, rng.randint(2, 9))
        expression = reduce(rshift, [reduce(or_, [expr for _, expr, _ in b]) for b in blocks])
        try:
            built, said = Graph.somatize(expression), None
        except ValueError as e:
            built, said = None, str(e)
        by_hand, said_by_hand = laid_by_hand(blocks)
        assert said == said_by_hand
        if built is not None:
            assert state(built) == state(by_hand)
        refused += said is not None
    assert 10 < refused < 55


def test_the_node_named_is_the_nearest_trainable_one_not_the_first_found_depth_first():
    far, near, p, x = (
        Lin().named("far"),
        Lin().named("near"),
        Plain().named("p"),
        Plain().named("x"),
    )
    above = far >> (p | near) >> x  # x <- p <- far, and x <- near: far and near trainable
    said = r"^node 'c' is \.cached\(\) but is fed by node 'near'"
    with pytest.raises(ValueError, match=said):
        Graph.somatize(above >> Plain().named("c").cached())
    g = Graph.somatize(above)
    g.node(Plain().named("c").cached())
    with pytest.raises(ValueError, match=said):
        g.edge("x", "c")


class Counted(Lin):
    """Counts how often its parameters are asked for: how often its trainability is read."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def parameters(self, recurse: bool = True):
        self.asked += 1
        return super().parameters(recurse)


@pytest.mark.parametrize("n", [20, 80])
def test_somatize_reads_whether_a_node_is_trainable_once_not_once_per_cached_node_below(n):
    held = [Counted().requires_grad_(False) for _ in range(n)]  # set aside by hand, not frozen
    chain = reduce(rshift, [part for lin in held for part in (lin, Plain().cached())])
    for lin in held:
        lin.asked = 0  # requires_grad_ asks too
    g = Graph.somatize(chain)
    assert len(g.cached()) == n
    assert [lin.asked for lin in held] == [1] * n  # read, once: a build is linear in its size
    held[0].requires_grad_(True)
    held[0].asked = 0
    with pytest.raises(ValueError, match=r"^node 'plain' .* fed by node 'counted'"):
        Graph.somatize(chain)  # read again at the next build
    assert held[0].asked == 1
    g.node("late", Plain().cached())  # and at the next g.edge of the graph built before
    with pytest.raises(ValueError, match=r"^node 'late' .* fed by node 'counted'"):
        g.edge(g.leaves()[0], "late")
    held[0].requires_grad_(False)
    g.edge(g.leaves()[0], "late")


def test_g_edge_reads_again_what_an_earlier_call_read():
    lins = [Lin().requires_grad_(False) for _ in range(3)]
    g = Graph()
    for k, lin in enumerate(lins):
        g.node(f"l{k}", lin)
        g.node(f"c{k}", Plain().cached())
    g.edge("l0", "l1")
    g.edge("l1", "c0")
    g.edge("l1", "l2")
    lins[0].requires_grad_(True)  # between two calls: the next one sees it
    with pytest.raises(ValueError, match=r"^node 'c1' is \.cached\(\) but is fed by node 'l0'"):
        g.edge("l2", "c1")
    lins[1].requires_grad_(True)  # nearer: named first
    with pytest.raises(ValueError, match=r"^node 'c1' is \.cached\(\) but is fed by node 'l1'"):
        g.edge("l2", "c1")
    g.declare("l2", frozen=True)  # nothing cached below it yet
    with pytest.raises(ValueError, match=r"^node 'c2' is \.cached\(\) but is fed by node 'l1'"):
        g.edge("l2", "c2")
    for lin in lins[:2]:
        lin.requires_grad_(False)  # set aside again: accepted
    g.edge("l2", "c2")
    assert g.edges()[-1] == ("l2", "c2")
