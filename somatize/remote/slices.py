"""Forward slices: consecutive steps of a plan that run on one host, on both sides of the wire.

The client cuts a plan where the host changes (`cut`) and runs the slices in order
(`run_plan`): a remote one in one round trip, carrying the values it reads from outside and
bringing back those read after it. A worker keeps a slice as a `ServedSlice` under its key,
so a repeated forward sends only the key and the values.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from somatize import _hooks
from somatize.codecs import NoCodec
from somatize.remote import wire
from somatize.remote.errors import not_held
from somatize.run import MANY, ONE, ROOT, Ctx, _result, finished, step_of, tell, walk

__all__ = ["Slice", "cut", "run_plan", "ServedSlice", "run_served"]

_keys = itertools.count(1)  # a key is never reused in this process, as an id() could be


@dataclass
class Slice:
    """Consecutive steps of a plan on one host (`None`: here), as the client cuts them."""

    host: str | None
    steps: list[tuple] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)  # slots it reads from outside itself
    roots: bool = False  # whether it reads the graph's input
    wanted: set[int] = field(default_factory=set)  # its slots read after it, or leaves
    key: str = field(default_factory=lambda: f"s{next(_keys)}")  # a worker keeps it under this


def cut(plan: Any) -> list[Slice]:
    """The plan's steps, in order, cut where the host changes."""
    slices: list[Slice] = []
    where: dict[int, Slice] = {}  # slot: the slice that writes it
    for step in plan.steps:
        i, mode, src, _fn, ctx, _device = step
        host = plan.hosts.get(ctx.id)
        if not slices or slices[-1].host != host:
            slices.append(Slice(host))
        here = where[i] = slices[-1]
        here.steps.append(step)
        if mode == ROOT:
            here.roots = True
        for j in _sources(mode, src):
            if where[j] is not here:
                if j not in here.reads:
                    here.reads.append(j)
                where[j].wanted.add(j)
    for _, i in plan.leaves:
        where[i].wanted.add(i)
    return slices


def _sources(mode: int, src: Any) -> list[int]:
    if mode == ONE:
        return [src]
    if mode == MANY:
        return [j for _, j in src]
    return []


def run_plan(broker: Any, plan: Any, input: Any, told: list[Callable[[dict], Any]]) -> Any:
    """Run every slice of `plan` in order; tell watchers what ran (a remote node with the
    time measured on its worker) and when it finished."""
    vals: list[Any] = [None] * len(plan.steps)
    start = time.perf_counter_ns()
    for one in broker.slices(plan):
        if one.host is None:
            walk(plan, one.steps, vals, input, told, start)
        else:
            _run_there(broker, plan, one, vals, input, told, start)
    if told:
        tell(told, finished(start))
    return _result(plan, vals)


def _described(broker: Any, plan: Any, one: Slice) -> list:
    """The slice's steps as a worker reads them: `[slot, key, id, mode, src, device, host,
    mapped, wanted]` each."""
    graph = plan.graph
    described = []
    for i, mode, src, _fn, ctx, device in one.steps:
        node = graph.implementation(ctx.id)
        mapped = bool(graph.setting(ctx.id).mapped)
        described.append(
            [i, broker.key(node), ctx.id, mode, src, device, one.host, mapped, i in one.wanted]
        )
    return described


def _run_there(
    broker: Any, plan: Any, one: Slice, vals: list, input: Any, told: list, start: int
) -> None:
    message = {
        "op": "run",
        "given": {j: vals[j] for j in one.reads},
        "input": input if one.roots else None,
        "watching": bool(told),  # per-node times only for somebody who watches
    }
    began = time.perf_counter_ns()
    graph = plan.graph
    nodes = [(ctx.id, graph.implementation(ctx.id), device) for *_, ctx, device in one.steps]
    try:
        got = broker.send(
            one.host, nodes, message, (one.key, lambda: _described(broker, plan, one))
        )
    except NoCodec as error:
        raise _unsent(plan, one, message, error) from None
    for i, value in got["out"].items():
        vals[i] = value
    if told:
        offset = (began - start) / 1e3
        for fact in got["facts"]:  # its `ran` facts, timed from when the worker began
            fact["began_us"] += offset
            tell(told, fact)


def _unsent(plan: Any, one: Slice, message: dict[str, Any], error: NoCodec) -> NoCodec:
    """The `NoCodec` of a value sent to slice `one` that no codec writes down, naming the node
    that made it and the node it was sent to (the first in `one` that reads it); `error`
    when it was another."""
    reader: dict[Any, str] = {}  # slot (None: the graph's input): the node that reads it
    for _i, mode, src, _fn, ctx, _device in one.steps:
        for j in [None] if mode == ROOT else _sources(mode, src):
            reader.setdefault(j, ctx.id)
    given = [(f"the output of node {plan.ids[j]!r}", j, v) for j, v in message["given"].items()]
    if one.roots:
        given.append(("the graph's input", None, message["input"]))
    parts = (
        (f"{what}, sent to node {reader.get(j)!r} on host {one.host!r}", value)
        for what, j, value in given
    )
    return wire.unwritable(parts, error)


class ServedSlice:
    """A slice as a worker keeps it: its described steps checked once and bound to the
    session's `nodes` as the engine's steps (`somatize.run.walk` runs them), and the slots
    whose values go back. A node the worker does not hold is `Unknown`.

    It stands in for a `Plan` where `walk` names a failing node: `ids` (slot → node id) and
    `graph.implementation(id)`.
    """

    __slots__ = ("steps", "ids", "wanted", "graph")

    def __init__(self, described: Any, nodes: dict[str, Any]) -> None:
        if type(described) is not list:
            raise ValueError(f"a slice is a list of steps, not {type(described).__name__}")
        steps = []
        self.ids: dict[int, str] = {}
        held: dict[str, Any] = {}
        wanted = []
        for step in described:
            if type(step) is not list or len(step) != 9:
                raise ValueError(f"a slice's step has nine fields, not {step!r:.80}")
            slot, key, nid, mode, src, device, host, mapped, want = step
            if mode == MANY:
                src = tuple((p, j) for p, j in src)
            elif mode not in (ONE, ROOT):
                raise ValueError(f"unknown step mode {mode!r}")
            node = nodes.get(key)
            if node is None:
                raise not_held(f"node {nid!r}")
            steps.append(step_of(slot, mode, src, node, Ctx(nid, device, host, None), mapped))
            self.ids[slot] = nid
            held[nid] = node
            if want:
                wanted.append(slot)
        self.steps = tuple(steps)
        self.wanted = tuple(wanted)
        self.graph = SimpleNamespace(implementation=held.__getitem__)

    def unwritable(self, answer: dict[str, Any], error: Exception) -> Exception:
        """The error of `answer` (`run_served`'s, which could not be written down, with
        `error`), naming the node whose output cannot be (no codec, or nested too deep)."""
        outs = answer["out"].items()
        return wire.unwritable(((f"the output of node {self.ids[s]!r}", v) for s, v in outs), error)


def run_served(served: ServedSlice, given: Any, input: Any, watching: bool) -> dict[str, Any]:
    """Run a slice through the engine's own loop without autograd (hooks fire, failures are
    noted with their node); `given` holds the values of the slots it reads from outside.
    Answers the values wanted outside and, when `watching`, the engine's `ran` facts."""
    vals: dict[int, Any] = dict(given) if type(given) is dict else {}
    facts: list[dict] = []
    told = [facts.append] if watching else None
    with _hooks.no_grad():
        walk(served, served.steps, vals, input, told, time.perf_counter_ns())
    return {"out": {slot: vals[slot] for slot in served.wanted}, "facts": facts}
