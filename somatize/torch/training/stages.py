"""A graph cut where a value crosses a host or a trainer, and run stage by stage.

Each node gets the pair (host, trained-by-a-Learning); an edge whose ends differ in it is a cut,
and a node's stage is the most cuts on any path behind it. The nodes of one stage with one pair
make a `Part`, which runs a small graph of its own (the graph itself is never touched). A
forward runs the parts stage by stage; a backward is `loss.backward()` in the last one, then
the gradient owed at each cut travels back, in reverse, inside an `Envelope`. A part runs here
or on a worker (`somatize.torch.training.remote`) through the same two calls.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from somatize import _hooks, run
from somatize.graph import Graph
from somatize.node import Node, Piece, Settings
from somatize.torch import _caches
from somatize.torch._modules import tensors_in
from somatize.torch.training.learning import Envelope, backward_from, grad_of, gradient, leafed
from somatize.torch.training.params import trainable_params, untied_from_frozen

__all__ = ["INPUT", "LOSS", "TARGET", "Part", "Stages", "Inlet", "Outlet", "untied"]

INPUT = "<input>"
"""The source of a value that is the graph's own input (what the roots receive)."""

LOSS = "<loss>"
"""The destination of a graph leaf: the objective, in the Trainer's process."""

TARGET = "<target>"
"""Where the step's target is among a part's inputs, for a Learning that `needs_target`."""


_keys = itertools.count(1)


