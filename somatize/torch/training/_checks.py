"""What a Trainer refuses before anything changes, each with an error that says what to do.

Every function here only reads: the Trainer calls them all first, and changes things (freezing,
telling each Learning its node) only when all of them have passed.
"""

from __future__ import annotations

from typing import Any

import torch

from somatize.graph import Graph
from somatize.torch.training.learning import Learning
from somatize.torch.training.params import _node_params, owners

__all__ = ["count", "trains_of", "held_by", "everything_moves", "hosts_of", "audit_of", "store_of"]


def count(value: Any, name: str) -> int:
    """`every` or `micro`: a positive int."""
    if type(value) is not int or value < 1:
        raise ValueError(
            f"Trainer({name}={value!r}): {name} is a positive int "
            + (
                "(how many steps go into one update)"
                if name == "every"
                else "(how many equal pieces one batch is cut into along its first dimension)"
            )
        )
    return value


def trains_of(graph: Graph, trains: Any) -> dict[str, Learning]:
    """`trains=` checked: ids of this graph, each its own Learning, none frozen."""
    if trains is None:
        return {}
    if not isinstance(trains, dict):
        raise TypeError(f"trains= is a dict {{node id: Learning}}, not {type(trains).__name__}")
    seen: dict[int, str] = {}
    for nid, learning in trains.items():
        if nid not in graph:
            raise ValueError(
                f"trains= names {nid!r}, and no node of this graph has that id; "
                f"it has {graph.nodes()}"
            )
        if not isinstance(learning, Learning):
            raise TypeError(
                f"trains[{nid!r}] is a {type(learning).__name__}, not a Learning: "
                "say how the node is trained, e.g. Split(torch.optim.SGD, lr=0.1)"
            )
        if graph.setting(nid).frozen:
            raise ValueError(
                f"node {nid!r} is declared .frozen() and is in trains=: a node cannot be "
                "both; drop .frozen() or take it out of trains="
            )
        other = learning.node
        if other is not None and other is not graph.implementation(nid):
            raise ValueError(
                f"trains[{nid!r}] already trains another node: give each node its own Learning"
            )
        if id(learning) in seen:
            raise ValueError(
                f"trains= gives the same Learning to {seen[id(learning)]!r} and {nid!r}: "
                "a Learning trains one node; give each its own"
            )
        seen[id(learning)] = nid
    return dict(trains)


def held_by(graph: Graph, optimizer: Any, trains: dict[str, Learning]) -> list[torch.Tensor]:
    """The parameters the optimizer holds, checked against the graph and `trains`."""
    if optimizer is None:
        return []
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"optimizer= takes a torch optimizer built over the graph's parameters "
            f"(torch.optim.Adam(parameters(g), lr=1e-3)), not {type(optimizer).__name__}"
        )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    owner = owners(graph)
    mine = [owner[id(p)] for p in held if id(p) in owner]
    if not mine:
        raise ValueError(
            f"the optimizer holds {len(held)} parameter(s) and none of them is a parameter "
            "of this graph: build it over parameters(g)"
        )
    for nid in dict.fromkeys(mine):
        if nid in trains:
            raise ValueError(
                f"the optimizer holds parameters of node {nid!r}, which trains= also "
                f"trains: it would be updated twice. Build the optimizer over "
                "parameters(g, without=trains)"
            )
        if graph.setting(nid).frozen:
            raise ValueError(
                f"the optimizer holds parameters of node {nid!r}, which is declared "
                ".frozen(): a node cannot be both frozen and trained. Build the optimizer "
                "over parameters(g), which leaves frozen nodes out"
            )
    return held


def everything_moves(graph: Graph, held: list[torch.Tensor], trains: dict[str, Learning]) -> None:
    """Refuses parameters nobody would move (not held, not trained, not frozen)."""
    moved = {id(p) for p in held}
    idle: list[str] = []
    for nid in graph.nodes():
        if nid in trains or graph.setting(nid).frozen:
            continue
        if any(
            p.requires_grad and id(p) not in moved for p in _node_params(graph.implementation(nid))
        ):
            idle.append(nid)
    if idle:
        raise ValueError(
            f"node(s) {idle} hold parameters that nobody would move: neither the optimizer "
            "nor trains= holds them. Build the optimizer over parameters(g), train them "
            "with trains=, or declare them .frozen()"
        )


def audit_of(auditing: Any) -> Any:
    """`auditing=` as an Audit, or None."""
    if auditing is None or auditing is False:
        return None
    if auditing is True:
        from somatize.torch.audit.audit import Audit

        return Audit()
    for method in ("watch", "observed", "moved", "release"):
        if not callable(getattr(auditing, method, None)):
            raise TypeError(
                f"auditing= takes an Audit (or True for the default one), not "
                f"{type(auditing).__name__}"
            )
    return auditing


def store_of(store: Any) -> Any:
    """`store=` as a Store, or None."""
    from somatize.store import store_of as named

    return None if store is None else named(store)


def hosts_of(graph: Graph, broker: Any) -> dict[str, str]:
    """`{node: host}` for the `.at(host)` nodes; refused without a broker that says where."""
    hosts = {n: h for n, h in graph.hosts().items() if h}
    if hosts and broker is None:
        nid, host = next(iter(hosts.items()))
        raise ValueError(
            f"node {nid!r} runs .at({host!r}), and no broker says where {host!r} is: pass "
            "Trainer(..., broker=Broker.embedded({" + repr(host) + ": Worker.at(...)}))"
        )
    if hosts and not callable(getattr(broker, "request", None)):
        raise TypeError(
            f"broker= must be a somatize Broker (it answers broker.request(host, message)) for "
            f"the .at() nodes; {type(broker).__name__} is not"
        )
    return hosts
