"""A plan cut into slices by host, and the walk that runs them: local ones here, remote ones
in one round trip each. Built on the plan's data (`plan.steps`, `plan.ids`, `plan.graph`),
with the engine's own rules: every root gets the input, a node with several predecessors a
dict keyed by their ids, an `Opaque` unwrapped on arrival, a failure noted with its node."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from somatize.node import Opaque
from somatize.remote.server import Unknown
from somatize.run import MANY, ONE, ROOT, _result, walk

__all__ = ["Slice", "cut", "run_plan"]

_sids = itertools.count(1)


@dataclass
class Slice:
    """Consecutive steps of a plan on one host (`None`: here)."""

    host: str | None
    steps: list[tuple] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)  # slots it reads from outside itself
    roots: bool = False  # whether it reads the graph's input
    wanted: set[int] = field(default_factory=set)  # its slots read after it, or leaves
    described: list | None = None  # its steps as a worker reads them (worked out once)
    sid: str = ""  # the id a worker keeps its compiled steps under, once it has them
    held: Any = None  # `broker.held(host)` when the worker was known to hold all it needs


def cut(plan: Any) -> list[Slice]:
    """The plan's steps, in order, cut where the host changes."""
    slices: list[Slice] = []
    hosts = plan.hosts
    where = {}
    for step in plan.steps:
        i, mode, src, fn, ctx, device = step
        host = hosts.get(ctx.id)
        if not slices or slices[-1].host != host:
            slices.append(Slice(host))
        here = slices[-1]
        here.steps.append(step)
        where[i] = len(slices) - 1
        if mode == ROOT:
            here.roots = True
        for j in _sources(mode, src):
            if where[j] != len(slices) - 1:
                if j not in here.reads:
                    here.reads.append(j)
                slices[where[j]].wanted.add(j)
    for _, i in plan.leaves:
        slices[where[i]].wanted.add(i)
    return slices


def _sources(mode: int, src: Any) -> list[int]:
    if mode == ONE:
        return [src]
    if mode == MANY:
        return [j for _, j in src]
    return []


def run_plan(broker: Any, plan: Any, input: Any, told: list[Callable[[dict], Any]]) -> Any:
    """Run every slice of `plan` in order; tell watchers what ran (remote nodes with the time
    measured on their worker) and when it finished."""
    if type(input) is Opaque:
        input = input.value
    vals: list[Any] = [None] * len(plan.steps)
    clock = time.perf_counter_ns
    start = clock() if told else 0  # times are only for somebody who watches
    last = broker._last  # the plan run last time, again: its slices without a lookup
    for piece in last[1] if last is not None and last[0]() is plan else broker.slices(plan):
        if piece.host is None:
            walk(plan, piece.steps, vals, input, told, start)
        else:
            _run_there(broker, plan, piece, vals, input, told, start)
    if told:
        finished = {"fact": "finished", "took_us": (clock() - start) / 1e3}
        for w in told:
            w(finished)
    return _result(plan, vals)


def _run_there(
    broker: Any, plan: Any, piece: Slice, vals: list, input: Any, told: list, start: int
) -> None:
    host = piece.host
    graph = plan.graph
    described = piece.described
    if described is None:
        described = []
        for i, mode, src, _fn, ctx, device in piece.steps:
            node = graph.implementation(ctx.id)
            mapped = bool(graph.setting(ctx.id).mapped)
            described.append(
                [i, broker.key(node), ctx.id, mode, src, device, host, mapped, i in piece.wanted]
            )
        piece.described = described
        piece.sid = f"s{next(_sids)}"  # never reused in this process (an id() could be)
    given = {}
    for j in piece.reads:
        given[j] = vals[j]
    began = time.perf_counter_ns() if told else 0
    attempts = (0, 1)
    if piece.held is not None and piece.held is broker._defined.get(host):  # broker.held
        # The worker holds the slice and its nodes (nothing was lost since): only the id and
        # the inputs go.
        try:
            if told:
                message = {
                    "op": "run",
                    "define": [],
                    "sid": piece.sid,
                    "slice": None,
                    "given": given,
                    "input": input if piece.roots else None,
                    "timed": True,
                }
                got = broker.request(host, message)
            else:  # the same request, written without its dict
                got = broker.run(host, piece.sid, given, input if piece.roots else None)
        except Unknown:
            broker.forget(host)  # a restarted worker: send the nodes again, once
            attempts = (1,)
            got = None
        if got is not None:
            if told:
                _took(got, vals, told, began, start)
            else:
                for i, value in got["out"].items():
                    vals[i] = value
            return
    for attempt in attempts:
        defs = []
        for _i, _mode, _src, _fn, ctx, device in piece.steps:
            d = broker.definition(host, ctx.id, graph.implementation(ctx.id), device)
            if d is not None:
                defs.append(d)
        sent = broker.holds(host, piece.sid)
        message = {
            "op": "run",
            "define": defs,
            "sid": piece.sid,
            "slice": None if sent else described,
            "given": given,
            "input": input if piece.roots else None,
            "timed": bool(told),  # per-node times only for somebody who watches
        }
        try:
            got = broker.request(host, message)
        except Unknown:
            if attempt:
                raise
            broker.forget(host)  # a restarted worker: send the nodes again, once
            continue
        if defs or not sent:
            broker.defined(host, [*defs, {"key": piece.sid}])
        piece.held = broker.held(host)
        break
    _took(got, vals, told, began, start)


def _took(got: dict, vals: list, told: list, began: int, start: int) -> None:
    """Write what a remote slice answered into `vals`; tell watchers what ran there."""
    for i, value in got["out"].items():
        vals[i] = value
    if told:
        offset = (began - start) / 1e3
        for nid, began, took in got["ran"]:
            fact = {"fact": "ran", "node": nid, "began_us": offset + began, "took_us": took}
            for w in told:
                w(fact)
