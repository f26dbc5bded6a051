"""The engine: a graph compiled once into a flat plan, then walked in one loop.

A plan is a tuple of steps, each with the slot its value goes into, where its input comes from
(the graph's input, one slot, or several slots gathered into a dict), the node's `forward`, its
`Ctx` and its device. Running is one loop over that tuple. Facts are built only when somebody
watches, and cache keys only when there is a store and something cached (`caching.walk_cached`
works them out and hands this loop steps whose cached nodes look themselves up), so a plain run
pays for neither.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from somatize import _hooks
from somatize.node import Wrapped, kind_name, note, to_call, unwrap

__all__ = ["Ctx", "Plan", "run_plan", "walk", "watchers"]

ROOT, ONE, MANY = 0, 1, 2


class Ctx:
    """What a node is handed besides its input: its id, device, host and graph (`None` once
    nobody else holds the graph: a plan does not keep it alive)."""

    __slots__ = ("id", "device", "host", "_graph")

    def __init__(self, id: str, device: str | None, host: str | None, graph: Any) -> None:
        self.id = id
        self.device = device
        self.host = host
        try:
            self._graph = weakref.ref(graph)
        except TypeError:  # None (a worker's), or what cannot be held weakly: held as it is
            self._graph = lambda: graph

    @property
    def graph(self) -> Any:
        """The graph this node runs in."""
        return self._graph()

    def __reduce__(self) -> tuple:
        return (Ctx, (self.id, self.device, self.host, self.graph))

    def __repr__(self) -> str:
        return f"Ctx(id={self.id!r}, device={self.device!r}, host={self.host!r})"


class Plan:
    """A graph compiled for running. Rebuilt by the graph whenever its topology changes."""

    __slots__ = ("_graph", "ids", "steps", "leaves", "cached", "hosts", "__weakref__")

    def __init__(self, graph: Any) -> None:
        order = graph.topological_sort()
        index = {n: i for i, n in enumerate(order)}
        steps = []
        for i, n in enumerate(order):
            preds = graph.predecessors(n)
            s = graph.setting(n)
            node = graph.implementation(n)
            if not preds:
                mode, src = ROOT, None
            elif len(preds) == 1:
                mode, src = ONE, index[preds[0]]
            else:
                mode, src = MANY, tuple((p, index[p]) for p in preds)
            steps.append(step_of(i, mode, src, node, Ctx(n, s.device, s.host, graph), s.mapped))
        self._graph = weakref.ref(graph)
        self.ids = tuple(order)
        self.steps = tuple(steps)
        self.leaves = tuple((n, index[n]) for n in graph.leaves())
        self.cached = bool(graph.cached())
        self.hosts = graph.hosts()

    @property
    def graph(self) -> Any:
        """The graph this plan was compiled from (held weakly: the graph keeps its plan)."""
        return self._graph()

    def __repr__(self) -> str:
        return f"Plan({len(self.steps)} steps)"


def not_a_list(nid: str, x: Any) -> TypeError:
    """The error for a `.mapped()` node handed something that is not a list."""
    return TypeError(
        f"node {nid!r} is .mapped() and was handed {type(x).__name__}, not a list: "
        "a mapped node takes a list and gives back a list as long"
    )


def step_of(slot: int, mode: int, src: Any, node: Any, ctx: Ctx, mapped: Any) -> tuple:
    """The engine's step `(slot, mode, src, fn, ctx, device)` that runs `node` (`_hooks.entry`);
    when `mapped`, a node of its own is handed the list, a `Node.of` one called per item."""
    call = _hooks.entry(node)
    if not mapped:
        return (slot, mode, src, call, ctx, ctx.device)
    whole = call
    if isinstance(node, Wrapped):  # it takes one item (a batch), as it would unmapped

        def whole(items: list, ctx: Ctx) -> list:
            return [call(item, ctx) for item in items]

    def each(x: Any, ctx: Ctx) -> list:
        if not isinstance(x, list):
            raise not_a_list(ctx.id, x)
        out = whole(x, ctx)
        if not isinstance(out, list) or len(out) != len(x):
            got = len(out) if isinstance(out, list) else type(out).__name__
            raise ValueError(
                f"node {ctx.id!r} is .mapped(): handed {len(x)} items it gave back {got}; "
                "it must return a list as long as the list it was handed"
            )
        return out

    return (slot, mode, src, each, ctx, ctx.device)


def watchers(watching: Any) -> list[Callable[[dict], Any]]:
    """`watching=` as a list of callables; anything that cannot be called is refused."""
    if watching is None:
        return []
    listed = list(watching) if isinstance(watching, (list, tuple)) else [watching]
    for w in listed:
        to_call(w, "watching=", "a callable (called with each fact), a Recorder, or a list of them")
    return listed


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str | Warning, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` (a Warning instance is its own category) said at the
    first line outside somatize on the way up (the user's call, a notebook cell), wherever in
    somatize it is raised: the place a warning names is one the user can act on, and Python's
    default filter tells it once per call site of theirs."""
    level = 1
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def in_one_line(error: BaseException) -> str:
    """`error` as a reason in one line: its class and its message's first line."""
    said = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {said}".strip()