def carried(value: Any) -> list[Any]:
    """Every tensor `value` carries across a cut (what a wire sends), in order: those
    `tensors_in` finds (the outputs one differentiates), and the tensors a transformers cache of
    any kind holds wherever one sits (a `DynamicCache`'s keys and values), which `tensors_in`
    leaves out: a model keeps them for its next call, and no gradient is asked of them."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in carried(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in carried(v)]
    if _caches.any_cache(value):
        return carried(list(vars(value).values()))  # its layers, and each layer's tensors
    return tensors_in(value)


def nbytes(value: Any) -> int:
    """How many bytes the tensors `value` carries hold (`carried`: a cache's among them)."""
    return sum(t.nelement() * t.element_size() for t in carried(value))


class Inlet(Node):
    """Picks the value of one source out of what a part was handed."""

    def __init__(self, source: str) -> None:
        self.source = source

    def forward(self, inputs: Any, ctx: Any) -> Any:
        """The value that came from `source`."""
        return inputs[self.source]


class Outlet(Node):
    """Hands on the value of a node that also feeds nodes inside its own part."""

    def forward(self, value: Any, ctx: Any) -> Any:
        """The value, untouched."""
        return value


class Part:
    """The nodes of one stage with one (host, Learning) pair: what a transport runs.

    It carries what rebuilds it on another machine: `ids` (its nodes, in the order they run),
    `nodes`, `settings` (host removed), `learning` (the Learning of `trained`, or None),
    `entering` (edges `(source, node)` from outside, `source` a node id or `INPUT`) and
    `leaving` (edges `(node, destination)` to outside, `destination` a node id or `LOSS`).

    The class is also the transport of a part run in this process: a transport answers
    `forward(part, {source: value}, store=, watching=)` with `{exit: value}` and
    `backward(part, {exit: Envelope})` with `{source: Envelope}`; a remote one is `Remote`.
    """

    def __init__(
        self,
        graph: Graph,
        ids: list[str],
        *,
        stage: int,
        host: str | None,
        learning: Any = None,
        trained: str | None = None,
        last: bool = False,
        whole: bool = False,
    ) -> None:
        inside = set(ids)
        self.key = f"p{next(_keys)}"  # what a worker keeps it under; never reused, as an id() is
        self.stage = stage
        self.host = host
        self.ids = tuple(ids)
        self.trained = trained
        self.learning = learning
        self.last = last
        self.nodes = {n: graph.implementation(n) for n in ids}
        self.settings = {n: replace(graph.setting(n), host=None) for n in ids}
        self.preds = {n: graph.predecessors(n) for n in ids}
        self.succ = {n: graph.successors(n) for n in ids}
        # a root reads the graph's input, a leaf goes to the loss
        self.entering = tuple(
            (p, n) for n in ids for p in self.preds[n] or [INPUT] if p not in inside
        )
        self.leaving = tuple((n, s) for n in ids for s in self.succ[n] or [LOSS] if s not in inside)
        self.sources = tuple(dict.fromkeys(s for s, _ in self.entering))
        self.exits = tuple(dict.fromkeys(n for n, _ in self.leaving))
        self.asks_target = bool(learning is not None and learning.needs_target)
        self._inputs: dict[str, Any] | None = None
        self._outputs: dict[str, Any] | None = None
        self.raw = True  # its graph takes the value of its one source as it is
        self.leaf_of: dict[str, str] = {}
        self.ctx: Any = None
        self.audit: Any = None  # on a worker, what measures its nodes there (remote.serve_stage)
        self.graph = graph if whole else self._small_graph()

    # -- the graph it runs ---------------------------------------------------------------
    def _small_graph(self) -> Graph:
        # Handed one value that its nodes take as their only input: no Inlet needed.
        self.raw = len(self.sources) == 1 and all(len(self.preds[n]) <= 1 for _, n in self.entering)
        sub = Graph()
        if not self.raw:
            for s in self.sources:
                sub.node(s, Inlet(s))
        for n in self.ids:  # in the order they run: what a node reads is there before it
            sub.node(n, Piece(self.nodes[n], replace(self.settings[n], name=None)))
            for p in self.preds[n] or [INPUT]:
                if p in self.nodes or not self.raw:
                    sub.edge(p, n)
        leaf_of: dict[str, str] = {}
        for n in self.exits:
            if sub.successors(n):
                # an id no user can give ('/' is refused in one), so it never meets theirs
                leaf_of[sub.node(Piece(Outlet(), Settings(name=f"{n}/out")))] = n
                sub.edge(n, f"{n}/out")
            else:
                leaf_of[n] = n
        self.leaf_of = leaf_of
        if self.trained is not None:
            device = self.settings[self.trained].device
            self.ctx = run.Ctx(f"{self.trained}/learning", device, None, sub)
        return sub

    # -- running -------------------------------------------------------------------------
    def forward(
        self, inputs: dict[str, Any], *, store: Any = None, watching: Any = None
    ) -> dict[str, Any]:
        """Run the part on `{source: value}`; answer `{exit: value}`. Values from another part
        become leaves here, so the gradient owed to each source can be read off them later; around
        a trained node its Learning's two positions run."""
        learning = self.learning
        device = None if learning is None else self.settings[self.trained].device
        if learning is None:
            self._inputs = inputs = {s: v if s == INPUT else leafed(v) for s, v in inputs.items()}
        elif self.asks_target:
            inputs = dict(inputs)
            target = inputs.pop(TARGET, None)
            learning.target = target if device is None else _hooks.move(target, device)
        x = inputs[self.sources[0]] if self.raw else inputs
        if learning is not None:
            x = learning.entering(x if device is None else _hooks.move(x, device), self.ctx)
        out = self.graph.forward(x, store=store, watching=watching)
        if len(self.exits) == 1:
            outs = {self.exits[0]: out}
        else:
            outs = {n: out[leaf] for leaf, n in self.leaf_of.items()}
        if learning is not None:
            outs[self.trained] = learning.forward(outs[self.trained], self.ctx)
        self._outputs = outs
        return outs

    def backward(self, envelopes: dict[str, Any]) -> dict[str, Any]:
        """Take `{exit: Envelope}` (dL/d of what left), answer `{source: Envelope}`: through the
        Learning of a trained part, else through the part's own autograd graph (the last part's
        already ran in `loss.backward()`). An empty envelope after no forward ends a group."""
        closing = any(e.closing for e in envelopes.values())
        if self.learning is None:
            inputs, outputs = self._inputs or {}, self._outputs
            if not self.last and outputs is not None:
                backward_from(
                    [outputs.get(n) for n in envelopes], [e.gradient for e in envelopes.values()]
                )
            self._inputs = self._outputs = None
            return {s: Envelope(grad_of(v), closing) for s, v in inputs.items() if s != INPUT}
        (came,) = envelopes.values()
        back = self.learning.forward(came, self.ctx).gradient
        self._outputs = None
        if self.raw:  # the Learning was given the one source's value as it is
            owed = {self.sources[0]: back}
        else:
            owed = {s: back.get(s) if isinstance(back, dict) else None for s in self.sources}
        return {s: Envelope(g, closing) for s, g in owed.items() if s != INPUT}

    def unwritable(self, answer: dict[str, Any], error: Any) -> Any:
        """The error of a `stage.forward` answer that could not be written down, naming the node
        whose output cannot be (no codec, or nested too deep)."""
        from somatize.remote import wire

        outs = answer["outs"].items()
        return wire.unwritable(((f"the output of node {n!r}", v) for n, v in outs), error)

    def __repr__(self) -> str:
        at = f" at {self.host!r}" if self.host else ""
        by = f" trained by {self.learning!r}" if self.learning is not None else ""
        return f"Part(stage {self.stage}{at}: {', '.join(self.ids)}{by})"


_HERE = (None, None)


def untied(graph: Graph, trains: dict[str, Any]) -> None:
    """Refuse one trainable parameter held by two nodes that a cut parts (tied weights, GPT-2's
    `wte` and `lm_head`): each side would update it on its own, so the tie would not hold; and
    one held by a frozen node and by one that is not (`untied_from_frozen`)."""
    hosts = graph.hosts()

    def how(nid: str) -> str:
        host, learning = hosts.get(nid), trains.get(nid)
        where = "here" if host is None else f"on host {host!r}"
        by = "the Trainer's optimizer" if learning is None else type(learning).__name__
        return f"{where}, by {by}"

    def side(nid: str) -> tuple[str | None, str | None]:
        return hosts.get(nid), nid if nid in trains else None

    frozen = {nid for nid in graph.nodes() if graph.setting(nid).frozen}
    untied_from_frozen(graph, frozen)
    seen: dict[int, tuple[str, str]] = {}
    for nid in graph.topological_sort():
        if nid in frozen:  # frozen, it learns nothing on either side
            continue
        for key, t in trainable_params(graph, nid):
            oid, okey = seen.setdefault(id(t), (nid, key))
            if side(oid) == side(nid):  # one host, trained by one thing
                continue
            raise ValueError(
                f"node {oid!r} ({okey}) and node {nid!r} ({key}) hold one parameter (tied "
                f"weights), and a cut runs between them: {oid!r} is trained {how(oid)}, "
                f"{nid!r} {how(nid)}. Each side would update it on its own (a worker, a copy "
                "of its own), so the tie would not hold and training would differ from one "
                "process. Keep tied weights on one side of every cut (one host, trained by "
                "one thing), or untie them: give one of the two a copy of its own, "
                "module.weight = nn.Parameter(module.weight.detach().clone())"
            )


class Stages:
    """A graph cut into parts, run forward stage by stage and backward in reverse.

    `trains` is `{node id: Learning}`; `transport(host)` answers how a part at that host runs
    (None: in this process, as by default everything runs). `watching` is told what the parts
    run as one forward, and while somebody watches `crossed()` counts the bytes that went from
    part to part. With no cut there is one part, the graph itself, run by `graph.forward`.
    """

    def __init__(
        self,
        graph: Graph,
        trains: dict[str, Any] | None = None,
        *,
        transport: Callable[[str | None], Any] | None = None,
        watching: list[Callable[[dict], Any]] | None = None,
    ) -> None:
        trains = trains or {}
        hosts = graph.hosts()
        order = graph.topological_sort()
        pair = {n: (hosts.get(n), n if n in trains else None) for n in order}
        stage: dict[str, int] = {}
        grouped: dict[tuple, list[str]] = {}
        for n in order:
            stage[n] = max(
                (stage[p] + (pair[p] != pair[n]) for p in graph.predecessors(n)), default=0
            )
            grouped.setdefault((stage[n], pair[n]), []).append(n)
        sink = max(stage[n] + (pair[n] != _HERE) for n in graph.leaves())
        self.whole = len(grouped) == 1 and (sink, _HERE) in grouped
        self.graph = graph
        self.parts: list[Part] = []
        for (s, (host, trained)), ids in sorted(grouped.items(), key=lambda kv: kv[0][0]):
            self.parts.append(
                Part(
                    graph,
                    ids,
                    stage=s,
                    host=host,
                    learning=trains.get(trained),
                    trained=trained,
                    last=(s, (host, trained)) == (sink, _HERE),
                    whole=self.whole,
                )
            )
        where = transport or (lambda host: None)
        self.leaves = tuple(graph.leaves())
        # the leaves outside the last part, whose values cross a cut to reach the loss
        self.sunk = tuple(n for n in self.leaves if (stage[n], pair[n]) != (sink, _HERE))
        self._sunk: dict[str, Any] = {}
        self.watchers = list(watching or [])
        self._bytes = [0, 0]  # forward, backward: what crossed from part to part, when watched
        self._route = tuple(
            (p, where(p.host) or Part, self._relay(p) if self.watchers else None)
            for p in self.parts
        )

    def _relay(self, part: Part) -> Callable[[dict], None]:
        ids = frozenset(part.ids)
        watchers = self.watchers

        def relay(fact: dict) -> None:
            if fact.get("fact") != "finished" and fact.get("node", "") in ids:
                run.tell(watchers, fact)

        return relay

    def audited(self, audit: Any) -> None:
        """Hand `audit` to every transport that runs a part elsewhere and measures it there
        (`Remote`), and tell the audit those nodes are measured there."""
        for part, transport, _ in self._route:
            if part.host is not None and hasattr(transport, "audit"):
                transport.audit = audit
                audit.elsewhere.update(part.ids)

    def recompile(self) -> None:
        """Drop every part's compiled plan, so the next forward sees the nodes as they are
        now (an Audit wraps and unwraps their `forward`)."""
        for part in self.parts:
            part.graph.invalidate()

    def crossed(self) -> tuple[int, int]:
        """`(forward, backward)`: the bytes of the tensors handed from one part to another since
        the last time it was asked, counted only while somebody watches."""
        counted, self._bytes = self._bytes, [0, 0]
        return counted[0], counted[1]

    def __repr__(self) -> str:
        return "Stages(" + "; ".join(repr(p) for p in self.parts) + ")"

    def forward(self, x: Any, *, store: Any = None, target: Any = None) -> Any:
        """Run every part in stage order on the graph's input; answer what the graph returns
        (a leaf that crossed a cut to get here arrives as a leaf of its own). `target` is
        handed to the parts whose Learning `needs_target`."""
        watchers = self.watchers
        if self.whole:
            return self.graph.forward(x, store=store, watching=watchers or None)
        began = time.perf_counter_ns() if watchers else 0
        values: dict[str, Any] = {INPUT: x}
        for part, transport, relay in self._route:
            inputs = {s: values[s] for s in part.sources}
            if part.asks_target:
                inputs[TARGET] = target
            if watchers:
                self._bytes[0] += sum(nbytes(v) for s, v in inputs.items() if s != INPUT)
            values.update(transport.forward(part, inputs, store=store, watching=relay))
        for n in self.sunk:
            values[n] = self._sunk[n] = leafed(values[n])
        if watchers:
            run.tell(watchers, run.finished(began))
        if len(self.leaves) == 1:
            return values[self.leaves[0]]
        return {n: values[n] for n in self.leaves}

    def backward(self, loss: Any, closing: bool = False) -> None:
        """`loss.backward()`, then the gradient at every cut back to where its value came from,
        part by part in reverse; `closing` rides along to say the group ends here."""
        loss.backward()
        if not self.whole:
            owed = {n: [Envelope(grad_of(self._sunk.pop(n)), closing)] for n in self.sunk}
            self._back(owed, closing)

    def update(self) -> None:
        """Tell every part the group is over: an empty, closing envelope, part by part."""
        if not self.whole:
            self._back({}, True)

    def _back(self, owed: dict[str, list], closing: bool) -> None:
        watched = bool(self.watchers)
        for part, transport, _ in reversed(self._route):
            envelopes = {}
            for n in part.exits:
                came = owed.pop(n, ())
                if len(came) == 1:
                    envelopes[n] = came[0]
                else:
                    total = gradient({str(i): e for i, e in enumerate(came)}) if came else None
                    envelopes[n] = Envelope(total, closing)
            if watched and not part.last:
                self._bytes[1] += sum(nbytes(e.gradient) for e in envelopes.values())
            for s, e in transport.backward(part, envelopes).items():
                owed.setdefault(s, []).append(e)
