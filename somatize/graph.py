"""Graph: the topology of a network of nodes, how to read it back, and how to run it.

Built from an expression (`Graph.somatize(enc >> (a | b) >> join)`) or by hand
(`g.node(...)`, `g.edge(a, b)`). Running it (`forward`) compiles it once into a flat plan,
which is kept until the topology changes (see `somatize.run`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import replace
from types import NoneType
from typing import Any

from somatize import _hooks, _keys, caching, run
from somatize.node import (
    DEVICE,
    Chain,
    Expr,
    Node,
    Piece,
    Settings,
    kind_name,
    takes_ctx,
    to_call,
    unwrap,
)
from somatize.store import store_of

__all__ = ["Graph", "as_graph"]


class Graph:
    """A directed acyclic graph of nodes, each with an id and what was declared of it.

    >>> g = Graph.somatize(Encoder() >> (Left() | Right()) >> Join())   # doctest: +SKIP
    >>> g.forward(x)                                                   # doctest: +SKIP

    Training does not touch the graph: its nodes, edges, plan and placement stay as they are;
    what changes are the weights inside the nodes.
    """

    def __init__(self) -> None:
        self._impl: dict[str, Node] = {}
        self._settings: dict[str, Settings] = {}
        self._succ: dict[str, list[str]] = {}
        self._pred: dict[str, list[str]] = {}
        self._edges: list[tuple[str, str]] = []
        self._counts: dict[str, int] = {}
        self._plan: Any = None
        self._unkeyed: dict[str, _keys.Unkeyable | None] = {}  # per node, `_keys.unkeyable`
        self._above: dict[str, dict[str, Any]] = {"modules": {}, "trainable": {}, "unkeyable": {}}

    # -- building ------------------------------------------------------------------------
    @classmethod
    def somatize(cls, expression: Any) -> Graph:
        """The graph an expression declares: `>>` chains, `|` opens branches.

        A module (`nn.Module`) or a plain function is taken as it is, a graph of one node
        (`Node.of(model)`), so an existing model needs no rewriting to be run, trained, drawn
        or probed here.
        """
        if not isinstance(expression, Expr):
            what = (
                "a somatize Graph, an expression of Nodes (a >> b, a | b), a module or a function"
            )
            to_call(expression, "Graph.somatize", what)
            expression = Node.of(expression)
        (g := cls())._lay(expression, Settings())
        return g

    def _lay(self, expr: Expr, outer: Settings) -> tuple[list[str], list[str]]:
        if isinstance(expr, (Node, Piece)):
            nid = self._add(*next(expr.pieces(outer)))  # a node or a piece holds one
            return [nid], [nid]
        mine = expr._settings.under(outer)
        entries: list[str] = []
        exits: list[str] = []
        for part in expr.parts:
            first, last = self._lay(part, mine)
            if isinstance(expr, Chain):  # every exit so far feeds every entry of this part
                for a in exits:
                    for b in first:
                        self._join(a, b)  # no requires_grad changes while laid
                entries, exits = entries or first, last
            else:  # side by side
                entries, exits = entries + first, exits + last
        return entries, exits

    def node(self, *args: Any) -> str:
        """Add a node, `g.node(obj)` or `g.node("id", obj)`, and return its id.

        `obj` is a `Node` or a declared one (`Enc().on("cpu")`). A duplicate id is refused.
        """
        if len(args) not in (1, 2):
            raise TypeError("g.node takes (obj) or (id, obj)")
        *named, obj = args
        if not isinstance(obj, Expr):
            raise TypeError(f"g.node takes a Node, not {type(obj).__name__} {obj!r:.60}")
        if len(found := list(obj.pieces())) != 1:
            raise ValueError(f"g.node adds one node; this expression holds {len(found)}")
        if named and named[0] is not None:
            found = list(obj.named(named[0]).pieces())  # the id checked as .named checks it
        return self._add(*found[0])

    def _add(self, node: Node, settings: Settings) -> str:
        nid = settings.name
        if nid is None:
            # as .named checks an id: no "/" or "." (a class may be given any __name__)
            base = kind_name(node).lower().replace("/", "_").replace(".", "_") or "node"
            k = self._counts.get(base, 0) + 1
            while (nid := base if k == 1 else f"{base}_{k}") in self._impl:
                k += 1
            self._counts[base] = k
        elif nid in self._impl:
            raise ValueError(
                f"duplicate node id {nid!r}: a {kind_name(self._impl[nid])} already has it; "
                f"give this {kind_name(node)} another with .named(...)"
            )
        if not takes_ctx(node):
            cls = type(node).__name__
            raise TypeError(
                f"node {nid!r}: {cls}.forward does not take ctx. A Node's forward is "
                f"forward(self, input, ctx), ctx saying where it runs: add the ctx parameter "
                f"to {cls}.forward, or put a plain module in the graph as it is with "
                f"Node.of(module)"
            )
        self._settle(nid, node, settings)
        self._impl[nid], self._settings[nid] = node, settings
        self._succ[nid], self._pred[nid] = [], []
        self._plan = None
        return nid

    def _settle(self, nid: str, node: Node, s: Settings, was: str | None = None) -> None:
        """Refuse what cannot be said of `node`, then move what it holds to the device `s`
        places it on, if not already `was` there (a node .at(host) is placed on its worker)."""
        if s.device is not None and not (isinstance(s.device, str) and DEVICE.match(s.device)):
            raise ValueError(
                f"node {nid!r} is placed .on({s.device!r}), which is not a device: use "
                "'cpu', 'cuda', 'cuda:N', 'mps' or 'meta'"
            )
        if s.host is not None and not (isinstance(s.host, str) and s.host):
            raise ValueError(f"node {nid!r}: a host is a non-empty name, not {s.host!r}")
        _hooks.ready()
        if s.cached and not s.frozen and _hooks.trainable(node):
            raise ValueError(
                f"node {nid!r} is .cached() but holds trainable state and is not .frozen(): "
                "its output would change under the cache. Declare it .frozen().cached(), "
                "or do not cache it"
            )
        if s.cached and (why := _keys.unkeyable(node, s.salt)) is not None:
            if s.salt is None:
                raise _keys.refusal(nid, nid, why)
            raise ValueError(
                f"node {nid!r} is .cached() with a salt its key cannot take in ({why}): pass a "
                "salt of plain values (a str, a number, a tuple of them)"
            )
        if s.device is None or s.device == was or s.host is not None:
            return
        try:
            _hooks.place(node, s.device)
        except ValueError as error:  # a device this machine does not have
            raise ValueError(f"node {nid!r}: {error}") from None
        except Exception as e:
            run.note(
                e,
                f"while placing node {nid!r} ({kind_name(node)}) .on({s.device!r}): this "
                "machine may not have that device; declare another with .on(...), or leave "
                ".on() out",
            )
            raise

    def edge(self, a: str, b: str) -> None:
        """Add the edge a → b. An unknown id, or an edge that would close a cycle, is refused."""
        for end in (a, b):
            if end not in self._impl:
                raise ValueError(f"no node {end!r} in this graph; it has {list(self._impl)}")
        self._above["trainable"].clear()  # a requires_grad may have changed since the last call
        self._join(a, b)

    def _join(self, a: str, b: str) -> None:
        if b in self._succ[a]:
            return
        down = self._around(b, self._succ)
        if a in down:
            raise ValueError(f"the edge {a!r} -> {b!r} would close a cycle")
        self._refuse_stale(a, [n for n in down if self._settings[n].cached])
        self._forget_above(down)
        self._succ[a].append(b)
        self._pred[b].append(a)
        self._edges.append((a, b))
        self._plan = None

    def _around(self, start: str, links: dict[str, list[str]]) -> list[str]:
        """`start` and every node `links` lead to from it, each once, nearest first."""
        found, seen = [start], {start}
        for here in found:  # grows as it goes
            for nxt in links[here]:
                if nxt not in seen:
                    seen.add(nxt)
                    found.append(nxt)
        return found

    def _refuse_stale(self, a: str, cached: list[str]) -> None:
        """Refuse the `cached` nodes `a` feeds if a node at or above `a` could change unseen by
        their keys (unfrozen trainable state, or an unkeyable argument where unsalted)."""
        if cached and self._nearest(a, "modules") and (up := self._nearest(a, "trainable")):
            raise ValueError(
                f"node {cached[0]!r} is .cached() but is fed by node {up!r}, which holds trainable "
                f"state and is not .frozen(): the value kept for {cached[0]!r} would still be "
                f"served after the weights of {up!r} change. Declare the part before it frozen, "
                f"(prefix).frozen() >> ..., or do not cache {cached[0]!r}"
            )
        unsalted = [c for c in cached if self._settings[c].salt is None]
        if unsalted and (up := self._nearest(a, "unkeyable")):
            raise _keys.refusal(unsalted[0], up, self._unkeyed[up])

    def _nearest(self, start: str, what: str) -> str | None:
        """The nearest node at or above `start` holding `what` (for "unkeyable" the first found
        depth first), or None; kept per node as (edges up, node) until something above changes."""
        above, todo = self._above[what], [start]
        step = what != "unkeyable"  # 0: the first edge in wins at every node, depth first
        while todo:
            if (here := todo[-1]) in above:
                todo.pop()
            elif waiting := [p for p in self._pred[here] if p not in above]:
                todo += waiting
            else:
                todo.pop()
                ups = [above[p] for p in self._pred[here] if above[p]]
                d, up = min(ups, key=lambda du: du[0], default=(0, None))  # ties: first edge in
                above[here] = (0, here) if self._holds(here, what) else up and (d + step, up)
        return above[start] and above[start][1]

    def _holds(self, nid: str, what: str) -> Any:
        """What `_nearest` looks for at `nid`: unfrozen modules, trainable ones, or why unkeyable."""
        if what == "modules":
            return not self._settings[nid].frozen and _hooks.state_modules(self._impl[nid])
        if what == "trainable":
            return self._above["modules"][nid] == (0, nid) and _hooks.trainable(self._impl[nid])
        if nid not in self._unkeyed:
            self._unkeyed[nid] = _keys.unkeyable(self._impl[nid])
        return self._unkeyed[nid]

    def _forget_above(self, nodes: list[str]) -> None:
        for above in self._above.values():
            for n in nodes:
                above.pop(n, None)

    def declare(self, id: str, **said: Any) -> None:
        """Say something more of a node already in the graph (`frozen=True`, `salt=...`).

        Checked as when the graph is built; a refusal leaves the node as it was.
        """
        s = self.setting(id)
        allowed = set(s.__dict__) - {"name"}
        if not allowed.issuperset(said):
            raise ValueError(f"declare() takes {sorted(allowed)}, not {sorted(said)}")
        new = replace(s, **said)
        down = self._around(id, self._succ)
        self._settings[id] = new  # as the check of what it feeds and is fed by sees it
        self._forget_above(down)
        self._above["trainable"].clear()  # a requires_grad may have changed since the last call
        try:
            self._refuse_stale(id, [n for n in down[1:] if self._settings[n].cached])
            for p in self._pred[id] if new.cached else ():
                self._refuse_stale(p, [id])
            self._settle(id, self._impl[id], new, s.device)
        except BaseException:
            self._settings[id] = s
            self._forget_above(down)
            raise
        self._plan = None

    def invalidate(self) -> None:
        """Drop the compiled plan, so the next forward compiles it again (after a node's
        `forward` was wrapped or unwrapped in place, for example), and with it the cache keys
        (after a frozen node's weights were changed by hand)."""
        self._plan = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plan": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # the plan is this process's (it points back weakly); what the refusals keep, found again
        self.__dict__.update(state, _unkeyed={}, _above=Graph()._above)

    # -- reading it back ------------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Node ids, in declaration order."""
        return list(self._impl)

    def edges(self) -> list[tuple[str, str]]:
        """Edges as (from, to) pairs, in the order they were added."""
        return list(self._edges)

    def roots(self) -> list[str]:
        """Nodes with no predecessor: each receives the graph's input."""
        return [n for n in self._impl if not self._pred[n]]

    def leaves(self) -> list[str]:
        """Nodes with no successor: what the graph returns."""
        return [n for n in self._impl if not self._succ[n]]

    def predecessors(self, id: str) -> list[str]:
        """The nodes feeding `id`, in the order their edges were added."""
        return list(self._pred[self._known(id)])

    def successors(self, id: str) -> list[str]:
        """The nodes `id` feeds."""
        return list(self._succ[self._known(id)])

    def topological_sort(self) -> list[str]:
        """Every node after all of its predecessors; ties kept in declaration order."""
        waiting = {n: len(self._pred[n]) for n in self._impl}
        rank = {n: i for i, n in enumerate(self._impl)}
        ready = [(rank[n], n) for n in self._impl if waiting[n] == 0]
        heapq.heapify(ready)
        out: list[str] = []
        while ready:
            _, n = heapq.heappop(ready)
            out.append(n)
            for m in self._succ[n]:
                waiting[m] -= 1
                if waiting[m] == 0:
                    heapq.heappush(ready, (rank[m], m))
        return out

    def implementation(self, id: str) -> Node:
        """The node object behind an id."""
        return self._impl[self._known(id)]

    def setting(self, id: str) -> Settings:
        """Everything declared of a node (name, device, host, frozen, cached, salt, mapped)."""
        return self._settings[self._known(id)]

    def devices(self) -> dict[str, str]:
        """`{id: device}` for the nodes placed `.on(device)`; a node placed nowhere in
        particular is not listed."""
        return {n: s.device for n, s in self._settings.items() if s.device is not None}

    def hosts(self) -> dict[str, str]:
        """`{id: host}` for the nodes that run `.at(host)`; a node that runs in this process is
        not listed."""
        return {n: s.host for n, s in self._settings.items() if s.host is not None}

    def frozen(self) -> dict[str, str | None]:
        """`{id: digest}` for every node declared `.frozen()`: the digest of its state once it
        is settled (`somatize.torch.freeze`, or a Trainer, has stopped every parameter it holds
        asking for a gradient), `None` until then and for a node that holds no state."""
        _hooks.ready()
        return {
            n: None if _hooks.trainable(node) else _hooks.state_digest(node)
            for n, node in self._impl.items()
            if self._settings[n].frozen
        }

    def cached(self) -> dict[str, Any]:
        """`{id: salt}` for every cached node."""
        return {n: self._settings[n].salt for n in self._impl if self._settings[n].cached}

    def mapped_nodes(self) -> list[str]:
        """The nodes that map over the items of a list."""
        return [n for n in self._impl if self._settings[n].mapped]

    def __len__(self) -> int:
        return len(self._impl)

    def __contains__(self, id: object) -> bool:
        return id in self._impl

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._impl))

    def __repr__(self) -> str:
        return f"Graph({len(self._impl)} nodes, {len(self._edges)} edges)"

    def _known(self, id: str) -> str:
        if id not in self._impl:
            raise KeyError(f"no node {id!r} in this graph; it has {list(self._impl)}")
        return id

    # -- the plan ---------------------------------------------------------------------------
    def plan_json(self) -> dict[str, Any]:
        """The graph as data: nodes with what was declared of them, edges, roots, leaves, order."""
        order = self.topological_sort()
        step = {n: k for k, n in enumerate(order)}
        nodes = [
            {
                "id": n,
                "kind": kind_name(self._impl[n]),
                "device": s.device,
                "host": s.host,
                "frozen": bool(s.frozen),
                "cached": bool(s.cached),
                "salt": s.salt if isinstance(s.salt, (str, int, float, NoneType)) else repr(s.salt),
                "mapped": bool(s.mapped),
                "predecessors": list(self._pred[n]),
                "step": step[n],
            }
            for n, s in self._settings.items()
        ]
        return {
            "nodes": nodes,
            "edges": [list(e) for e in self._edges],
            "roots": self.roots(),
            "leaves": self.leaves(),
            "order": order,
        }

    def plan(self) -> str:
        """The plan as text for a person: one line per step, in the order it runs."""
        data = self.plan_json()
        lines = [repr(self)]
        for d in sorted(data["nodes"], key=lambda d: d["step"]):  # in the order they run
            src = ", ".join(d["predecessors"]) or "input"
            marks = [f"{k} {d[key]}" for k, key in (("on", "device"), ("at", "host")) if d[key]]
            mark = " ".join(marks + [m for m in ("frozen", "cached", "mapped") if d[m]])
            step = f"{d['step']:>3}. {d['id']} ({d['kind']}) <- {src}"
            lines.append(step + (f"  [{mark}]" if mark else ""))
        lines.append("returns " + ", ".join(data["leaves"]))
        return "\n".join(lines)

    # -- running --------------------------------------------------------------------------
    def forward(
        self,
        input: Any = None,
        *,
        broker: Any = None,
        store: Any = None,
        watching: Any = None,
    ) -> Any:
        """Run the whole graph on `input` and return the leaf's value.

        Every root receives `input`; a node with one predecessor receives its value, one with
        several a dict keyed by predecessor id. With several leaves the answer is a dict keyed
        by leaf id. Any value crosses an edge untouched (tensors keep their autograd history).
        A node that raises propagates its own exception, with a note naming the node.

        `store` (a `Store` or a path) keeps what `.cached()` nodes produce; `watching` (a
        callable, a `Recorder`, or a list of them) is told what happens; `broker` says where
        the hosts of `.at(host)` nodes are.
        """
        plan = self._plan = self._plan or run.Plan(self)
        told = run.watchers(watching)
        input = unwrap(input)
        if plan.hosts:
            broker_for(plan.hosts, broker, "broker=Broker.embedded({%s: Worker.at('host:port')})")
            return broker.forward(plan, input, store=store, watching=told)
        if store is not None and plan.cached:
            return caching.walk_cached(plan, input, store_of(store), told)
        return run.run_plan(plan, input, told)

    def __call__(self, input: Any = None, **kw: Any) -> Any:
        """Same as `forward`."""
        return self.forward(input, **kw)

    # -- drawing --------------------------------------------------------------------------
    def figure(self, inside: Any = None, colour: Any = None, **kw: Any) -> Any:
        """Draw the graph as a live widget; `inside=architecture(g, x)` opens each node."""
        from somatize.figures import graph_figure

        return graph_figure(self, inside=inside, colour=colour, **kw)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        try:
            fig = self.figure()
        except ImportError:
            return {"text/plain": repr(self)}
        data, meta = fig._repr_mimebundle_(include=include, exclude=exclude)
        return {**data, "text/plain": repr(self)}, meta


def broker_for(hosts: dict[str, str], broker: Any, passing: str) -> None:
    """Refuses `.at(host)` nodes (`hosts`, `{node: host}`) without a broker that says where
    their hosts are, or with something that is not a somatize Broker (it answers `forward` and
    `request`). `passing` is how to pass one, `%s` where the first host's name goes."""
    if not hosts:
        return
    if broker is None:
        nid, host = next(iter(hosts.items()))
        raise ValueError(
            f"node {nid!r} runs .at({host!r}), and no broker says where {host!r} is: "
            "pass " + passing % repr(host)
        )
    if not all(callable(getattr(broker, asked, None)) for asked in ("forward", "request")):
        raise TypeError(
            f"broker= takes a somatize Broker (Broker.embedded({{host: Worker}})), not "
            f"{type(broker).__name__} {broker!r:.60}"
        )


def as_graph(what: Any) -> Graph:
    """What every tool that takes a graph looks at: a `Graph` as it is, anything else as
    `Graph.somatize` builds it (an expression, a bare module or function), or its TypeError."""
    return what if isinstance(what, Graph) else Graph.somatize(what)