def tell(told: list[Callable[[dict], Any]], *facts: dict) -> None:
    """Give each of `facts`, in order, to every watcher in `told`."""
    for fact in facts:
        for w in told:
            w(fact)


def flush(told: list[Callable[[dict], Any]]) -> None:
    """Flush every watcher in `told` that has a `flush()`: what it was told goes where it keeps
    it now (after a step, or after a probe)."""
    for w in told:
        flushing = getattr(w, "flush", None)
        if callable(flushing):
            flushing()


def finished(start: int) -> dict:
    """The `finished` fact of a run begun at `start` (a `perf_counter_ns` reading)."""
    return {"fact": "finished", "took_us": (time.perf_counter_ns() - start) / 1e3}


def _noted(error: BaseException, plan: Plan, i: int, device: str | None) -> BaseException:
    nid = plan.ids[i]
    node = plan.graph.implementation(nid)
    said = f"while running node {nid!r} ({kind_name(node)})"
    if device is not None:
        said += f", placed .on({device!r})"
    return note(error, said)


def _result(plan: Plan, vals: list) -> Any:
    if len(plan.leaves) == 1:
        return vals[plan.leaves[0][1]]
    return {n: vals[i] for n, i in plan.leaves}


def run_plan(
    plan: Plan, input: Any, told: list[Callable[[dict], Any]], steps: tuple | None = None
) -> Any:
    """Run a plan on `input` and answer what the graph returns; watchers in `told` (if any)
    are told a `ran` fact per node and a `finished` one. `steps` may stand in for
    `plan.steps` (the cached walk's, whose cached nodes look themselves up)."""
    vals: list[Any] = [None] * len(plan.steps)
    start = time.perf_counter_ns()
    walk(plan, plan.steps if steps is None else steps, vals, input, told, start)
    if told:
        tell(told, finished(start))
    return _result(plan, vals)


def walk(
    plan: Plan,
    steps: tuple,
    vals: list[Any],
    input: Any,
    told: list[Callable[[dict], Any]] | None = None,
    start: int = 0,
) -> None:
    """Run `steps` (all of `plan.steps`, or a run of them) writing each value into `vals`.

    With watchers, each is told one `ran` fact per node, its times counted from `start`
    (a `perf_counter_ns` reading); unwatched, no fact is built.

    `plan` is read only to name a failing node: anything with `ids` (slot → node id) and
    `graph.implementation(id)` will do (a worker's compiled slice, `vals` then a dict).
    """
    move = _hooks.move
    clock = time.perf_counter_ns
    i, device = 0, None
    try:
        for i, mode, src, fn, ctx, device in steps:
            began = clock() if told else 0
            if mode == ONE:
                x = vals[src]
            elif mode == ROOT:
                x = input
            else:
                x = {p: vals[j] for p, j in src}
            if device is not None:
                x = move(x, device)
            out = fn(x, ctx)
            vals[i] = unwrap(out)  # an Opaque anywhere in it: what it wraps
            if told:
                fact = {
                    "fact": "ran",
                    "node": ctx.id,
                    "began_us": (began - start) / 1e3,
                    "took_us": (clock() - began) / 1e3,
                }
                tell(told, fact)
    except BaseException as e:
        _noted(e, plan, i, device)
        raise
